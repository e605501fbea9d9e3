"""The sampler of single-turn completions (docs/design.md §1): G samples per prompt from the run's
backend, and the inputs of the reward functions in TRL's formats.
"""

from __future__ import annotations

from torch import Tensor

from backstream.rl.backends.base import SamplingParams
from backstream.rl.records import Round, Samples
from backstream.rl.rollout.sampler import RESPONSE_KEYS, response_metrics
from backstream.stream.vision import VISION_KEYS, vision_metrics


class CompletionSampler:
    """The sampler of single-turn completions (rl/rollout/sampler.py's protocol): G per prompt, sampled by
    the run's backend (rl/backends/), and the inputs of the reward functions in TRL's formats
    (`reward_inputs`)."""

    metric_keys = RESPONSE_KEYS

    def __init__(self, config: SamplingParams, group_size: int, tokenizer, eos: list[int], return_kv: bool,
                 prompts: list[Tensor], prompt_text: list[str], backend, pictures: list[list] | None = None):
        self.config, self.group_size, self.tok, self.eos, self.return_kv = config, group_size, tokenizer, eos, return_kv
        self.prompts, self.prompt_text = prompts, prompt_text  # per example: its token ids and text
        self.pictures = pictures if pictures and any(pictures) else None  # per example: its images
        self.metric_keys = RESPONSE_KEYS + (VISION_KEYS if self.pictures is not None else ())
        self.backend = backend
        longest, new = max((len(p) for p in prompts), default=0), config.max_new_tokens
        # the longest sequence it samples, and what sets it (a server's context must hold it: `Preflight`)
        self.needs = (longest + new, f"the longest prompt, {longest} tokens, + rollout.max_new_tokens = {new}")

    def sample(self, rows: list[dict], indices: list[int], generators: list, progress=None) -> Round:
        """G samples for each example `indices[j]` (the data's rows `rows[j]`), group j drawn with
        `generators[j]`; `prompt_index` holds the examples' indices."""
        G = self.group_size
        prompts = [self.prompts[i] for i in indices]
        pictures = None
        if self.pictures is not None:  # this round's: an image two prompts hold is one object, encoded once
            fresh: dict[str, object] = {}
            pictures = [[fresh.setdefault(p.digest, p.fresh()) for p in self.pictures[i]] for i in indices]
        out = self.backend.complete(prompts, G, self.config.max_new_tokens, generators, self.return_kv, progress,
                                    pictures=pictures)
        return Round(Samples.of_groups(indices, prompts, out, G, self.return_kv, pictures=pictures))

    def reward_inputs(self, r: Samples, rows: list[dict]) -> tuple[list, list, dict]:
        return completion_reward_inputs(r, rows, self.tok, self.prompt_text, self.config.stop)

    def metrics(self, r: Samples) -> dict[str, float]:
        # vision/*: read after the update, so the tower forwards of the learner's are counted beside the sampler's
        return {**response_metrics(r), **(vision_metrics(r.pictures) if r.pictures is not None else {})}


def before_stop(text: str, stop: list[str]) -> str:
    """The text of a completion that a stop string ended, up to that string: what the reward reads (the
    trained tokens keep the stop, as the policy sampled it; vLLM's and TRL's completion text is cut
    so too). A token may hold more than the stop ("\n\n" for "\n"): the text is cut where the stop
    first occurs."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def completion_reward_inputs(r: Samples, rows: list[dict], tokenizer, prompt_text: list[str],
                             stop: list[str] = ()):
    """(completions, prompts, extra keyword arguments) of single-turn samples as TRL passes them: chat
    prompts give the prompt's messages and the completion as an assistant message, text prompts
    strings; `prompt_text`: each example's rendered prompt; `stop`: rollout.stop (a completion that
    one ended is read up to it, `before_stop`)."""
    texts = [before_stop(t, stop) if reason == "stop" else t
             for t, reason in zip(r.texts(tokenizer), r.finish_reason)]
    chat = [isinstance(row["prompt"], list) for row in rows]
    prompts = [row["prompt"] if c else prompt_text[i] for row, c, i in zip(rows, chat, r.prompt_index)]
    completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
    return completions, prompts, {"completion_ids": [c.tolist() for c in r.completion_ids]}

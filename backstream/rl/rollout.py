"""The in-process rollout engine: G sampled completions per prompt, with the sampler's log-probs and,
on request, the K/V the streamed backward can reuse (docs/design.md §1, §4).

Each prompt is prefilled once (prompts of one length as one batch); its cache is repeated over the G
rows of its group, and every row of the call then decodes as one batch (rl/decode.py: rows of other
lengths left-padded; finished rows stay in the batch, fed and ignored, and leave it together each
time they are a quarter of it). The log-probs are taken under softmax(logits / T) before
top-k/top-p truncation, the learner's convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from backstream.checks import UserError, literals
from backstream.rl.decode import Rows, check_return_kv, decode
from backstream.rl.records import Rollout
from backstream.stream.hf import takes_logits_to_keep


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens holding at least this mass; in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens before sampling; 0 turns it off."""
    max_new_tokens: int = 64
    """Most tokens sampled per completion (a completion cut here has finish_reason "length")."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a completion ends right after the token that completes one (needs a tokenizer)."""
    group_size: int = 1
    """G: completions sampled per prompt, sharing one prefill of the prompt."""
    backend: Literal["local", "vllm"] = "local"
    """Who samples: "local" (this process's sampler) or "vllm" (a vLLM server, `[vllm]`; the learner's
    weights are published to it after every optimizer step)."""
    max_staleness: int = 0
    """k: how many optimizer steps behind the learner a trained token's weights may be. 0: the synchronous
    loop (sample, then train). k >= 1 (rollout.backend = "vllm"): the server samples the next steps'
    prompts while the learner trains, every group started with weights at most k steps older than
    those its update starts from (rl/source.py, docs/design.md §6e)."""
    in_flight: Literal["resume", "keep"] = "resume"
    """With max_staleness >= 1, what a publish does with the samples in flight: "resume" aborts them and
    resumes each from its tokens so far, re-prefilled with the new weights; "keep" pauses them and their
    next tokens are sampled with the new weights after K/V computed with the old ones. Either way each
    token records the version it was sampled with."""

    def __post_init__(self):
        def bad(name, allowed):
            raise UserError(f"rollout.{name}: got {getattr(self, name)!r}, expected {allowed}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 = off)")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad("max_new_tokens", "an integer >= 1")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if not is_int(self.group_size) or self.group_size < 1:
            bad("group_size", "an integer >= 1")
        if not is_int(self.max_staleness) or self.max_staleness < 0:
            bad("max_staleness", "an integer >= 0 (0 = the synchronous loop)")
        literals(self, "rollout")


@torch.no_grad()
def generate(
    model,
    prompts: list[Tensor],
    config: SamplingConfig,
    *,
    eos_token_id: int | list[int] | None,
    tokenizer=None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    return_kv: bool = False,
    progress=None,
) -> Rollout:
    """Sample `config.group_size` completions for every prompt (1-D token-id tensors).

    eos_token_id: the token(s) that end a completion (kept as its last token); None for none.
    tokenizer: anything with `decode(ids) -> str`; needed only for `config.stop`.
    generator: seeds the sampling, so that a seeded run is reproducible; or one generator per prompt
      (the same object may repeat). Every row of the call decodes in one batch; a row's samples
      depend only on its generator and its place among that generator's rows (rl/decode.py `Draws`).
    progress: optional `progress(groups done, groups in all)`, called as each group finishes.
    return_kv: also return each sample's K/V (as the model's cache holds them, post-RoPE) for the
      streamed backward at the same weights (`stream_backward(..., kv=rollout.kv)`).
    The model runs as it is: call `model.eval()` first if it has dropout.
    """
    if config.stop and tokenizer is None:
        raise UserError("tokenizer: required to detect SamplingConfig.stop strings, got None")
    if not isinstance(prompts, (list, tuple)):
        raise UserError(f"prompts: expected a list of 1-D integer tensors, got {type(prompts).__name__}")
    gens = generator if isinstance(generator, (list, tuple)) else [generator] * len(prompts)
    if len(gens) != len(prompts):
        raise UserError(f"generator: got {len(gens)} generators for {len(prompts)} prompts; pass one per prompt "
                         "or a single one")
    for j, p in enumerate(prompts):
        if not isinstance(p, Tensor) or p.dim() != 1 or len(p) == 0 or p.is_floating_point():
            got = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
            raise UserError(f"prompts[{j}]: expected a non-empty 1-D integer tensor, got {got}")
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    keep_last = takes_logits_to_keep(model)

    G, n = config.group_size, len(prompts) * config.group_size
    prompts = [p.detach().to("cpu", torch.long) for p in prompts]
    check_return_kv(model, return_kv)
    if not prompts:  # a rank's share of a round too small to reach it
        return Rollout(prompt_index=[], prompt_ids=[], completion_ids=[], logprobs=[], finish_reason=[],
                       kv=[] if return_kv else None, group_size=G)
    rows = Rows.of_prompts(model, [prompts[i // G].tolist() for i in range(n)], keep_last, config.max_new_tokens)
    left = [G] * len(prompts)  # rows of each group still sampling

    def finished(i: int) -> None:
        left[i // G] -= 1
        if progress is not None and left[i // G] == 0:
            progress(sum(x == 0 for x in left), len(prompts))

    out = decode(model, rows, config, eos, tokenizer, [gens[i // G] for i in range(n)], keep_last,
                 [config.max_new_tokens] * n, keep_kv=return_kv, finished=finished)
    return Rollout(prompt_index=[i // G for i in range(n)], prompt_ids=[prompts[i // G] for i in range(n)],
                   completion_ids=[torch.tensor(ids, dtype=torch.long) for ids in out.tokens],
                   logprobs=out.logprobs, finish_reason=out.reasons,
                   kv=[c.as_kv() for c in out.caches] if return_kv else None, group_size=G)


class Sampler:
    """The sampler of single-turn completions (rl/sampling.py's protocol): G per prompt, sampled by the
    run's backend (rl/backends/), and the inputs of the reward functions in TRL's formats
    (`reward_inputs`)."""

    environment = None  # an EpisodeSampler's Environment (its get_reward is a reward)

    def __init__(self, config: SamplingConfig, tokenizer, eos: list[int], return_kv: bool, prompts: list[Tensor],
                 prompt_text: list[str], backend):
        self.config, self.tok, self.eos, self.return_kv = config, tokenizer, eos, return_kv
        self.prompts, self.prompt_text = prompts, prompt_text  # per example: its token ids and text
        self.backend, self.metric_keys = backend, tuple(backend.metric_keys)
        longest, new = max((len(p) for p in prompts), default=0), config.max_new_tokens
        # the longest sequence it samples, and what sets it (a server's context must hold it: `Sync.need_context`)
        self.needs = (longest + new, f"the longest prompt, {longest} tokens, + rollout.max_new_tokens = {new}")

    def sample(self, rows: list[dict], indices: list[int], generators: list, progress=None) -> Rollout:
        """G samples for each example `indices[j]` (the data's rows `rows[j]`), group j drawn with
        `generators[j]`; `prompt_index` holds the examples' indices."""
        G = self.config.group_size
        prompts = [self.prompts[i] for i in indices]
        out = self.backend.complete(prompts, G, self.config.max_new_tokens, generators, self.return_kv, progress)
        return Rollout(prompt_index=[i for i in indices for _ in range(G)],
                       prompt_ids=[p for p in prompts for _ in range(G)],
                       completion_ids=[torch.tensor(c.ids, dtype=torch.long) for c in out],
                       logprobs=[c.logprobs for c in out], finish_reason=[c.reason for c in out],
                       kv=[c.kv for c in out] if self.return_kv else None, group_size=G,
                       weight_version=[c.versions for c in out])

    def reward_inputs(self, r: Rollout, rows: list[dict]) -> tuple[list, list, dict]:
        return completion_reward_inputs(r, rows, self.tok, self.prompt_text, self.config.stop)

    def metrics(self, r: Rollout) -> dict[str, float]:
        return self.backend.metrics(r.weight_version)

    def timings(self, r: Rollout) -> dict[str, float]:
        """Seconds of sampling `r` spent in phases of their own (none here; an episode's tools: "tool")."""
        return {}

    def release(self, r: Rollout | None = None) -> None:
        """Let go of what `r` (None: every sample so far) held for its reward functions (nothing here)."""

    def close(self) -> None:
        """Stop what the sampler started (nothing here; the backend is the run's)."""

    def check_prompts(self, examples: list[dict]) -> int:
        """The longest prompt (its tokens were checked against the context when the data was loaded)."""
        return max((len(p) for p in self.prompts), default=0)


def before_stop(text: str, stop: list[str]) -> str:
    """The text of a completion that a stop string ended, up to that string: what the reward reads (the
    trained tokens keep the stop, as the policy sampled it; vLLM's and TRL's completion text is cut
    so too). A token may hold more than the stop ("\n\n" for "\n"): the text is cut where the stop
    first occurs."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def completion_reward_inputs(r: Rollout, rows: list[dict], tokenizer, prompt_text: list[str],
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

"""Multi-turn, tool-using episodes (docs/design.md §6d): the sampler that plays an episode against its
environment and hands the trainer one token sequence per episode.

An episode of a task: the prompt (its tools' schemas and `reset`'s text in it), then turns. A turn is
what the policy samples up to its end-of-turn token; a turn that calls tools is followed by their
results, one that does not ends the episode (or, in a text environment, is followed by the next user
message). Only the sampled tokens carry a loss (`Samples.sampled`); tool results, template tokens and
user messages are context of weight 0, and the trie of the streamed backward merges a group's shared
prompt and any turns its episodes share, so an episode costs its unique tokens.

The turns are sampled by the run's backend (rl/backends/: `Backend.play`): in process in rounds, every
live episode's turn of a round decoded as one batch, each episode keeping its own K/V so that a later
turn prefills only its new tokens; on a server every episode in a thread of its own, each turn a
request after exactly the episode's ids so far. Every sampled token keeps the sampler's log-prob and
weight version; inserted tokens have none (NaN, version -1). With `return_kv` (in process) each
episode's K/V (every position but its last token's) go to the engine, no prefill.

Fidelity: an episode's sequence is bitwise the tokens the backend fed, in order, plus the last token
it sampled (each sample's `EpisodeInfo.fed` keeps them for the test that checks it).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from operator import attrgetter

import torch

from backstream.checks import UserError
from backstream.rl.agent.env import TEXT_HOOK, EnvConfig, EnvError, Environment, ToolResult
from backstream.rl.agent.turns import make_format
from backstream.rl.backends.base import SamplingParams
from backstream.rl.records import CONTEXT, Completion, EpisodeInfo, Round, Samples
from backstream.rl.rollout.sampler import episode_metric_keys, episode_metrics, episode_reward_inputs
from backstream.stream import vision
from backstream.stream.vision import VISION_KEYS

MEANS = {  # the step's line: the mean over its episodes of each
    "episode/turns/mean": attrgetter("turns"), "episode/tool_calls/mean": attrgetter("tool_calls"),
    "episode/tool_errors/mean": attrgetter("tool_errors"), "episode/timeouts": attrgetter("timed_out"),
    "episode/results_cut/mean": attrgetter("results_cut")}
CUT = "[... {} more characters cut]"  # ends a tool result cut at env.max_result_tokens: the policy reads it


@dataclass
class _Episode:
    env: object
    prompt: list[int]
    prompt_for_rewards: object  # text or messages, as the reward functions get the prompt
    messages: list[dict] = field(default_factory=list)  # after the prompt: assistant, tool and user messages
    ids: list[int] = field(default_factory=list)  # the completion: every token after the prompt
    sampled: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)  # the last turn's sampled tokens
    turn_reason: str = "eos"  # how the last turn ended: "eos", "stop" or "length"
    inserted: list[int] = field(default_factory=list)  # the tokens to feed before the next turn
    tool_s: float = 0.0  # seconds in its tools
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    results_cut: int = 0
    reason: str | None = None
    versions: list[int] = field(default_factory=list)  # per completion token (-1: inserted)
    lp_dtype: torch.dtype = torch.float32  # the sampler's log-probs' (float64 for a float64 model)
    pictures: list = field(default_factory=list)  # a VLM's: the images it holds so far, in order
    prompt_at: list[bool] = field(default_factory=list)  # ... which prompt positions are images
    image_at: list[bool] = field(default_factory=list)  # ... which completion positions are
    new_pictures: list = field(default_factory=list)  # ... those `inserted` holds
    inserted_at: list[bool] = field(default_factory=list)

    def add(self, ids: list[int], logprobs: list[float] | None, versions: list[int] | None = None,
            image_at: list[bool] | None = None) -> None:
        self.ids += ids
        self.image_at += image_at if image_at is not None else [False] * len(ids)
        self.sampled += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [math.nan] * len(ids)
        self.versions += versions if versions is not None else [CONTEXT] * len(ids)

    def length(self) -> int:
        return len(self.prompt) + len(self.ids)

    def end(self, reason: str) -> None:
        """The episode is over: the policy's last message says how (`finish_reason`)."""
        self.reason = reason
        self.messages[-1]["finish_reason"] = reason


class EpisodeSampler:
    """The sampler of `[env]` runs (rl/rollout/sampler.py's protocol): G episodes per task (see the module
    docstring)."""

    metric_keys = (*episode_metric_keys(MEANS), "episode/tool_seconds")

    def __init__(self, config: SamplingParams, group_size: int, env_cfg: EnvConfig, environment: Environment,
                 tokenizer, eos: list[int], return_kv: bool, context: int | None, backend, examples: list[dict] = (),
                 vision=None, pictures: list | None = None):
        """`environment`: `[env]` `env_cfg` loaded (its workers are the caller's to close); `examples`: the
        data, every prompt rendered once now, so that one the format cannot render fails before the run
        starts (reset's text comes at sampling time). A vision-language policy's `vision` (rl/data/images.py
        `Pictures`: its processor's images) takes the images of `pictures[i]` (example i's prompt's)
        and those its tools return (docs/vision.md, "Images in episodes")."""
        self.config, self.group_size, self.tok, self.eos, self.return_kv = config, group_size, tokenizer, eos, return_kv
        self.vision, self.prompt_pictures = vision, pictures
        self.backend, self.env_cfg, self.env = backend, env_cfg, environment
        self.environment = environment  # its get_reward is the reward 'env'
        self.format = make_format(env_cfg.format, tokenizer, self.env.schemas, set(eos), env_cfg.chat_template)
        self.max_tokens = env_cfg.token_limit(context) or 10**9
        self.needs = (self.max_tokens, f"env.max_episode_tokens = {env_cfg.max_episode_tokens}" + (
            "" if self.max_tokens == env_cfg.max_episode_tokens else ": the model's context")) \
            if env_cfg.token_limit(context) else None  # an episode's budget (`Preflight.need_context`)
        if vision is not None:
            self.format.image_marker = vision.marker()
            self.metric_keys = (*self.metric_keys, *VISION_KEYS)
        self.fresh: dict = {}  # a round's pictures by digest: one object (encoded once) per image
        self.live: list = []  # the environments of the episodes started, until they are released (`close`)
        self.starting = threading.Lock()  # episodes of concurrent `sample` calls start one at a time
        for i, ex in enumerate(examples):
            if "prompt" in ex:
                self._prompt(ex, i, None)

    def sample(self, rows: list[dict], indices: list[int], generators: list, progress=None) -> Round:
        G = self.group_size
        self.fresh = {}
        episodes = self._start_groups(rows, indices)
        left, lock = [G] * len(rows), threading.Lock()  # live episodes per group (a server's turn from threads)

        def turn(k: int, c: Completion) -> list[int] | None:
            ep = episodes[k]
            ep.lp_dtype = torch.promote_types(c.logprobs.dtype, torch.float32)
            ep.add(c.ids, c.logprobs.tolist(), c.versions.tolist())
            ep.turn, ep.turn_reason = c.ids, c.reason
            ep.turns += 1
            if self._after_turn(ep):
                ep.add(ep.inserted, None, image_at=ep.inserted_at or None)
                ep.pictures += ep.new_pictures
                ep.new_pictures, ep.inserted_at = [], []
                return ep.inserted
            with lock:
                left[k // G] -= 1
                if progress is not None and left[k // G] == 0:
                    progress(sum(x == 0 for x in left), len(rows))
            return None

        gens = [gen for gen in generators for _ in range(G)]  # an episode draws from its group's generator
        images = {} if self.vision is None else {"pictures": [ep.pictures for ep in episodes]}  # (extended by turn)
        played = self.backend.play([ep.prompt for ep in episodes], gens, turn, self._budget, self.env_cfg.max_turns,
                                   self.return_kv, **images)
        r = self._rollout(episodes, indices, played)
        # an in-process backend plays the episodes' tools between its rounds: a slice of the step's time;
        # a server's episodes run theirs while the others' turns are sampled (episode/tool_seconds sums them)
        return Round(r, {"tool": sum(e.tool_seconds for e in r.episodes)} if self.backend.in_process else {})

    def close(self) -> None:
        """The environments of episodes never scored (`Samples.release` hands back the scored ones)."""
        with self.starting:
            envs, self.live = self.live, []
        for env in envs:
            env.release()

    def _start_groups(self, rows: list[dict], indices: list[int]) -> list[_Episode]:
        """G episodes of each row, their environments reset (one call at a time across threads: the
        environments' pool is shared); a prompt with no room for a turn is an error."""
        with self.starting:
            self.live = [env for env in self.live if not env.released]
            episodes = [self._start(row, index) for row, index in zip(rows, indices)
                        for _ in range(self.group_size)]
        for ep in episodes:
            if len(ep.prompt) >= self.max_tokens:
                raise UserError(f"env.max_episode_tokens: a prompt of {len(ep.prompt)} tokens leaves no room for "
                                f"a turn (limit {self.max_tokens}); raise it or shorten the prompt")
        return episodes

    def _start(self, row: dict, index: int) -> _Episode:
        env, extra = self.env.new(row, index)
        self.live.append(env)
        if "prompt" not in row and not extra:
            raise EnvError(f"data: row {index} has no `prompt` column and {self.env.name}.reset returned no text; "
                           "give the row a prompt, or return the task's text from reset (an environment that owns "
                           "its data)")
        prompt, messages, pictures, at = self._prompt(row, index, extra)
        chat = isinstance(row.get("prompt"), list) or (self.format.name == "chat" and "prompt" not in row)
        for_rewards = messages if chat else messages[-1]["content"]
        return _Episode(env=env, prompt=prompt, prompt_for_rewards=for_rewards, pictures=pictures, prompt_at=at)

    def _prompt(self, row: dict, index: int, extra: str | None):
        """(the prompt's ids, its messages, its pictures, which of its positions are images)."""
        prompt = row.get("prompt")
        if self.vision is None:
            return (*self.format.prompt(prompt, extra), [], [])
        from backstream.rl.data.images import placeholders_only  # noqa: PLC0415

        pics = [self.fresh.setdefault(p.digest, p.fresh()) for p in (self.prompt_pictures or [[]] * (index + 1))[index]]
        ids, messages = self.format.prompt(placeholders_only(prompt) if isinstance(prompt, list) else prompt, extra)
        ids, at = self.vision.expand(ids, pics, f"data: example {index}'s prompt")
        return ids, messages, pics, at

    def _budget(self, length: int) -> int:
        return max(1, min(self.config.max_new_tokens, self.max_tokens - length))

    def _after_turn(self, ep: _Episode) -> bool:
        """The sampled turn becomes a message; its tool calls run (or the text hook), and what they
        return is fed next (`ep.inserted`). Returns False when the episode is over: a turn cut by a
        token limit, an answer, `max_turns`, no room for what would follow, or an environment that
        overran its time. A call the episode has no turn or no room left to read is not run: the
        policy's call is then its last message, and the rewards see nothing it did not see."""
        message, calls = self.format.parse(ep.turn)
        ep.messages.append(message)
        if ep.turn_reason == "length":  # cut by rollout.max_new_tokens or the episode's token limit
            ep.end("length")
            return False
        if calls:
            if ep.turns >= self.env_cfg.max_turns:
                ep.end("turns")
                return False
            empty = self.format.tool_results([(c.name, "") for c in calls])
            if ep.length() + len(empty) + 1 > self.max_tokens:
                ep.end("length")
                return False
            results = []
            for call in calls:
                res = self._images_of(call.name, self.env.call(ep.env, call))
                ep.tool_s += res.seconds
                ep.tool_calls += 1
                ep.tool_errors += res.failed
                if res.timed_out:  # the environment is gone: the episode ends on the call
                    ep.end("timeout")
                    return False
                results.append((call.name, res))
            fitted = self._fit_results(ep, results)
            if fitted is None:
                ep.end("length")
                return False
            contents, ep.inserted = fitted
            ep.messages += [{"role": "tool", "name": name, "content": c} for (name, _), c in zip(results, contents)]
            return True
        reply, timed_out = self.env.respond(ep.env, message.get("content", ""))
        if timed_out:
            ep.tool_errors += 1
            ep.end("timeout")
            return False
        if reply is None:
            ep.end("eos")  # an answer: the episode is over
            return False
        pictures = []
        if isinstance(reply, tuple):  # a message with images (agent/env.py `respond`)
            res = self._images_of(TEXT_HOOK, ToolResult(reply[0], False, 0.0, len(reply[0]), images=tuple(reply[1])))
            if res.failed:
                raise EnvError(f"env.factory: {self.env.name}.{TEXT_HOOK}: {res.content}")
            pictures = res.images
            reply = self._parts(reply[0], pictures)
        inserted, ep.inserted_at = self._expand(self.format.user(reply), pictures, f"{TEXT_HOOK}'s message")
        ep.new_pictures = list(pictures)
        if ep.turns >= self.env_cfg.max_turns or ep.length() + len(inserted) + 1 > self.max_tokens:
            ep.end("turns" if ep.turns >= self.env_cfg.max_turns else "length")
            return False
        ep.messages.append({"role": "user", "content": reply})
        ep.inserted = inserted
        return True

    def _fit_results(self, ep: _Episode, results: list[tuple[str, ToolResult]]):
        """The results' contents as the policy will read them (text, or parts with their images) and
        their tokens: each text cut at env.max_result_tokens, then all of them cut further until they fit
        the episode's token limit with room for one sampled token (images are never cut). None when not
        even the cut markers fit."""
        cap = self.env_cfg.max_result_tokens
        pictures = [p for _, res in results for p in res.images]
        for _ in range(8):
            contents = [self._cut(res, cap) for _, res in results]
            parts = [self._parts(text, res.images) for (_, res), (text, _) in zip(results, contents)]
            inserted, at = self._expand(self.format.tool_results([(name, c) for (name, _), c in zip(results, parts)]),
                                        pictures, "a tool result")
            over = ep.length() + len(inserted) + 1 - self.max_tokens
            if over <= 0:
                ep.results_cut += sum(cut for _, cut in contents)
                ep.new_pictures, ep.inserted_at = pictures, at
                return parts, inserted
            if cap == 0:
                return None
            cap = max(0, cap - max(1, -(-over // len(results))))
        return None

    def _images_of(self, name: str, res: ToolResult) -> ToolResult:
        """`res` with its images read and processed (`Picture`s of this round: one object per image); one
        that does not decode is the tool's error, which the policy reads; an image for a text policy
        stops the run (it needs env.images and a vision-language model)."""
        if not res.images:
            return res
        if self.vision is None:
            raise EnvError(f"env: the tool {name} returned an image, but the policy is a text model; set "
                           "env.images = true with a vision-language model (model.name)")
        from backstream.rl.data.images import open_image  # noqa: PLC0415

        try:
            images = [open_image(b, f"the image {name} returned", ".") for b in res.images]
        except UserError as e:
            return ToolResult(f"error: {name} returned an image that cannot be read ({str(e).split(': ', 2)[-1]})",
                              True, res.seconds, 0)
        pics = [self.vision.picture(img) for img in images]
        return res._replace(images=tuple(self.fresh.setdefault(p.digest, p) for p in pics))

    @staticmethod
    def _parts(text: str, pictures) -> str | list[dict]:
        """A message's content: its text, or with images the parts a template renders (images first)."""
        if not pictures:
            return text
        return [{"type": "image"} for _ in pictures] + ([{"type": "text", "text": text}] if text else [])

    def _expand(self, ids: list[int], pictures: list, where: str) -> tuple[list[int], list[bool]]:
        """Rendered `ids` with each image's token over its placeholders, and which are images."""
        if self.vision is None:
            return ids, []
        return self.vision.expand(ids, pictures, where)

    def _cut(self, res: ToolResult, cap: int) -> tuple[str, bool]:
        """A result's text cut at `cap` tokens, with the marker that says how much is missing."""
        text = res.content
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= cap and res.length <= len(text):
            return text, False
        kept = self.tok.decode(ids[:cap]) if len(ids) > cap else text
        return kept + CUT.format(max(res.length, len(text)) - len(kept)), True

    def _rollout(self, episodes: list[_Episode], indices: list[int], played: list) -> Samples:
        G = self.group_size
        kv = [p.kv for p in played] if self.return_kv else None
        infos = [EpisodeInfo(turns=ep.turns, tool_calls=ep.tool_calls, tool_errors=ep.tool_errors,
                             results_cut=ep.results_cut, timed_out=ep.reason == "timeout", tool_seconds=ep.tool_s,
                             prompt=ep.prompt_for_rewards, messages=ep.messages, env=ep.env, fed=p.fed, hold=ep.env)
                 for ep, p in zip(episodes, played)]
        return Samples(
            prompt_index=[i for i in indices for _ in range(G)],
            prompt_ids=[torch.tensor(ep.prompt, dtype=torch.long) for ep in episodes],
            completion_ids=[torch.tensor(ep.ids, dtype=torch.long) for ep in episodes],
            logprobs=[torch.tensor(ep.logprobs, dtype=ep.lp_dtype) for ep in episodes],
            finish_reason=[ep.reason for ep in episodes], kv=kv, group_size=G,
            sampled=[torch.tensor(ep.sampled, dtype=torch.bool) for ep in episodes], episodes=infos,
            weight_version=[torch.tensor(ep.versions, dtype=torch.long) for ep in episodes],
            pictures=None if self.vision is None else
            [vision.Placed(ep.pictures, torch.tensor(ep.prompt_at + ep.image_at, dtype=torch.bool)) for ep in episodes])

    def reward_inputs(self, r: Samples, rows: list[dict]) -> tuple[list, list, dict]:
        return episode_reward_inputs(r)

    def metrics(self, r: Samples) -> dict[str, float]:
        return {**episode_metrics(r, MEANS, ended=("length", "turns")),
                "episode/tool_seconds": sum(x.tool_seconds for x in r.episodes or []),
                **(vision.vision_metrics(r.pictures) if r.pictures is not None else {})}


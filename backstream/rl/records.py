"""The records of a rollout that several parts of the rollout layer share, at its bottom floor: what a
backend answers (`Completion`, an episode's `Played`), what a round hands the trainer (`Round`: its
`Samples`, their `Fork`s, an episode's `EpisodeInfo`), what the update trains (`TrainingRows`), and the one version
convention of them all (docs/design.md §6e, §6f):

- a sampled token carries the learner step whose weights sampled it (0: the initial weights);
- a token no policy sampled (a prompt's, a tool result, a template's) carries `CONTEXT` (-1);
- `versions_behind(versions, v)`: how many versions a token's weights are behind v (-1 at context);
- `oldest(versions)`: the oldest version any sampled token of a rollout holds.

It imports nothing of the package: every module of rl/ may import it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

CONTEXT = -1  # the weight version of a token no policy sampled (inserted, prompt)


@dataclass
class Completion:
    """One sample after some token ids: its tokens, their log-probs under softmax(logits / T) before
    truncation, the weight version each was sampled with, how it ended ("eos", "stop" for a stop string,
    "length"), and in process with `return_kv` the K/V of every position of the sequence but its last."""

    ids: list[int]
    logprobs: Tensor  # float, one per token
    versions: Tensor  # int64, one per token
    reason: str
    kv: object = None


def at_version(ids: list[int], logprobs: Tensor, version: int, reason: str, kv=None) -> Completion:
    """A completion whose every token was sampled with the weights of `version`."""
    return Completion(list(ids), logprobs, torch.full((len(ids),), version, dtype=torch.long), reason, kv)


@dataclass
class Played:
    """An episode as the backend played it: every token it fed the model, in order (for the fidelity
    test), and with `return_kv` the K/V of every position but the last."""

    fed: list[int]
    kv: object = None


def oldest(versions: list[Tensor] | None) -> float:
    """The oldest weight version any sampled token of a rollout holds (NaN: no token)."""
    mins = [int(v[v >= 0].min()) for v in versions or [] if (v >= 0).any()]
    return float(min(mins)) if mins else math.nan


@dataclass
class EpisodeInfo:
    """What an episode has beyond its tokens: its counts (gathered across ranks with the rollout), and
    for the reward functions of the process that played it (`local`; never gathered) the prompt as the
    rewards get it, the messages after it and the environment."""

    turns: int
    tool_calls: int
    tool_errors: int  # malformed or unknown calls, tools that raised or overran their time
    results_cut: int  # tool results cut at env.max_result_tokens (or at the episode's token limit)
    timed_out: bool  # the environment overran env.tool_timeout_s and was discarded
    tool_seconds: float = 0.0  # seconds in its tools
    prompt: object = None  # text, or chat messages (reset's text in them)
    messages: list | None = None  # after the prompt; the last assistant message has a `finish_reason`
    env: object = None
    fed: list | None = None  # every token the backend fed the model, in order (the fidelity test's)
    hold: object = None  # what it holds until it is scored (its environment's worker), let go by `Samples.release`

    def light(self) -> EpisodeInfo:
        """The counts alone (what crosses ranks)."""
        return dataclasses.replace(self, prompt=None, messages=None, env=None, fed=None, hold=None)


@dataclass
class Fork:
    """A sequence a sample trains beside its own (prompt + completion): a branch an agent's rewritten
    history started (rl/agent/transcript.py). Every token, whether its loss is here (a token sampled on
    this branch; the others are context), the sampler's log-probs (NaN at context) and the weight
    version of each token (-1 at context)."""

    ids: Tensor  # 1-D long
    sampled: Tensor  # bool, per token
    logprobs: Tensor  # per token
    versions: Tensor | None = None
    pictures: list | None = None  # a VLM's: its images in order (stream/vision.py `Placed`, with their positions)


def versions_behind(versions: Tensor, version: int) -> Tensor:
    """How many versions each token's weights are behind `version`; -1 at a token no policy sampled
    (version -1: inserted, context)."""
    return torch.where(versions >= 0, version - versions.long(), -1)


@dataclass
class TrainingRows:
    """What the update trains: one entry per sequence, a sample's own and then every sample's forks;
    `owner[s]` is the sample (row of the rollout) sequence s belongs to, whose advantage it takes."""

    seqs: list[Tensor]
    mask: list[Tensor]  # True at the tokens with a loss
    logprobs: list[Tensor]  # the sampler's, NaN elsewhere (`Samples.aligned_logprobs`' layout)
    behind: list[Tensor]  # versions behind the update's weights per token, -1 at the prompt (`Samples.behind`)
    owner: list[int]
    kv: list | None
    pictures: list[list] | None = None  # per sequence, its prompt's images (stream/vision.py `Picture`)

    def rows_of(self, n_samples: int) -> list[list[int]]:
        """Per sample, its sequences."""
        out: list[list[int]] = [[] for _ in range(n_samples)]
        for s, i in enumerate(self.owner):
            out[i].append(s)
        return out


@dataclass
class Samples:
    """One entry per sample; the G samples of prompt j are rows j*G .. j*G+G-1."""

    prompt_index: list[int]
    prompt_ids: list[Tensor]  # 1-D long
    completion_ids: list[Tensor]  # 1-D long; ends with the EOS token or the token completing a stop string, if any
    # per completion token, under softmax(logits / T) before truncation; float32 (float64 for a float64 model)
    logprobs: list[Tensor]
    finish_reason: list[str]  # "eos" | "stop" | "length"
    # per sample, a list over layers of (K, V) [kv_heads, len(prompt) + len(completion) - 1, head_dim]
    kv: list | None = None
    group_size: int = 1
    # episodes (several turns, rl/rollout/episodes.py): per completion token whether the policy sampled it
    # (the rest, tool results and template tokens, is context without loss; its logprobs are NaN), and
    # per sample what only an episode has. None for single-turn samples.
    sampled: list[Tensor] | None = None
    episodes: list[EpisodeInfo] | None = None
    # per sample, per completion token, the version of the weights it was sampled with: the learner's
    # step that made them (0: the initial weights), int64 [len(completion)]; -1 at a token the sampler
    # inserted (rl/backends/base.py's convention). Every sampler sets it; None only in a rollout made
    # by hand (taken as sampled at the current weights)
    weight_version: list[Tensor] | None = None
    # per sample, the sequences it trains beside its own (an agent program's rewritten histories:
    # rl/rollout/programs.py); None: one sequence per sample
    forks: list[list[Fork]] | None = None
    # per sample, the images its prompt's placeholder tokens stand for (stream/vision.py `Picture`: a
    # group's rows hold the same objects, encoded once a round); None: a text model's samples
    pictures: list[list] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    def release(self) -> None:
        """Let go of what the samples held for their reward functions once they are scored (an episode's
        environment goes back to its pool)."""
        for e in self.episodes or []:
            if e.hold is not None:
                e.hold.release()

    def sampled_ids(self) -> list[Tensor]:
        """Per sample, the token ids the policy sampled (of an episode: its turns, without what came between)."""
        if self.sampled is None:
            return list(self.completion_ids)
        own = [c[m] for c, m in zip(self.completion_ids, self.sampled)]
        return own if self.forks is None else [torch.cat([x, *[f.ids[f.sampled] for f in fs]])
                                               for x, fs in zip(own, self.forks)]

    def sampled_tokens(self) -> list[int]:
        """Per sample, how many tokens the policy sampled."""
        if self.sampled is None:
            return [len(c) for c in self.completion_ids]
        return [len(x) for x in self.sampled_ids()]

    def sampled_versions(self) -> list[Tensor]:
        """The weight version of every token the policy sampled, per sequence (forks included); none
        without versions (a rollout made by hand)."""
        if self.weight_version is None:
            return []
        own = [v if self.sampled is None else v[m] for v, m in
               zip(self.weight_version, self.sampled or [None] * len(self))]
        return own + [f.versions[f.sampled] for fs in self.forks or [] for f in fs if f.versions is not None]

    def tokens_total(self) -> int:
        """Tokens of every sequence the update trains, each counted in each (shared prefixes as often as
        they are held)."""
        return sum(len(p) + len(c) for p, c in zip(self.prompt_ids, self.completion_ids)) + sum(
            len(f.ids) for fs in self.forks or [] for f in fs)

    def sequences(self) -> list[Tensor]:
        """Prompt + completion, one 1-D tensor per sample."""
        return [torch.cat([p, c]) for p, c in zip(self.prompt_ids, self.completion_ids)]

    def behind(self, version: int) -> list[Tensor]:
        """Per sample, over `sequences()[i]`: how many versions each sampled token's weights are behind
        `version` (0 without versions), -1 at the prompt and at inserted tokens."""
        versions = self.weight_version or [torch.full((len(c),), version) for c in self.completion_ids]
        return [torch.cat([torch.full((len(p),), -1, dtype=torch.long), versions_behind(v, version)])
                for p, v in zip(self.prompt_ids, versions)]

    def training(self, version: int) -> TrainingRows:
        """The sequences the update trains: each sample's own (`sequences()`), then every sample's forks,
        with their loss masks, sampler log-probs and versions behind `version` (`behind`)."""
        rows = TrainingRows(seqs=self.sequences(), mask=self.completion_mask(), logprobs=self.aligned_logprobs(),
                            behind=self.behind(version), owner=list(range(len(self))), kv=self.kv,
                            pictures=None if self.pictures is None else list(self.pictures))
        for i, fs in enumerate(self.forks or []):
            for f in fs:
                behind = (torch.zeros(len(f.ids), dtype=torch.long) if f.versions is None else
                          versions_behind(f.versions, version))
                rows.seqs.append(f.ids)
                rows.mask.append(f.sampled)
                rows.logprobs.append(f.logprobs)
                rows.behind.append(behind)
                rows.owner.append(i)
                if rows.pictures is not None:
                    rows.pictures.append(f.pictures if f.pictures is not None else [])
        assert self.kv is None or len(rows.seqs) == len(self), "Samples.training: K/V with forks"
        return rows

    def completion_mask(self) -> list[Tensor]:
        """Per sample, a bool tensor over `sequences()[i]`: True at the tokens the policy sampled (the
        completion; of an episode, its sampled turns only)."""
        if self.sampled is None:
            return [torch.arange(len(p) + len(c)) >= len(p) for p, c in zip(self.prompt_ids, self.completion_ids)]
        return [torch.cat([torch.zeros(len(p), dtype=torch.bool), m]) for p, m in zip(self.prompt_ids, self.sampled)]

    def aligned_logprobs(self) -> list[Tensor]:
        """The sampler's log-probs placed over `sequences()[i]`, NaN at the prompt tokens (the same
        layout as `StreamResult.logprobs`, so sampler/learner mismatch is one subtraction)."""
        return [torch.cat([torch.full((len(p),), math.nan, dtype=lp.dtype), lp])
                for p, lp in zip(self.prompt_ids, self.logprobs)]

    def texts(self, tokenizer, skip_special_tokens: bool = True) -> list[str]:
        """Each completion decoded (of an episode: its sampled tokens only)."""
        if self.sampled is None:
            return [tokenizer.decode(c.tolist(), skip_special_tokens=skip_special_tokens) for c in self.completion_ids]
        return [tokenizer.decode(c[m].tolist(), skip_special_tokens=skip_special_tokens)
                for c, m in zip(self.completion_ids, self.sampled)]

    def group_rows(self, groups: list[int]) -> list[int]:
        """The sample rows of `groups` (group indices), in that order."""
        G = self.group_size
        return [g * G + j for g in groups for j in range(G)]

    def select(self, groups: list[int]) -> Samples:
        """The rollout of `groups` only (whole groups, in that order)."""
        rows = self.group_rows(groups)

        def pick(xs):
            return None if xs is None else [xs[r] for r in rows]

        return Samples(**{f.name: pick(getattr(self, f.name)) for f in dataclasses.fields(self)
                          if f.name != "group_size"}, group_size=self.group_size)

    @staticmethod
    def of_groups(indices: list[int], prompts: list[Tensor], completions: list[Completion], group_size: int,
                  kv: bool = False, pictures: list[list] | None = None) -> Samples:
        """The record of `group_size` completions after each prompt (prompt j's at j*G .. j*G+G-1), group j
        of example `indices[j]`; `kv`: keep the completions' K/V; `pictures[j]`: prompt j's images."""
        G = group_size
        assert len(completions) == G * len(prompts) == G * len(indices)
        return Samples(prompt_index=[i for i in indices for _ in range(G)],
                       prompt_ids=[p for p in prompts for _ in range(G)],
                       completion_ids=[torch.tensor(c.ids, dtype=torch.long) for c in completions],
                       logprobs=[c.logprobs for c in completions], finish_reason=[c.reason for c in completions],
                       kv=[c.kv for c in completions] if kv else None, group_size=G,
                       weight_version=[c.versions for c in completions],
                       pictures=None if pictures is None else [p for p in pictures for _ in range(G)])

    @staticmethod
    def concat(parts: list[Samples]) -> Samples:
        """The samples of every part, in order (same group size). The K/V are kept only if every part
        has them (they stay on the rank that computed them); any other field is in every part or in none,
        and a part that lacks one the others have is a bug, not a field to drop."""
        assert parts and all(p.group_size == parts[0].group_size for p in parts)

        def join(name):
            values = [getattr(p, name) for p in parts]
            missing = [v is None for v in values]
            assert name == "kv" or all(missing) or not any(missing), f"Samples.concat: {name} is in some parts only"
            return None if any(missing) else [x for v in values for x in v]

        return Samples(**{f.name: join(f.name) for f in dataclasses.fields(Samples) if f.name != "group_size"},
                       group_size=parts[0].group_size)

    @staticmethod
    def empty(group_size: int, like: Samples | None = None) -> Samples:
        """No sample: a rank's share of a round too small to reach it (the fields `like` has, empty)."""
        fields = {f.name: ([] if like is None or getattr(like, f.name) is not None else None)
                  for f in dataclasses.fields(Samples) if f.name != "group_size"}
        return Samples(**fields, group_size=group_size)


@dataclass
class Round:
    """A round's samples (this rank's groups) and the seconds they spent in phases of their own ("sync":
    publishing the weights; "tool": an in-process episode's tools)."""

    samples: Samples
    seconds: dict[str, float] = field(default_factory=dict)

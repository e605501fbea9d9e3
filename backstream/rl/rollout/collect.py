"""The step's collect phase (docs/design.md §1): rollout rounds from the run's rollout source
(rl/rollout/source.py) until `train.prompts_per_step` groups are kept, each round scored by the reward
functions (called as TRL calls them), its samples logged (train.log_episodes) and joined over the
ranks, the overlong ones shaped; DAPO's dynamic sampling drops the groups whose rewards are all equal
and refills the batch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from backstream.metrics import episode_rows
from backstream.rl.records import Samples
from backstream.rl.scoring.rewards import RewardLog, TrainerState
from backstream.rl.scoring.shaping import informative_groups, overlong_shaping


@dataclass
class Batch:
    """What `collect` hands on: the kept samples, their rewards after overlong shaping and which of
    them get a loss; for the metrics, the reward of every sample scored in the step (dropped groups
    included) as the reward functions gave it."""

    samples: Samples
    rewards: Tensor  # [N] float, shaped
    keep: Tensor  # [N] bool: False where overlong filtering takes a sample out of the loss
    scored: Tensor  # [M >= N] total reward of every sample scored, before shaping
    scored_by_fn: dict[str, Tensor]  # per reward function, [M]
    refill_rounds: int = 0  # DAPO: rounds after the first, to refill the groups it dropped
    groups_dropped: int = 0  # DAPO: groups whose rewards were all equal, left out of the batch


class Collector:
    """The run's collect phase: `rollout` ([rollout]: G, the token limit, DAPO's dynamic sampling), `reward`
    ([reward]: the overlong shaping), `per_step` / `steps` (train.prompts_per_step, train.steps),
    `source` (the rounds), `sampler` (the reward functions' inputs), `rewards`, the data's `examples`,
    `dp` (rl/parallel/), `tokenizer` (the samples' log), `resting` (what rests once a step's samples are
    in: rl/backends/base.py `Resting`)."""

    def __init__(self, rollout, reward, per_step: int, steps: int, source, sampler, rewards, examples: list[dict],
                 dp, tokenizer, resting=()):
        self.rollout, self.reward, self.per_step, self.steps = rollout, reward, per_step, steps
        self.source, self.sampler, self.rewards, self.examples, self.dp = source, sampler, rewards, examples, dp
        self.tok, self.resting = tokenizer, tuple(resting)

    def collect(self, step: int, times: dict[str, float], log: RewardLog, episode_log, phase) -> Batch:
        """Samples rounds until `prompts_per_step` groups are kept: sample, score, shape the overlong
        samples. With dynamic sampling (DAPO) a round keeps only the groups whose rewards differ and
        the next one refills the rest; the last (after `max_refills`) keeps what it gets. `step`: the
        steps done; `times`: the step's seconds per phase, added to; `log`: what the reward functions
        log; `episode_log`: the samples' log; `phase(what)`: the progress line."""
        ro, G = self.rollout, self.rollout.group_size
        kept: list[tuple[Samples, Tensor, Tensor]] = []
        scored, by_fn, dropped = [], {}, 0
        self.dp.begin_step()
        for attempt in range(1 + (ro.max_refills if ro.dynamic_sampling else 0)):
            need = self.per_step - sum(len(r) for r, _, _ in kept) // G
            if need <= 0:
                break
            r, total, per_fn = self.round(need, attempt > 0, step, times, log, episode_log, phase)
            scored.append(total)
            for k, v in per_fn.items():
                by_fn.setdefault(k, []).append(v)
            total, keep = overlong_shaping(r, total, self.reward, ro.max_new_tokens)
            if ro.dynamic_sampling:
                groups = informative_groups(total, G) if attempt < ro.max_refills else list(range(need))
                self.dp.kept(groups)  # under torchrun with the rollout's K/V, refills then even the shares
                dropped += need - len(groups)
                rows = torch.tensor(r.group_rows(groups), dtype=torch.long)
                r, total, keep = r.select(groups), total[rows], keep[rows]
            kept.append((r, total, keep))
        for backend in self.resting:  # the step's samples are in: what samples may rest while the learner trains
            backend.rest()
        rollouts, rewards, keeps = zip(*kept)
        return Batch(samples=Samples.concat(list(rollouts)), rewards=torch.cat(rewards), keep=torch.cat(keeps),
                     scored=torch.cat(scored), scored_by_fn={k: torch.cat(v) for k, v in by_fn.items()},
                     refill_rounds=len(kept) - 1, groups_dropped=dropped)  # `kept`: one entry per round

    def round(self, n: int, refill: bool, step: int, times: dict[str, float], log: RewardLog, episode_log,
              phase) -> tuple[Samples, Tensor, dict[str, Tensor]]:
        """One rollout round and its rewards (total, per function), over the whole round: each process
        samples and scores its groups, `dp.join_round` hands every rank every group (without the K/V,
        which stay where they were computed), in the round's order."""
        with timed(times, "rollout"):  # asynchronous: the learner's wait for the samples
            got = self.source.take(n, refill)
        r = got.samples
        for name, seconds in got.seconds.items():  # inside the rollout: on their own line
            times[name] += seconds
            times["rollout"] -= seconds
        with timed(times, "reward"):
            phase("reward")
            total, per_fn = self.score(r, step, log=log) if len(r) else (torch.zeros(0), {})
        episode_log.write(step + 1, lambda: episode_rows(
            self.sampler, self.tok, r, total, per_fn, log.columns, [self.examples[i] for i in r.prompt_index]))
        r.release()  # scored: an episode's environment goes back to its pool
        return self.dp.join_round(r, total, per_fn)

    def score(self, r: Samples, step: int, sampler=None, examples: list[dict] | None = None,
              log: RewardLog | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Total reward per sample and each reward function's, called as TRL calls them (the sampler
        formats prompts and completions: `CompletionSampler.reward_inputs`), with the step and every column.
        `sampler`/`examples`: those `r` came from (default: the training ones); `log` collects what
        the functions log (log_metric, log_extra)."""
        sampler, examples = sampler or self.sampler, examples or self.examples
        rows = [examples[i] for i in r.prompt_index]
        completions, prompts, extra = sampler.reward_inputs(r, rows)
        cols = {k: [row.get(k) for row in rows] for k in examples[0] if k != "prompt"}
        return self.rewards(completions, prompts, cols, **extra, log=log,
                            trainer_state=TrainerState(global_step=step, max_steps=self.steps))


@contextlib.contextmanager
def timed(times: dict[str, float], phase: str):
    """The block's seconds added to `times[phase]`."""
    t = time.perf_counter()
    yield
    times[phase] += time.perf_counter() - t

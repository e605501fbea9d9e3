"""`[eval]`: evaluation during training on held-out prompts: `eval.samples` = k samples (or episodes)
per prompt, scored by the run's reward functions, every `eval.every` steps, after the last step, and
before the first one when `eval.at_start`.

  eval/reward/mean   mean total reward over every sample
  eval/pass@k        share of the prompts with at least one of their k samples passing
  eval/avg@k         mean over the prompts of the share of their k samples passing
A sample passes when its total reward is at least `eval.pass_reward` (1.0: an exact match).

The prompts are `eval.path`'s (a JSONL or `datasets` folder, as data.path), or for a built-in task
rows drawn from another seed than the training data's, without the training prompts. The samples come
from generators of their own (seeded by the run's seed, the step and the prompt), so evaluating
changes nothing of the training run, and gives the same samples on any number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backstream.checks import UserError, at_least
from backstream.rl.data import prompts as datamod

EVAL_SEED = 0x5EED  # xor-ed into the run's seed: the evaluation's generators are not the training's


@dataclass(kw_only=True)
class EvalConfig:
    every: int = 0
    """Evaluate every N steps and after the last one; 0 = no evaluation."""
    at_start: bool = False
    """Also evaluate before the first step (a metrics line of step 0)."""
    path: str = ""
    """Held-out prompts (JSONL or a datasets folder, as data.path); "" = held-out rows of the built-in
    data.task (needed with data.path)."""
    prompts: int = 64
    """How many held-out prompts are evaluated."""
    samples: int = 4
    """k: samples (or episodes) per prompt, for eval/pass@k and eval/avg@k."""
    pass_reward: float = 1.0
    """A sample passes when its total reward is at least this."""
    shots: int | None = None
    """Solved examples before each held-out prompt of a built-in task (as data.shots); unset = the
    training's (data.shots as the run resolved it)."""

    def __post_init__(self):
        at_least("eval.every", self.every, 0)
        at_least("eval.prompts", self.prompts, 1)
        at_least("eval.samples", self.samples, 1)
        if self.shots is not None:
            at_least("eval.shots", self.shots, 0)

    @property
    def enabled(self) -> bool:
        return self.every > 0 or self.at_start


class NoEvaluation:
    """A run without `[eval]`: the evaluator's methods, doing nothing (the loop does not branch on it)."""

    at_start = False

    def due(self, step: int, last: int) -> bool:
        return False

    def keys(self) -> list[str]:
        return []


class Evaluator(NoEvaluation):
    """The run's evaluation: its prompts, a sampler of `eval.samples` per prompt and the scoring."""

    def __init__(self, cfg: EvalConfig, data_cfg, seed: int, make_sampler):
        """`make_sampler(examples, group_size)`: the run's kind of sampler over these examples."""
        self.cfg, self.seed, self.at_start = cfg, seed, cfg.at_start
        self.examples = held_out(cfg, data_cfg, seed)
        self.sampler = make_sampler(self.examples, cfg.samples)

    def due(self, step: int, last: int) -> bool:
        return self.cfg.every > 0 and (step % self.cfg.every == 0 or step == last)

    @staticmethod
    def build(cfg: EvalConfig, data_cfg, seed: int, make_sampler):
        """The evaluation `[eval]` asks for, or `NoEvaluation`."""
        return Evaluator(cfg, data_cfg, seed, make_sampler) if cfg.enabled else NoEvaluation()

    def run(self, sample, score, dp, step: int) -> dict[str, float]:
        """Sample this rank's share of the prompts (`dp.share`) with `sample(rows, indices, generators)`
        (the rollout source's, at the current weights), score them with `score(rollout)` (total rewards
        [N]), gather every rank's, and return the eval/ metrics."""
        mine = dp.share(len(self.examples))
        gens = [torch.Generator().manual_seed(((self.seed ^ EVAL_SEED) * 1_000_003 + step * 100_003 + i) % 2**63)
                for i in mine]
        totals = []
        # every rank samples, an empty share too: a backend's rollout may be a collective (vLLM's weight sync)
        r = sample([self.examples[i] for i in mine], mine, gens)
        if mine:
            totals = score(r).view(len(mine), self.cfg.samples).tolist()
        r.release()
        per_prompt = [row for part in dp.gather(totals) for row in part]
        k = self.cfg.samples
        passed = [[x >= self.cfg.pass_reward for x in row] for row in per_prompt]
        n = max(1, len(per_prompt))
        return {"eval/reward/mean": sum(sum(row) for row in per_prompt) / (n * k),
                f"eval/pass@{k}": sum(any(p) for p in passed) / n,
                f"eval/avg@{k}": sum(sum(p) / k for p in passed) / n}

    def keys(self) -> list[str]:
        k = self.cfg.samples
        return ["eval/reward/mean", f"eval/pass@{k}", f"eval/avg@{k}"]


def held_out(cfg: EvalConfig, data_cfg, seed: int) -> list[dict]:
    """The evaluation's prompts (see the module docstring): a built-in task's rows none of the training's
    (data_cfg's, drawn with `seed`), in its format and with its shots (or eval.shots')."""
    if cfg.path:
        examples = datamod.load_examples(cfg.path)
        datamod.check_examples(examples, cfg.path)
        return examples[: cfg.prompts]
    if data_cfg.path:
        raise UserError("eval.path: the run reads its prompts from data.path, so the evaluation needs its own "
                         "held-out file; set eval.path (or eval.every = 0)")
    from backstream.rl.data.tasks import make_dataset  # noqa: PLC0415

    shots = data_cfg.shots if cfg.shots is None else cfg.shots
    datamod.check_shots(data_cfg.task, shots or 0, "eval.shots")
    seen = {ex["prompt"] for ex in make_dataset(data_cfg.task, data_cfg.num_examples, seed)}  # the training's rows
    out, draw = [], 0
    while len(out) < cfg.prompts and draw < 20:
        for ex in make_dataset(data_cfg.task, 4 * cfg.prompts, seed=seed + 7919 * (draw + 1)):
            if ex["prompt"] not in seen and len(out) < cfg.prompts:
                seen.add(ex["prompt"])
                out.append(ex)
        draw += 1
    if not out:
        raise UserError(f"eval: every prompt of task {data_cfg.task!r} is in the training data; set eval.path")
    return data_cfg.present(out, seed ^ EVAL_SEED, shots or 0)  # in the training's format, with its shots


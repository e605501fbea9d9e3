"""The update phase (docs/design.md §1): `[update]` and the `Learner`, which trains a collected batch with
`epochs` × `minibatches` optimizer steps, each over one group-aligned minibatch: its objective (the
normalisers over the whole minibatch, before any block), the backward `[engine]` chose, a clipped step.
Where π_old and π_ref come from is chosen once (`BeforeUpdate`). Under torchrun the batch is the global
one and this rank trains its own groups of each minibatch, normalised by the global minibatch's counts
(rl/parallel/); the learner runs the rollout's quantized forward when `quant.aligned`."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from torch import Tensor

from backstream.checks import at_least
from backstream.metrics import sum_metrics
from backstream.quant.linear import quantized
from backstream.rl.parallel.placement import take
from backstream.rl.records import Samples
from backstream.rl.update.losses import Normalisers, build_objective
from backstream.rl.update.offpolicy import mismatch_metrics, staleness_metrics, staleness_mismatch
from backstream.rl.update.optim import Stepper
from backstream.stream import fsdp


@dataclass(kw_only=True)
class UpdateConfig:
    epochs: int = 1
    """PPO epochs over each rollout batch."""
    minibatches: int = 1
    """Optimizer steps per epoch (the rollout batch is split in this many groups-aligned parts)."""
    kl_reference: bool = False
    """Keep a frozen copy of the initial policy for the KL term (loss.kl_coef > 0 needs it)."""

    def __post_init__(self):
        at_least("update.epochs", self.epochs, 1)
        at_least("update.minibatches", self.minibatches, 1)


class BeforeUpdate:
    """The policy before the update, as the run's objective needs it: where π_old and π_ref come from,
    chosen once from [update] and engine.reuse_rollout_kv (so that the trainer's step has no branch on it). π_old: the
    sampler's log-probs when the engine reuses the rollout's K/V (`engine.reuse_rollout_kv`: the same
    weights and numerics, so they are the current policy's too: `old_is_current`); one no-grad pass
    before the first optimizer step when several follow (epochs × minibatches > 1); else none before
    the update, as the engine's own prefill at the first (and only) step gives it. π_ref: the frozen
    `ref` policy's, or with LoRA (`ref` None) the base model under the adapters."""

    def __init__(self, update: UpdateConfig, reuse_rollout_kv: bool):
        self.old_is_current = reuse_rollout_kv
        self.old_pass = not self.old_is_current and update.epochs * update.minibatches > 1
        self.kl_reference = update.kl_reference

    def logprobs(self, engine, model, ref, seqs: list[Tensor], mask: list[Tensor],
                 sampler_lp: list[Tensor], pictures: list | None = None) -> tuple[list | None, list | None]:
        """(π_old, π_ref) of `seqs` (their prompts' images `pictures`) where the objective needs them
        before the update, else None."""
        old = sampler_lp if self.old_is_current else None
        ref_lp = None
        if self.old_pass:
            with fsdp.gathered(model):
                old = engine.logprobs(model, seqs, mask, pictures=pictures)
        if self.kl_reference:
            if ref is not None:  # (its own tower: the images encoded again, by it)
                ref_lp = engine.logprobs(ref, seqs, mask, pictures=None if pictures is None else
                                         [[p.fresh() for p in ps] for ps in pictures])
            else:
                with model.disable_adapter(), fsdp.gathered(model):  # LoRA: the base model is the reference
                    ref_lp = engine.logprobs(model, seqs, mask, pictures=pictures)
        return old, ref_lp

    def learner_at_sampling(self, old: list | None, first_step: list) -> list:
        """The learner's log-probs at the weights that sampled, which the sampler's are measured
        against (`mismatch/*`): π_old where a pass computed it, else the engine's own at the first
        optimizer step (`first_step`); with the rollout's K/V π_old *is* the sampler's, and the
        mismatch would be measured against itself."""
        return old if self.old_pass else first_step


@dataclass
class Updated:
    """What an update did: each optimizer step's loss metrics (summed over ranks), the sampler/learner
    mismatch of its first epoch, the tokens its trees held (first epoch, this rank's), and its seconds
    per phase ("prefill", "backward", "optim")."""

    logged: dict[str, list[float]]
    mismatch: dict[str, float]
    tree_tokens: int
    seconds: dict[str, float] = field(default_factory=dict)


class Learner:
    """The update phase (see the module docstring): `update` [update], `loss` [loss], `engine` the backward
    [engine] chose (rl/update/backward.py), `before` where π_old and π_ref come from, `stepper` the
    optimizer step (rl/update/optim.py); `model`, `ref` (the frozen KL reference, or None), `dp`
    (rl/parallel/); `aligned`: quant.aligned; `max_staleness`: rollout.max_staleness (the mismatch per
    version behind); `phase(what)`: shows what the step is doing."""

    def __init__(self, update: UpdateConfig, loss, engine, before: BeforeUpdate, stepper: Stepper, model, ref, dp, *,
                 aligned: bool = False, max_staleness: int = 0, phase=None):
        self.cfg, self.loss, self.engine, self.before, self.stepper = update, loss, engine, before, stepper
        self.model, self.ref, self.dp, self.aligned, self.max_staleness = model, ref, dp, aligned, max_staleness
        self.phase = phase or (lambda what: None)

    def state_dict(self) -> dict:
        """What a checkpoint holds of it: the optimizer (checkpoint.save takes its state_dict in one
        process, its shards under torchrun) and the schedule."""
        return {"optimizer": self.stepper.opt, "scheduler": self.stepper.sched.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The schedule (the optimizer's state is loaded by checkpoint.restore, in either layout)."""
        self.stepper.sched.load_state_dict(state["scheduler"])

    def update(self, batch: Samples, adv: Tensor, step: int) -> Updated:
        """`epochs` × `minibatches` optimizer steps on `batch` (the global batch, every rank's groups) with
        per-sample advantages `adv`; `step`: the steps done (the errors say where)."""
        with quantized(self.model, self.aligned):
            return self._update(batch, adv, step)

    def _update(self, batch: Samples, adv: Tensor, step: int) -> Updated:
        up, seconds = self.cfg, dict.fromkeys(("prefill", "backward", "optim"), 0.0)
        view = batch.training(step)  # a sample's sequences: its own, and its forks (an agent's branches)
        seqs, mask, sampler_lp = view.seqs, view.mask, view.logprobs
        adv = adv[view.owner]
        plan = self.dp.plan_update(len(batch) // batch.group_size, up.minibatches, batch.group_size, batch.kv)
        plan = plan.over(view.rows_of(len(batch)))
        mine = {"seqs": take(seqs, plan.mine), "mask": take(mask, plan.mine), "sampler": take(sampler_lp, plan.mine),
                "kv": take(view.kv, plan.mine), "pictures": take(view.pictures, plan.mine)}
        t = time.perf_counter()
        mine["old"], mine["ref"] = self.before.logprobs(self.engine, self.model, self.ref, mine["seqs"], mine["mask"],
                                                        mine["sampler"], mine["pictures"])
        seconds["prefill"] += time.perf_counter() - t
        norms = [Normalisers.of(take(mask, rows), adv[rows]) for rows in plan.batch_rows]
        logged: dict[str, list[float]] = {}
        tree_tokens = 0
        learner_lp: list[Tensor | None] = [None] * len(plan.mine)  # at the weights that sampled, first epoch
        for epoch in range(up.epochs):
            for rows, rows_b, norm in zip(plan.local, plan.own, norms):
                where = f"minibatch {len(logged.get('grad_norm', [])) + 1}/{up.epochs * up.minibatches}"
                metrics, res = self._minibatch({k: take(v, rows) for k, v in mine.items()}, adv[rows_b], norm, step,
                                               where, seconds)
                if epoch == 0:  # sampler/learner agreement on the tokens the learner computed
                    tree_tokens += res.stats.tree_tokens or res.stats.input_tokens
                    for r, lp in zip(rows, res.logprobs):
                        learner_lp[r] = lp
                for k, v in metrics.items():
                    logged.setdefault(k, []).append(v)
        before = self.before.learner_at_sampling(mine["old"], learner_lp)
        before = self.dp.gather_rows(plan.mine, before, len(seqs))  # the global batch's, in its order
        mismatch = {**mismatch_metrics(before, sampler_lp, mask), **staleness_metrics(view.behind, mask),
                    **staleness_mismatch(before, sampler_lp, mask, view.behind, self.max_staleness)}
        return Updated(logged, mismatch, tree_tokens, seconds)

    def _minibatch(self, part: dict, adv: Tensor, norm, step: int, where: str, seconds: dict):
        """One optimizer step on this process's rows of a minibatch (`part`: their sequences, masks,
        sampler / old / reference log-probs and K/V): its objective, the backward, a clipped step.
        Returns the step's metrics (summed over ranks) and the engine's result."""
        obj = build_objective(self.loss, sequences=part["seqs"], completion_mask=part["mask"], advantages=adv,
                              old_logprobs=part["old"], ref_logprobs=part["ref"], rollout_logprobs=part["sampler"],
                              old_is_current=self.before.old_is_current, normalisers=norm)
        self.model.train(False)  # no dropout: the backward must be that of the sampled policy
        res = self.engine.backward(self.model, part["seqs"], obj, kv=part["kv"], pictures=part["pictures"],
                                   progress=lambda phase, done, n: self.phase(f"{phase} {done}/{n} ({where})"))
        seconds["prefill"] += res.stats.prefill_s
        seconds["backward"] += res.stats.backward_s
        metrics = sum_metrics(self.dp.gather(obj.metrics()))  # additive: the normalisers are global
        t = time.perf_counter()
        grad_norm = self.stepper.step(all(math.isfinite(v) for v in metrics.values()), step)
        seconds["optim"] += time.perf_counter() - t
        if res.stats.router_aux_loss is not None:
            metrics["router_aux"] = res.stats.router_aux_loss
        metrics["grad_norm"] = grad_norm
        return metrics, res

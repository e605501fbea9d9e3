"""The RL loop: prompts → rollouts → rewards → advantages → streamed backward → optimizer step.

One step (`Trainer.train_step`) is the stages of docs/design.md §1:
  collect     rounds of G completions (or episodes) for `prompts_per_step` prompts from the rollout
              source, scored by the reward functions (TRL's signature), the overlong ones shaped;
              DAPO's dynamic sampling drops the groups with no signal and refills (rl/rollout/collect.py);
  advantages  per group (GRPO, Dr.GRPO, RLOO), zero where a sample gets no loss;
  update      per epoch and group-aligned minibatch: the objective (normalisers over the whole
              minibatch, before any block), the backward chosen once (`engine.backward`), a step;
  metrics     one line: rewards, lengths, loss terms, sampler/learner mismatch, time per phase.
The parts are built by their configs and live beside them: the run folder (runfolder.Run), the
backend that samples (rl/backends/) and the sampler over it (rl/rollout/), the rollout
source that owns the round (rl/rollout/source.py: the prompt stream, the rank split, the policy view and its
sync; synchronous, or up to rollout.max_staleness steps ahead), rewards, data parallelism
(rl/parallel.py, docs/design.md §6c), the optimizer step (rl/optim.Stepper), where π_old and π_ref
come from (rl/backward.BeforeUpdate). Each part's choices are taken once, when it is built: the step
branches on none of them, only on the algorithm's own options (DAPO's dynamic sampling).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import torch
from torch import Tensor

from backstream import checkpoint, runfolder
from backstream import config as cfgmod
from backstream.checks import UserError
from backstream.log import log
from backstream.metrics import (
    EpisodeLog,
    Logger,
    NoLogger,
    check_backends,
    gathered_means,
    peak_mib,
    plot_quietly,
    sum_metrics,
)
from backstream.quant.linear import quant_linears, quantize_model, quantized
from backstream.rl import parallel
from backstream.rl.backends import build_backend
from backstream.rl.data import prompts as datamod
from backstream.rl.parallel import take
from backstream.rl.policy import eos_ids, reference_policy
from backstream.rl.records import Samples
from backstream.rl.rollout import build_sampler
from backstream.rl.rollout.collect import Batch, Collector, timed
from backstream.rl.rollout.evaluate import Evaluator
from backstream.rl.rollout.source import build_source, check_backend
from backstream.rl.scoring.advantages import ZeroAdvantageWatch, format_hint
from backstream.rl.scoring.rewards import RewardLog, Rewards
from backstream.rl.update.backward import verify_engine
from backstream.rl.update.learner import BeforeUpdate
from backstream.rl.update.losses import Normalisers, build_objective
from backstream.rl.update.offpolicy import (
    MISMATCH_KEYS,
    STALENESS_KEYS,
    error_token_share,
    mismatch_metrics,
    staleness_metrics,
    staleness_mismatch,
    staleness_mismatch_keys,
)
from backstream.rl.update.optim import NonFiniteError, Stepper, check_finite_weights  # noqa: F401  (NonFiniteError: the API's)
from backstream.runfolder import Interrupted  # noqa: F401  (the CLI's: where a stopped run says it stopped)
from backstream.stream.router import moe_spec

PHASES = ("rollout", "sync", "tool", "reward", "prefill", "backward", "optim")  # the step's time split, as logged


class Trainer:
    """One run: built from a RunConfig (policy, prompts, rewards, optimizer, the backward), then
    `train_step` after `train_step`; checkpoints and resume. In one process, or on every rank of a
    torchrun job (see the module docstring)."""

    def __init__(self, cfg: cfgmod.RunConfig, run_dir: str | None = None, resume: bool = False,
                 model=None, tokenizer=None, overwrite: bool = False, allow_changed_files: bool = False,
                 backend=None):
        """`model`/`tokenizer`: objects to train instead of loading `cfg.model.name` (LoRA and the
        dtype from `cfg.model` are still applied to it); `backend`: what samples, (its sampling side, its
        sync side) (rl/backends/base.py), instead of the one `rollout.backend` names. `resume`: continue
        the run in `run_dir`, with
        `cfg` its config (config.RESUMABLE keys may differ; others are refused) and the files it read
        unchanged unless `allow_changed_files`. Everything that can fail on bad input is checked
        before the run folder is touched."""
        if resume and overwrite:
            raise UserError("--overwrite: not with --resume (--resume continues the run in its folder; --overwrite "
                             "moves an earlier run aside to start a new one); pass one of them")
        self.run_dir = run_dir or cfg.train.output_dir
        if resume:  # the run lives where it was found (its folder may have moved)
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=os.path.abspath(run_dir)))
        cfg = cfg.with_absolute_paths()  # the run folder names the same files wherever it is resumed from
        self.cfg = cfg
        tc = cfg.train
        changes = cfgmod.resume_changes(self.run_dir, cfg) if resume else []
        torch.manual_seed(tc.seed)
        self.device = cfg.model.torch_device()
        cfg.validate(world_size=parallel.requested_world())  # None in a plain process
        check_backends(tc.log_tensorboard, tc.log_wandb)
        self.dp = parallel.start(cfg.distributed, device=self.device, seed=tc.seed,
                                 minibatches=cfg.update.minibatches, reuse_kv=cfg.engine.reuse_rollout_kv)
        self._build_policy(model, tokenizer)
        self.cfg = cfg = cfg.for_tokenizer(self.tok)  # a built-in task through a chat model's template
        self.examples = cfg.data.build(tc.seed, prompt_optional=bool(cfg.env.factory or cfg.env.program))
        self.eos = eos_ids(self.model, self.tok)
        self.closing = contextlib.ExitStack()
        self.sampling = backend or build_backend(cfg.rollout, cfg.vllm, policy=cfg.model, quant=cfg.quant, seed=tc.seed,
                                                 tokenizer=self.tok, eos=self.eos, run_dir=self.run_dir,
                                                 model=self.model, dp=self.dp)
        self.closing.enter_context(self.sampling.closing)
        check_backend(cfg.rollout, self.sampling.backend)
        self.built: list = []
        self.sampler, environment = self._sampler_for(self.examples, cfg.rollout.group_size,
                                                      cfg.engine.reuse_rollout_kv)
        self.rewards = Rewards(cfg.reward, environment=environment)
        self.reward_log = RewardLog()  # what the reward functions log during the current step
        self.evaluator = Evaluator.build(cfg.eval, cfg.data, tc.seed, self.examples,
                                         lambda examples, k: self._sampler_for(examples, k)[0])
        for check in self.sampling.preflight:  # every sampler built: the backend's needs (a server's context)
            for sampler in self.built:
                if sampler.needs is not None:
                    check.need_context(*sampler.needs)
            check.check(self.model)
        self.ref = reference_policy(cfg.update.kl_reference, cfg.model, cfg.quant, self.model,
                                    copy_of_given=model is not None)  # a whole copy, before sharding
        self.dp.prepare(self.model, self.ref)  # after LoRA and quantization; the optimizer then holds the shards
        self.opt, self.sched = cfg.optim.build(self.model.parameters())
        self.engine = cfg.engine.build(self.device)
        self.before_update = BeforeUpdate(cfg.update, cfg.engine.reuse_rollout_kv)  # where π_old and π_ref come from
        self.advantage_fn = cfg.algorithm.advantages
        self.stream = datamod.PromptStream(len(self.examples), tc.seed)
        self.step = 0
        self.last_end: float | None = None  # when the last step ended (time/step runs from there)
        self.stepper = Stepper(cfg.optim, self.model, self.opt, self.sched, self.quantized_layers,
                               where=lambda: (self.step, checkpoint.latest(self.run_dir)))
        self.times = dict.fromkeys(PHASES, 0.0)
        self.zero_adv = ZeroAdvantageWatch(format_hint(self.tok, cfg.data.format, cfg.reward.functions))
        self.source = build_source(cfg.rollout, self.sampler, self.sampling, self.examples, self.stream, self.dp,
                                   self.model, cfg.quant, per_step=tc.prompts_per_step,
                                   servers_here=cfg.rollout.backend == "vllm" and not cfg.vllm.addresses(),
                                   phase=lambda what: self.logger.phase(self.step + 1, what))
        asynchronous = (self.source,) if cfg.rollout.max_staleness else ()
        for source in asynchronous:
            self.closing.callback(source.close)
        self.reporters = (self.sampler, *self.sampling.reporters, *asynchronous)
        self.collector = Collector(cfg.rollout, cfg.reward, tc.prompts_per_step, tc.steps, self.source, self.sampler,
                                   self.rewards, self.examples, self.dp, self.tok, self.sampling.resting)
        self._open_run(resume, overwrite, changes, allow_changed_files)
        self.source.at_step(self.step)  # a resumed run's weights are its checkpoint's step's

    def _open_run(self, resume: bool, overwrite: bool, changes: list, allow_changed_files: bool) -> None:
        """The run folder (rank 0's), the checkpoint to resume from, the loggers."""
        tc = self.cfg.train
        self.run_folder = runfolder.Run(self.cfg, self.run_dir, self.dp, resume=resume, overwrite=overwrite)
        with self.run_folder.guard():
            self.run_folder.open(changes, allow_changed_files)
            if resume:
                self._resume()
            self.logger = self.dp.on_main(lambda: Logger(
                self.run_dir, progress=tc.progress, tensorboard=tc.log_tensorboard, wandb=tc.log_wandb,
                config=self.cfg.public_dict(), total_steps=tc.steps, append=resume, wandb_project=tc.wandb_project,
                start_step=self.step, keys=self.metric_keys())) or NoLogger()
            self.episode_log = self.dp.on_main(lambda: EpisodeLog(self.run_dir, tc.log_episodes, resume,
                                                                  self.step)) or NoLogger()

    def _build_policy(self, model, tokenizer) -> None:
        """The policy (LoRA, quantization) and the checks it must pass before anything is written."""
        cfg = self.cfg
        self.model, self.tok = cfg.model.build(model, tokenizer)
        if cfg.quant.enabled:  # after LoRA: the base layers are quantized, the adapters stay in full precision
            quantize_model(self.model, cfg.quant)
        self.quantized_layers = list(quant_linears(self.model).values())
        if cfg.loss.router_aux_coef > 0:
            moe_spec(self.model, "loss.router_aux_coef")
        cfg.engine.check_model(self.model)
        if cfg.engine.verify and cfg.engine.streamed:
            verify_engine(self.model)

    def _sampler_for(self, examples: list[dict], k: int, return_kv: bool = False):
        """The run's kind of sampler over `examples` (the training ones, or the evaluation's), k samples
        per prompt; a prompt whose completion could run past the model's context is an error now."""
        ctx = getattr(self.model.config, "max_position_embeddings", None)
        prompts, text = datamod.encode_and_render(examples, self.tok, self.cfg.data.max_prompt_tokens,
                                                  self.cfg.rollout.max_new_tokens, ctx)
        sampler, environment = build_sampler(self.cfg.env, self.cfg.rollout.sampling(), k, tokenizer=self.tok,
                                             eos=self.eos, context=ctx, backend=self.sampling.backend,
                                             examples=examples, prompts=prompts, prompt_text=text, return_kv=return_kv,
                                             closing=self.closing)
        self.built.append(sampler)
        return sampler, environment

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics at the current weights (rl/rollout/evaluate.py), in the rollout's numerics."""
        ev = self.evaluator
        return ev.run(lambda *a: self.source.sample(ev.sampler, *a).samples,
                      lambda r: self.collector.score(r, self.step, ev.sampler, ev.examples)[0], self.dp, self.step)

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint holds beside the weights; the optimizer itself (checkpoint.save takes
        its state_dict in one process, its shards under torchrun)."""
        return {"step": self.step, "optimizer": self.opt, "scheduler": self.sched.state_dict(),
                "rng": checkpoint.rng_state(), "data_position": self.source.consumed}

    def save(self) -> str:
        """A checkpoint of the current step (collective under torchrun: every rank calls it)."""
        check_finite_weights(self.model, self.dp, self.step, self.run_folder.last)
        with self.dp.guard(f"the checkpoint of step {self.step}"):
            path = checkpoint.save(self.run_dir, self.step, self.model, self.tok, self.state(),
                                   self.cfg.train.keep_checkpoints)
        self.run_folder.saved()
        if self.cfg.train.plots:
            self.dp.on_main(lambda: plot_quietly(self.run_dir))
        return path

    def _resume(self) -> None:
        """Weights, optimizer, schedule, RNG, data position and step of the latest intact checkpoint
        (written by any number of ranks: DCP reshards)."""
        path = self.run_folder.resume_point()
        st = checkpoint.restore(path, self.model, self.opt, self.sched)
        checkpoint.restore_rng(st["rng"])
        self.stream.position = st["data_position"]
        self.step = st["step"]

    # -- the loop -------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One RL step (docs/design.md §1): collect → advantages → update → metrics; returns the metrics."""
        t0 = self.last_end or time.perf_counter()  # the end of the last step: its logging, checkpoint and
        # evaluation count (an asynchronous source samples on meanwhile), so steps per hour read off time/step
        self.times = dict.fromkeys(PHASES, 0.0)
        self.reward_log = RewardLog()
        self.unique_tokens = 0  # tokens the engine's trees held this step (first epoch)
        with self.dp.guard(f"step {self.step + 1}"):
            batch = self.collect()  # the global batch (on every rank under torchrun)
            adv = self.advantages(batch.rewards) * batch.keep
            logged, mismatch = self.update(batch.samples, adv)
            self.step += 1
            with timed(self.times, "sync"):  # the weights are now this step's (an asynchronous source syncs them now)
                self.source.at_step(self.step)
            self.last_end = time.perf_counter()
            return self.metrics(batch, adv, logged, mismatch, self.last_end - t0)

    def collect(self) -> Batch:
        """The step's batch (rl/rollout/collect.py): rollout rounds until `prompts_per_step` groups are kept."""
        return self.collector.collect(self.step, self.times, self.reward_log, self.episode_log,
                                      lambda what: self.logger.phase(self.step + 1, what))

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Per-sample advantages from the group rewards (algorithm.advantage)."""
        return self.advantage_fn(rewards, self.cfg.rollout.group_size)

    def update(self, batch: Samples, adv: Tensor) -> tuple[dict[str, list[float]], dict[str, float]]:
        """`epochs` × `minibatches` optimizer steps on the collected samples, each over one
        group-aligned minibatch: its objective, the backward chosen at construction, a clipped step.
        Under torchrun `batch` is the global batch and this rank trains its own groups of each
        minibatch, normalised by the global minibatch's counts. The learner runs the rollout's
        quantized forward when `quant.aligned`, full precision else. Returns each step's loss
        metrics (summed over ranks) and the sampler/learner mismatch of the first epoch."""
        with quantized(self.model, self.cfg.quant.aligned):
            return self._update(batch, adv)

    def _update(self, batch: Samples, adv: Tensor) -> tuple[dict[str, list[float]], dict[str, float]]:
        ac = self.cfg.update
        view = batch.training(self.step)  # a sample's sequences: its own, and its forks (an agent's branches)
        seqs, mask, sampler_lp = view.seqs, view.mask, view.logprobs
        adv = adv[view.owner]
        plan = self.dp.plan_update(len(batch) // batch.group_size, ac.minibatches, batch.group_size, batch.kv)
        plan = plan.over(view.rows_of(len(batch)))
        mine = {"seqs": take(seqs, plan.mine), "mask": take(mask, plan.mine), "sampler": take(sampler_lp, plan.mine),
                "kv": take(view.kv, plan.mine)}
        with timed(self.times, "prefill"):
            mine["old"], mine["ref"] = self.before_update.logprobs(self.engine, self.model, self.ref, mine["seqs"],
                                                                   mine["mask"], mine["sampler"])
        norms = [Normalisers.of(take(mask, rows), adv[rows]) for rows in plan.batch_rows]
        logged: dict[str, list[float]] = {}
        learner_lp: list[Tensor | None] = [None] * len(plan.mine)  # at the weights that sampled, first epoch
        for epoch in range(ac.epochs):
            for rows, rows_b, norm in zip(plan.local, plan.own, norms):
                step, res = self._minibatch({k: take(v, rows) for k, v in mine.items()}, adv[rows_b], norm,
                                            f"minibatch {len(logged.get('grad_norm', [])) + 1}/"
                                            f"{ac.epochs * ac.minibatches}")
                if epoch == 0:  # sampler/learner agreement on the tokens the learner computed
                    self.unique_tokens += res.stats.tree_tokens or res.stats.input_tokens
                    for r, lp in zip(rows, res.logprobs):
                        learner_lp[r] = lp
                for k, v in step.items():
                    logged.setdefault(k, []).append(v)
        before = self.before_update.learner_at_sampling(mine["old"], learner_lp)
        before = self.dp.gather_rows(plan.mine, before, len(seqs))  # the global batch's, in its order
        return logged, {**mismatch_metrics(before, sampler_lp, mask), **staleness_metrics(view.behind, mask),
                        **staleness_mismatch(before, sampler_lp, mask, view.behind, self.cfg.rollout.max_staleness)}

    def _minibatch(self, part: dict, adv: Tensor, norm, where: str):
        """One optimizer step on this process's rows of a minibatch (`part`: their sequences, masks,
        sampler / old / reference log-probs and K/V): its objective, the backward, a clipped step.
        Returns the step's metrics (summed over ranks) and the engine's result."""
        obj = build_objective(self.cfg.loss, sequences=part["seqs"], completion_mask=part["mask"], advantages=adv,
                              old_logprobs=part["old"], ref_logprobs=part["ref"], rollout_logprobs=part["sampler"],
                              old_is_current=self.before_update.old_is_current, normalisers=norm)
        self.model.train(False)  # no dropout: the backward must be that of the sampled policy
        res = self.engine.backward(self.model, part["seqs"], obj, kv=part["kv"],
                                   progress=lambda phase, done, n: self.logger.phase(
                                       self.step + 1, f"{phase} {done}/{n} ({where})"))
        self.times["prefill"] += res.stats.prefill_s
        self.times["backward"] += res.stats.backward_s
        step = sum_metrics(self.dp.gather(obj.metrics()))  # additive: the normalisers are global
        with timed(self.times, "optim"):
            grad_norm = self.stepper.step(loss_finite=all(math.isfinite(v) for v in step.values()))
        if res.stats.router_aux_loss is not None:
            step["router_aux"] = res.stats.router_aux_loss
        step["grad_norm"] = grad_norm
        return step, res

    def metric_keys(self) -> list[str]:
        """Every key of a step's metrics line, in order (`Logger` writes each on every line, null where
        a step leaves it undefined)."""
        loss = [k if "/" in k else f"loss/{k}" for k in self.cfg.loss.metric_keys()]
        loss += ["loss/router_aux"] * (self.cfg.loss.router_aux_coef > 0)
        dapo = ["dapo/refill_rounds", "dapo/groups_dropped"] if self.cfg.rollout.dynamic_sampling else []
        return ["step", *self.evaluator.keys(), "reward/mean", "reward/std",
                *[k for r in self.reporters for k in r.metric_keys], "batch/groups", "batch/zero_adv_frac", *dapo,
                *[f"reward/{name}" for name in self.rewards.functions],
                "tree/tokens_total", "tree/tokens_unique", *loss, "optim/grad_norm", *MISMATCH_KEYS, *STALENESS_KEYS,
                *staleness_mismatch_keys(self.cfg.rollout.max_staleness),
                "optim/skipped_nonfinite", *[f"time/{p}" for p in PHASES], "time/step", "throughput/tokens_per_s",
                "optim/lr", "memory/peak_mib"]

    def metrics(self, batch: Batch, adv: Tensor, logged: dict[str, list[float]], mismatch: dict[str, float],
                step_time: float) -> dict:
        """The step's line: rewards as scored, lengths, the loss terms averaged over the optimizer
        steps, sampler/learner mismatch, time per phase, throughput, learning rate, peak memory."""
        r, n, ro = batch.scored, len(batch.samples), batch.samples
        m = {"step": self.step, "reward/mean": float(r.mean()), "reward/std": float(r.std()) if len(r) > 1 else 0.0}
        for part in self.reporters:  # the samples' lengths and episodes, a server pool's, the asynchronous source's
            m.update(part.metrics(ro))
        m.update({"batch/groups": n // ro.group_size, "batch/zero_adv_frac": float((adv == 0).float().mean())})
        if self.cfg.rollout.dynamic_sampling:
            m.update({"dapo/refill_rounds": batch.refill_rounds, "dapo/groups_dropped": batch.groups_dropped})
        # a function's mean over the samples it scored (None: TRL's "does not apply")
        m.update({f"reward/{k}": float(v.nanmean()) for k, v in batch.scored_by_fn.items()})
        logged_means = self.reward_log.means()
        m.update({k: float(sum(v) / len(v)) for k, v in gathered_means(self.dp.gather(logged_means)).items()})
        m["tree/tokens_total"] = ro.tokens_total()
        m["tree/tokens_unique"] = sum(self.dp.gather(self.unique_tokens))  # the engine's, over every rank
        # loss terms as loss/…; an objective's own groups (is/…, tbpo/…) keep their names
        m.update({"optim/grad_norm" if k == "grad_norm" else k if "/" in k else f"loss/{k}": float(sum(v) / len(v))
                  for k, v in logged.items()})
        m.update(mismatch)
        m["mismatch/error_token_share"] = error_token_share(ro.sampled_ids())
        tokens = m["tree/tokens_total"]
        m["optim/skipped_nonfinite"] = self.stepper.skipped
        m.update({f"time/{k}": v for k, v in self.times.items()})  # rank 0's, under torchrun
        m.update({"time/step": step_time, "throughput/tokens_per_s": tokens / step_time,
                  "optim/lr": self.sched.get_last_lr()[0],
                  "memory/peak_mib": max(self.dp.gather(peak_mib(self.device)))})  # the fullest rank's
        return m

    def run(self) -> str:
        """Train until train.steps; returns the run folder. On SIGINT/SIGTERM, saves and raises
        `Interrupted` (the CLI exits 130 / 143 with where to resume)."""
        tc, run = self.cfg.train, self.run_folder
        run.step = self.step
        if self.step >= tc.steps:
            self.logger.close()
            run.finished()
            return self.run_dir
        try:
            with run.training(self.step):
                if self.evaluator.at_start and self.step == 0:
                    self.logger.log({"step": 0, **self.evaluate()})
                while self.step < tc.steps and run.next_step():
                    m = self.train_step()
                    run.step_done(self.step)
                    if self.evaluator.due(self.step, tc.steps):
                        m.update(self.evaluate())
                    self.logger.log(m)
                    if self.zero_adv.saw(m["batch/zero_adv_frac"] == 1.0, self.step, m["response/truncated"] == 1.0):
                        log.warning(self.zero_adv.warning)
                    if run.checkpoint_due():
                        self.save()
                self.save()
                run.ended()
        finally:
            self.close()
        return self.run_dir

    def close(self) -> None:
        """The logs, the samplers' worker processes."""
        self.logger.close()
        self.episode_log.close()
        self.closing.close()


def train(config: cfgmod.RunConfig | str | None = None, overrides: list[str] = (), resume: str | None = None,
          model=None, tokenizer=None, overwrite: bool = False, allow_changed_files: bool = False, backend=None) -> str:
    """Run a training job; returns the run folder. `config` is a RunConfig, a TOML path or None
    (defaults), `overrides` "section.key=value" strings on top of it; `resume` a run folder to
    continue, its own config.toml the config unless `config` is given (keys of `config.RESUMABLE` may
    change, others are refused); `allow_changed_files`: resume although a file the run read (data,
    reward source) changed; `model`/`tokenizer` objects to train instead of loading `model.name`;
    `overwrite` moves an earlier run in `train.output_dir` aside (a new run refuses a folder that
    holds one otherwise); `backend`: (sampling side, sync side) that sample instead of the one
    `rollout.backend` names (rl/backends/base.py).
    Raises `Interrupted` after SIGINT/SIGTERM."""
    if resume and not os.path.exists(os.path.join(resume, "config.toml")):
        raise UserError(f"--resume: {resume} is not a run folder (no config.toml)")
    if not isinstance(config, cfgmod.RunConfig):
        config = cfgmod.load(config or (os.path.join(resume, "config.toml") if resume else None), overrides)
    return Trainer(config, run_dir=resume, resume=bool(resume), model=model, tokenizer=tokenizer, overwrite=overwrite,
                   allow_changed_files=allow_changed_files, backend=backend).run()

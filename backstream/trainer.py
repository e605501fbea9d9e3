"""The RL loop: prompts → rollouts → rewards → advantages → streamed backward → optimizer step.

One step (`Trainer.train_step`) is the phases of docs/design.md §1, each a part of the run
(backstream/parts.py builds them, every check before the run folder is touched):
  collect     rounds of G completions (or episodes) for `prompts_per_step` prompts from the rollout
              source, scored by the reward functions (TRL's signature), the overlong ones shaped;
              DAPO's dynamic sampling drops the groups with no signal and refills (rl/rollout/collect.py);
  advantages  per group ([algorithm]: GRPO, Dr.GRPO, RLOO), zero where a sample gets no loss;
  update      [update]'s epochs × minibatches optimizer steps, each over one group-aligned minibatch:
              its objective (normalisers over the whole minibatch, before any block), the backward
              [engine] chose, a clipped step (rl/update/learner.py);
  metrics     one line: rewards, the samples' own metrics, loss terms, sampler/learner mismatch, time
              per phase, throughput.
The trainer owns the run folder (runfolder.Run), the step counter, the loggers and the checkpoint: its
state is the step, the RNG and the parts' own (`Learner.state_dict`: the optimizer and its schedule;
`Source.state_dict`: the data position). Each part's choices are taken when it is built: the step
branches on none of them, only on the algorithm's own options (DAPO's dynamic sampling).
"""

from __future__ import annotations

import dataclasses
import os
import time

from backstream import checkpoint, parts, runfolder
from backstream import config as cfgmod
from backstream.checks import UserError
from backstream.log import log
from backstream.metrics import EpisodeLog, Logger, NoLogger, gathered_means, peak_mib, plot_quietly
from backstream.rl.rollout.collect import Batch
from backstream.rl.scoring.rewards import RewardLog
from backstream.rl.update.learner import Updated
from backstream.rl.update.offpolicy import MISMATCH_KEYS, STALENESS_KEYS, error_token_share, staleness_mismatch_keys
from backstream.rl.update.optim import NonFiniteError, check_finite_weights  # noqa: F401  (NonFiniteError: the API's)
from backstream.runfolder import Interrupted  # noqa: F401  (the CLI's: where a stopped run says it stopped)

PHASES = ("rollout", "sync", "tool", "reward", "prefill", "backward", "optim")  # the step's time split, as logged


class Trainer:
    """One run: its parts built from a RunConfig (backstream/parts.py), then `train_step` after
    `train_step`; checkpoints and resume. In one process, or on every rank of a torchrun job
    (rl/parallel/)."""

    def __init__(self, cfg: cfgmod.RunConfig, run_dir: str | None = None, resume: bool = False,
                 model=None, tokenizer=None, overwrite: bool = False, allow_changed_files: bool = False,
                 backend=None):
        """`model`/`tokenizer`: objects to train instead of loading `cfg.model.name` (LoRA and the dtype
        from `cfg.model` are still applied to it); `backend`: what samples (rl/backends/base.py
        `Sampling`), instead of the backend `rollout.backend` names. `resume`: continue the run in
        `run_dir`, with `cfg` its config (config.RESUMABLE keys may differ; others are refused) and the
        files it read unchanged unless `allow_changed_files`. Everything that can fail on bad input is
        checked before the run folder is touched."""
        if resume and overwrite:
            raise UserError("--overwrite: not with --resume (--resume continues the run in its folder; --overwrite "
                            "moves an earlier run aside to start a new one); pass one of them")
        self.run_dir = run_dir or cfg.train.output_dir
        if resume:  # the run lives where it was found (its folder may have moved)
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, output_dir=os.path.abspath(run_dir)))
            cfg = cfgmod.kept_on_resume(run_dir, cfg)  # what the run decided at its start (Dr.GRPO's L_max)
        cfg = cfg.with_absolute_paths()  # the run folder names the same files wherever it is resumed from
        cfg = cfg.with_run_defaults()  # Dr.GRPO's L_max and the learning rate, stated in config.toml
        changes = cfgmod.resume_changes(self.run_dir, cfg) if resume else []
        self.parts = parts.build(cfg, self.run_dir, model=model, tokenizer=tokenizer, sampling=backend)
        self.cfg, self.model, self.sampler = self.parts.cfg, self.parts.model, self.parts.sampler
        self.step, self.last_end = 0, None  # steps done; when the last one ended (time/step runs from there)
        self.times, self.reward_log = dict.fromkeys(PHASES, 0.0), RewardLog()  # the current step's
        self._open_run(resume, overwrite, changes, allow_changed_files)
        self.parts.source.at_step(self.step)  # a resumed run's weights are its checkpoint's step's

    def _open_run(self, resume: bool, overwrite: bool, changes: list, allow_changed_files: bool) -> None:
        """The run folder (rank 0's), the checkpoint to resume from, the loggers."""
        tc, dp = self.cfg.train, self.parts.dp
        self.run_folder = runfolder.Run(self.cfg, self.run_dir, dp, resume=resume, overwrite=overwrite)
        with self.run_folder.guard():
            self.run_folder.open(changes, allow_changed_files)
            if resume:
                self.load_state_dict(self.run_folder.resume_point())
            self.logger = dp.on_main(lambda: Logger(
                self.run_dir, progress=self.parts.progress, tensorboard=tc.log_tensorboard, wandb=tc.log_wandb,
                config=self.cfg.public_dict(), total_steps=tc.steps, append=resume, wandb_project=tc.wandb_project,
                start_step=self.step, keys=self.metric_keys())) or NoLogger()
            self.episode_log = dp.on_main(lambda: EpisodeLog(self.run_dir, tc.log_episodes, resume,
                                                             self.step)) or NoLogger()

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics at the current weights (rl/rollout/evaluate.py), in the rollout's numerics."""
        p = self.parts
        ev = p.evaluator
        return ev.run(lambda *a: p.source.sample(ev.sampler, *a).samples,
                      lambda r: p.collector.score(r, self.step, ev.sampler, ev.examples)[0], p.dp, self.step)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint holds beside the weights: the step, the RNG and each part's own state (the
        learner's optimizer and schedule, the source's data position)."""
        return {"step": self.step, "rng": checkpoint.rng_state(), **self.parts.learner.state_dict(),
                **self.parts.source.state_dict()}

    def load_state_dict(self, path: str) -> None:
        """The weights, optimizer, schedule, RNG, data position and step of checkpoint `path` (written by
        any number of ranks: DCP reshards)."""
        st = checkpoint.restore(path, self.model, self.parts.learner.stepper.opt)
        self.parts.learner.load_state_dict(st)
        self.parts.source.load_state_dict(st)
        checkpoint.restore_rng(st["rng"])
        self.step = st["step"]

    def save(self) -> str:
        """A checkpoint of the current step (collective under torchrun: every rank calls it)."""
        dp = self.parts.dp
        check_finite_weights(self.model, dp, self.step, self.run_folder.last)
        with dp.guard(f"the checkpoint of step {self.step}"):
            path = checkpoint.save(self.run_dir, self.step, self.model, self.parts.saved, self.state_dict(),
                                   self.cfg.train.keep_checkpoints)
        self.run_folder.saved()
        if self.cfg.train.plots:
            dp.on_main(lambda: plot_quietly(self.run_dir))
        return path

    # -- the loop -------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One RL step (docs/design.md §1): collect → advantages → update → metrics; returns the metrics."""
        p = self.parts
        t0 = self.last_end or time.perf_counter()  # the end of the last step: its logging, checkpoint and
        # evaluation count (an asynchronous source samples on meanwhile), so steps per hour read off time/step
        self.times, self.reward_log = dict.fromkeys(PHASES, 0.0), RewardLog()
        p.progress.at(self.step + 1)
        with p.dp.guard(f"step {self.step + 1}"):
            batch = self.collect()  # the global batch (on every rank under torchrun)
            adv = self.advantages(batch.rewards) * batch.keep
            updated = p.learner.update(batch.samples, adv, self.step)
            for k, v in updated.seconds.items():
                self.times[k] += v
            self.step += 1
            t = time.perf_counter()  # the weights are now this step's (an asynchronous source syncs them now)
            p.source.at_step(self.step)
            self.times["sync"] += time.perf_counter() - t
            self.last_end = time.perf_counter()
            return self.metrics(batch, adv, updated, self.last_end - t0)

    def collect(self) -> Batch:
        """The step's batch (rl/rollout/collect.py): rollout rounds until `prompts_per_step` groups are kept."""
        return self.parts.collector.collect(self.step, self.times, self.reward_log, self.episode_log,
                                            self.parts.progress.phase)

    def advantages(self, rewards):
        """Per-sample advantages from the group rewards ([algorithm])."""
        return self.parts.advantages(rewards, self.cfg.rollout.group_size)

    def metric_keys(self) -> list[str]:
        """Every key of a step's metrics line, in order (`Logger` writes each on every line, null where
        a step leaves it undefined)."""
        p, cfg = self.parts, self.cfg
        loss = [k if "/" in k else f"loss/{k}" for k in cfg.loss.metric_keys()]
        loss += ["loss/router_aux"] * (cfg.loss.router_aux_coef > 0)
        dapo = ["dapo/refill_rounds", "dapo/groups_dropped"] if cfg.rollout.dynamic_sampling else []
        return ["step", *p.evaluator.keys(), "reward/mean", "reward/std",
                *[k for r in p.reporters for k in r.metric_keys], "batch/groups", "batch/zero_adv_frac", *dapo,
                *[f"reward/{name}" for name in p.rewards.functions],
                "tree/tokens_total", "tree/tokens_unique", *loss, "optim/grad_norm", *MISMATCH_KEYS, *STALENESS_KEYS,
                *staleness_mismatch_keys(cfg.rollout.max_staleness),
                "optim/skipped_nonfinite", *[f"time/{p}" for p in PHASES], "time/step",
                "throughput/tokens_per_s", "optim/lr", "memory/peak_mib"]

    def metrics(self, batch: Batch, adv, updated: Updated, step_time: float) -> dict:
        """The step's line: rewards as scored, the samples' own metrics (lengths, episodes, a server
        pool's), the loss terms averaged over the optimizer steps, sampler/learner mismatch, time per
        phase, throughput, learning rate, peak memory."""
        p, dp = self.parts, self.parts.dp
        r, n, ro = batch.scored, len(batch.samples), batch.samples
        m = {"step": self.step, "reward/mean": float(r.mean()), "reward/std": float(r.std()) if len(r) > 1 else 0.0}
        for part in p.reporters:
            m.update(part.metrics(ro))
        m.update({"batch/groups": n // ro.group_size, "batch/zero_adv_frac": float((adv == 0).float().mean())})
        if self.cfg.rollout.dynamic_sampling:
            m.update({"dapo/refill_rounds": batch.refill_rounds, "dapo/groups_dropped": batch.groups_dropped})
        # a function's mean over the samples it scored (None: TRL's "does not apply")
        m.update({f"reward/{k}": float(v.nanmean()) for k, v in batch.scored_by_fn.items()})
        m.update({k: float(sum(v) / len(v)) for k, v in gathered_means(dp.gather(self.reward_log.means())).items()})
        m["tree/tokens_total"] = ro.tokens_total()
        m["tree/tokens_unique"] = sum(dp.gather(updated.tree_tokens))  # the engine's, over every rank
        # loss terms as loss/…; an objective's own groups (is/…, tbpo/…) keep their names
        m.update({"optim/grad_norm" if k == "grad_norm" else k if "/" in k else f"loss/{k}": float(sum(v) / len(v))
                  for k, v in updated.logged.items()})
        m.update(updated.mismatch)
        m["mismatch/error_token_share"] = error_token_share(ro.sampled_ids())
        m["optim/skipped_nonfinite"] = p.learner.stepper.skipped
        m.update({f"time/{k}": v for k, v in self.times.items()})  # rank 0's, under torchrun
        m.update({"time/step": step_time, "throughput/tokens_per_s": m["tree/tokens_total"] / step_time,
                  "optim/lr": p.learner.stepper.sched.get_last_lr()[0],
                  "memory/peak_mib": max(dp.gather(peak_mib(p.device)))})  # the fullest rank's
        return m

    def run(self) -> str:
        """Train until train.steps; returns the run folder. On SIGINT/SIGTERM, saves and raises
        `Interrupted` (the CLI exits 130 / 143 with where to resume)."""
        tc, run, p = self.cfg.train, self.run_folder, self.parts
        run.step = self.step
        if self.step >= tc.steps:
            self.close()
            run.finished()
            return self.run_dir
        try:
            with run.training(self.step):
                if p.evaluator.at_start and self.step == 0:
                    self.logger.log({"step": 0, **self.evaluate()})
                while self.step < tc.steps and run.next_step():
                    m = self.train_step()
                    run.step_done(self.step)
                    if p.evaluator.due(self.step, tc.steps):
                        m.update(self.evaluate())
                    self.logger.log(m)
                    if p.zero_adv.saw(m["batch/zero_adv_frac"] == 1.0, self.step, m["response/truncated"] == 1.0):
                        log.warning(p.zero_adv.warning)
                    if run.checkpoint_due():
                        self.save()
                self.save()
                run.ended()
        finally:
            self.close()
        return self.run_dir

    def close(self) -> None:
        """The logs, and what the parts started (servers, environment workers, an endpoint, threads)."""
        self.logger.close()
        self.episode_log.close()
        self.parts.close()


def train(config: cfgmod.RunConfig | str | None = None, overrides: list[str] = (), resume: str | None = None,
          model=None, tokenizer=None, overwrite: bool = False, allow_changed_files: bool = False, backend=None) -> str:
    """Run a training job; returns the run folder. `config` is a RunConfig, a TOML path or None
    (defaults), `overrides` "section.key=value" strings on top of it; `resume` a run folder to
    continue, its own config.toml the config unless `config` is given (keys of `config.RESUMABLE` may
    change, others are refused); `allow_changed_files`: resume although a file the run read (data,
    reward source) changed; `model`/`tokenizer` objects to train instead of loading `model.name`;
    `overwrite` moves an earlier run in `train.output_dir` aside (a new run refuses a folder that
    holds one otherwise); `backend`: what samples instead of the backend `rollout.backend` names
    (rl/backends/base.py `Sampling`).
    Raises `Interrupted` after SIGINT/SIGTERM."""
    if resume and not os.path.exists(os.path.join(resume, "config.toml")):
        raise UserError(f"--resume: {resume} is not a run folder (no config.toml)")
    if not isinstance(config, cfgmod.RunConfig):
        config = cfgmod.load(config or (os.path.join(resume, "config.toml") if resume else None), overrides)
    return Trainer(config, run_dir=resume, resume=bool(resume), model=model, tokenizer=tokenizer, overwrite=overwrite,
                   allow_changed_files=allow_changed_files, backend=backend).run()

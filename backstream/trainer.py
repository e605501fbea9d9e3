"""The RL loop: prompts → rollouts → rewards → advantages → streamed backward → optimizer step.

One step (`Trainer.train_step`), in the stages of DESIGN §1:
  collect     take `prompts_per_step` prompts and sample G completions each (in-process sampler,
              one prefill per prompt); score them (reward functions, TRL signature); shape the
              overlong ones (filter or penalty); DAPO dynamic sampling drops the groups with no
              signal and refills the batch;
  advantages  per group (GRPO, Dr.GRPO, RLOO), zero where a sample gets no loss;
  update      for each epoch and minibatch (group-aligned): build the objective (normalisers over
              the whole minibatch, before any block), run the backward chosen once from
              `engine.backward` (the exact streamed one, or the naive reference, for comparison),
              clip, step. Log-probs of the policy before the update come from the engine's prefill
              when there is a single update per rollout, else from one no-grad pass up front;
  metrics     one line: rewards, lengths, loss terms, sampler/learner mismatch, time per phase.
The policy, the data and the optimizer are built by their configs (model.py, data.py, optim.py).

Under torchrun (DESIGN §6c) the same loop runs on every rank and reads the same: `self.dp`
(rl/parallel.py) is the one-process `DataParallel`, whose methods do nothing, or a `Torchrun`, which
shards the policy with FSDP2, has each rank sample and train whole prompt groups of the global batch,
gathers the rollouts so that rewards, advantages, normalisers and metrics are those of the global
batch (the gradients are summed over ranks), and lets rank 0 alone write the run folder (checkpoints
are collective).
Simplified on purpose: rollout and learner share weights (and, under torchrun, the rollout runs on
the learner's ranks with the parameters gathered).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
from dataclasses import dataclass

import torch
from torch import Tensor

from backstream import checkpoint, config as cfgmod, runfolder
from backstream.metrics import EpisodeLog, Logger, check_backends, plot
from backstream.quant.linear import quant_linears, quantize_model, quantized
from backstream.rl import data as datamod, parallel
from backstream.rl.advantages import ADVANTAGES
from backstream.rl.losses import Normalisers, build_objective
from backstream.rl.offpolicy import error_token_share, mismatch_metrics
from backstream.rl.rewards import RewardLog, Rewards, TrainerState
from backstream.rl.agent.episodes import build_sampler, eos_ids
from backstream.rl.evaluate import Evaluator, with_group_size
from backstream.rl.rollout import Rollout
from backstream.rl.shaping import informative_groups, overlong_shaping
from backstream.stream import fsdp
from backstream.stream.hf import base_model
from backstream.stream.router import moe_spec

PHASES = ("rollout", "tool", "reward", "prefill", "backward", "optim")  # the step's time split, as logged
ZERO_ADVANTAGE_STEPS = 5  # this many steps in a row with every advantage 0 get a warning
MISMATCH_KEYS = ("mismatch/kl", "mismatch/abs_log_ratio/mean", "mismatch/logprob_abs", "mismatch/ratio/max",
                 "mismatch/tokens", "mismatch/error_token_share")


# -- set-up --------------------------------------------------------------------------------------


_VERIFIED: dict = {}  # architecture → VerifyReport: a process checks each architecture once


def verify_engine(model) -> None:
    """engine.verify: the streamed backward must be exact on a miniature of `model`'s architecture
    (same config, same LoRA config, same train/eval mode; `backstream.stream.verify`), else stop before
    the run folder is written."""
    from backstream.stream.verify import Verdict, verify  # noqa: PLC0415

    base = base_model(model)
    peft = getattr(model, "peft_config", None)
    # what saving a checkpoint writes into the config (architectures, dtype) is not architecture
    arch = {k: v for k, v in base.config.to_dict().items()
            if k not in ("architectures", "dtype", "_name_or_path", "transformers_version")}
    key = (json.dumps(arch, sort_keys=True, default=str), repr(peft), model.training)
    report = _VERIFIED.get(key)
    if report is None:
        report = _VERIFIED[key] = verify(model)
    if not report.ok:
        detail = f"{report.verdict} ({report.reason})" if report.kind is Verdict.WRONG else report.verdict
        raise ValueError("engine.verify: the streamed backward is not exact on a miniature of this model's "
                         f"architecture ({report.model_type}): {detail}. `backstream verify` prints the details; set "
                         "engine.backward = \"reference\" to train with the naive backward, or engine.verify = false "
                         "to skip this check")


def peak_mib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- one step's pieces ---------------------------------------------------------------------------


def minibatches(n_groups: int, n: int, group_size: int) -> list[list[int]]:
    """The sample rows of `n` group-aligned minibatches of equal size, in order."""
    assert n_groups % n == 0, (n_groups, n)  # RunConfig.validate: minibatches divides prompts_per_step
    rows = n_groups // n * group_size
    return [list(range(m * rows, (m + 1) * rows)) for m in range(n)]


def take(xs: list | None, rows: list[int]) -> list | None:
    """The entries `rows` of a per-sample list (None stays None)."""
    return None if xs is None else [xs[i] for i in rows]


class _NoLogger:
    """The logger of the ranks other than 0 under torchrun: the Logger's methods, doing nothing."""

    def log(self, metrics: dict) -> None:
        pass

    def phase(self, step: int, what: str) -> None:
        pass

    def close(self) -> None:
        pass


class NonFiniteError(ValueError):
    """Training produced NaN/inf (gradients or weights): the run stops before writing from them."""


@dataclass
class Batch:
    """What `collect` hands on: the kept samples, their rewards after overlong shaping and which of
    them get a loss; for the metrics, the reward of every sample scored in the step (dropped groups
    included) as the reward functions gave it."""

    rollout: Rollout
    rewards: Tensor  # [N] float, shaped
    keep: Tensor  # [N] bool: False where overlong filtering takes a sample out of the loss
    scored: Tensor  # [M >= N] total reward of every sample scored, before shaping
    scored_by_fn: dict[str, Tensor]  # per reward function, [M]


class Trainer:
    """One run: built from a RunConfig (policy, prompts, rewards, optimizer, the backward), then
    `train_step` after `train_step`; checkpoints and resume. In one process, or on every rank of a
    torchrun job (see the module docstring)."""

    def __init__(self, cfg: cfgmod.RunConfig, run_dir: str | None = None, resume: bool = False,
                 model=None, tokenizer=None, overwrite: bool = False, allow_changed_files: bool = False):
        """`model`/`tokenizer`: objects to train instead of loading `cfg.model.name` (LoRA and the
        dtype from `cfg.model` are still applied to it). `resume`: continue the run in `run_dir`, with
        `cfg` its config (config.RESUMABLE keys may differ; others are refused) and the files it read
        unchanged unless `allow_changed_files`. Everything that can fail on bad input is checked
        before the run folder is touched."""
        if resume and overwrite:
            raise ValueError("--overwrite: not with --resume (--resume continues the run in its folder; --overwrite "
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
        self.gen = torch.Generator().manual_seed(tc.seed)  # the sampler's (one process; checkpointed)
        self.dp = parallel.start(cfg.distributed, device=self.device, seed=tc.seed, generator=self.gen,
                                 minibatches=cfg.algorithm.minibatches, reuse_kv=cfg.engine.reuse_rollout_kv)
        self.model, self.tok = cfg.model.build(model, tokenizer)
        if cfg.quant.enabled:  # after LoRA: the base layers are quantized, the adapters stay in full precision
            quantize_model(self.model, cfg.quant)
        self.quantized_layers = list(quant_linears(self.model).values())
        if cfg.loss.router_aux_coef > 0:
            moe_spec(self.model, "loss.router_aux_coef")
        if cfg.engine.verify and cfg.engine.streamed:
            verify_engine(self.model)
        self._load_prompts()
        self.sampler = build_sampler(cfg.env, cfg.rollout, self.tok, eos_ids(self.model, self.tok),
                                     cfg.engine.reuse_rollout_kv, self.prompts, self.prompt_text,
                                     getattr(self.model.config, "max_position_embeddings", None))
        self.sampler.check_prompts(self.examples)
        self.rewards = Rewards(cfg.reward, environment=self.sampler.environment)
        self.reward_log = RewardLog()  # what the reward functions log during the current step
        self.evaluator = Evaluator.build(cfg.eval, cfg.data, tc.seed, self.examples, self._sampler_for)
        self.ref = self._reference_policy(copy_of_given=model is not None)  # a whole copy, before sharding
        self.dp.prepare(self.model, self.ref)  # after LoRA and quantization; the optimizer then holds the shards
        self.opt, self.sched = cfg.optim.build(self.model.parameters())
        self.engine = cfg.engine.build(self.device)
        self.advantage_fn = ADVANTAGES[cfg.algorithm.advantage]
        self.stream = datamod.PromptStream(len(self.examples), tc.seed)
        self.step = 0
        self.skipped_nonfinite = 0  # optimizer steps skipped for a NaN/inf gradient norm, this process
        self.nonfinite_in_a_row = 0
        self.times = dict.fromkeys(PHASES, 0.0)
        self._stop: int = 0  # the signal that asked the run to stop, 0 while none did
        self.zero_adv_steps = 0  # steps in a row on which every advantage was 0
        # rank 0 owns the run folder (lock, config, metrics); its errors stop every rank
        self.lock = self.dp.on_main(lambda: runfolder.claim(self.run_dir, resume=resume, overwrite=overwrite))
        try:
            self.dp.check_shared(self.run_dir, os.path.join(self.run_dir, runfolder.LOCK))
            if resume:
                self.dp.on_main(lambda: self._record_resume(changes, allow_changed_files))
                self._resume()
            else:
                self.dp.on_main(self._start_run_folder)
            self.logger = self.dp.on_main(lambda: Logger(
                self.run_dir, progress=tc.progress, tensorboard=tc.log_tensorboard, wandb=tc.log_wandb,
                config=cfg.to_dict(), total_steps=tc.steps, append=resume, wandb_project=tc.wandb_project,
                start_step=self.step, keys=self.metric_keys())) or _NoLogger()
            self.episode_log = self.dp.on_main(lambda: EpisodeLog(self.run_dir, tc.log_episodes, resume, self.step))
        except BaseException as e:
            self._record_error(e)
            if self.lock is not None:
                self.lock.release()
            raise

    def _start_run_folder(self) -> None:
        """A new run: its resolved config and the fingerprints of the files it reads."""
        self._write_config()
        runfolder.record_fingerprints(self.run_dir, self.cfg.files_read())

    def _record_resume(self, changes: list, allow_changed_files: bool) -> None:
        """A resume: the files the run read must be unchanged (or allowed); what the resume changed is
        applied, logged with its step and time, and config.toml rewritten to say what the run now is."""
        changed = runfolder.check_fingerprints(self.run_dir, allow_changed_files)
        step = _checkpoint_step(checkpoint.latest_intact(self.run_dir))
        changes = changes + [("file", None, c) for c in changed]
        if changes:
            runfolder.record_changes(self.run_dir, step, changes)
            self._write_config()

    def _write_config(self) -> None:
        notes = [f"resumed at step {c['step']} ({c['time']}): {c['key']} {c['old']!r} -> {c['new']!r}"
                 for c in runfolder.read_changes(self.run_dir)]
        with open(os.path.join(self.run_dir, "config.toml"), "w") as f:
            f.write(cfgmod.to_toml(self.cfg.to_dict(), notes))

    def _record_error(self, e: BaseException) -> None:
        """The error that stopped the run, with its traceback, in RUN_DIR/error.log (rank 0, a folder
        this run claimed); a user's mistake is named there as on the terminal."""
        if not self.dp.main or isinstance(e, (KeyboardInterrupt, Interrupted)):
            return
        if os.path.isdir(self.run_dir) and os.path.exists(os.path.join(self.run_dir, "config.toml")):
            path = runfolder.record_error(self.run_dir, "".join(traceback.format_exception(e)))
            if path is not None:
                print(f"backstream: the error and its traceback are in {path}", file=sys.stderr, flush=True)

    def _sampler_for(self, examples: list[dict], k: int):
        """The run's kind of sampler over other examples (the evaluation's), k samples per prompt."""
        prompts = datamod.encode_prompts(examples, self.tok, self.cfg.data.max_prompt_tokens)
        text = [datamod.render_prompt(e["prompt"], self.tok, i) if "prompt" in e else ""
                for i, e in enumerate(examples)]
        return build_sampler(self.cfg.env, with_group_size(self.cfg.rollout, k), self.tok,
                             eos_ids(self.model, self.tok), False, prompts, text,
                             getattr(self.model.config, "max_position_embeddings", None))

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics at the current weights (rl/evaluate.py), in the rollout's numerics."""
        ev = self.evaluator
        self.model.eval()
        with quantized(self.model, self.cfg.quant.enabled), fsdp.gathered(self.model):
            return ev.run(self.model, lambda r: self.score(r, ev.sampler, ev.examples)[0], self.dp, self.step)

    def _load_prompts(self) -> None:
        """The examples, their prompts' token ids and text; a prompt whose completion could run
        past the model's context is an error now rather than mid-run."""
        cfg = self.cfg
        self.examples = cfg.data.build(cfg.train.seed, prompt_optional=bool(cfg.env.factory))
        self.prompts = datamod.encode_prompts(self.examples, self.tok, cfg.data.max_prompt_tokens)
        self.prompt_text = [datamod.render_prompt(e["prompt"], self.tok) if "prompt" in e else ""
                            for e in self.examples]
        ctx = getattr(self.model.config, "max_position_embeddings", None)
        longest = max(len(p) for p in self.prompts)
        if ctx is not None and longest + cfg.rollout.max_new_tokens > ctx:
            raise ValueError(f"data: the longest prompt ({longest} tokens) + rollout.max_new_tokens "
                             f"({cfg.rollout.max_new_tokens}) exceeds the model's context ({ctx} positions)")

    def _reference_policy(self, copy_of_given: bool):
        """The frozen reference policy of the KL term (algorithm.kl_reference): the initial policy,
        copied from the model passed in or loaded again. None when not asked for, and with LoRA,
        where the base model under the adapters is the reference."""
        if not self.cfg.algorithm.kl_reference or self.cfg.model.lora_r > 0:
            return None
        if copy_of_given:
            ref = copy.deepcopy(self.model)  # before any update: the initial policy
        else:
            ref, _ = dataclasses.replace(self.cfg.model, lora_r=0).build()
            if self.cfg.quant.enabled:  # the reference is the initial policy as the learner computes it
                quantize_model(ref, self.cfg.quant)
        return ref.requires_grad_(False)

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint holds beside the weights; the optimizer itself (checkpoint.save takes
        its state_dict in one process, its shards under torchrun)."""
        return {"step": self.step, "optimizer": self.opt, "scheduler": self.sched.state_dict(),
                "rng": checkpoint.rng_state(self.gen), "data_position": self.stream.position}

    def save(self) -> str:
        """A checkpoint of the current step (collective under torchrun: every rank calls it)."""
        self._check_finite_weights()
        with self.dp.guard(f"the checkpoint of step {self.step}"):
            path = checkpoint.save(self.run_dir, self.step, self.model, self.tok, self.state(),
                                   self.cfg.train.keep_checkpoints)
        self.last_save = time.monotonic()
        self.dp.on_main(self._plot)
        return path

    def _plot(self) -> None:
        """The PNG curves beside the checkpoint (when matplotlib is installed; a plot that fails is
        reported, never a reason to stop a run)."""
        if not self.cfg.train.plots or importlib.util.find_spec("matplotlib") is None:
            return
        if not os.path.exists(os.path.join(self.run_dir, "metrics.jsonl")):
            return
        try:
            plot(self.run_dir)
        except Exception as e:  # noqa: BLE001
            print(f"backstream: warning: the plots were not written ({type(e).__name__}: {e})", file=sys.stderr)

    def _resume(self) -> None:
        """Weights, optimizer, schedule, RNG, data position and step of the latest intact checkpoint
        (written by any number of ranks: DCP reshards)."""
        path = self.dp.broadcast(self.dp.on_main(lambda: checkpoint.latest_intact(self.run_dir)))
        if path is None:
            tc = self.cfg.train
            cadence = (f"train.save_every_minutes = {tc.save_every_minutes}, train.save_every = {tc.save_every}: a "
                       "checkpoint after step 1 and then at that cadence" if tc.periodic_checkpoints else
                       "train.save_every = train.save_every_minutes = 0: checkpoints only at the end or on Ctrl-C")
            raise ValueError(f"--resume: {self.run_dir} holds no complete checkpoint ({cadence}); the run stopped "
                             "before its first one, so there is nothing to resume: start it again with `backstream "
                             "train CONFIG` (the folder is taken over, as it holds nothing of value), and keep "
                             "train.save_every_minutes > 0 so that a kill can be resumed")
        st = checkpoint.restore(path, self.model, self.opt, self.sched)
        checkpoint.restore_rng(st["rng"], self.gen)
        self.stream.position = st["data_position"]
        self.step = st["step"]

    # -- the loop -------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One RL step (DESIGN §1): collect → advantages → update → metrics; returns the metrics."""
        t0 = time.perf_counter()
        self.times = dict.fromkeys(PHASES, 0.0)
        self.reward_log = RewardLog()
        self.unique_tokens = 0  # tokens the engine's trees held this step (first epoch)
        with self.dp.guard(f"step {self.step + 1}"):
            batch = self.collect()  # the global batch (on every rank under torchrun)
            adv = self.advantages(batch.rewards) * batch.keep
            logged, mismatch = self.update(batch.rollout, adv)
            self.step += 1
            return self.metrics(batch, adv, logged, mismatch, time.perf_counter() - t0)

    @contextlib.contextmanager
    def _timed(self, phase: str):
        t = time.perf_counter()
        yield
        self.times[phase] += time.perf_counter() - t

    def rollout_round(self, n_prompts: int, refill: bool = False) -> Rollout:
        """G samples for each of this process's groups (`dp.round_groups`: all of them in one process)
        of the next `n_prompts` prompts of the data stream, each group drawn with `dp.generator` (the
        one sampler generator, or under torchrun one per prompt position, so that a group's samples do
        not depend on the rank that draws it); `refill`: a DAPO refill round of the step."""
        start, idx = self.stream.position, self.stream.take(n_prompts)
        groups = self.dp.round_groups(n_prompts, refill)
        self.model.eval()
        # the sampler runs the rollout format; under FSDP with the parameters gathered once
        with quantized(self.model, self.cfg.quant.enabled), fsdp.gathered(self.model):
            r = self.sampler.sample(self.model, [self.examples[idx[j]] for j in groups], [idx[j] for j in groups],
                                    [self.dp.generator(start + j) for j in groups],
                                    progress=lambda done, n: self.logger.phase(self.step + 1, f"rollout {done}/{n}"))
        for phase, seconds in self.sampler.timings().items():  # inside the rollout: on their own line
            self.times[phase] += seconds
            self.times["rollout"] -= seconds
        return r

    def sample_and_score(self, n_prompts: int, refill: bool = False) -> tuple[Rollout, Tensor, dict[str, Tensor]]:
        """One rollout round and its rewards (total, per function), over the whole round: each
        process samples and scores its groups, `dp.join_round` hands every rank every group (without
        the K/V, which stay where they were computed), in the round's order."""
        with self._timed("rollout"):
            r = self.rollout_round(n_prompts, refill)
        with self._timed("reward"):
            self.logger.phase(self.step + 1, "reward")
            log = RewardLog()
            total, per_fn = self.score(r, log=log) if len(r) else (torch.zeros(0), {})
        for k, v in log.metrics.items():
            self.reward_log.metrics.setdefault(k, []).extend(v)
        if self.episode_log is not None and self.cfg.train.log_episodes:
            self.episode_log.write(self.step + 1, episode_rows(self.sampler, r, total, per_fn, log.columns,
                                                               [self.examples[i] for i in r.prompt_index]))
        return self.dp.join_round(r, total, per_fn)

    def score(self, r: Rollout, sampler=None, examples: list[dict] | None = None,
              log: RewardLog | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Total reward per sample and each reward function's, called as TRL calls them (the sampler
        formats prompts and completions: `Sampler.reward_inputs`), with the step and every column.
        `sampler`/`examples`: those `r` came from (default: the training ones); `log` collects what
        the functions log (log_metric, log_extra)."""
        sampler, examples = sampler or self.sampler, examples or self.examples
        rows = [examples[i] for i in r.prompt_index]
        completions, prompts, extra = sampler.reward_inputs(r, rows)
        cols = {k: [row.get(k) for row in rows] for k in examples[0] if k != "prompt"}
        return self.rewards(completions, prompts, cols, **extra, log=log,
                            trainer_state=TrainerState(global_step=self.step, max_steps=self.cfg.train.steps))

    def collect(self) -> Batch:
        """Rollout rounds until `prompts_per_step` groups are kept: sample, score, shape the overlong
        samples. With dynamic sampling (DAPO) a round keeps only the groups whose rewards differ and
        the next one refills the rest; the last (after `max_refills`) keeps what it gets."""
        ac, G = self.cfg.algorithm, self.cfg.rollout.group_size
        kept: list[tuple[Rollout, Tensor, Tensor]] = []
        scored, by_fn = [], {}
        self.dp.begin_step()
        for attempt in range(1 + (ac.max_refills if ac.dynamic_sampling else 0)):
            need = self.cfg.train.prompts_per_step - sum(len(r) for r, _, _ in kept) // G
            if need <= 0:
                break
            r, total, per_fn = self.sample_and_score(need, refill=attempt > 0)
            scored.append(total)
            for k, v in per_fn.items():
                by_fn.setdefault(k, []).append(v)
            total, keep = overlong_shaping(r, total, ac, self.cfg.rollout.max_new_tokens)
            if ac.dynamic_sampling:
                groups = informative_groups(total, G) if attempt < ac.max_refills else list(range(need))
                self.dp.kept(groups)  # under torchrun with the rollout's K/V, refills then even the shares
                rows = torch.tensor(r.group_rows(groups), dtype=torch.long)
                r, total, keep = r.select(groups), total[rows], keep[rows]
            kept.append((r, total, keep))
        rollouts, rewards, keeps = zip(*kept)
        return Batch(rollout=Rollout.concat(list(rollouts)), rewards=torch.cat(rewards), keep=torch.cat(keeps),
                     scored=torch.cat(scored), scored_by_fn={k: torch.cat(v) for k, v in by_fn.items()})

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Per-sample advantages from the group rewards (algorithm.advantage)."""
        return self.advantage_fn(rewards, self.cfg.rollout.group_size)

    def update(self, batch: Rollout, adv: Tensor) -> tuple[dict[str, list[float]], dict[str, float]]:
        """`epochs` × `minibatches` optimizer steps on the collected samples, each over one
        group-aligned minibatch: its objective, the backward chosen at construction, a clipped step.
        Under torchrun `batch` is the global batch and this rank trains its own groups of each
        minibatch, normalised by the global minibatch's counts. The learner runs the rollout's
        quantized forward when `quant.aligned`, full precision else. Returns each step's loss
        metrics (summed over ranks) and the sampler/learner mismatch of the first epoch."""
        with quantized(self.model, self.cfg.quant.aligned):
            return self._update(batch, adv)

    def _update(self, batch: Rollout, adv: Tensor) -> tuple[dict[str, list[float]], dict[str, float]]:
        ac = self.cfg.algorithm
        G, n_groups = batch.group_size, len(batch) // batch.group_size
        seqs, mask, sampler_lp = batch.sequences(), batch.completion_mask(), batch.aligned_logprobs()
        # per minibatch, its rows in the batch (the global minibatch's, normalising) and this rank's
        # (one process: the same); `mine` = this rank's rows, `at` their place in the local lists
        glob = minibatches(n_groups, ac.minibatches, G)
        groups = self.dp.train_groups(n_groups, batch.kv)
        mine = [g * G + i for g in groups for i in range(G)]
        owned = set(mine)
        local = [[r for r in rows if r in owned] for rows in glob]
        at = {r: k for k, r in enumerate(mine)}
        seqs_l, mask_l, sampler_l = take(seqs, mine), take(mask, mine), take(sampler_lp, mine)
        kv_l = take(batch.kv, mine)
        old, ref = self.policy_logprobs(seqs_l, mask_l, sampler_l)
        norms = [Normalisers.of(take(mask, rows), adv[rows]) for rows in glob]
        logged: dict[str, list[float]] = {}
        learner_lp: list[Tensor | None] = [None] * len(mine)  # at the weights that sampled, first epoch
        for epoch in range(ac.epochs):
            for rows_g, norm in zip(local, norms):
                rows = [at[r] for r in rows_g]
                obj = build_objective(self.cfg.loss, sequences=take(seqs_l, rows), completion_mask=take(mask_l, rows),
                                      advantages=adv[rows_g], old_logprobs=take(old, rows),
                                      ref_logprobs=take(ref, rows), rollout_logprobs=take(sampler_l, rows),
                                      old_is_current=self.cfg.engine.reuse_rollout_kv, normalisers=norm)
                self.model.train(False)  # no dropout: the backward must be that of the sampled policy
                where = f"minibatch {len(logged.get('grad_norm', [])) + 1}/{ac.epochs * ac.minibatches}"
                res = self.engine.backward(self.model, take(seqs_l, rows), obj, kv=take(kv_l, rows),
                                           progress=lambda phase, done, n, where=where: self.logger.phase(
                                               self.step + 1, f"{phase} {done}/{n} ({where})"))
                self.times["prefill"] += res.stats.prefill_s
                self.times["backward"] += res.stats.backward_s
                if epoch == 0:  # sampler/learner agreement on the tokens the learner computed
                    self.unique_tokens += res.stats.tree_tokens or res.stats.input_tokens
                    for r, lp in zip(rows, res.logprobs):
                        learner_lp[r] = lp
                step = sum_metrics(self.dp.gather(obj.metrics()))  # additive: the normalisers are global
                with self._timed("optim"):
                    grad_norm = self._optimizer_step(loss_finite=all(math.isfinite(v) for v in step.values()))
                if res.stats.router_aux_loss is not None:
                    step["router_aux"] = res.stats.router_aux_loss
                step["grad_norm"] = grad_norm
                for k, v in step.items():
                    logged.setdefault(k, []).append(v)
        # the learner's log-probs before the update: π_old when it was computed up front (several
        # optimizer steps), else the engine's own at the first (and only) step's weights
        before = old if old is not None and not self.cfg.engine.reuse_rollout_kv else learner_lp
        before = self.dp.gather_rows(mine, before, len(batch))  # the global batch's, in its order
        return logged, mismatch_metrics(before, sampler_lp, mask)

    def policy_logprobs(self, seqs: list[Tensor], mask: list[Tensor], sampler_lp: list[Tensor]):
        """(π_old, π_ref) log-probs where the objective needs them up front, else None. π_old: the
        sampler's when the engine reuses the rollout's K/V (same weights); from the engine's own
        prefill (None here) when there is a single update; else one no-grad pass now."""
        ac = self.cfg.algorithm
        old = ref = None
        if self.cfg.engine.reuse_rollout_kv:
            old = sampler_lp
        elif ac.epochs * ac.minibatches > 1:
            with self._timed("prefill"), fsdp.gathered(self.model):
                old = self.engine.logprobs(self.model, seqs, mask)
        if ac.kl_reference:
            with self._timed("prefill"):
                ref = self._ref_logprobs(seqs, mask)
        return old, ref

    def metric_keys(self) -> list[str]:
        """Every key of a step's metrics line, in order (`Logger` writes each on every line, null where
        a step leaves it undefined)."""
        loss = [k if "/" in k else f"loss/{k}" for k in self.cfg.loss.metric_keys()]
        loss += ["loss/router_aux"] * (self.cfg.loss.router_aux_coef > 0)
        return ["step", *self.evaluator.keys(), "reward/mean", "reward/std", "response_length/mean", "batch/groups",
                "batch/zero_adv_frac",
                *[f"reward/{name}" for name in self.rewards.functions], *self.sampler.metric_keys,
                "tree/tokens_total", "tree/tokens_unique", *loss, "optim/grad_norm", *MISMATCH_KEYS,
                "optim/skipped_nonfinite", *[f"time/{p}" for p in PHASES], "time/step", "throughput/tokens_per_s",
                "optim/lr", "memory/peak_mib"]

    def metrics(self, batch: Batch, adv: Tensor, logged: dict[str, list[float]], mismatch: dict[str, float],
                step_time: float) -> dict:
        """The step's line: rewards as scored, lengths, the loss terms averaged over the optimizer
        steps, sampler/learner mismatch, time per phase, throughput, learning rate, peak memory."""
        r, n, ro = batch.scored, len(batch.rollout), batch.rollout
        m = {"step": self.step, "reward/mean": float(r.mean()), "reward/std": float(r.std()) if len(r) > 1 else 0.0,
             "response_length/mean": float(sum(ro.sampled_tokens()) / n),  # the policy's tokens (of an episode too)
             "batch/groups": n // ro.group_size, "batch/zero_adv_frac": float((adv == 0).float().mean())}
        # a function's mean over the samples it scored (None: TRL's "does not apply")
        m.update({f"reward/{k}": float(v.nanmean()) for k, v in batch.scored_by_fn.items()})
        m.update(self.sampler.metrics(ro))
        logged_means = self.reward_log.means()
        m.update({k: float(sum(v) / len(v)) for k, v in _gathered_means(self.dp.gather(logged_means)).items()})
        m["tree/tokens_total"] = sum(len(p) + len(c) for p, c in zip(ro.prompt_ids, ro.completion_ids))
        m["tree/tokens_unique"] = sum(self.dp.gather(self.unique_tokens))  # the engine's, over every rank
        # loss terms as loss/…; an objective's own groups (is/…, tbpo/…) keep their names
        m.update({"optim/grad_norm" if k == "grad_norm" else k if "/" in k else f"loss/{k}": float(sum(v) / len(v))
                  for k, v in logged.items()})
        m.update(mismatch)
        m["mismatch/error_token_share"] = error_token_share(ro.sampled_ids())
        tokens = sum(len(p) + len(c) for p, c in zip(batch.rollout.prompt_ids, batch.rollout.completion_ids))
        m["optim/skipped_nonfinite"] = self.skipped_nonfinite
        m.update({f"time/{k}": v for k, v in self.times.items()})  # rank 0's, under torchrun
        m.update({"time/step": step_time, "throughput/tokens_per_s": tokens / step_time,
                  "optim/lr": self.sched.get_last_lr()[0],
                  "memory/peak_mib": max(self.dp.gather(peak_mib(self.device)))})  # the fullest rank's
        return m

    def _optimizer_step(self, loss_finite: bool = True) -> float:
        """Clip and step; a NaN/inf loss term or gradient norm skips the step instead, and
        `optim.max_nonfinite_steps` of them in a row stop the run."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        fsdp.reshard(self.model)  # no gathered copy outlives the step (the next forward re-gathers)
        gn = fsdp.grad_norm(params, self.cfg.optim.max_grad_norm)  # global: every rank decides alike
        if not (math.isfinite(gn) and loss_finite):
            self.opt.zero_grad(set_to_none=True)
            self.skipped_nonfinite += 1
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= self.cfg.optim.max_nonfinite_steps:
                raise NonFiniteError(self._nonfinite_message())
            return gn
        self.nonfinite_in_a_row = 0
        self.opt.step()
        for m in self.quantized_layers:  # new master weights: new codes (a fused optimizer may not bump versions)
            m.invalidate()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return gn

    def _nonfinite_message(self) -> str:
        last = checkpoint.latest(self.run_dir)
        return (f"optim.max_nonfinite_steps: {self.nonfinite_in_a_row} optimizer steps in a row had a NaN/inf "
                f"loss or gradient norm (training step {self.step + 1}); the run stopped without writing a "
                f"checkpoint. Last good checkpoint: {last or 'none'}. Usual causes: a learning rate too high "
                f"(optim.lr = {self.cfg.optim.lr}), bfloat16 overflow (model.dtype), or a reward function "
                "returning NaN/inf")

    def _check_finite_weights(self) -> None:
        local = [n for n, p in self.model.named_parameters() if not bool(torch.isfinite(fsdp.local(p.detach())).all())]
        bad = sorted({n for part in self.dp.gather(local) for n in part})  # over every rank's shards
        if bad:
            raise NonFiniteError(f"train: parameters {bad[:3]}{' …' if len(bad) > 3 else ''} hold NaN/inf at step "
                                 f"{self.step}; no checkpoint is written from them. Last good checkpoint: "
                                 f"{checkpoint.latest(self.run_dir) or 'none'}")

    def _ref_logprobs(self, seqs, mask):
        if self.ref is not None:
            return self.engine.logprobs(self.ref, seqs, mask)
        with self.model.disable_adapter(), fsdp.gathered(self.model):  # LoRA: the base model is the reference
            return self.engine.logprobs(self.model, seqs, mask)

    def _signal(self, signum, frame):
        """First SIGINT/SIGTERM: finish the step, save, stop. A second: stop at once (a checkpoint
        being written is left unpublished; the last complete one stays)."""
        if self._stop:
            raise KeyboardInterrupt
        self._stop = signum
        if self.dp.main:
            last = checkpoint.latest(self.run_dir)
            print(f"\nbackstream: {signal.Signals(signum).name} received: finishing step {self.step + 1} and saving; "
                  f"press Ctrl-C again to stop now (the last checkpoint stays: {last or 'none yet'})",
                  file=sys.stderr, flush=True)

    def _checkpoint_due(self) -> bool:
        """After step 1, every train.save_every steps, and when train.save_every_minutes have passed
        since the last checkpoint (rank 0's clock decides for every rank)."""
        tc = self.cfg.train
        due = tc.periodic_checkpoints and self.step == 1
        due |= bool(tc.save_every) and self.step % tc.save_every == 0
        due |= tc.save_every_minutes > 0 and time.monotonic() - self.last_save >= 60 * tc.save_every_minutes
        return self.dp.broadcast(due)

    def _watch_advantages(self, m: dict) -> None:
        """ZERO_ADVANTAGE_STEPS steps in a row on which every advantage was 0 learn nothing: say why."""
        self.zero_adv_steps = self.zero_adv_steps + 1 if m["batch/zero_adv_frac"] == 1.0 else 0
        if self.zero_adv_steps == ZERO_ADVANTAGE_STEPS and self.dp.main:
            first = self.step - ZERO_ADVANTAGE_STEPS + 1
            print(f"backstream: warning: steps {first}-{self.step} had every advantage 0: within each group every "
                  "sample got the same reward, so nothing is learned. Check that the reward functions tell samples "
                  "apart (reward/<function> in metrics.jsonl), raise rollout.temperature or rollout.group_size, or "
                  "set algorithm.dynamic_sampling = true to replace the groups without signal",
                  file=sys.stderr, flush=True)

    def run(self) -> str:
        """Train until train.steps; returns the run folder. On SIGINT/SIGTERM, saves and raises
        `Interrupted` (the CLI exits 130 / 143 with where to resume)."""
        tc = self.cfg.train
        if self.step >= tc.steps:
            self.logger.close()
            if self.lock is not None:
                self.lock.release()
            if self.dp.main:
                print(f"backstream: the run in {self.run_dir} is finished (step {self.step} of train.steps = "
                      f"{tc.steps}); to train on, resume it with --set train.steps=N (N > {self.step})",
                      file=sys.stderr)
            return self.run_dir
        old = {s: signal.signal(s, self._signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self.last_save = time.monotonic()
        try:
            if self.evaluator.at_start and self.step == 0:
                self.logger.log({"step": 0, **self.evaluate()})
            # a signal may reach one rank only: every rank stops at the same step boundary
            while self.step < tc.steps and not self.dp.any(bool(self._stop)):
                m = self.train_step()
                if self.evaluator.due(self.step, tc.steps):
                    m.update(self.evaluate())
                self.logger.log(m)
                self._watch_advantages(m)
                if self._checkpoint_due():
                    self.save()
            self.save()
            stop = self.dp.broadcast(self._stop)
            if stop:
                raise Interrupted(stop, self.step, self.run_dir, checkpoint.latest(self.run_dir), saved=True)
        except KeyboardInterrupt:  # a second Ctrl-C, or one outside the handler's reach
            raise Interrupted(self._stop or signal.SIGINT, self.step, self.run_dir, checkpoint.latest(self.run_dir),
                              saved=False) from None
        except BaseException as e:
            if not isinstance(e, Interrupted):
                self._record_error(e)
                self.dp.failed(e)  # under torchrun: say so now, leave the group so that the others stop too
            raise
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.logger.close()
            if self.episode_log is not None:
                self.episode_log.close()
            self.sampler.close()
            self.evaluator.close()
            if self.lock is not None:
                self.lock.release()
        return self.run_dir


class Interrupted(Exception):
    """The run stopped on SIGINT or SIGTERM: after finishing and saving its step (`saved`), or at once
    on a second one (the last complete checkpoint stays). `exit_code` is the shell's 128 + signal."""

    def __init__(self, signum: int, step: int, run_dir: str, last: str | None, saved: bool):
        self.signum, self.step, self.run_dir, self.last, self.saved = int(signum), step, run_dir, last, saved
        self.exit_code = 128 + self.signum
        name = signal.Signals(self.signum).name
        where = (f"after step {step}, saved" if saved else
                 f"at once during step {step + 1}; the last checkpoint stays ({last or 'none'})")
        resume = f"resume with: backstream train --resume {run_dir}" if last else "no checkpoint to resume from"
        super().__init__(f"interrupted ({name}) {where}; {resume}")


def _checkpoint_step(path: str | None) -> int:
    return int(os.path.basename(path).split("-", 1)[1]) if path else 0


def _gathered_means(parts: list[dict[str, float]]) -> dict[str, list[float]]:
    """Per key, the ranks' values (a rank that logged nothing under a key adds none)."""
    out: dict[str, list[float]] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, []).append(v)
    return out


def episode_rows(sampler, r: Rollout, total: Tensor, per_fn: dict[str, Tensor], columns: dict[str, list],
                 rows: list[dict]) -> list[dict]:
    """The samples of a round as `EpisodeLog` writes them (see metrics.EpisodeLog)."""
    completions, prompts, _ = sampler.reward_inputs(r, rows)
    out = []
    for i in range(len(r)):
        ids, mask = r.completion_ids[i].tolist(), r.sampled[i].tolist() if r.sampled is not None else None
        runs: list[dict] = []
        for j, t in enumerate(ids):
            s = True if mask is None else bool(mask[j])
            if not runs or runs[-1]["sampled"] != s:
                runs.append({"sampled": s, "ids": []})
            runs[-1]["ids"].append(t)
        tokens = [{"sampled": run["sampled"], "text": sampler.tok.decode(run["ids"])} for run in runs]
        info = r.episodes[i].light() if r.episodes is not None else None
        out.append({"prompt_index": r.prompt_index[i], "prompt": prompts[i], "completion": completions[i],
                    "tokens": tokens, "reward": float(total[i]),
                    "rewards": {k: (None if math.isnan(float(v[i])) else float(v[i])) for k, v in per_fn.items()},
                    "finish_reason": r.finish_reason[i],
                    "episode": None if info is None else {k: getattr(info, k) for k in
                                                          ("turns", "tool_calls", "tool_errors", "results_cut",
                                                           "timed_out")},
                    "extra": {k: v[i] for k, v in columns.items()}})
    return out


def sum_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the sum over the ranks' dicts (a key a rank lacks counts 0): the objective's metrics
    are additive once its normalisers are global. One process: its dict."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def train(config: cfgmod.RunConfig | str | None = None, overrides: list[str] = (), resume: str | None = None,
          model=None, tokenizer=None, overwrite: bool = False, allow_changed_files: bool = False) -> str:
    """Run a training job; returns the run folder. `config` is a RunConfig, a TOML path or None
    (defaults), `overrides` "section.key=value" strings on top of it; `resume` a run folder to
    continue, its own config.toml the config unless `config` is given (keys of `config.RESUMABLE` may
    change, others are refused); `allow_changed_files`: resume although a file the run read (data,
    reward source) changed; `model`/`tokenizer` objects to train instead of loading `model.name`;
    `overwrite` moves an earlier run in `train.output_dir` aside (a new run refuses a folder that
    holds one otherwise). Raises `Interrupted` after SIGINT/SIGTERM."""
    if resume:
        path = os.path.join(resume, "config.toml")
        if not os.path.exists(path):
            raise ValueError(f"--resume: {resume} is not a run folder (no config.toml)")
        if isinstance(config, cfgmod.RunConfig):
            cfg = config
        else:
            cfg = cfgmod.load(config or path, overrides)
        return Trainer(cfg, run_dir=resume, resume=True, model=model, tokenizer=tokenizer, overwrite=overwrite,
                       allow_changed_files=allow_changed_files).run()
    cfg = config if isinstance(config, cfgmod.RunConfig) else cfgmod.load(config, overrides)
    return Trainer(cfg, model=model, tokenizer=tokenizer, overwrite=overwrite).run()

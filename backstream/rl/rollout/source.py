"""Where a step's rollout rounds come from (docs/design.md §1, §6e): `[rollout]` (`RolloutConfig`) and
the rollout source. The collect phase asks it for the next `n` prompt groups of the data stream
(`take`) and gets a `Round`, the samples with the seconds they spent in phases of their own; the
trainer says which step made its weights (`at_step`). The source owns what every round needs, in one
place:

- the prompt stream and the position consumed (what a checkpoint holds);
- the rank split: which groups of a round this rank samples (`dp.round_groups`; an asynchronous
  source's by stream position, `dp.position_groups`), every rank's joined after scoring;
- the per-position generators (`dp.generator`: what a group draws depends on its position alone);
- the policy as it samples (`policy`: eval mode, the rollout's quantized forward) and the sync of the
  backend's weights with it (`Weights.sync(model, step)`: a server's published, labelled with the
  step that made them). At the first sync QaRL's alignment is applied here, visibly: a low-bit
  sampler reports its int8 GEMM (`Aligned.kernels`), the learner's is set to it (`set_int8_gemm`),
  then the sampler checks the learner agrees with it;
- errors: a rank's failed round is raised on every rank (`dp.fail_together`).

Two sources:
- `Source` (rollout.max_staleness = 0, the synchronous loop): a round is sampled when the step
  asks for it, with the learner's weights as they are;
- `AsyncSource` (rollout.max_staleness = k >= 1, a backend that samples beside the learner): groups are
  sampled ahead while the learner trains. The learner's weights are synced at each step boundary
  (`at_step`: a server's requests in flight resumed or kept, rollout.in_flight), and the source starts
  every group of the stream (this rank's, under torchrun), each in a thread of its own (its turns and
  tool calls too, for episodes), as soon as the bound allows it.

The bound. Let c_v be the data position consumed when the weights of step v are published (the
groups the steps before took). With those weights the source starts the groups at positions
p < c_v + (k + 1)·P (P = train.prompts_per_step). Every step takes at least P groups (DAPO's refills
take more), so by the end of step v + k + 1 the position consumed is >= c_v + (k + 1)·P > p: the group
is trained by a step whose update starts from weights v + k at the latest, k steps at most after the
weights it started with; a token sampled after a publish is newer still. A round the step needs
beyond the limit (a DAPO refill) is started at once, with the current weights. `take` checks the
bound on every token it hands over.

What a group draws depends on its data position alone, so the groups in flight when a run stops are
re-sampled with the same seeds when it resumes (from the position consumed, which checkpoints hold);
they then sample with the resumed weights. Under torchrun every rank runs its own source over the
same stream, starts the groups at its own positions, and syncs the weights at the same step
boundaries (a collective, on the trainer's thread); no collective runs in a source's threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch

from backstream.checks import UserError, at_least, literals
from backstream.log import log
from backstream.quant.linear import quantized, set_int8_gemm
from backstream.rl.backends.base import SamplingParams, is_int
from backstream.rl.records import Round, Samples

# The interpreter's thread switch interval while an asynchronous source runs (Python's default: 5 ms).
# Its threads wake for a moment per server answer (parse it, call a tool, send the next turn) and then
# wait on the network again; at 5 ms each wake-up waited behind the learner's thread, which a small
# model keeps busy in Python, and the server idled for want of requests. Measured with
# bench/bench_async.py (toolcalc, k = 1, server and learner on a core each, 6 steps): 1.01 s a step at
# 5 ms, 0.81 s at 0.5 ms, 0.71 s at 1 ms, 0.75 s at 0.2 ms; the synchronous loop 1.2 s at either.
SWITCH_INTERVAL_S = 0.001


@dataclass(kw_only=True)
class RolloutConfig(SamplingParams):
    """`[rollout]`: what is sampled (the sampling parameters a backend takes, `sampling()`), how many
    samples per prompt, who samples them, and how far ahead of the learner."""

    max_new_tokens: int = 8  # the run's (a caller of the decoder gives its own)
    group_size: int = 8
    """G: completions (or episodes) sampled per prompt; its prompt is prefilled and trained once for all."""
    backend: Literal["local", "vllm"] = "local"
    """Who samples: "local" (this process's sampler) or "vllm" (a vLLM server, `[vllm]`; the learner's
    weights are published to it after every optimizer step)."""
    max_staleness: int = 0
    """k: how many optimizer steps behind the learner a trained token's weights may be. 0: the synchronous
    loop (sample, then train). k >= 1 (rollout.backend = "vllm"): the server samples the next steps'
    prompts while the learner trains, every group started with weights at most k steps older than
    those its update starts from (rl/rollout/source.py, docs/design.md §6e)."""
    in_flight: Literal["resume", "keep"] = "resume"
    """With max_staleness >= 1, what a publish does with the samples in flight: "resume" aborts them and
    resumes each from its tokens so far, re-prefilled with the new weights; "keep" pauses them and their
    next tokens are sampled with the new weights after K/V computed with the old ones. Either way each
    token records the version it was sampled with."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill the batch with new prompts (rl/rollout/collect.py)."""
    max_refills: int = 4
    """Most extra rollout rounds per step that dynamic sampling may run."""

    def __post_init__(self):
        super().__post_init__()
        at_least("rollout.max_refills", self.max_refills, 0)
        if not is_int(self.group_size) or self.group_size < 1:
            raise UserError(f"rollout.group_size: got {self.group_size!r}, expected an integer >= 1")
        if not is_int(self.max_staleness) or self.max_staleness < 0:
            raise UserError(f"rollout.max_staleness: got {self.max_staleness!r}, expected an integer >= 0 (0 = the "
                            "synchronous loop)")
        literals(self, "rollout")


class Source:
    """The synchronous loop's source (see the module docstring). `sampler`: the run's kind of sampler
    over the run's backend; `sampling`: what samples (rl/backends/base.py `Sampling`: its `weights` are
    synced here, its `aligned` kernels copied at the first sync); `examples`: the data; `stream`: its
    prompt stream (rl/data/prompts.py `PromptStream`); `dp`: the run's rl/parallel/ object; `model`: the
    policy; `quant`: the run's [quant]; `phase(what)`: shows what the step is doing (the progress line)."""

    def __init__(self, sampler, sampling, examples: list[dict], stream, dp, model, quant, phase=None):
        self.sampler, self.examples, self.stream, self.dp = sampler, examples, stream, dp
        self.weights, self.aligned = sampling.weights, sampling.aligned
        self.model, self.quant, self.phase = model, quant, phase or (lambda what: None)
        self.step = 0  # the learner's step that made its current weights (`at_step`)
        self.synced = False  # the weights have been synced once (QaRL's alignment applied)

    @property
    def consumed(self) -> int:
        """The data position of the next group to train (what a checkpoint holds)."""
        return self.stream.position

    def state_dict(self) -> dict:
        """What a checkpoint holds of the source: the data position of the next group to train."""
        return {"data_position": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        """Go on from a checkpoint's data position (before the first round: nothing is in flight)."""
        self.stream.position = state["data_position"]

    @contextlib.contextmanager
    def policy(self):
        """The policy as the backend samples it: no dropout, the rollout's quantized forward."""
        self.model.eval()
        with quantized(self.model, self.quant.enabled):
            yield self.model

    def sync(self) -> float:
        """The backend samples the policy's current weights, those of step `self.step`, from now on
        (inside `policy`); the seconds spent publishing them. The first time, QaRL's alignment (see the
        module docstring)."""
        seconds = self.weights.sync(self.model, self.step, lambda seconds: self.phase(
            f"starting the vLLM servers, {seconds:.0f} s"))
        if not self.synced:
            self.synced = True
            for sampler in self.aligned:  # QaRL: the learner computes what the sampler's low-bit kernels do
                gemm = sampler.kernels().get("int8_gemm")
                if gemm is not None:
                    n = set_int8_gemm(self.model, gemm)
                    log.info(f"quant: the learner's int8 GEMM is the backend's, {gemm} ({n} layers)")
                sampler.check_aligned(self.model)
        return seconds

    def sample(self, sampler, rows: list[dict], indices: list[int], generators: list, progress=None) -> Round:
        """`sampler`'s samples of `rows` at the policy's current weights (every rank calls it, an empty
        share too: the sync may be a collective); a rank's error is raised on every rank."""
        error, got, seconds = None, None, 0.0
        with self.policy():
            seconds = self.sync()
            try:
                got = sampler.sample(rows, indices, generators, progress)
            except Exception as e:  # noqa: BLE001  (raised below, on every rank)
                error = e
        self.dp.fail_together(error)
        return Round(got.samples, {"sync": seconds, **got.seconds})

    def take(self, n: int, refill: bool = False) -> Round:
        """G samples for each of this process's groups (`dp.round_groups`: all of them in one process)
        of the next `n` prompts of the stream, each group drawn with its position's generator;
        `refill`: a DAPO refill round of the step."""
        start, idx = self.stream.position, self.stream.take(n)
        groups = self.dp.round_groups(n, refill)
        return self.sample(self.sampler, [self.examples[idx[j]] for j in groups], [idx[j] for j in groups],
                           [self.dp.generator(start + j) for j in groups],
                           lambda done, total, what=None: self.phase(what or f"rollout {done}/{total}"))

    def at_step(self, step: int) -> None:
        """The learner's weights are now step's: the version the next tokens record (synced at the next
        round)."""
        self.step = step


class AsyncSource(Source):
    """rollout.max_staleness = k >= 1: groups sampled ahead, in flight while the learner trains (see
    the module docstring); `per_step`: P."""

    metric_keys = ("time/sampler_idle",)
    """Seconds of the step with no group of this rank in flight: the backend idle for want of work the
    bound allows."""

    def __init__(self, sampler, sampling, examples, stream, dp, model, quant, per_step: int, k: int, phase=None):
        super().__init__(sampler, sampling, examples, stream, dp, model, quant, phase)
        self.per_step, self.k = per_step, k
        self.handed: int | None = None  # groups handed to the trainer (once it runs; the stream runs ahead)
        self.limit = 0  # groups at positions below it may start
        self.step = 0  # the learner's step: the weights the next update starts from
        self.started: dict[int, concurrent.futures.Future] = {}
        self.cv = threading.Condition()
        self.feeder: threading.Thread | None = None
        self.closed = False
        self.running = 0  # groups in flight
        self.idle_since: float | None = time.perf_counter()
        self.idle_s = 0.0  # since the trainer last read it (`metrics`)
        self.switch_interval = sys.getswitchinterval()

    @property
    def consumed(self) -> int:
        return self.stream.position if self.handed is None else self.handed

    def take(self, n: int, refill: bool = False) -> Round:
        """This rank's groups of the next n positions of the stream, once sampled (started now if the
        bound had not let them)."""
        if self.feeder is None:
            self._start()
        first = self.consumed
        with self.cv:
            self.limit = max(self.limit, first + n)
            self.cv.notify_all()
        mine = self.dp.position_groups(first, n)
        parts, error = [], None
        for j in mine:
            with self.cv:
                self.cv.wait_for(lambda p=first + j: p in self.started)
                future = self.started.pop(first + j)
            if not future.done():
                self.phase(f"waiting for samples {j + 1}/{n}")
            try:
                parts.append(future.result())
            except Exception as e:  # noqa: BLE001  (raised below, on every rank)
                error = error or e
        self.handed = first + n
        self.dp.fail_together(error)
        r = Samples.concat(parts) if parts else self.sampler.sample([], [], []).samples
        self._check_bound(r)
        return Round(r, {})

    def _check_bound(self, r: Samples) -> None:
        oldest = min((int(v.min()) for v in r.sampled_versions() if len(v)), default=self.step)
        if oldest < self.step - self.k:
            raise RuntimeError(f"a sample trained after step {self.step} holds tokens of weight version {oldest}, "
                               f"more than rollout.max_staleness = {self.k} behind (a bug of the rollout source)")

    def at_step(self, step: int) -> None:
        """The learner's weights are now step's: synced now (once the source runs), and groups up to
        (k + 1) steps ahead of what is consumed may start."""
        self.step = step
        if self.feeder is None:
            return
        with self.policy():
            self.sync()
        with self.cv:
            self.limit = max(self.limit, self.consumed + (self.k + 1) * self.per_step)
            self.cv.notify_all()

    def _start(self) -> None:
        """The backend synced with the learner's weights (a server started or connected to), then the
        feeder."""
        with self.policy():
            self.sync()
        sys.setswitchinterval(min(self.switch_interval, SWITCH_INTERVAL_S))
        self.idle_since = time.perf_counter()
        self.handed = self.stream.position
        self.limit = self.handed + (self.k + 1) * self.per_step
        self.feeder = threading.Thread(target=self._feed, name="backstream-source", daemon=True)
        self.feeder.start()

    def _feed(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.closed or self.stream.position < self.limit)
                if self.closed:
                    return
                pos = self.stream.position
                (index,) = self.stream.take(1)
                if not self.dp.owns(pos):  # another rank's group
                    continue
                future = self.started[pos] = concurrent.futures.Future()
                if self.running == 0 and self.idle_since is not None:
                    self.idle_s += time.perf_counter() - self.idle_since
                self.running += 1
                self.cv.notify_all()
            threading.Thread(target=self._sample, args=(pos, index, future), name=f"backstream-group-{pos}",
                             daemon=True).start()

    def _sample(self, pos: int, index: int, future: concurrent.futures.Future) -> None:
        try:
            got = self.sampler.sample([self.examples[index]], [index], [self.dp.generator(pos)])
            future.set_result(got.samples)
        except BaseException as e:  # noqa: BLE001  (raised in the trainer, by `take`)
            future.set_exception(e)
        finally:
            with self.cv:
                self.running -= 1
                if self.running == 0:
                    self.idle_since = time.perf_counter()

    def metrics(self, samples=None) -> dict[str, float]:
        with self.cv:
            now = time.perf_counter()
            idle = self.idle_s + (now - self.idle_since if self.running == 0 and self.idle_since is not None else 0)
            self.idle_s, self.idle_since = 0.0, now if self.running == 0 else self.idle_since
        return {"time/sampler_idle": idle}

    def close(self) -> None:
        """Start nothing more; what is in flight is the backend's to drop (a server aborts it, or the run
        stops the server it started)."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if self.feeder is not None:
            self.feeder.join(timeout=5)
            sys.setswitchinterval(self.switch_interval)


SHARED_WARNING = ("rollout.max_staleness = {k}: the vLLM server this run starts shares this machine's {what} with the "
                  "learner, so sampling ahead takes the learner's resources (measured on 2 shared cores: toolcalc "
                  "steps 1.43x slower at k = 1 than k = 0). It pays where the server has resources of its own: start "
                  "one with `backstream vllm serve` on other cores or GPUs and set vllm.urls (docs/vllm.md, \"Sampling "
                  "ahead of the learner\"), or set rollout.max_staleness = 0")


def check_backend(rollout: RolloutConfig, backend) -> None:
    """rollout.max_staleness = k >= 1 (of [rollout] `rollout`) needs a backend that samples beside the
    learner, not in its process; refused by name before anything else is built."""
    k = rollout.max_staleness
    if k and backend.in_process:
        raise UserError(f"rollout.max_staleness = {k}: the local sampler runs in the learner's process, on its "
                        "weights, so nothing samples while the learner trains; set rollout.backend = \"vllm\" (a "
                        "server samples ahead), or rollout.max_staleness = 0")


def build_source(rollout: RolloutConfig, sampler, sampling, examples: list[dict], stream, dp, model, quant, *,
                 per_step: int, servers_here: bool = False, phase=None) -> Source:
    """The run's source (`check_backend` passed) for [rollout] `rollout`: synchronous, or asynchronous with
    rollout.max_staleness = k >= 1 (said at start-up when `servers_here`: the vLLM servers the run
    starts share the learner's machine); `sampling`: what samples; `quant`: [quant]; `per_step`:
    train.prompts_per_step."""
    k = rollout.max_staleness
    if not k:
        return Source(sampler, sampling, examples, stream, dp, model, quant, phase)
    if servers_here:
        dp.on_main(lambda: log.warning(SHARED_WARNING.format(
            k=k, what="GPUs" if torch.cuda.is_available() else "CPU cores")))
    return AsyncSource(sampler, sampling, examples, stream, dp, model, quant, per_step, k, phase)

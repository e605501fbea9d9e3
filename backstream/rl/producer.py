"""Where a step's rollout rounds come from (docs/design.md §6e). The trainer asks for the next `n`
prompt groups of the data stream (`take`) and says when its weights changed (`at_step`); two objects
answer:

- `Rounds` (rollout.max_staleness = 0, the synchronous loop): a round is sampled when the step asks
  for it, with the learner's weights as they are (a server's sampler publishes them first);
- `Producer` (rollout.max_staleness = k >= 1, a server's samplers): the server samples the next steps'
  groups while the learner trains. The learner publishes its weights at each step boundary
  (`at_step`: the requests in flight resumed or kept, rollout.in_flight), and the producer starts
  every group of the stream, each in a thread of its own (its turns and tool calls too, for
  episodes), as soon as the bound allows it.

The bound. Let c_v be the data position consumed when the weights of step v are published (the
groups the steps before took). With those weights the producer starts the groups at positions
p < c_v + (k + 1)·P (P = train.prompts_per_step). Every step takes at least P groups (DAPO's refills
take more), so by the end of step v + k + 1 the position consumed is >= c_v + (k + 1)·P > p: the group
is trained by a step whose update starts from weights v + k at the latest, k steps at most after the
weights it started with; a token sampled after a publish is newer still. A round the step needs
beyond the limit (a DAPO refill) is started at once, with the current weights. `take` checks the
bound on every token it hands over.

What a group draws depends on its data position alone (rl/parallel.py `group_generator`), so the
groups in flight when a run stops are re-sampled with the same seeds when it resumes (from the
position consumed, which checkpoints hold); they then sample with the resumed weights.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time

from backstream.rl.rollout import Rollout

# The interpreter's thread switch interval while a producer runs (Python's default: 5 ms). Its threads
# wake for a moment per server answer (parse it, call a tool, send the next turn) and then wait on the
# network again; at 5 ms each wake-up waited behind the learner's thread, which a small model keeps
# busy in Python, and the server idled for want of requests. Measured with bench/bench_async.py
# (toolcalc, k = 1, server and learner on a core each, 6 steps): 1.01 s a step at 5 ms, 0.81 s at
# 0.5 ms, 0.71 s at 1 ms, 0.75 s at 0.2 ms; the synchronous loop 1.2 s at either.
SWITCH_INTERVAL_S = 0.001


class Rounds:
    """The synchronous loop's rounds: `sample(n, refill)` (the trainer's) draws the next n groups of
    the stream now."""

    metric_keys: tuple[str, ...] = ()

    def __init__(self, sample, stream, samplers):
        self.sample, self.stream, self.samplers = sample, stream, samplers

    @property
    def consumed(self) -> int:
        """The data position of the next group to train (what a checkpoint holds)."""
        return self.stream.position

    def take(self, n: int, refill: bool = False) -> Rollout:
        return self.sample(n, refill)

    def at_step(self, step: int) -> None:
        """The learner's weights are now step's: a server's samplers publish them at their next round."""
        self.samplers.at_step(step)

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class Producer:
    """rollout.max_staleness = k >= 1: groups sampled ahead, in flight while the learner trains (see the
    module docstring). `sampler`: the run's (a server's; called with model None and from threads);
    `publish()`: publishes the learner's weights now; `generator(position)`:
    a group's generator; `per_step`: P."""

    metric_keys = ("time/sampler_idle",)
    """Seconds of the step with no group in flight: the server idle for want of work the bound allows."""

    def __init__(self, sampler, examples: list[dict], stream, generator, per_step: int, k: int, samplers,
                 publish, progress=None):
        self.sampler, self.examples, self.stream, self.generator = sampler, examples, stream, generator
        self.per_step, self.k, self.samplers, self.publish = per_step, k, samplers, publish
        self.progress = progress  # progress(what): the learner's wait, on the progress line
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

    @property
    def consumed(self) -> int:
        """The data position of the next group to train (what a checkpoint holds)."""
        return self.stream.position if self.handed is None else self.handed

    def take(self, n: int, refill: bool = False) -> Rollout:
        """The next n groups of the stream, once sampled (started now if the bound had not let them)."""
        if self.feeder is None:
            self._start()
        first = self.consumed
        with self.cv:
            self.limit = max(self.limit, first + n)
            self.cv.notify_all()
        parts = []
        for pos in range(first, first + n):
            with self.cv:
                self.cv.wait_for(lambda p=pos: p in self.started)
                future = self.started.pop(pos)
            if self.progress is not None and not future.done():
                self.progress(f"waiting for samples {pos - first + 1}/{n}")
            parts.append(future.result())
        self.handed = first + n
        r = Rollout.concat(parts)
        self._check_bound(r)
        return r

    def _check_bound(self, r: Rollout) -> None:
        oldest = min((int(v.min()) for v in r.sampled_versions() if len(v)), default=self.step)
        if oldest < self.step - self.k:
            raise RuntimeError(f"a sample trained after step {self.step} holds tokens of weight version {oldest}, "
                               f"more than rollout.max_staleness = {self.k} behind (a bug of the producer)")

    def at_step(self, step: int) -> None:
        """The learner's weights are now step's: published now (once the producer runs), and groups up to
        (k + 1) steps ahead of what is consumed may start."""
        self.step = step
        self.samplers.at_step(step)
        if self.feeder is None:
            return
        self.publish()
        with self.cv:
            self.limit = max(self.limit, self.consumed + (self.k + 1) * self.per_step)
            self.cv.notify_all()

    def _start(self) -> None:
        """The server started (or connected to) with the learner's weights, then the feeder."""
        self.publish()
        self.switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self.switch_interval, SWITCH_INTERVAL_S))
        self.idle_since = time.perf_counter()
        self.handed = self.stream.position
        self.limit = self.handed + (self.k + 1) * self.per_step
        self.feeder = threading.Thread(target=self._feed, name="backstream-producer", daemon=True)
        self.feeder.start()

    def _feed(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.closed or self.stream.position < self.limit)
                if self.closed:
                    return
                pos = self.stream.position
                (index,) = self.stream.take(1)
                future = self.started[pos] = concurrent.futures.Future()
                if self.running == 0 and self.idle_since is not None:
                    self.idle_s += time.perf_counter() - self.idle_since
                self.running += 1
                self.cv.notify_all()
            threading.Thread(target=self._sample, args=(pos, index, future), name=f"backstream-group-{pos}",
                             daemon=True).start()

    def _sample(self, pos: int, index: int, future: concurrent.futures.Future) -> None:
        try:
            future.set_result(self.sampler.sample(None, [self.examples[index]], [index], [self.generator(pos)]))
        except BaseException as e:  # noqa: BLE001  (raised in the trainer, by `take`)
            future.set_exception(e)
        finally:
            with self.cv:
                self.running -= 1
                if self.running == 0:
                    self.idle_since = time.perf_counter()

    def metrics(self) -> dict[str, float]:
        with self.cv:
            now = time.perf_counter()
            idle = self.idle_s + (now - self.idle_since if self.running == 0 and self.idle_since is not None else 0)
            self.idle_s, self.idle_since = 0.0, now if self.running == 0 else self.idle_since
        return {"time/sampler_idle": idle}

    def close(self) -> None:
        """Start nothing more; what is in flight is the server's to drop (the publisher aborts it, or
        stops the server the run started)."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if self.feeder is not None:
            self.feeder.join(timeout=5)
            sys.setswitchinterval(self.switch_interval)

"""The run's vLLM servers and which one serves each request (docs/vllm.md, "Several servers").

- Servers: `vllm.servers = N` started by the run (rank 0), each on its own cores or GPUs
  (`vllm.devices`), or `vllm.urls` of your own, each checked at connect. Under torchrun rank 0 starts
  or connects to them and every rank learns their addresses: every rank samples from the pool.
- Routing (`request`): every request of one key goes to one server, so that server's prefix cache
  holds the prefix the learner's tree shares: a group is one request (`n = G`), an episode's turns and
  an agent session's requests carry their key. A key seen for the first time goes to the server with
  the least work in flight (of those, the one that took the fewest).
- Deaths: a request that finds its server gone (its process exited, or it stopped answering) marks it
  dead and goes to another; the run says so once (the server, its log). A server the run started is
  restarted from the weights it started with (RUN_DIR/vllm/initial, kept for that) in the background,
  and rejoins the pool at a later sync, once it answers, with the learner's current weights published
  to it before any request. A server of your own is dropped. With none left the run stops with an
  error naming every log and `--resume`.
- Nothing started outlives the run: each server runs under backstream/lifetime.py's guard.
- Each step logs `vllm/requests/<i>` (the requests server i took, this rank's) and `vllm/servers_alive`.

Under torchrun the ranks agree at each sync (`agree`, a collective): every rank's dead servers are
gathered, rank 0 restarts its own, and the table of addresses is broadcast.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from backstream.log import log
from backstream.rl.backends.vllm.server import Server, ServerError

STICKY = 100_000  # keys remembered (episodes, sessions); the oldest forgotten first


@dataclass
class Member:
    """One server of the pool: where it is, whether it serves, what it holds, what it took."""

    index: int
    server: Server | None
    managed: bool  # started by the run (restarted when it dies)
    alive: bool = True
    weights: int = -1  # the learner's weights it holds (the sync's counter; -1: none of the run's)
    label: int = -1  # the step its tokens record
    in_flight: int = 0
    requests: int = 0  # since the last `metrics`
    taken: int = 0  # in all (ties of in flight go to the server that took fewest)
    reviving: concurrent.futures.Future | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"vLLM server {self.index} ({self.server.where() if self.server else 'gone'})"


class ServerPool:
    """The run's servers (see the module docstring). `start(i, progress)` (rank 0): a started server
    number i (the caller's: the weights it starts from, its arguments); `connect(url)`: a server of your
    own, checked; `dp`: the run's rl/parallel/ object; `client_timeout`, `client_key`: a request's time
    limit and key on the other ranks' clients of rank 0's servers."""

    def __init__(self, count: int, dp, start=None, connect=None, urls: list[str] = (), client_timeout: float = 600.0,
                 client_key: str = ""):
        self.count, self.dp, self.start_one, self.connect, self.urls = count, dp, start, connect, list(urls)
        self.client_timeout, self.client_key = client_timeout, client_key
        self.members: list[Member] = []
        self.lock = threading.Lock()
        self.sticky: OrderedDict = OrderedDict()
        self.said: set[int] = set()  # deaths said (once each)
        self.reviver = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, count), thread_name_prefix="revive")

    @property
    def started(self) -> bool:
        return bool(self.members)

    def open(self, progress=None) -> None:
        """Rank 0 starts (at once, side by side) or connects to every server; every rank learns them."""
        def start_all():
            if self.urls:
                return [Member(i, self.connect(u), False) for i, u in enumerate(self.urls)]
            with concurrent.futures.ThreadPoolExecutor(self.count) as ex:
                futures = [ex.submit(self.start_one, i, progress if i == 0 else None) for i in range(self.count)]
                servers, error = [], None
                for f in futures:
                    try:
                        servers.append(f.result())
                    except BaseException as e:  # noqa: BLE001  (the others stopped, then raised)
                        error = error or e
                if error is not None:
                    for s in servers:
                        s.stop()
                    raise error
            return [Member(i, s, True) for i, s in enumerate(servers)]

        members = self.dp.on_main(start_all)
        table = self.dp.broadcast([(m.server.url, m.managed, m.server.log_path) for m in members] if members else None)
        if members is None:  # a client of rank 0's servers (their logs are in the run folder, which ranks share)
            members = [Member(i, Server.client(url, self.client_timeout, self.client_key, log), managed)
                       for i, (url, managed, log) in enumerate(table)]
        self.members = members

    # -- routing ------------------------------------------------------------------------------------
    def request(self, fn, key=None):
        """`fn(member)` on the member of `key` (the one with the least in flight for a new key); a server
        found gone is marked dead and the request goes to another."""
        while True:
            m = self._pick(key)
            try:
                return fn(m)
            except ServerError:
                if m.server.answers():
                    raise
                self._dead(m)
            finally:
                with self.lock:
                    m.in_flight -= 1

    def forget(self, key) -> None:
        """`key`'s requests are over (an episode, a session): which server took them is not kept."""
        with self.lock:
            self.sticky.pop(key, None)

    def _pick(self, key) -> Member:
        with self.lock:
            live = [m for m in self.members if m.alive]
            if not live:
                raise ServerError(self.none_left())
            m = self.sticky.get(key) if key is not None else None
            if m is None or not m.alive:
                m = min(live, key=lambda x: (x.in_flight, x.taken, x.index))
                if key is not None:
                    self.sticky[key] = m
                    while len(self.sticky) > STICKY:
                        self.sticky.popitem(last=False)
            m.in_flight += 1
            m.requests += 1
            m.taken += 1
            return m

    def _dead(self, m: Member) -> None:
        with self.lock:
            if not m.alive:
                return
            m.alive = False
        if m.index not in self.said:
            self.said.add(m.index)
            what = "it is restarted with the current weights" if m.managed else "it is dropped from the pool"
            left = sum(x.alive for x in self.members)
            log.warning(f"vllm: {m.name} died or stopped answering; its requests go to the other {left} server(s), "
                        f"and {what}")

    def none_left(self) -> str:
        logs = ", ".join(m.name for m in self.members)
        return (f"every vLLM server of the run died or stopped answering ({logs}). The last checkpoint is intact: "
                "`backstream train --resume RUN_DIR` goes on")

    # -- the step boundary (every rank, the trainer's thread) ------------------------------------------
    def agree(self) -> bool:
        """The ranks' dead servers gathered and marked on every rank; rank 0 restarts its own, and
        servers restarted since rejoin (their new addresses broadcast). Returns whether the pool changed
        (a publish must reach the servers that came back)."""
        for m in self.members:  # a server the run started that exited is dead without a request finding it
            if m.alive and m.managed and m.server.proc is not None and m.server.proc.poll() is not None:
                self._dead(m)
        dead = sorted({i for part in self.dp.gather([m.index for m in self.members if not m.alive]) for i in part})
        changed = False
        for i in dead:
            if self.members[i].alive:
                self._dead(self.members[i])
                changed = True

        def revive():
            back = []
            for m in self.members:
                if m.alive or not m.managed or m.server is None:
                    continue
                if m.reviving is None:
                    m.reviving = self.reviver.submit(self._restart, m)
                elif m.reviving.done():
                    future, m.reviving = m.reviving, None
                    try:
                        m.server = future.result()
                    except Exception as e:  # noqa: BLE001  (said, tried again at a later sync)
                        log.warning(f"vllm: restarting {m.name} failed ({e}); tried again at the next step")
                        continue
                    back.append((m.index, m.server.url))
            return back

        back = self.dp.broadcast(self.dp.on_main(revive))
        for i, url in back or []:
            m = self.members[i]
            if not self.dp.main:
                m.server = Server.client(url, self.client_timeout, self.client_key, m.server.log_path)
            m.alive, m.weights, m.label = True, -1, -1
            self.said.discard(i)
            log.info(f"vllm: {m.name} is back; it gets the current weights before any request")
            changed = True
        if not any(m.alive for m in self.members):
            raise ServerError(self.none_left())
        return changed

    def recheck(self) -> bool:
        """After a publish failed (every rank): rank 0 asks each live server whether it is still there; the
        ones that are not are marked dead on every rank. Whether any was (the publish is then tried again
        with the others)."""
        gone = self.dp.broadcast(self.dp.on_main(lambda: [m.index for m in self.alive() if not m.server.answers()]))
        for i in gone:
            self._dead(self.members[i])
        if not self.alive():
            raise ServerError(self.none_left())
        return bool(gone)

    def _restart(self, m: Member) -> Server:
        """A dead server the run started, started again (in a thread of rank 0's): its process group
        ended first, then the same command on a free port."""
        m.server.stop()
        return self.start_one(m.index, None)

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.alive]

    def metrics(self) -> dict[str, float]:
        with self.lock:
            out = {f"vllm/requests/{m.index}": float(m.requests) for m in self.members}
            for m in self.members:
                m.requests = 0
            out["vllm/servers_alive"] = float(sum(m.alive for m in self.members))
        return out

    def metric_keys(self) -> tuple[str, ...]:
        n = len(self.urls) or self.count
        return (*(f"vllm/requests/{i}" for i in range(n)), "vllm/servers_alive")

    def close(self) -> None:
        """Stop the servers the run started (rank 0's), and the restarts in flight."""
        self.reviver.shutdown(wait=False, cancel_futures=True)
        servers = [m.server for m in self.members if m.server is not None]
        with concurrent.futures.ThreadPoolExecutor(max(1, len(servers))) as ex:  # each its grace, side by side
            list(ex.map(lambda s: s.stop(), servers))
        self.members = []


def core_lists(count: int) -> list[str]:
    """CPU: each of `count` servers' cores for VLLM_CPU_OMP_THREADS_BIND, the machine's cores dealt out
    round robin (a server gets at least one; two servers on one core share it)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    per = max(1, len(cores) // count)
    return [",".join(str(c) for c in cores[(i * per) % len(cores):(i * per) % len(cores) + per]) for i in range(count)]

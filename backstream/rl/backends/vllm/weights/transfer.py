"""The learner's side of vLLM's weight-transfer engine (rl/backends/vllm/weights/receive.py is the servers'): one
process group of the learner's rank 0 and every worker of every server, and the four phases of a
publish driven over HTTP on every server at once while rank 0 broadcasts the weights.

The group is torch's own, made directly (a TCPStore whose master is rank 0, a ProcessGroupGloo on CPU
or ProcessGroupNCCL on GPUs), never through init_process_group: it lives beside a torchrun job's
default group, and the learner's environment has no vLLM to borrow vLLM's trainer side from. Server k's
workers take ranks 1 + (the world sizes of the servers before it) + their own (`/get_world_size`).
Joining blocks on both sides until every member is in, so every server's /init_weight_transfer_engine
is posted from a thread while the learner builds its end.

A publish (`publishing`), every phase on every server concurrently, each within `timeout_s`:
  /start_weight_update -> /update_weights (returns once that server received and loaded every bucket)
  while rank 0 broadcasts the buckets -> /finish_weight_update {weight_version}.
A phase that overruns raises `TransferError` naming the phase, the server and the timeout; the group
is then shut down (a broadcast that a dead peer never joins would otherwise hold the learner until
the group's own timeout). One host: the bytes go through a shared-memory file (`shm_path`), the group
carrying an 8-byte signal per bucket.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from backstream.checks import UserError

BUCKET_BYTES = 1 << 28  # a bucket closes once it holds this much (a tensor larger than it is one bucket)


class TransferError(UserError):
    """A phase of a publish failed or overran vllm.transfer_timeout_s (the message names which, where)."""


def buckets_of(sizes: list[int], limit: int | None = None) -> list[int]:
    """Tensors per bucket, in order: a bucket closes once it holds `limit` (BUCKET_BYTES) bytes or more."""
    limit = limit or BUCKET_BYTES
    out, count, total = [], 0, 0
    for s in sizes:
        count, total = count + 1, total + s
        if total >= limit:
            out.append(count)
            count, total = 0, 0
    if count:
        out.append(count)
    return out


class Group:
    """The transfer group over `servers` (objects with `url` and `post(path, body, timeout)`), named in
    errors by `names` (the pool's "vLLM server i (its log: ...)"; default their URLs): joined at
    construction. `host`: the learner's address the servers reach; `device`: "gloo" (CPU) or "nccl";
    `shm_path`: the shared file of a one-host group ("" over the network)."""

    def __init__(self, servers: list, host: str, timeout_s: float, device: str = "gloo", shm_path: str = "",
                 names: list[str] | None = None):
        self.servers, self.timeout_s, self.device, self.shm_path = list(servers), timeout_s, device, shm_path
        self.names = list(names) if names else [f"the server at {s.url}" for s in self.servers]
        self.shm = None
        self.late = list  # the phases still unanswered, by server (while one runs)
        sizes = [int(_ask(s, "/get_world_size?include_dp=true", None, timeout_s, "get")["world_size"])
                 for s in self.servers]
        self.world = 1 + sum(sizes)
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, self.world, is_master=True, timeout=timeout, wait_for_workers=False)
        prefix = f"backstream-{os.getpid()}-{time.monotonic_ns()}"
        self.prefix = prefix
        offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]
        bind = host if host in ("127.0.0.1", "::1", "localhost") else ""  # else each worker's own interface
        infos = [{"init_info": {"master_address": host, "master_port": self.store.port, "rank_offset": o,
                                "world_size": self.world, "timeout_s": timeout_s, "prefix": prefix, "device": device,
                                "shm_path": shm_path, "bind": bind}} for o in offsets]
        with self._on_all("/init_weight_transfer_engine", infos) as joined:
            store = dist.PrefixStore(prefix, self.store)
            if device == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self.group = dist.ProcessGroupNCCL(store, 0, self.world, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
                self.group = dist.ProcessGroupGloo(store, 0, self.world, opts)
            joined()

    @contextlib.contextmanager
    def _on_all(self, path: str, bodies: list[dict]):
        """`path` posted to every server from threads while the caller works; the value: a function
        that waits for every answer (within the timeout, naming the server otherwise) and returns them."""
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self.servers)))
        futures = [pool.submit(_ask, s, path, b, self.timeout_s + 30) for s, b in zip(self.servers, bodies)]
        deadline = time.monotonic() + self.timeout_s

        def wait() -> list:
            out = []
            for name, f in zip(self.names, futures):
                try:
                    out.append(f.result(timeout=max(0.0, deadline - time.monotonic())))
                except concurrent.futures.TimeoutError:
                    raise TransferError(f"the weight transfer's {path} did not finish within vllm.transfer_timeout_s "
                                        f"= {self.timeout_s:g} on {name}; raise it, or look at that server's "
                                        "log") from None
                except Exception as e:  # noqa: BLE001  (named, with the server)
                    raise TransferError(f"the weight transfer's {path} failed on {name}: {e}") from None
            return out

        self.late = lambda: [f"{path} on {name}" for name, f in zip(self.names, futures) if not f.done()]
        try:
            yield wait
        except BaseException:
            self.close()
            raise
        finally:
            self.late = list
            pool.shutdown(wait=False, cancel_futures=True)

    def held(self) -> bool:
        """Whether every worker of every server is still in this group (a server of your own may have
        joined another learner's since)."""
        try:
            with self._on_all("/collective_rpc", [{"method": "backstream_group"}] * len(self.servers)) as wait:
                answers = wait()
        except TransferError:
            return False
        return all(r == self.prefix for a in answers for r in a["results"])

    def phase(self, path: str, body: dict | None = None) -> None:
        """One phase posted to every server at once, waited for."""
        with self._on_all(path, [body or {}] * len(self.servers)) as wait:
            wait()

    @contextlib.contextmanager
    def publishing(self, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], version: str,
                   load: bool = True):
        """A publish of the tensors `names` (Hugging Face names; their dtypes and whole shapes), labelled
        `version`: vLLM's start phase on every server, then its update phase in flight while the caller
        hands the buckets to `send` (the value: bucket k's tensors, whole, in order; `buckets` says how
        many each), then the finish phase. `load` False: the servers receive and drop them (the test of a
        publish that did not land). Raises TransferError, the group closed."""
        sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)]
        self.buckets = buckets_of(sizes)
        self.sizes, self.sent, self.off, self.works = sizes, 0, 0, []
        info = {"names": list(names), "dtype_names": [str(d).removeprefix("torch.") for d in dtypes],
                "shapes": [list(s) for s in shapes], "buckets": self.buckets, "version": version, "load": load}
        if self.shm_path and (self.shm is None or self.shm.numel() < sum(sizes)):
            with open(self.shm_path, "ab") as f:  # sized once; its pages stay mapped on both sides
                f.truncate(max(sum(sizes), os.fstat(f.fileno()).st_size))
            self.shm = torch.from_file(self.shm_path, shared=True, size=sum(sizes), dtype=torch.uint8)
        self.phase("/start_weight_update")
        with self._on_all("/update_weights", [{"update_info": info}] * len(self.servers)) as received:
            yield self.send
            for w in self.works:
                self._wait(w)
            received()
        self.phase("/finish_weight_update", {"weight_version": version})

    def send(self, part: list[torch.Tensor]) -> None:
        """The next bucket's tensors (whole), broadcast from rank 0; one bucket in flight while the caller
        gathers the next."""
        k = len(self.works) + self.sent
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if self.shm_path:  # the bytes into the shared file, then the signal that bucket k is there
            for t in part:
                n = t.numel() * t.element_size()
                self.shm[self.off:self.off + n].copy_(_bytes(t))
                self.off += n
            buf = torch.tensor([k], dtype=torch.int64)
        else:  # a bucket of one tensor goes as it is; several are packed into one buffer
            buf = _bytes(part[0]) if len(part) == 1 else torch.cat([_bytes(t) for t in part])
        self.works.append(self.group.broadcast([buf], opts))
        if len(self.works) > 1:
            self._wait(self.works.pop(0))
            self.sent += 1

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001  (gloo's and NCCL's errors alike)
            late = self.late()
            where = f" (unanswered: {', '.join(late)})" if late else ""
            raise TransferError(f"the weight transfer's broadcast failed ({type(e).__name__}: {e}); a server of the "
                                f"group died or overran vllm.transfer_timeout_s = {self.timeout_s:g}{where}; look at "
                                "that server's log") from None

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.group.shutdown()
        if self.shm_path:
            with contextlib.suppress(OSError):
                os.unlink(self.shm_path)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat (a view where it is contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8)


def _ask(server, path: str, body: dict | None, timeout: float, method: str = "post"):
    return server.get(path, timeout=timeout) if method == "get" else server.post(path, body or {}, timeout=timeout)

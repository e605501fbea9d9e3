"""The process group torchrun's environment describes (joined, left, abandoned on an error) and the
collectives on plain data every rank calls alike (`gather`, `broadcast`, `on_main`, `fail_together`, ...);
a collective that fails becomes an error that says another rank failed."""


from __future__ import annotations

import contextlib
import datetime
import os
import pickle

import torch
import torch.distributed as dist

from backstream.checks import UserError


def launched() -> bool:
    """Is this process one rank of a torchrun job (or of an already started process group)?"""
    return (dist.is_available() and dist.is_initialized()) or "WORLD_SIZE" in os.environ


def requested_world() -> int | None:
    """The torchrun world size (before the group starts), or None in a plain process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


_STARTED_HERE = False


def init(timeout_s: int, device: torch.device) -> bool:
    """Join the process group torchrun's environment describes (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT): gloo on CPU, nccl on CUDA with this rank's local GPU made current;
    an already started group is reused (with its own timeout). Returns whether this process runs
    distributed."""
    global _STARTED_HERE
    if active():
        return True
    if not launched():
        return False
    if not dist.is_available():
        raise UserError("torchrun: this torch build has no torch.distributed; run in one process (python -m "
                         "backstream train ...) or install a torch with distributed support")
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    missing = [k for k, v in env.items() if v is None]
    if missing:
        raise UserError(f"torchrun: WORLD_SIZE is set but {missing} are not; start the job with `torchrun "
                         "--nproc_per_node N -m backstream train run.toml` (which sets them all), or unset "
                         "WORLD_SIZE to train in one process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        local = int(env["LOCAL_RANK"])
        if local >= torch.cuda.device_count():
            raise UserError(f"torchrun: LOCAL_RANK {local} but this node sees {torch.cuda.device_count()} GPU(s); "
                             "set --nproc_per_node to at most the number of GPUs per node")
        torch.cuda.set_device(local)
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", torch.cuda.current_device())
                                if backend == "nccl" else None)
    except Exception as e:
        raise RuntimeError(
            f"torchrun: rank {env['RANK']} of {env['WORLD_SIZE']} could not start the {backend} process group at "
            f"{env['MASTER_ADDR']}:{env['MASTER_PORT']} within distributed.timeout_s={timeout_s} "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}). Check "
            "that every rank was started (torchrun --nnodes/--nproc_per_node on every node), that MASTER_ADDR "
            "(--rdzv_endpoint / --master_addr) is reachable from every node and MASTER_PORT is free, and that "
            "distributed.timeout_s leaves time for the slowest node to start") from e
    _STARTED_HERE = True
    return True


def shutdown() -> None:
    """Leave the process group if `init` started it."""
    global _STARTED_HERE
    if _STARTED_HERE and active():
        dist.destroy_process_group()
    _STARTED_HERE = False


def abandon() -> None:
    """A rank that stops on an error leaves the group it started at once: the other ranks'
    pending collectives then fail (gloo: at once; nccl: by the timeout) instead of waiting on it."""
    global _STARTED_HERE
    if _STARTED_HERE and active():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (already broken: nothing left to release)
            pass
    _STARTED_HERE = False


@contextlib.contextmanager
def clear_failures(what: str, timeout_s: int):
    """A collective that fails (another rank died, or did not answer within the timeout) becomes an
    error that says so, instead of a backend trace."""
    try:
        yield
    except (dist.DistError, RuntimeError) as e:
        if not active() or not _looks_collective(e):
            raise
        raise RuntimeError(
            f"distributed: rank {rank()} of {world()} stopped during {what}: another rank failed or did not reach "
            f"the same collective within distributed.timeout_s={timeout_s} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). The first error is in the log of the rank that "
            "failed; no checkpoint was written from this step") from e


def _looks_collective(e: BaseException) -> bool:
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()  # gloo raises plain RuntimeErrors
    return any(w in text for w in ("gloo", "nccl", "connection closed", "connection reset", "timed out",
                                   "process group"))


# -- collectives on plain data -------------------------------------------------------------------


def gather(obj) -> list:
    """Every rank's `obj`, by rank, on every rank ([obj] in one process)."""
    if not active():
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if not active():
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True on every rank if it is True on some rank."""
    if not active():
        return flag
    t = torch.tensor([int(bool(flag))], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def on_main(fn):
    """fn() on rank 0 only (its result there, None elsewhere); an error it raises stops every rank,
    with the same message (a run folder in use, say), instead of leaving them waiting on rank 0."""
    if not active():
        return fn()
    result, raised = None, None
    if is_main():
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001  (re-raised below, on every rank)
            raised = e
    error = broadcast(_portable(raised))  # the exception itself: its type (UserError, say) survives
    if raised is not None:
        raise raised
    if error is not None:
        raise error
    return result


def fail_together(error: BaseException | None) -> None:
    """The end of a phase each rank ran on its own (its requests to a shared server, say): when some
    rank failed in it, every rank raises, its own error where it has one, else the first failed
    rank's, so that each says what went wrong rather than that another rank failed."""
    if not active():
        if error is not None:
            raise error
        return
    errors = gather(_portable(error))
    if error is not None:
        raise error
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def _portable(e: BaseException | None) -> BaseException | None:
    """`e` as it can cross ranks: itself where it pickles, else a RuntimeError that names it."""
    if e is None:
        return None
    try:
        return pickle.loads(pickle.dumps(e))  # a traceback does not pickle: rank 0 keeps its own
    except Exception:  # noqa: BLE001  (an exception whose arguments do not pickle)
        return RuntimeError(f"rank 0: {type(e).__name__}: {e}")


def check_shared(run_dir: str, marker: str) -> None:
    """Every rank must see the run folder rank 0 claimed (checkpoints are written by every rank):
    each reads `marker` (rank 0's lock file in it) and compares it with rank 0's. On several nodes
    a folder on a node-local disk fails here, before any training, rather than at the first
    checkpoint."""
    if not active():
        return
    import socket  # noqa: PLC0415

    def read():
        try:
            with open(marker) as f:
                return f.read()
        except OSError:
            return None

    expect = broadcast(read() if is_main() else None)
    seen = gather((read() == expect, socket.gethostname()))
    blind = [f"{r} ({host})" for r, (ok, host) in enumerate(seen) if not ok]
    if blind:
        raise UserError(f"train.output_dir: {run_dir}, as rank 0 ({seen[0][1]}) created it, is not visible from "
                         f"rank(s) {', '.join(blind)}; every rank writes its checkpoint shards there, so under "
                         "torchrun on several nodes it must be on storage every node sees (a shared file system); "
                         "set train.output_dir to such a path")


def _comm_device() -> torch.device:
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

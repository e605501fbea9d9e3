"""Run a function in N gloo processes (the CPU stand-in for N GPUs under torchrun) and collect what
each rank returns. Tests only.

    results = dist.run(module_level_fn, 2, arg1, arg2)   # [rank 0's return value, rank 1's, ...]

The function must live at module level in an importable module (processes are spawned, not forked:
a fork after torch's OpenMP threads started can hang). Each process gets torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), one thread, and an initialised gloo process group;
a rank that raises makes `run` raise with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

# the two collectives FSDP2 calls by name (torch 2.13: the *_single ones; torch 2.11, a GPU image's,
# the *_tensor ones): what the tests' counters wrap
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(torch_dist, "reduce_scatter_single") else "reduce_scatter_tensor"
ALL_GATHER = "all_gather_single" if hasattr(torch_dist, "all_gather_single") else "all_gather_into_tensor"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's environment for one rank of a single-node job."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str, init: bool) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    os.environ.update(env(rank, world, port))
    torch.set_num_threads(1)
    code = 1
    try:
        if init:
            torch_dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        result = fn(*args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
        code = 0
    except BaseException:  # noqa: BLE001  (the rank's failure, whatever it is, goes to its file)
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        try:
            if torch_dist.is_initialized():
                torch_dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (a broken group after a failure: nothing left to release)
            pass
        # what the rank has to say is in its file: skip the interpreter's teardown, where gloo's objects
        # can abort a finished process (as the `backstream` command does under torchrun)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(fn, world: int, *args, init: bool = True) -> list:
    """fn(*args) on `world` ranks; their return values (torch.save-able), by rank. `init=False`
    leaves the process group to the code under test (it reads torchrun's environment)."""
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(_worker, args=(world, free_port(), fn, args, d, init), nprocs=world,
                               start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # the rank's own traceback is in its file
        results = []
        for rank in range(world):
            path = os.path.join(d, f"{rank}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else
                           {"error": "no result (killed when another rank failed)"})
        # a rank's own traceback first: the others were only stopped because of it
        for rank, res in sorted(enumerate(results), key=lambda x: "no result" in x[1].get("error", "")):
            if "error" in res:
                raise RuntimeError(f"rank {rank} failed:\n{res['error']}")
        return [res["ok"] for res in results]


# -- whole jobs under torchrun -------------------------------------------------------------------


def torchrun(argv: list[str], nproc: int = 2):
    """`python -m torch.distributed.run --standalone --nproc_per_node nproc -m backstream ARGV`, started
    (a Popen with text stdout/stderr pipes), each rank on one thread."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "backstream", *argv]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def ranks_of(agent_pid: int) -> dict[int, int]:
    """{rank: pid} of the worker processes torchrun's agent `agent_pid` started (Linux /proc)."""
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(d)
    return found

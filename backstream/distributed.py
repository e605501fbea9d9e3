"""Data parallelism under torchrun (DESIGN §6c): the process group, FSDP2 sharding of the policy,
and the few collectives the trainer needs, so that the loop itself hardly branches on it.

    torchrun --nproc_per_node 8 -m backstream train run.toml                      one node, 8 GPUs
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_id JOB \\
             --rdzv_backend c10d --rdzv_endpoint HOST:29500 -m backstream train run.toml   on each node

How N ranks give the update one process would give on the same global batch:
- every rank walks the same seeded prompt stream; a step's `train.prompts_per_step` prompts are the
  GLOBAL batch, and each rank trains whole prompt groups (a token tree never spans ranks): of every
  minibatch, rank r takes the r-th of W equal contiguous slices (`rank_groups`); with the rollout's
  K/V reused, the groups it sampled (K/V never travel; DAPO refills go to the ranks that keep the
  fewest, `round_share`'s `held`, so the shares end even);
- a group's completions are drawn with a generator seeded from (train.seed, the prompt's position in
  the stream) (`group_generator`), so they do not depend on which rank draws them; the rollouts are
  then gathered, so every rank holds the global batch (rewards, advantages, metrics as one process
  has them) and keeps the samples of its own groups for the update;
- the loss normalisers (Σ|y_i|, N, L_max) are those of the global minibatch (`losses.Normalisers`),
  and FSDP's gradient reduction is a SUM over ranks (`shard`): Σ_ranks ∇(global-normalised local
  loss) = ∇(the single-process loss);
- the gradient norm of `clip_grad_norm` is the global one, so clipping and the non-finite guard
  agree on every rank.
Parameters are gathered once around each phase that runs forwards only (`gathered`): ranks decode
different numbers of tokens, and a per-forward all-gather would make them wait on each other per
token (or deadlock).

Rank 0 alone writes the run folder (lock, config.toml, metrics.jsonl, progress); checkpoints are
written by every rank together (checkpoint.save: DCP shards + a Hugging Face export) and a run resumes
on any number of ranks. A rank that raises leaves the process group at once, and a rank killed
outright closes its connections, so the others stop with an error that says so (gloo: at once;
nccl: within `timeout_s`) instead of hanging; torchrun then ends the job.

No `reshard_after_forward` key: every phase keeps the whole model gathered for its duration (the
rollout here, each engine call in engine.FSDPCall), so FSDP's per-layer resharding never applies.
Quantized layers (quant.py) hold the Linear's own Parameters, so FSDP shards them with their layer
and the codes are computed from the gathered weights. The frozen KL reference policy of a full fine-tune is
sharded the same way (1/N of a copy per rank, gathered once per log-prob pass); with LoRA it is the
base model under the adapters.
The MoE router load-balancing loss takes its routing counts and N from the whole minibatch: one
all-reduce inside the engine call, before any block runs (router.py).

In a plain process (no torchrun, no process group) every helper is trivial: rank 0 of 1, gathers
return [x], nothing is sharded, and the trainer runs exactly as it does without this module.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backstream.checks import at_least, choice

MIXED_PRECISION = ["none", "bf16"]


@dataclass(kw_only=True)
class DistributedConfig:
    mixed_precision: str = "none"
    """Under torchrun: "bf16" all-gathers parameters and runs forwards in bfloat16 while gradients are
    reduced in float32 (FSDP2's MixedPrecisionPolicy); "none" computes in model.dtype."""
    timeout_s: int = 1800
    """Under torchrun: seconds a collective may wait for the other ranks before this rank stops with an
    error (a rank that died or hangs); also the wait for every rank to join at start."""

    def __post_init__(self):
        choice("distributed.mixed_precision", self.mixed_precision, MIXED_PRECISION)
        at_least("distributed.timeout_s", self.timeout_s, 1)


# -- the process group ---------------------------------------------------------------------------


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


def init(cfg: DistributedConfig, device: torch.device) -> bool:
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
        raise ValueError("torchrun: this torch build has no torch.distributed; run in one process (python -m "
                         "backstream train ...) or install a torch with distributed support")
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    missing = [k for k, v in env.items() if v is None]
    if missing:
        raise ValueError(f"torchrun: WORLD_SIZE is set but {missing} are not; start the job with `torchrun "
                         "--nproc_per_node N -m backstream train run.toml` (which sets them all), or unset "
                         "WORLD_SIZE to train in one process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        local = int(env["LOCAL_RANK"])
        if local >= torch.cuda.device_count():
            raise ValueError(f"torchrun: LOCAL_RANK {local} but this node sees {torch.cuda.device_count()} GPU(s); "
                             "set --nproc_per_node to at most the number of GPUs per node")
        torch.cuda.set_device(local)
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s),
                                device_id=torch.device("cuda", torch.cuda.current_device())
                                if backend == "nccl" else None)
    except Exception as e:  # noqa: BLE001  (the store, the rendezvous, the backend: all worth the same advice)
        raise RuntimeError(
            f"torchrun: rank {env['RANK']} of {env['WORLD_SIZE']} could not start the {backend} process group at "
            f"{env['MASTER_ADDR']}:{env['MASTER_PORT']} within distributed.timeout_s={cfg.timeout_s} "
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


def sum_over_ranks(t: Tensor) -> Tensor:
    """The element-wise sum of `t` over every rank (`t` itself in one process), on t's device."""
    if not active():
        return t
    out = t.to(_comm_device()).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device)


def max_over_ranks(x: float) -> float:
    if not active():
        return x
    return max(gather(x))


def sum_metrics(m: dict[str, float]) -> dict[str, float]:
    """Per key, the sum over ranks (a key a rank lacks counts 0): the objective's metrics are
    additive once its normalisers are global. One process: `m` itself."""
    if not active():
        return m
    out: dict[str, float] = {}
    for part in gather(m):
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


def on_main(fn):
    """fn() on rank 0 only (its result there, None elsewhere); an error it raises stops every rank,
    with the same message (a run folder in use, say), instead of leaving them waiting on rank 0."""
    if not active():
        return fn()
    result, error, raised = None, None, None
    if is_main():
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001  (re-raised below, on every rank)
            raised, error = e, (type(e).__name__, str(e))
    error = broadcast(error)
    if raised is not None:
        raise raised
    if error is not None:
        kind, msg = error
        raise (ValueError if kind == "ValueError" else RuntimeError)(f"{msg}" if kind == "ValueError"
                                                                     else f"rank 0: {kind}: {msg}")
    return result


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
        raise ValueError(f"train.output_dir: {run_dir}, as rank 0 ({seen[0][1]}) created it, is not visible from "
                         f"rank(s) {', '.join(blind)}; every rank writes its checkpoint shards there, so under "
                         "torchrun on several nodes it must be on storage every node sees (a shared file system); "
                         "set train.output_dir to such a path")


def _comm_device() -> torch.device:
    if active() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- the global batch, split by whole groups -----------------------------------------------------


def rank_groups(n_groups: int, parts: int, world_size: int, r: int) -> list[int]:
    """The group indices (of a batch of `n_groups` groups cut into `parts` contiguous minibatches)
    that rank r trains: of every minibatch its r-th of `world_size` contiguous slices, in order, so
    that the rank's own minibatch m lies inside the global minibatch m."""
    if n_groups % (parts * world_size):
        raise ValueError(f"train.prompts_per_step: {n_groups} prompt groups do not split into {parts} "
                         f"minibatch(es) × {world_size} ranks")
    per, share = n_groups // parts, n_groups // parts // world_size
    return [m * per + r * share + j for m in range(parts) for j in range(share)]


def round_share(need: int, parts: int, world_size: int, r: int, held: list[int] | None = None) -> list[int]:
    """The groups of a rollout round of `need` groups that rank r samples: its own training groups
    when the round is a whole batch, else an even contiguous split (a DAPO refill). With `held`,
    the groups each rank already keeps for this step and must train itself (it holds their K/V:
    engine.reuse_rollout_kv), a refill goes one group at a time to the rank holding the fewest (ties
    to the lower rank): as no rank holds more than its even share of the step, the round that fills
    the step ends with even shares. Who samples a group changes none of its samples
    (`group_generator`), only where its K/V lie."""
    if held is not None:
        if len(held) != world_size:
            raise ValueError(f"round_share: held has {len(held)} counts for {world_size} ranks")
        counts, mine = list(held), []
        for j in range(need):
            k = min(range(world_size), key=lambda q: (counts[q], q))
            counts[k] += 1
            if k == r:
                mine.append(j)
        return mine
    if need % (parts * world_size) == 0:
        return rank_groups(need, parts, world_size, r)
    return list(range(r * need // world_size, (r + 1) * need // world_size))


def group_generator(seed: int, position: int, device="cpu") -> torch.Generator:
    """The sampler's generator of the group drawn at `position` of the prompt stream: the same on
    every rank and in every world size, so a group's samples do not depend on who draws them."""
    return torch.Generator(device).manual_seed((seed * 0x9E3779B1 + position * 0x85EBCA77 + 1) % 2**63)


# -- FSDP2 ---------------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers causal LM (PEFT wrapper or not): the modules whose
    class is in `_no_split_modules`, else the longest ModuleList."""
    from backstream.adapter import base_model  # noqa: PLC0415

    base = base_model(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if layers:
        return layers
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def shard(model: nn.Module, cfg: DistributedConfig, device: torch.device) -> nn.Module:
    """FSDP2 over every rank: `fully_shard` on each decoder layer, then on the root (after LoRA and
    quantization, so adapters and frozen base weights are sharded alike). Gradients are reduced as a
    SUM over ranks: the loss normalisers are global (see the module docstring), so FSDP's default
    mean would divide the gradient by the world size a second time."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    mesh = init_device_mesh(device.type, (world(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.mixed_precision == "bf16" else MixedPrecisionPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)  # the root, as FSDP itself sets it
    from backstream.engine import FSDPCall  # noqa: PLC0415

    FSDPCall.check_supported([m for m in model.modules() if isinstance(m, FSDPModule)])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM), no division
    return model


def units(model: nn.Module) -> list[nn.Module]:
    """The FSDP modules of `model` (none when it is not sharded)."""
    if not active():
        return []
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Every FSDP unit's parameters all-gathered once on entry (every rank must enter) and kept for
    the block's forwards, resharded on exit: forwards inside cost no collective, so ranks that run
    different numbers of them (decoding, skipped sequences) never wait on each other. No-op when
    the model is not sharded."""
    us = units(model)
    if not us:
        yield
        return
    for u in us:  # what FSDP does at the root's first forward (outer units come first)
        state = u._get_fsdp_state()
        if state._is_root is None:
            state._lazy_init()
    keep = []  # FSDP2 has setters, no getters: each unit's reshard-after-forward, read where the setter writes it
    for u in us:
        groups = u._get_fsdp_state()._fsdp_param_groups
        keep.append(any(g.post_forward_mesh_info is not None for g in groups))
        u.set_reshard_after_forward(False, recurse=False)
    for u in us:
        u.unshard()  # one all-gather per unit, in the same order on every rank
    try:
        yield
    finally:
        for u, k in zip(us, keep):
            u.reshard()
            u.set_reshard_after_forward(k, recurse=False)


def reshard(model: nn.Module) -> None:
    """Free every unit's gathered parameters (so that the next forward gathers the weights the
    optimizer just wrote, not a stale copy)."""
    for u in units(model):
        u.reshard()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def grad_norm(params: list[Tensor], max_norm: float) -> float:
    """The global gradient norm (over every rank's shards); clips to `max_norm` when > 0. In one
    process: torch's clip_grad_norm_ / the plain norm, as before."""
    grads = [p.grad for p in params if p.grad is not None]
    if not units_present(params):
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        norms = [g.norm() for g in grads]
        return float(torch.norm(torch.stack(norms))) if norms else 0.0  # no gradient: every advantage was 0
    # DTensor gradients: the norm is a partial sum over shards; full_tensor() all-reduces it
    total = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    gn = float(total)
    if max_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return gn


def units_present(params: list[Tensor]) -> bool:
    return active() and any(hasattr(p, "to_local") for p in params)


def nonfinite_params(model: nn.Module) -> list[str]:
    """Names of the parameters holding NaN/inf, over every rank's shards."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(_local(p.detach())).all())]
    if not active():
        return bad
    return sorted({n for part in gather(bad) for n in part})


def check_same_weights(model: nn.Module) -> None:
    """Every rank must start from the same weights (FSDP shards each rank's own copy, it does not
    broadcast): compare a checksum before sharding."""
    if not active():
        return
    with torch.no_grad():
        s = sum(float(p.detach().double().sum()) + float(p.detach().double().abs().sum()) * 1e-3
                for p in model.parameters())
    sums = gather(s)
    if any(x != sums[0] for x in sums):
        raise ValueError(f"torchrun: the ranks built different initial weights (checksums {sums}); every rank "
                         "must load the same model with the same train.seed (a model object passed to the "
                         "Trainer must be built identically on every rank)")

"""Data parallelism under torchrun (docs/design.md §6c): the process group, and the split of every step's
global batch over the ranks behind one object, so that the trainer's step reads the same in one
process and under torchrun.

    torchrun --nproc_per_node 8 -m backstream train run.toml                      one node, 8 GPUs
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_id JOB \\
             --rdzv_backend c10d --rdzv_endpoint HOST:29500 -m backstream train run.toml   on each node

`start(...)` returns a `DataParallel`: in a plain process the one-process object, whose every method
is the identity (this process samples and trains the whole batch, gathers return [x]); under
torchrun a `Torchrun`, which gives the update one process would give on the same global batch:
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
  and FSDP's gradient reduction is a SUM over ranks (`fsdp.shard`): Σ_ranks ∇(global-normalised
  local loss) = ∇(the single-process loss);
- the gradient norm of `clip_grad_norm` is the global one (`fsdp.grad_norm`), so clipping and the
  non-finite guard agree on every rank.
Parameters are gathered once around each phase that runs forwards only (`fsdp.gathered`) and once
per engine call (`fsdp.FSDPCall`), so FSDP's per-layer resharding never applies (no
`reshard_after_forward` key).

Rank 0 alone writes the run folder (lock, config.toml, metrics.jsonl, progress); checkpoints are
written by every rank together (checkpoint.save: DCP shards + a Hugging Face export) and a run resumes
on any number of ranks. A rank that raises leaves the process group at once, and a rank killed
outright closes its connections, so the others stop with an error that says so (gloo: at once;
nccl: within `timeout_s`) instead of hanging; torchrun then ends the job.

Quantized layers (quant/linear.py) hold the Linear's own Parameters, so FSDP shards them with their
layer and the codes are computed from the gathered weights. The frozen KL reference policy of a full
fine-tune is sharded the same way (1/N of a copy per rank, gathered once per log-prob pass); with
LoRA it is the base model under the adapters. The MoE router load-balancing loss takes its routing
counts and N from the whole minibatch: one all-reduce inside the engine call (stream/router.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backstream.checks import UserError, at_least, literals
from backstream.log import log
from backstream.rl.records import Samples
from backstream.stream import fsdp

MIXED_PRECISION = {"none": False, "bf16": True}  # distributed.mixed_precision → forwards in bfloat16


@dataclass(kw_only=True)
class DistributedConfig:
    mixed_precision: Literal[tuple(MIXED_PRECISION)] = "none"
    """Under torchrun: "bf16" all-gathers parameters and runs forwards in bfloat16 while gradients are
    reduced in float32 (FSDP2's MixedPrecisionPolicy); "none" computes in model.dtype."""
    timeout_s: int = 1800
    """Under torchrun: seconds a collective may wait for the other ranks before this rank stops with an
    error (a rank that died or hangs); also the wait for every rank to join at start, and for rank 0
    to start the vLLM server (rollout.backend = "vllm": at least vllm.start_timeout_s)."""

    def __post_init__(self):
        literals(self, "distributed")
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
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s),
                                device_id=torch.device("cuda", torch.cuda.current_device())
                                if backend == "nccl" else None)
    except Exception as e:
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


# -- the global batch, split by whole groups -----------------------------------------------------


def rank_groups(n_groups: int, parts: int, world_size: int, r: int) -> list[int]:
    """The group indices (of a batch of `n_groups` groups cut into `parts` contiguous minibatches)
    that rank r trains: of every minibatch its r-th of `world_size` contiguous slices, in order, so
    that the rank's own minibatch m lies inside the global minibatch m."""
    if n_groups % (parts * world_size):
        raise UserError(f"train.prompts_per_step: {n_groups} prompt groups do not split into {parts} "
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
            raise UserError(f"round_share: held has {len(held)} counts for {world_size} ranks")
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


# -- the object the trainer holds ----------------------------------------------------------------


def minibatches(n_groups: int, n: int, group_size: int) -> list[list[int]]:
    """The sample rows of `n` group-aligned minibatches of equal size, in order."""
    assert n_groups % n == 0, (n_groups, n)  # RunConfig.validate: minibatches divides prompts_per_step
    rows = n_groups // n * group_size
    return [list(range(m * rows, (m + 1) * rows)) for m in range(n)]


def take(xs: list | None, rows: list[int]) -> list | None:
    """The entries `rows` of a per-sample list (None stays None)."""
    return None if xs is None else [xs[i] for i in rows]


@dataclass
class UpdatePlan:
    """How this process trains a step's batch: `mine`, its sample rows in the batch; per minibatch,
    `batch_rows` (the global minibatch's rows: its normalisers count them all), `own` (this process's
    rows of it, in the batch) and `local` (the same rows as positions in `mine`). One process: every
    row is its own."""

    mine: list[int]
    batch_rows: list[list[int]]
    own: list[list[int]]
    local: list[list[int]]

    def over(self, rows_of: list[list[int]]) -> UpdatePlan:
        """The same plan over sequences, where sample r trains the sequences `rows_of[r]` (a sample with
        forks: rl/records.py `TrainingRows`)."""
        def expand(rows):
            return [s for r in rows for s in rows_of[r]]

        mine, own = expand(self.mine), [expand(rows) for rows in self.own]
        at = {s: k for k, s in enumerate(mine)}
        return UpdatePlan(mine=mine, batch_rows=[expand(rows) for rows in self.batch_rows], own=own,
                          local=[[at[s] for s in rows] for rows in own])


class DataParallel:
    """One process: it samples and trains the whole batch, and every method is the identity. The
    trainer calls the same methods under torchrun (`Torchrun`), where they split and gather."""

    world, rank, main = 1, 0, True

    def __init__(self, seed: int = 0):
        self.seed = seed  # train.seed: the groups' generators are drawn from it (`generator`)

    # set-up, the run folder, failures
    def prepare(self, model: nn.Module, ref: nn.Module | None) -> None:
        """Shard the policy (and the frozen KL reference) over the ranks."""

    def on_main(self, fn):
        """fn() on rank 0 (its result there, None elsewhere); its error stops every rank."""
        return fn()

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        return obj

    def gather(self, obj) -> list:
        """Every rank's `obj`, by rank."""
        return [obj]

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on some rank (a signal may reach one rank only)."""
        return flag

    def fail_together(self, error: BaseException | None) -> None:
        """After a phase every rank ran on its own: an error of some rank raised on every rank (its own
        first); nothing when none failed."""
        if error is not None:
            raise error

    def check_shared(self, run_dir: str, marker: str) -> None:
        """Every rank must see the run folder rank 0 claimed."""

    def guard(self, what: str):
        """A collective failing during `what` becomes an error that says another rank failed."""
        return contextlib.nullcontext()

    def failed(self, error: BaseException) -> None:
        """This rank stops on `error`: say so now and leave the group, so the others stop too."""

    # the step's batch
    def begin_step(self) -> None:
        """A new step: no group kept yet."""

    def round_groups(self, need: int, refill: bool) -> list[int]:
        """The groups (indices in a rollout round of `need` prompt groups) this rank samples."""
        return list(range(need))

    def position_groups(self, first: int, need: int) -> list[int]:
        """The groups (indices in a round of `need` groups from stream position `first`) this rank
        samples when groups are assigned by position (an asynchronous source, which starts them before
        it knows the rounds): those at positions it `owns`."""
        return [j for j in range(need) if self.owns(first + j)]

    def owns(self, position: int) -> bool:
        """Whether this rank samples the group at `position` of the stream (an asynchronous source's
        split: strided over the ranks)."""
        return True

    def generator(self, position: int) -> torch.Generator:
        """The generator of the group at `position` of the prompt stream (`group_generator`): what a group
        samples depends on its position alone, not on the rounds before it, their sizes or their order
        (an asynchronous rollout source samples groups concurrently; a resumed run re-samples a group
        thrown away in flight with the same seed)."""
        return group_generator(self.seed, position)

    def join_round(self, rollout: Samples, total: Tensor, per_fn: dict[str, Tensor]):
        """Every rank's samples of the round (K/V only for this rank's) and their rewards, in the
        round's order: (rollout, total reward [N], per reward function [N])."""
        return rollout, total, per_fn

    def kept(self, groups: list[int]) -> None:
        """DAPO dynamic sampling kept these groups of the last round for the update."""

    def share(self, n: int) -> list[int]:
        """This rank's share of n independent items (evaluation prompts): strided over the ranks."""
        return list(range(self.rank, n, self.world))

    def train_groups(self, n_groups: int, kv: list | None) -> list[int]:
        """The groups of the step's batch this rank trains (`kv`: the batch's per-sample K/V, None
        where this rank does not hold them)."""
        return list(range(n_groups))

    def plan_update(self, n_groups: int, n_minibatches: int, group_size: int, kv: list | None) -> UpdatePlan:
        """This process's share of the update's group-aligned minibatches (`UpdatePlan`)."""
        glob = minibatches(n_groups, n_minibatches, group_size)
        mine = [g * group_size + i for g in self.train_groups(n_groups, kv) for i in range(group_size)]
        owned, at = set(mine), {r: k for k, r in enumerate(mine)}
        own = [[r for r in rows if r in owned] for rows in glob]
        return UpdatePlan(mine=mine, batch_rows=glob, own=own, local=[[at[r] for r in rows] for rows in own])

    def gather_rows(self, rows: list[int], values: list, n: int) -> list:
        """Per-sample `values` of this rank's `rows`, gathered from every rank (`gather`) into the order of
        the n-sample batch."""
        out = [None] * n
        for part_rows, part in self.gather((rows, values)):
            for r, v in zip(part_rows, part):
                out[r] = v
        return out


class Torchrun(DataParallel):
    """One rank of a torchrun job (see the module docstring); `init` has started the process group."""

    def __init__(self, cfg: DistributedConfig, *, device: torch.device, seed: int, minibatches: int,
                 reuse_kv: bool, world_size: int | None = None,
                 this_rank: int | None = None):
        """`world_size`/`this_rank`: the process group's unless given (tests of the split policy)."""
        super().__init__(seed)
        self.cfg, self.device, self.seed, self.minibatches = cfg, device, seed, minibatches
        self.reuse_kv = reuse_kv  # a rank trains the groups it sampled: it holds their K/V
        self.world = world() if world_size is None else world_size
        self.rank = rank() if this_rank is None else this_rank
        self.main = self.rank == 0
        self.held = [0] * self.world
        self.groups: list[int] = []  # this rank's groups of the current round
        self.owner: list[int] = []  # the rank that sampled each group of the current round

    def prepare(self, model, ref) -> None:
        check_same_weights(model)
        bf16 = MIXED_PRECISION[self.cfg.mixed_precision]
        fsdp.shard(model, self.device, bf16)
        if ref is not None:  # 1/N of a copy per rank, gathered per log-prob pass
            fsdp.shard(ref, self.device, bf16)

    def on_main(self, fn):
        return on_main(fn)

    def broadcast(self, obj):
        return broadcast(obj)

    def gather(self, obj) -> list:
        return gather(obj)

    def any(self, flag: bool) -> bool:
        return any_rank(flag)

    def fail_together(self, error: BaseException | None) -> None:
        fail_together(error)

    def check_shared(self, run_dir: str, marker: str) -> None:
        check_shared(run_dir, marker)

    def guard(self, what: str):
        return clear_failures(what, self.cfg.timeout_s)

    def failed(self, error: BaseException) -> None:
        # torchrun ends this process soon after a rank failed: say why now, while the trainer's
        # SIGTERM handler still holds, not only when the exception reaches the top
        log.info(f"rank {self.rank}: {type(error).__name__}: {error}", extra={"every_rank": True})
        abandon()  # the other ranks' collectives fail now rather than at the timeout

    def begin_step(self) -> None:
        self.held = [0] * self.world

    def round_groups(self, need: int, refill: bool) -> list[int]:
        held = self.held if self.reuse_kv and refill else None
        self.groups = round_share(need, self.minibatches, self.world, self.rank, held)
        return self.groups

    def position_groups(self, first: int, need: int) -> list[int]:
        self.groups = super().position_groups(first, need)
        return self.groups

    def owns(self, position: int) -> bool:
        return position % self.world == self.rank

    def join_round(self, rollout, total, per_fn):
        # K/V stay where they were computed; an episode's messages and environment served this rank's
        # reward functions: its counts alone travel
        episodes = None if rollout.episodes is None else [e.light() for e in rollout.episodes]
        light = dataclasses.replace(rollout, kv=None, episodes=episodes)
        return self.join(self.gather((self.groups, light, total, per_fn)), rollout.kv)

    def join(self, parts: list[tuple], kv: list | None):
        """`join_round` once every rank's (groups, rollout without K/V, total, per_fn) is here; `kv`:
        this rank's K/V of its own samples (None without engine.reuse_rollout_kv)."""
        group_size = parts[self.rank][1].group_size
        # this rank's samples keep their K/V (engine.reuse_rollout_kv); the others' are not here
        joined = Samples.concat([p if kv is None else
                                 dataclasses.replace(p, kv=kv if k == self.rank else [None] * len(p))
                                 for k, (_, p, _, _) in enumerate(parts)])
        need = sum(len(groups) for groups, *_ in parts)
        offsets = [0]
        for _, p, _, _ in parts:
            offsets.append(offsets[-1] + len(p) // group_size)
        where = {j: offsets[k] + g for k, (groups, *_) in enumerate(parts) for g, j in enumerate(groups)}
        owner = {j: k for k, (groups, *_) in enumerate(parts) for j in groups}
        self.owner = [owner[j] for j in range(need)]
        order = [where[j] for j in range(need)]  # the round's order
        rows = torch.tensor(joined.group_rows(order), dtype=torch.long)
        total = torch.cat([t for _, _, t, _ in parts])[rows]
        keys = dict.fromkeys(key for *_, fns in parts for key in fns)  # a rank that sampled nothing has none
        per_fn = {key: torch.cat([fns.get(key, torch.zeros(len(p))) for _, p, _, fns in parts])[rows] for key in keys}
        return joined.select(order), total, per_fn

    def kept(self, groups: list[int]) -> None:
        if self.reuse_kv:
            for g in groups:
                self.held[self.owner[g]] += 1

    def train_groups(self, n_groups: int, kv: list | None) -> list[int]:
        if kv is not None:
            # the groups whose K/V this rank holds: those it sampled (an even split by `round_groups`,
            # also after DAPO refills, which go to the ranks that keep the fewest)
            G = len(kv) // n_groups
            return [g for g in range(n_groups) if kv[g * G] is not None]
        return rank_groups(n_groups, self.minibatches, self.world, self.rank)



def start(cfg: DistributedConfig, *, device: torch.device, seed: int, minibatches: int,
          reuse_kv: bool) -> DataParallel:
    """The data parallelism of this process: `Torchrun` when torchrun started it (the process group is
    joined here), the one-process `DataParallel` otherwise."""
    if not init(cfg, device):
        return DataParallel(seed)
    return Torchrun(cfg, device=device, seed=seed, minibatches=minibatches, reuse_kv=reuse_kv)


def check_same_weights(model: nn.Module) -> None:
    """Every rank must start from the same weights (FSDP shards each rank's own copy, it does not
    broadcast): compare a checksum before sharding."""
    with torch.no_grad():
        s = sum(float(p.detach().double().sum()) + float(p.detach().double().abs().sum()) * 1e-3
                for p in model.parameters())
    sums = gather(s)
    if any(x != sums[0] for x in sums):
        raise UserError(f"torchrun: the ranks built different initial weights (checksums {sums}); every rank "
                         "must load the same model with the same train.seed (a model object passed to the "
                         "Trainer must be built identically on every rank)")

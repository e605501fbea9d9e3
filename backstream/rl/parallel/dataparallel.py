"""`[distributed]` and the object the run holds (`start`): `DataParallel` in one process, whose every
method is the identity, or `Torchrun` on one rank of a torchrun job, which splits and gathers."""


from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from backstream.checks import UserError, at_least, literals
from backstream.log import log
from backstream.rl.parallel.collectives import (
    abandon,
    any_rank,
    broadcast,
    check_shared,
    clear_failures,
    fail_together,
    gather,
    init,
    on_main,
    rank,
    world,
)
from backstream.rl.parallel.placement import UpdatePlan, group_generator, minibatches, rank_groups, round_share
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
    if not init(cfg.timeout_s, device):
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

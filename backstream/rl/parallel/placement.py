"""The global batch split by whole prompt groups (a token tree never spans ranks): which groups of a round
each rank samples and of a minibatch each rank trains, each group's generator by its stream position
alone, and `UpdatePlan`, a process's share of an update's minibatches."""


from __future__ import annotations

from dataclasses import dataclass

import torch

from backstream.checks import UserError


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

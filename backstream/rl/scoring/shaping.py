"""Between the rewards and the advantages: DAPO's overlong handling (`reward.overlong`, one function
per mode in `OVERLONG`) and its dynamic sampling's test of which groups carry a signal.

  none     every sample keeps its reward and its loss
  filter   a sample cut at rollout.max_new_tokens gets no loss (its reward still counts in its group)
  penalty  a linear penalty over the last `overlong_buffer` tokens before max_new_tokens, −1 at the limit
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from backstream.rl.records import Samples


def _none(rollout: Samples, rewards: Tensor, max_new: int, buffer: int) -> tuple[Tensor, Tensor]:
    return rewards, torch.ones(len(rewards), dtype=torch.bool)


def _filter(rollout: Samples, rewards: Tensor, max_new: int, buffer: int) -> tuple[Tensor, Tensor]:
    return rewards, torch.tensor([r != "length" for r in rollout.finish_reason], dtype=torch.bool)


def _penalty(rollout: Samples, rewards: Tensor, max_new: int, buffer: int) -> tuple[Tensor, Tensor]:
    lens = torch.tensor(rollout.sampled_tokens(), dtype=torch.float32)
    start = max_new - buffer
    shaped = rewards + torch.clamp((start - lens) / max(buffer, 1), min=-1.0, max=0.0)
    return shaped, torch.ones(len(rewards), dtype=torch.bool)


# reward.overlong → (samples, rewards [N], max_new_tokens, overlong_buffer) → (rewards, keep [N] bool)
OVERLONG: dict[str, Callable[[Samples, Tensor, int, int], tuple[Tensor, Tensor]]] = {
    "none": _none, "filter": _filter, "penalty": _penalty}


def informative_groups(rewards: Tensor, group_size: int) -> list[int]:
    """The groups whose rewards are not all equal (DAPO dynamic sampling): the others have zero
    advantage on every sample, so they would cost a backward and teach nothing."""
    G = group_size
    return [g for g in range(len(rewards) // G) if rewards[g * G:(g + 1) * G].std() > 0]


def overlong_shaping(rollout: Samples, rewards: Tensor, reward, max_new: int) -> tuple[Tensor, Tensor]:
    """`reward.overlong`'s shaping ([reward] `reward`; `max_new`: rollout.max_new_tokens): (shaped rewards
    [N], keep [N]: which samples get a loss)."""
    return OVERLONG[reward.overlong](rollout, rewards, max_new, reward.overlong_buffer)

"""`[algorithm]`: how a group's rewards become advantages. The estimators are per sample, from the rewards
of its group (the G samples of one prompt, contiguous); `ADVANTAGES` is the registry
`algorithm.advantage` names.

  GRPO      A_i = (r_i − mean_g r) / (std_g r + ε)   (unbiased std, as TRL; ε = algorithm.eps)
  Dr.GRPO   A_i =  r_i − mean_g r                      (Liu et al. 2025: no std)
  RLOO      A_i =  r_i − mean_{j≠i} r_j                (leave-one-out baseline)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from backstream.checks import UserError, literals


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if group_size < 1 or rewards.numel() % group_size:
        raise UserError(f"group_size: {group_size} does not divide the {rewards.numel()} rewards")
    return rewards.double().view(-1, group_size)


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, scale: bool = True) -> Tensor:
    r = _groups(rewards, group_size)
    a = r - r.mean(1, keepdim=True)
    if scale:
        a = a / (r.std(1, keepdim=True) + eps)  # unbiased std, as TRL
    return a.flatten().float()


def drgrpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    return grpo_advantages(rewards, group_size, scale=False)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    if group_size < 2:
        raise UserError(f"group_size: RLOO needs at least 2 samples per group, got {group_size}")
    r = _groups(rewards, group_size)
    baseline = (r.sum(1, keepdim=True) - r) / (group_size - 1)
    return (r - baseline).flatten().float()


def format_hint(tokenizer, data_format: str, reward_functions: list[str]) -> str:
    """The likely cause of rewards that never differ, when the set-up suggests one: a chat model scored
    on whole completions (it answers in sentences, which exact_match scores 0)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return ""
    if data_format == "plain" or "exact_match" in reward_functions:
        return ("The model has a chat template: if it answers in sentences, a reward that reads the whole completion "
                "(exact_match) scores every sample 0. For a built-in task set data.format = \"chat\" (the question "
                "through the chat template, scored by the \"answer\" reward, which reads the answer from the "
                "response); for your own data use reward.functions = [\"answer\"] or a function of your own")
    return ""


ADVANTAGES: dict[str, Callable[[Tensor, int], Tensor]] = {
    "grpo": grpo_advantages, "drgrpo": drgrpo_advantages, "rloo": rloo_advantages}


@dataclass(kw_only=True)
class AlgorithmConfig:
    advantage: Literal[tuple(ADVANTAGES)] = "grpo"
    """Advantage estimator: grpo (group mean/std), drgrpo (group mean, no std), rloo (leave-one-out)."""
    eps: float = 1e-6
    """ε of grpo's A = (r − mean) / (std + ε), which keeps a group whose rewards barely differ finite; TRL's
    GRPOTrainer uses 1e-4 (at a group std of 1e-3 the two differ by 10% in A)."""

    def __post_init__(self):
        literals(self, "algorithm")
        if not (isinstance(self.eps, (int, float)) and not isinstance(self.eps, bool) and self.eps > 0):
            raise UserError(f"algorithm.eps: got {self.eps!r}, expected a number > 0 (e.g. 1e-6, or TRL's 1e-4): "
                             "a group whose rewards are all equal has std 0")

    def advantages(self, rewards: Tensor, group_size: int) -> Tensor:
        """Per-sample advantages of `rewards` [N], groups of `group_size` contiguous samples."""
        if self.advantage == "grpo":
            return grpo_advantages(rewards, group_size, eps=self.eps)
        return ADVANTAGES[self.advantage](rewards, group_size)


class ZeroAdvantageWatch:
    """`STEPS` steps in a row on which every advantage was 0 learn nothing: `saw` says when to warn
    (once), with `hint`, the likely cause the run's set-up suggests (`format_hint`), and, when every
    sample of those steps ran to rollout.max_new_tokens, that the model never stopped (a base model on
    text it continues past the answer)."""

    STEPS = 5

    def __init__(self, hint: str = ""):
        self.in_a_row, self.cut_in_a_row, self.warning, self.hint = 0, 0, "", hint

    def saw(self, all_zero: bool, step: int, all_cut: bool = False) -> bool:
        """`all_zero`: every advantage of the step was 0; `all_cut`: every sample ran to the token limit."""
        self.in_a_row = self.in_a_row + 1 if all_zero else 0
        self.cut_in_a_row = self.cut_in_a_row + 1 if all_zero and all_cut else 0
        first = step - self.STEPS + 1
        never = ("; every sample of those steps ran to rollout.max_new_tokens: the model never stopped: set "
                 "rollout.stop (e.g. [\"\\n\"] for one-line answers) or use a model with a chat template "
                 "(data.format = \"chat\")") if self.cut_in_a_row >= self.STEPS else ""
        self.warning = (f"steps {first}-{step} had every advantage 0: within each group every "
                        "sample got the same reward, so nothing is learned" + never + ". Check that the reward "
                        "functions tell samples apart (reward/<function> in metrics.jsonl), raise "
                        "rollout.temperature or rollout.group_size, or set rollout.dynamic_sampling = true to "
                        "replace the groups without signal" + (f". {self.hint}" if self.hint else ""))
        return self.in_a_row == self.STEPS

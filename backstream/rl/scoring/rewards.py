"""`[reward]` and `Rewards`, the step between the rollout and the advantages (docs/design.md §1).

A reward function has TRL's signature, so functions written for TRL's GRPOTrainer work unchanged:

    f(completions, **kwargs) -> list[float]

with, per sample, as TRL passes them (its "Using a custom reward function" documentation):
- `prompts` and `completions` in the dataset's format: plain text prompts give strings (TRL's
  *standard* format); chat prompts (a list of {"role", "content"} messages) give the prompt's message
  list and the completion as a list of messages, `[{"role": "assistant", "content": text}]` (TRL's
  *conversational* format);
- `completion_ids`: the completion's token ids (a list of ints; also under this project's older name
  `completions_ids`);
- `trainer_state`: an object with `global_step` (steps done) and `max_steps`;
- `log_metric(name, value)`: a number the step's metrics line gets as `reward_log/<name>` (the mean of
  what the step logged under that name), and `log_extra(column, values)`: a column with one value per
  sample, written beside the episodes in `episodes.jsonl` (`train.log_episodes`);
- with an environment (`[env]`): `environments`, each episode's environment (TRL's names);
- every other dataset column (e.g. `answer`), one entry per sample.
A function without `**kwargs` is given only the arguments it names. It may return a list or tuple of
numbers, a 1-D numpy array or tensor, or `None` for a sample it does not apply to (TRL's multi-task
functions): a sample's total is the weighted sum over the functions that scored it, and a sample no
function scores stops the step. `async def` functions are awaited.

`Rewards` calls each function once per step on the whole batch and returns the weighted sum. A reward
that raises, returns the wrong number of values, a non-number or a NaN stops the step: a silent 0 or
NaN would turn into advantages, and then into an update, before anyone noticed.

Built-ins (rl/scoring/builtin.py): `exact_match`, `answer`, `math` (Math-Verify), `format_reward(pattern)`,
`env`, and a reward model (rl/scoring/reward_model.py); each reads either format (rl/scoring/answers.py).
`builtin.load_reward(spec)` turns the strings of a run file into functions (`SPEC_FORMS`).
"""

from __future__ import annotations

import copy
import functools
import math as _math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from backstream import usercode
from backstream.checks import UserError, at_least, literals
from backstream.log import log
from backstream.rl.scoring.answers import text_of
from backstream.rl.scoring.builtin import RewardFn, load_reward, spec_form, spec_name
from backstream.rl.scoring.shaping import OVERLONG

# the arguments a reward function gets beside the dataset's columns (a column may not take their names)
RESERVED = ("completions", "prompts", "completion_ids", "completions_ids", "trainer_state", "environments",
            "log_metric", "log_extra")


class RewardLog:
    """What reward functions log during a step through TRL's `log_metric(name, value)` (numbers: the
    step's line gets their mean as `reward_log/<name>`) and `log_extra(column, values)` (one value per
    sample: a column beside the episodes in episodes.jsonl)."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}

    def metric(self, name: str, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"log_metric({name!r}, {value!r}): the value must be a number")
        self.metrics.setdefault(str(name), []).append(float(value))

    def extra(self, column: str, values: list, n: int) -> None:
        values = list(values)
        if len(values) != n:
            raise RewardError(f"log_extra({column!r}, ...): {len(values)} values for {n} samples; give one per sample")
        self.columns[str(column)] = values

    def means(self) -> dict[str, float]:
        return {f"reward_log/{k}": sum(v) / len(v) for k, v in self.metrics.items()}


class RewardError(UserError):
    """A reward function failed or returned something unusable; the step cannot go on."""


@dataclass(frozen=True)
class TrainerState:
    """What TRL's `trainer_state` offers a reward function that this trainer has: the steps done and
    the run's length (for curricula)."""

    global_step: int = 0
    max_steps: int = 0


def with_env_reward(functions: list[tuple[RewardFn | str, float]], environment) -> list[tuple[RewardFn | str, float]]:
    """TRL's habit: an environment's `get_reward` is a reward. When the environment has one and the
    functions do not name 'env', it is added with weight 1, and a line says so (name 'env' in
    reward.functions to weight it, with weight 0 to leave it out). Naming 'env' for an environment
    without `get_reward` is refused."""
    named = any(f == "env" for f, _ in functions)
    if environment is None:
        if named:
            raise UserError("reward.functions: 'env' scores an episode with its environment's get_reward, but the "
                             "run has no environment ([env] factory)")
        return functions
    if named and not environment.has_reward:
        raise UserError(f"reward.functions: 'env' reads get_reward(), but {environment.name} has none; add one or "
                         "remove 'env'")
    if environment.has_reward and not named:
        source = getattr(environment, "reward_source", f"{environment.name}.get_reward()")
        log.info(f"reward: {source} is the reward 'env' with weight 1, as in TRL (name 'env' "
                 "in reward.functions to weight it; weight 0 leaves it out)")
        return [*functions, ("env", 1.0)]
    return functions


@dataclass(kw_only=True)
class RewardConfig:
    """Which reward functions a run uses and how they combine; `build()` gives `Rewards`."""

    functions: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward specs, each one of: 'exact_match', 'answer' (the answer of a chat response: "####",
    \\boxed{}, an "Answer:" line or its last number), 'math', 'format:<regex>',
    'package.module:function', 'path/to/file.py:function', 'reward_model:<local folder>'."""
    weights: list[float] | None = None
    """Weight of each function in the total reward, in the order of `functions`; None = all 1.0."""
    timeout_s: float | None = None
    """Seconds one call of one reward function may take before the step stops; None = no limit."""
    overlong: Literal[tuple(OVERLONG)] = "none"
    """Completions cut at rollout.max_new_tokens: none, filter (no loss), or penalty (DAPO's soft penalty)."""
    overlong_buffer: int = 16
    """Length of the soft-penalty ramp before rollout.max_new_tokens (penalty mode)."""

    def __post_init__(self) -> None:
        literals(self, "reward")
        at_least("reward.overlong_buffer", self.overlong_buffer, 1)
        if not isinstance(self.functions, (list, tuple)) or not self.functions:
            raise UserError(
                f"reward functions={self.functions!r}: give a non-empty list of specs, "
                f"e.g. functions=['exact_match']"
            )
        for spec in self.functions:
            if not isinstance(spec, str):
                raise UserError(f"reward functions entry {spec!r}: must be a string spec")
            try:
                spec_form(spec)
            except ValueError as e:
                raise UserError(f"reward functions entry {spec!r}: {e}") from None
        self.functions = list(self.functions)
        if self.weights is not None:
            if not isinstance(self.weights, (list, tuple)):
                raise UserError(
                    f"reward weights={self.weights!r}: give a list with one weight per function"
                )
            if len(self.weights) != len(self.functions):
                raise UserError(
                    f"reward weights={self.weights!r}: {len(self.weights)} weights for "
                    f"{len(self.functions)} functions; give one weight per function, or omit "
                    f"weights for all 1.0"
                )
            for w in self.weights:
                if isinstance(w, bool) or not isinstance(w, numbers.Real) or not _math.isfinite(w):
                    raise UserError(
                        f"reward weights={self.weights!r}: {w!r} is not a finite number"
                    )
            self.weights = [float(w) for w in self.weights]
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, numbers.Real) or t <= 0):
            raise UserError(
                f"reward timeout_s={self.timeout_s!r}: must be a positive number of seconds, "
                f"or None for no limit"
            )

    def build(self) -> Rewards:
        return Rewards(self)


# ---------------------------------------------------------------------------------------------
# Combining rewards


def _name_of(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


_NO_ENV = object()  # Rewards built without saying whether there is an environment: 'env' taken as it is


class Rewards:
    """A weighted sum of reward functions, validated sample by sample.

    Rewards(RewardConfig(...)) or Rewards([(fn_or_spec, weight), ...], timeout_s=None). `environment`:
    the run's `Environment` or None (a trainer's: its `get_reward` is added, see `with_env_reward`).
    """

    def __init__(
        self,
        functions: RewardConfig | Sequence[tuple[RewardFn | str, float]],
        *,
        timeout_s: float | None = None,
        environment=_NO_ENV,
    ):
        if isinstance(functions, RewardConfig):
            cfg = functions
            weights = cfg.weights or [1.0] * len(cfg.functions)
            functions, timeout_s = list(zip(cfg.functions, weights)), cfg.timeout_s
        functions = with_env_reward(list(functions), environment) if environment is not _NO_ENV else functions
        if timeout_s is not None and timeout_s <= 0:
            raise UserError(f"Rewards timeout_s={timeout_s!r}: must be positive, or None")
        self.functions: dict[str, RewardFn] = {}
        self.weights: dict[str, float] = {}
        for fn, weight in functions:
            name = spec_name(fn) if isinstance(fn, str) else _name_of(fn)
            fn = load_reward(fn) if isinstance(fn, str) else fn
            if not callable(fn):
                raise TypeError(f"reward function {name!r} is a {type(fn).__name__}, not callable")
            if name in self.functions:  # two format rewards, or two files' `correct`: keep both apart
                name = f"{name}#{len(self.functions)}"
            self.functions[name], self.weights[name] = fn, float(weight)
        if not self.functions:
            raise UserError("Rewards: give at least one reward function")
        self.timeout_s = timeout_s

    def __call__(
        self, completions: list, prompts: list, columns: dict[str, list], *,
        completion_ids: list[list[int]] | None = None, trainer_state: TrainerState | None = None,
        environments: list | None = None, log: RewardLog | None = None, completions_ids=None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total [N] float32 = Σ over the functions that scored a sample of weight·reward,
        {name: unweighted reward [N] float32, NaN where the function returned None}). `log` collects
        what the functions hand `log_metric` and `log_extra` (a fresh one per call when None)."""
        n = len(completions)
        ids = completion_ids if completion_ids is not None else completions_ids
        log = log if log is not None else RewardLog()
        if len(prompts) != n:
            raise UserError(f"Rewards: {len(prompts)} prompts for {n} completions")
        for key, values in columns.items():
            if key in RESERVED:
                raise UserError(f"Rewards: column {key!r} clashes with a reward argument")
            if len(values) != n:
                raise UserError(f"Rewards: column {key!r} has {len(values)} rows for {n} samples")
        if ids is not None and len(ids) != n:
            raise UserError(f"Rewards: {len(ids)} completion_ids for {n} completions")
        total = torch.zeros(n, dtype=torch.float64)
        scored = torch.zeros(n, dtype=torch.bool)
        per_function = {}
        for name, fn in self.functions.items():
            # fresh lists per function: one that mutates its inputs cannot affect the next
            kwargs = {"completions": copy.deepcopy(list(completions)), "prompts": copy.deepcopy(list(prompts))}
            if ids is not None:
                kwargs["completion_ids"] = [list(x) for x in ids]
                kwargs["completions_ids"] = kwargs["completion_ids"]
            kwargs |= {k: list(v) for k, v in columns.items()}
            if trainer_state is not None:
                kwargs["trainer_state"] = trainer_state
            if environments is not None:
                kwargs["environments"] = list(environments)
            kwargs["log_metric"], kwargs["log_extra"] = log.metric, functools.partial(log.extra, n=n)
            values = self._run(name, fn, kwargs, prompts)
            known = ~torch.isnan(values)
            total[known] += self.weights[name] * values[known]
            scored |= known
            per_function[name] = values.float()
        if n and not bool(scored.all()):
            i = int(torch.nonzero(~scored)[0])
            names = ", ".join(repr(k) for k in self.functions)
            raise RewardError(f"no reward function scored {_where(prompts, i)}: {names} returned None (NoneType) "
                              "for it (None means 'does not apply', as in TRL's multi-task functions; at least one "
                              "function must score every sample)")
        return total.float(), per_function

    def _invoke(self, name: str, fn: RewardFn, kwargs: dict) -> Any:
        try:
            return usercode.with_deadline(lambda: usercode.call(fn, kwargs=kwargs), self.timeout_s,
                                          f"reward:{name}")
        except TimeoutError:
            raise RewardError(f"reward function {name!r} did not return within timeout_s={self.timeout_s} "
                              f"for {len(kwargs['completions'])} samples") from None

    def _run(self, name: str, fn: RewardFn, kwargs: dict, prompts: list) -> torch.Tensor:
        n = len(prompts)
        params = usercode.params(fn) or []
        kwargs = usercode.named(fn, kwargs)  # TRL passes every argument; one without **kwargs gets what it names
        missing = [
            p.name
            for p in params
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in kwargs
        ]
        if missing:
            given = sorted(set(kwargs) - set(RESERVED))
            raise RewardError(f"reward function {name!r} needs column(s) {missing}, but the dataset gives {given}")
        try:
            values = self._invoke(name, fn, kwargs)
        except RewardError:
            raise
        except Exception as e:
            culprit = self._culprit(name, fn, kwargs, prompts)
            raise RewardError(
                f"reward function {name!r} raised {type(e).__name__}: {e}; {culprit}"
            ) from e
        values = _as_list(name, values, n)
        if len(values) != n:
            first_bad = min(len(values), n)
            raise RewardError(
                f"reward function {name!r} returned {len(values)} values for {n} samples "
                f"(first unmatched: sample {first_bad})"
            )
        for i, v in enumerate(values):
            if v is None:
                continue
            if not isinstance(v, numbers.Real):
                raise RewardError(
                    f"reward function {name!r} returned {v!r} ({type(v).__name__}) "
                    f"for {_where(prompts, i)}; expected a float"
                )
            if not _math.isfinite(v):
                raise RewardError(f"reward function {name!r} returned {v} for {_where(prompts, i)}")
        return torch.tensor([_math.nan if v is None else float(v) for v in values], dtype=torch.float64)

    def _culprit(self, name: str, fn: RewardFn, kwargs: dict, prompts: list) -> str:
        """Find the sample that makes `fn` raise by calling it on one sample at a time.

        Only on the failure path, which ends the step anyway; a function that only fails on the
        whole batch (e.g. one that normalises within it) gets no index."""
        for i in range(len(kwargs["completions"])):
            try:
                self._invoke(name, fn, {k: v[i : i + 1] if isinstance(v, list) else v for k, v in kwargs.items()})
            except Exception:  # noqa: BLE001  (looking for the sample that fails, whatever it raises)
                return f"called alone, {_where(prompts, i)} fails"
        return "no single sample fails when called alone"


def _where(prompts: list, i: int) -> str:
    return f"sample {i} (prompt {text_of(prompts[i])[:80]!r})"


def _as_list(name: str, values: Any, n: int) -> list:
    """A reward function's return as a list: a list or tuple, or a 1-D numpy array or tensor."""
    if isinstance(values, (list, tuple)):
        return list(values)
    if isinstance(values, torch.Tensor) or type(values).__module__ == "numpy":
        shape = tuple(values.shape)
        if len(shape) == 1:
            return values.tolist()
        raise RewardError(f"reward function {name!r} returned a {type(values).__name__} of shape {shape}; "
                          f"expected a list of {n} floats (or a 1-D array or tensor of {n})")
    raise RewardError(f"reward function {name!r} returned a {type(values).__name__}; expected a list of {n} floats")

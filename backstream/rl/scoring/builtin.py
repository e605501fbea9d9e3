"""The built-in reward functions (`exact_match`, `answer`, `math`, `format_reward(pattern)`, the reward
`env`: an episode's environment's get_reward) and the spec strings of a run file that name a reward
(`SPECS`: the built-ins, a reward model's folder, a function of a file or module), each read by
`load_reward` and named on the step's line by `spec_name`."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from backstream import usercode
from backstream.checks import UserError
from backstream.rl.scoring.answers import answers_equal, chat_answer, final_text
from backstream.rl.scoring.reward_model import RewardModel
from backstream.usercode import is_module_spec, is_path_spec, load_object

RewardFn = Callable[..., Sequence[float]]


def exact_match(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion's final answer equals the `answer` column, else 0.0.

    Both sides go through `final_answer`, so a GSM8K answer column ("... #### 72") works as is;
    numbers compare numerically ("72.0" == "72", "1,000" == "1000").
    """
    return [0.0 if (t := final_text(c)) is None else float(answers_equal(t, str(a)))
            for c, a in zip(completions, answer, strict=True)]


def answer(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the answer a chat response gives (`chat_answer`: "####", \\boxed{}, an "Answer:" line,
    else its last number) equals the `answer` column, else 0.0: a right answer inside a sentence
    counts. What the built-in tasks score a chat model with (data.format = "chat")."""
    return [0.0 if (t := final_text(c)) is None else float(answers_equal(chat_answer(t), str(a)))
            for c, a in zip(completions, answer, strict=True)]


def _import_math_verify():
    try:
        import math_verify  # noqa: PLC0415  (an optional extra: only for the math reward)
    except ImportError as e:
        raise ImportError(
            "the 'math' reward needs Math-Verify: pip install 'backstream[math]'"
        ) from e
    return math_verify


def math(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where Math-Verify finds the completion's answer (boxed, LaTeX, plain) equivalent to
    the `answer` column, else 0.0. A bare gold answer ("x^2+1") is retried inside $...$; one
    that still does not parse falls back to `exact_match` instead of scoring 0 forever."""
    mv = _import_math_verify()
    # Math-Verify's timeout uses signal.alarm, which only works in the main thread; in a worker
    # thread (Rewards' timeout_s) the caller's timeout takes over.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    rewards = []
    for completion, gold_text in zip(completions, answer, strict=True):
        completion = final_text(completion)
        if completion is None:  # no answer
            rewards.append(0.0)
            continue
        gold_text = str(gold_text).rsplit("####", 1)[-1].strip()
        gold = mv.parse(gold_text, parsing_timeout=timeout) or mv.parse(
            f"${gold_text}$", parsing_timeout=timeout
        )
        if not gold:
            rewards.append(float(answers_equal(completion, gold_text)))
            continue
        pred = mv.parse(completion, parsing_timeout=timeout)
        rewards.append(float(bool(pred) and mv.verify(gold, pred, timeout_seconds=timeout)))
    return rewards


def format_reward(pattern: str, flags: int = re.DOTALL) -> RewardFn:
    """A reward giving 1.0 to completions that match `pattern` in full (re.fullmatch), else 0.0."""
    regex = re.compile(pattern, flags)

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [float((t := final_text(c)) is not None and regex.fullmatch(t) is not None) for c in completions]

    reward.__name__ = f"format:{pattern}"
    return reward


# ---------------------------------------------------------------------------------------------
# Specs: the strings of a run file


def env_reward(environments: list, **kwargs: Any) -> list[float | None]:
    """The built-in reward `env`: each episode's environment scores it (`get_reward()`, TRL's
    contract, awaited when `async def`); 0 for an environment discarded after a timeout (its episode
    failed); None for one without `get_reward` (another function must score that sample)."""
    out = []
    for e in environments:
        if getattr(e, "discarded", False):
            out.append(0.0)
            continue
        fn = getattr(e, "get_reward", None)
        out.append(usercode.call(fn) if callable(fn) else None)
    return out


def _load_math(spec: str) -> RewardFn:
    _import_math_verify()  # fail when the run starts, not at the first reward
    return math


# The spec strings of a run file: (form shown to users, does a spec have this form, its function).
# The first form that matches decides.
SPECS: tuple[tuple[str, Callable[[str], bool], Callable[[str], RewardFn]], ...] = (
    ("exact_match", lambda s: s == "exact_match", lambda s: exact_match),
    ("answer", lambda s: s == "answer", lambda s: answer),
    ("math", lambda s: s == "math", _load_math),
    ("format:<regex>", lambda s: s.startswith("format:") and len(s) > len("format:"),
     lambda s: format_reward(s[len("format:"):])),
    ("reward_model:<local folder>", lambda s: s.startswith("reward_model:") and len(s) > len("reward_model:"),
     lambda s: RewardModel.from_pretrained(s[len("reward_model:"):])),
    ("env", lambda s: s == "env", lambda s: env_reward),
    ("path/to/file.py:function", is_path_spec, lambda s: load_object(s, "reward spec")),
    ("package.module:function", is_module_spec, lambda s: load_object(s, "reward spec")),
)
SPEC_FORMS = ", ".join(f"'{form}'" for form, _, _ in SPECS)


def spec_form(spec: str):
    """The entry of `SPECS` that `spec` has, without importing or loading anything."""
    for entry in SPECS:
        if entry[1](spec):
            return entry
    raise UserError(f"unknown reward spec {spec!r}; accepted forms: {SPEC_FORMS}")


def load_reward(spec: str) -> RewardFn:
    """Resolve a spec string (one of `SPEC_FORMS`) to a reward function."""
    return spec_form(spec)[2](spec)


def spec_name(spec: str) -> str:
    """The name a reward spec's metrics go under (`reward/<name>`): a file's or a module's function by
    its own name ("rewards.py:correct" → "correct"), "format:<regex>" → "format",
    "reward_model:<folder>" → "reward_model", the others as they are."""
    form = spec_form(spec)[0]
    if form.endswith(":function"):
        return spec.rsplit(":", 1)[1]
    return form.split(":", 1)[0] if ":<" in form else spec

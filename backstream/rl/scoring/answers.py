"""The answer a completion gives, in either of TRL's formats (text, or chat messages): the final text of a
completion, the answer after "####" or in the last \\boxed{}, a chat response's "Answer:" line or last
number, and whether two answers are equal (numbers numerically)."""

from __future__ import annotations

import math as _math
import re


def text_of(x) -> str:
    """The text of a prompt or completion in either of TRL's formats: a string as it is; a list of
    chat messages, the content of its last message (a completion's answer)."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and isinstance(x[-1], dict):
        return str(x[-1].get("content", ""))
    raise TypeError(f"expected text or a list of chat messages, got {type(x).__name__}")


def final_text(completion) -> str | None:
    """The policy's final answer in a completion: a string as it is; of chat messages, the content of
    the last message when it is the assistant's and calls no tool. None when there is no answer: an
    episode that ended on a tool call (at `env.max_turns`, or a timeout), on a tool result or a user
    message, or has no message. A turn cut by a token limit is an answer (its `finish_reason` says
    "length"), as a cut single-turn completion is."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        if not completion:
            return None
        last = completion[-1]
        if isinstance(last, dict) and last.get("role", "assistant") == "assistant" and not last.get("tool_calls"):
            return str(last.get("content") or "")
        if isinstance(last, dict):
            return None
    raise TypeError(f"expected text or a list of chat messages, got {type(completion).__name__}")


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`, braces matched (answers like `\\frac{1}{2}` nest)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None  # unclosed: the completion was cut off before the answer ended


def final_answer(text: str) -> str:
    """The text after the last '####' (GSM8K), else the last \\boxed{} content, else all of it."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = _last_boxed(text)
    return (boxed if boxed is not None else text).strip()


# no inf/nan/1_000, which float() would accept; commas are thousands separators ("1,000")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _as_number(text: str) -> float | None:
    text = text.replace(",", "").strip()
    return float(text) if _NUMBER.fullmatch(text) else None


def answers_equal(pred: str, gold: str) -> bool:
    pred, gold = final_answer(pred), final_answer(gold)
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return _math.isclose(a, b, rel_tol=1e-9)
    return pred == gold


_ANSWER_LINE = re.compile(r"^\s*\**answer\**\s*[:：]\s*\**\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


def chat_answer(text: str) -> str:
    """The answer a chat response gives: after its last "####", else its last \\boxed{}, else its last
    "Answer: …" line, else its last number ("The sum is 82." → "82"), else the whole text."""
    if "####" in text or _last_boxed(text) is not None:
        return final_answer(text)
    lines = _ANSWER_LINE.findall(text)
    if lines:
        return lines[-1].strip().strip("*").rstrip(".").strip()
    numbers = list(_NUMBER_IN_TEXT.finditer(text))
    return numbers[-1].group(0) if numbers else text.strip()


_NUMBER_IN_TEXT = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")

"""Environments for tests/test_episodes.py (imported by module name: `envs_for_tests:Calc`)."""

import time


class Calc:
    """A TRL-style environment: reset(**row), two tools, get_reward."""

    def reset(self, **row):
        self.calls, self.answer = 0, row.get("answer")
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls += 1
        return a + b

    def boom(self, x: int) -> int:
        """Raise, always.

        Args:
            x: Anything.
        """
        raise RuntimeError("the tool broke")

    def get_reward(self) -> float:
        return float(self.calls)


class Slow:
    def reset(self, **row):
        return " (slowly)"

    def wait(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "done"


class Game:
    """A text environment: no tools; `step(text)` answers each turn twice, then ends the episode."""

    def reset(self, **row):
        self.turns = 0
        return "?"

    def step(self, text):
        self.turns += 1
        return None if self.turns >= 3 else f"more {self.turns}"


class BadReset:
    def reset(self, **row):
        raise KeyError("no such level")


class Undocumented:
    def reset(self, **row):
        return None

    def helper(self, x):
        return x


def double(x: int) -> int:
    """Twice x.

    Args:
        x: A number.
    """
    return 2 * x

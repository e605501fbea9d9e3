"""Environments for tests/rl/agent/test_episodes.py (imported by module name: `envs_for_tests:Calc`)."""

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
    """A text environment: no tools; `env_response(text)` answers each turn twice, then ends the episode."""

    def reset(self, **row):
        self.turns = 0
        return "?"

    def env_response(self, text):
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


class IncrementEnv:
    """The environment of TRL's GRPOTrainer demo (reset takes no row, one tool), as TRL users write it."""

    def __init__(self):
        self._counter = 0

    def reset(self) -> None:
        self._counter = 0

    def increment(self, a: int) -> int:
        """
        Increment the integer by a specified value

        Args:
            a: The value to increment by

        Returns:
            The incremented integer.
        """
        self._counter += a
        return self._counter


class EchoLike:
    """TRL's OpenEnv echo example's shape: a tool named `step` (its parameter is not `text`), get_reward."""

    def reset(self, **kwargs) -> None:
        self._reward = 0.0

    def step(self, message: str) -> str:
        """
        Echo the message back from the environment.

        Args:
            message: The message to echo

        Returns:
            The echoed message.
        """
        self._reward = float(len(message))
        return message

    def get_reward(self) -> float:
        return self._reward


class Spin:
    """A tool that spins the CPU for ever, mutating the environment as it goes (issue 25: a thread kept
    it running after its timeout, and get_reward then read 4,287,085)."""

    def reset(self, **row):
        self.count = 0

    def spin(self, n: int) -> int:
        """Count up, for ever.

        Args:
            n: The step.
        """
        while True:
            self.count += n

    def get_reward(self) -> float:
        return float(self.count)


class SlowReset:
    def reset(self, **row):
        time.sleep(30)


class Big:
    """A tool whose result is 10 MB of text."""

    def reset(self, **row):
        return None

    def dump(self, n: int) -> str:
        """Dump.

        Args:
            n: How many megabytes.
        """
        return "x" * (n * 1_000_000)


class Point:
    def __init__(self, x):
        self.x = x

    def __str__(self):
        return f"Point({self.x})"


class TrlShapes:
    """What TRL documents and a thread-bound loop did not take: an async tool, an async get_reward,
    results that are neither text nor JSON (numpy scalars, custom objects); reset's text."""

    def reset(self, **row):
        self.total = 0
        return " [ready]"

    async def add(self, a: int, b: int) -> int:
        """Add, asynchronously.

        Args:
            a: The first number.
            b: The second number.
        """
        self.total = a + b
        return a + b

    def as_numpy(self, a: int) -> int:
        """A numpy integer.

        Args:
            a: The number.
        """
        import numpy as np

        return np.int64(a)

    def point(self, x: int) -> str:
        """A custom object.

        Args:
            x: The coordinate.
        """
        return Point(x)

    def step(self, text: str) -> str:
        """A tool named step (TRL's echo environment has one): a tool, not a hook.

        Args:
            text: What to echo.
        """
        return text

    async def get_reward(self) -> float:
        return float(self.total)


class OwnsItsData:
    """An environment that owns its data: rows carry only a level, reset returns the task."""

    def reset(self, level: int = 1, **row):
        self.level = level
        return f"{level}+{level}="

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    def get_reward(self) -> float:
        return float(self.level)


def _screen(k: int):
    """Screen k: a seeded 56 x 56 picture (the tiny VLM's size: 4 image tokens)."""
    import random

    from backstream.rl.data.shapes import draw

    return draw(random.Random(k))[0]


class Screens:
    """A screenshot environment (issue 54): tools that return images, alone, beside text, or broken."""

    def reset(self, **row):
        self.looked = 0
        return None

    def look(self, k: int):
        """The screen k.

        Args:
            k: Which screen.
        """
        self.looked += 1
        return _screen(k)

    def peek(self, k: int) -> dict:
        """Screen k and a caption.

        Args:
            k: Which screen.
        """
        return {"image": _screen(k), "text": f"screen {k}"}

    def broken(self, k: int) -> dict:
        """An image that does not decode.

        Args:
            k: Anything.
        """
        return {"image": b"not an image at all", "text": "x"}

    def get_reward(self) -> float:
        return float(self.looked)


class ScreensTalk:
    """A text environment whose next user message is a screenshot, twice (the text hook)."""

    def reset(self, **row):
        self.turns = 0
        return None

    def env_response(self, text: str):
        self.turns += 1
        return {"image": _screen(self.turns), "text": "again"} if self.turns <= 2 else None

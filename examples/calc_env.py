"""A TRL-style environment: the same class runs in TRL's GRPOTrainer (`environment_factory=CalcEnv`)
and in backstream (`[env] factory = "examples/calc_env.py:CalcEnv"`), one instance per episode.

Its public methods are the tools the model may call (transformers turns their type hints and
docstrings into the JSON schemas of the chat template's `tools=`); `reset(**row)` starts an episode
with the data row; `get_reward()` is read by the built-in reward "env"."""


class CalcEnv:
    def reset(self, **row) -> str | None:
        self.answer = str(row.get("answer", ""))
        self.calls = 0
        return None  # or text to append to the task's first user message

    def add(self, a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls += 1
        return a + b

    def multiply(self, a: float, b: float) -> float:
        """Multiply two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        """A small bonus for using a tool at all; correctness comes from the exact_match reward."""
        return 0.1 if self.calls else 0.0

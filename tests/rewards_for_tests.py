"""Reward functions with signal for a random model (tests only)."""


def count_ones(completions, **kwargs):
    """Fraction of the characters that are '1': varies across random samples, so advantages are nonzero."""
    return [c.count("1") / max(1, len(c)) for c in completions]


def count_digits(completions, **kwargs):
    """Fraction of digit characters: a denser signal than count_ones for short runs."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]

"""Rewards for the benchmarks."""


def char_overlap(completions, answer, **kwargs):
    """Fraction of the answer's characters matched position by position: partial credit, so a model
    that cannot yet solve kvlookup still gets advantages that differ within a group."""
    out = []
    for c, a in zip(completions, answer):
        c = c.strip()
        out.append(sum(x == y for x, y in zip(c, a)) / max(1, len(a)))
    return out

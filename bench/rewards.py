"""Rewards for the benchmarks."""


def char_overlap(completions, answer, **kwargs):
    """Fraction of the answer's characters matched position by position: partial credit, so a model
    that cannot yet solve kvlookup still gets advantages that differ within a group."""
    out = []
    for c, a in zip(completions, answer):
        c = c.strip()
        out.append(sum(x == y for x, y in zip(c, a)) / max(1, len(a)))
    return out


def text_hash(completions, **kwargs):
    """A number in [0, 1) from each completion's text (CRC-32): different completions get different
    rewards, so every group has advantages and the learner does all of its work. For the memory and
    time benches, where what is learned does not matter (bench_real --long)."""
    import zlib

    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [zlib.crc32(t.encode()) / 2**32 for t in texts]

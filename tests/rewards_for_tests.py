"""Reward functions with signal for a random model (tests only)."""


def count_ones(completions, **kwargs):
    """Fraction of the characters that are '1': varies across random samples, so advantages are nonzero."""
    return [c.count("1") / max(1, len(c)) for c in completions]


def count_digits(completions, **kwargs):
    """Fraction of digit characters: a denser signal than count_ones for short runs."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


SEEN: list[dict] = []


def record_columns(completions, prompts, **columns):
    """Records what the trainer passes (TRL's call: prompts, completions, completion_ids, trainer_state,
    log_metric, log_extra and the dataset's columns); rewards as count_digits on the completions' text."""
    SEEN.append({"prompts": list(prompts), "completions": list(completions),
                 **{k: v if k == "trainer_state" or callable(v) else list(v) for k, v in columns.items()}})
    return count_digits([c if isinstance(c, str) else c[-1]["content"] for c in completions])


FLAT_PROMPT = "1+1="


def flat_for_one_prompt(completions, prompts, **kwargs):
    """The same reward for every sample of FLAT_PROMPT (a group with no signal); for any other
    prompt, a different reward for each sample of its group (the row number)."""
    return [0.5 if p == FLAT_PROMPT else float(i) for i, p in enumerate(prompts)]


def constant(completions, **kwargs):
    """The same reward for every sample: every group advantage is 0, nothing is learned."""
    return [0.5] * len(completions)


def ones_in_turns(completions, **kwargs):
    """count_ones over an episode's turns (its assistant messages), or over a plain completion."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c if m["role"] == "assistant")
             for c in completions]
    return count_ones(texts)


def count_digits_any(completions, **kwargs):
    """count_digits over a completion's text, or over the contents of an episode's messages."""
    texts = [c if isinstance(c, str) else "".join(str(m.get("content") or "") for m in c) for c in completions]
    return count_digits(texts)


def hash_turns(completions, **kwargs):
    """A hash of an episode's turns (its assistant messages) in [0, 1): different turns, different
    rewards, so a group has advantages whatever the policy says."""
    import zlib

    return [zlib.crc32("".join(str(m.get("content") or "") for m in c if m["role"] == "assistant").encode()) / 2**32
            for c in completions]

"""A user reward function, called as in TRL: completions first, then `prompts` and every column of
the dataset as keyword arguments; one float per completion. Used as
`reward.functions = ["examples/my_reward.py:length_penalised_match"]`."""


def length_penalised_match(completions, prompts=None, answer=None, **columns):
    out = []
    for text, ans in zip(completions, answer or [None] * len(completions)):
        hit = ans is not None and str(ans).strip() in text
        out.append((1.0 if hit else 0.0) - 0.001 * len(text))
    return out


def prefix_credit(completions, answer, **columns):
    """Partial credit: the share of the answer that the completion gets right before its first
    wrong character (so a model that cannot solve a task yet still sees differences in a group)."""
    out = []
    for text, ans in zip(completions, answer):
        text, ans = text.strip(), str(ans)
        n = 0
        while n < min(len(text), len(ans)) and text[n] == ans[n]:
            n += 1
        out.append(n / max(1, len(ans)))
    return out

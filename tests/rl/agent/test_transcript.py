"""An agent's episode as branches (rl/agent/transcript.py): an agent that appends, rewrites its
history (strips earlier reasoning, as Qwen3's template does; summarises; edits a tool result) or
sends requests concurrently; every sampled token carries its loss exactly once, on a branch whose
tokens before it are exactly the context it was sampled in."""

import random

import pytest

from backstream.rl.agent.transcript import Transcript, common_prefix


def _check(t: Transcript, contexts: dict[int, list[int]]) -> None:
    seen = {}
    for b in t.branches:
        assert len(b.ids) == len(b.sampled) == len(b.logprobs) == len(b.versions)
        for pos, (tok, s) in enumerate(zip(b.ids, b.sampled)):
            if s:
                assert tok not in seen, "a sampled token is trained twice"
                seen[tok] = b.ids[:pos]
                assert b.logprobs[pos] == -tok / 1e5 and b.versions[pos] == 3
    assert seen == contexts  # every sampled token, in exactly the context it was sampled in


def _sample(t: Transcript, ids: list[int], counter: list[int], contexts: dict, n: int) -> list[int]:
    branch = t.request(ids)
    out = []
    for _ in range(n):
        counter[0] += 1
        tok = 100_000 + counter[0]  # unique: a sampled token is recognised wherever it lands
        contexts[tok] = ids + out
        out.append(tok)
    t.answer(branch, out, [-x / 1e5 for x in out], [3] * len(out))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_rewritten_histories_become_branches_and_each_sampled_token_is_trained_once(seed):
    rng = random.Random(seed)
    t, counter, contexts = Transcript(), [0], {}
    history = [rng.randrange(100) for _ in range(rng.randrange(1, 8))]  # the system + user prompt
    forks = 0
    for _ in range(rng.randrange(1, 7)):
        forks += not any(common_prefix(b.ids, history) == len(b.ids) for b in t.branches)
        answer = _sample(t, history, counter, contexts, rng.randrange(1, 6))
        kind = rng.choice(["append", "strip", "summarise", "edit"])
        if kind == "append":  # the usual turn: the answer as sent, then a tool result
            history = history + answer + [rng.randrange(100) for _ in range(rng.randrange(1, 4))]
        elif kind == "strip":  # the template drops the answer's reasoning (its first half)
            history = history + answer[len(answer) // 2:] + [rng.randrange(100)]
        elif kind == "summarise":  # the agent keeps the prompt's start and a summary
            history = history[:rng.randrange(1, len(history) + 1)] + [rng.randrange(100) for _ in range(3)]
        else:  # an earlier token edited
            history = history + answer
            history[rng.randrange(len(history))] = rng.randrange(100)
    _check(t, contexts)
    assert len(t.branches) == forks  # a branch per request that extended none, no more


def test_appending_agent_keeps_one_branch_and_a_rewrite_forks_at_the_first_difference():
    t, counter, contexts = Transcript(), [0], {}
    prompt = [1, 2, 3]
    a1 = _sample(t, prompt, counter, contexts, 3)
    a2 = _sample(t, prompt + a1 + [7, 8], counter, contexts, 2)  # appends: the same branch
    assert len(t.branches) == 1 and t.divergences() == 0
    assert t.branches[0].ids == prompt + a1 + [7, 8] + a2
    assert t.branches[0].sampled == [False] * 3 + [True] * 3 + [False] * 2 + [True] * 2
    # the template strips a1's first token (its "reasoning"): a new branch, all context before its answer
    rewritten = prompt + a1[1:] + [7, 8] + a2
    a3 = _sample(t, rewritten, counter, contexts, 2)
    assert t.divergences() == 1 and t.branches[1].ids == rewritten + a3
    assert t.branches[1].sampled == [False] * len(rewritten) + [True] * 2
    assert common_prefix(t.branches[0].ids, t.branches[1].ids) == 3  # the tree shares the prompt
    _check(t, contexts)


def test_concurrent_requests_on_one_branch_fork():
    t = Transcript()
    first = t.request([1, 2])
    second = t.request([1, 2, 5])  # the first answer is not in yet: it cannot extend that branch
    assert first != second and t.branches[second].ids == [1, 2, 5]
    t.answer(first, [9], [-0.1], [0])
    t.answer(second, [10], [-0.2], [0])
    third = t.request([1, 2, 9, 4])  # extends the first branch, now answered
    assert third == first and t.branches[first].ids == [1, 2, 9, 4]

"""What the agentic tests share: a chat template, the episode sampler on a tiny model, its episodes'
text and fields, and `scripted_turns`, the `script` fixture's body (tests/conftest.py)."""

import torch

from backstream.rl import rollout as R
from backstream.rl.agent import episodes as E
from backstream.rl.agent.env import EnvConfig
from backstream.rl.rollout import SamplingConfig

CHAT_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}</tools>\n"
    "{% endif %}{% for m in messages %}{% if m['role'] == 'assistant' %}<a>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}<eos>\n"
    "{% elif m['role'] == 'tool' %}<t>{{ m['content'] }}</t>\n{% else %}<u>{{ m['content'] }}</u>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


def scripted_turns(monkeypatch):
    """`script(turns)`: the next episodes' turns, forced (one list of texts per episode, in the order
    the sampler plays them: a task's first turns as one batch, then each episode to its end)."""
    real = E.decode
    state = {"queues": [], "next": 0}

    def scripted(model, cache, logits_BV, start, config, eos, tok, gen, keep_last, max_new=None):
        B = logits_BV.shape[0]
        qs = state["queues"]
        if B > 1 or not any(q for q in qs[: state["next"]]):
            rows = list(range(state["next"], state["next"] + B))  # a task's first turns
            state["next"] += B
        else:
            rows = [next(i for i, q in enumerate(qs[: state["next"]]) if q)]
        forced = [tok(qs[r].pop(0), add_special_tokens=False)["input_ids"] for r in rows]
        t = [0]

        def sample(logits, config, generator):
            toks = torch.tensor([f[min(t[0], len(f) - 1)] for f in forced], device=logits.device)
            t[0] += 1
            lp = torch.log_softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), -1)
            return toks, lp.gather(-1, toks[:, None])[:, 0]

        monkeypatch.setattr(R, "_sample", sample)
        try:
            return real(model, cache, logits_BV, start, config, eos, tok, gen, keep_last, max_new)
        finally:
            monkeypatch.undo()  # only _sample; the decode patch below is re-applied
            monkeypatch.setattr(E, "decode", scripted)

    monkeypatch.setattr(E, "decode", scripted)

    def add(turns):
        state["queues"] += [list(t) for t in turns]

    return add


def sampler(tok, env="envs_for_tests:Calc", G=2, max_new=24, **env_kw):
    return E.EpisodeSampler(SamplingConfig(group_size=G, max_new_tokens=max_new),
                            EnvConfig(factory=env, **env_kw), tok, [tok.eos_token_id], True, 256)


def sample(s, model, rows):
    return s.sample(model, rows, list(range(len(rows))), [torch.Generator().manual_seed(0) for _ in rows])


def text(tok, r, i):
    return tok.decode(torch.cat([r.prompt_ids[i], r.completion_ids[i]]))


def info(r, key):
    """Per episode, one field of its EpisodeInfo."""
    return [getattr(e, key) for e in r.episodes]



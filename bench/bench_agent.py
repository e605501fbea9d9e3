"""Agent programs on a thinking template: one training step of the same episodes in three layouts (issue 34, 7).

The episodes are real endpoint episodes (rl/agent/endpoint.py): an agent written with the `openai`
client solves a tool task (the add tool, Hermes-style `<tool_call>` blocks) in T requests, G episodes
for each of P tasks, all sharing a system prompt of ~S characters. Behind the endpoint a scripted
policy answers (no model samples: the bench is about training): `<think>` + ~R random characters +
`</think>`, then a tool call for the first T - 1 requests and a final answer for the last. The chat
template (tests/rl/agent/test_endpoint.py's THINKING, with tools) drops an assistant turn's reasoning once
the conversation goes on. Qwen3's own template does that to the turns before the last user message;
this one does it to every earlier turn, as Qwen3's does in a conversation that asks a new question
at each request. So no request extends what was sampled before it and every request starts a branch
(rl/agent/transcript.py). `AgentSampler` turns each transcript into
a sample of a Samples (its last branch, the others as forks). Each episode gets one advantage; every
layout trains the linear objective Σ adv · log π over the sampled tokens, so all three make the same
gradient (checked here in float32 on the --quick shape). The layouts, each with the no-grad log-prob
pass a PPO-style trainer runs before its backward (the tree's prefill is that pass):
  tree            backstream: `Samples.training` → every branch of every episode on one token tree,
                  one stream_backward (what branches and episodes share is computed once)
  per-request     one sample per request (AReaL's "hf" mode, SkyRL's step-wise training): the ids the
                  request was fed + its answer, loss on the answer; reference_backward
  per-divergence  a new sample at each divergence (slime's FORK, TRL's reconciler, prime-rl): the
                  episode's branches as samples of their own; reference_backward. Under this template
                  every request diverges, so its samples are per-request's (an agent whose template
                  keeps its history would have fewer branches than requests)
Targets: tree ≥ 2× fewer tokens and ≥ 1.8× faster than per-request; the tree's tokens equal the
unique bound (the tokens of the trie of all branches' inputs: no layout can forward fewer).

The model is random with Qwen3-0.6B's shape per layer (bench_agentic's `qwen3_06b_shaped`), `--layers`
of its 28 layers and a `--vocab` of 32K (the char-level tokenizer's 100 ids are valid in it). Times
are the best of `--rounds` round-robin rounds. `--quick` (1 layer, vocab 4096, G = 4, T = 2, shorter
turns, one round whose times include the first call's warm-up) is a smoke test of under a minute.
Results: results/agent.json (not with --quick).

    python -m bench.bench_agent [--layers 2] [--vocab 32768] [--rounds 2] [--quick]

`--reuse` measures something else: the in-process backend (rl/backends/local/backend.py `LocalBackend`) with
and without continuing a request's K/V, on the built-in model, 8 episodes of an agent that appends
to its conversation (4 requests) on a ~2.3K-token prompt. Results: results/agent_reuse.json.

    python -m bench.bench_agent --reuse [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import time

import torch

from backstream import reference_backward, stream_backward
from backstream.default_model import build_tokenizer
from backstream.rl.agent.env import EnvConfig
from backstream.rl.agent.transcript import common_prefix
from backstream.rl.backends.base import SamplingParams
from backstream.rl.records import Completion
from backstream.rl.rollout.programs import AgentSampler
from bench import common
from bench.bench_agentic import logprob_pass, qwen3_06b_shaped

# A thinking model's template with tools: an assistant turn keeps its <think>…</think> only while it
# is the last message (Qwen3's rule for the turns before the last user message, here for every turn),
# the tools' schemas in the system turn, calls as Hermes blocks
TEMPLATE = ("{%- for m in messages -%}"
            "{%- if m.role == 'system' -%}S:{{ m.content }}"
            "{%- if tools -%} Tools:{%- for t in tools -%}{{ t.function | tojson }}{%- endfor -%}{%- endif -%}"
            "{%- elif m.role == 'assistant' -%}"
            "{%- set c = m.content or '' -%}"
            "{%- if not loop.last and '</think>' in c -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
            "A:{{ c }}{%- for t in m.tool_calls or [] -%}"
            "<tool_call>{{ {'name': t.function.name, 'arguments': t.function.arguments} | tojson }}</tool_call>"
            "{%- endfor -%}{{ eos_token }}"
            "{%- elif m.role == 'tool' -%}<tool_response>{{ m.content }}</tool_response>"
            "{%- else -%}U:{{ m.content }}{%- endif -%}"
            "{%- endfor -%}{%- if add_generation_prompt -%}A:{%- endif -%}")
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
LETTERS = "abcdefghijklmnopqrstuvwxyz     ,."  # reasoning text: no markup the parser would read
HTTP = None  # `--reuse`'s agents share one HTTP client (OpenAI() builds a TLS context per client, ~20 ms)


def tool_agent(base_url, api_key, model, row):
    """The agent, as people write one with the `openai` client: call the model with the add tool, run
    its calls, send the results back, until it answers."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": row["system"]}, {"role": "user", "content": row["prompt"]}]
    while True:
        message = client.chat.completions.create(model=model, messages=messages, tools=[ADD]).choices[0].message
        if not message.tool_calls:
            return 1.0
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in message.tool_calls]})
        for c in message.tool_calls:
            args = json.loads(c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})


class Scripted:
    """The backend behind the endpoint (`AgentSampler`'s), scripted: request k of an episode (k = the tool
    results it was fed) is answered with ~R characters of reasoning, then a call of add while k < T - 1,
    else an answer; seeded by the request's seed. Records (fed ids, answer)."""

    def __init__(self, tok, T: int, R: int):
        self.tok, self.T, self.R = tok, T, R
        self.calls: list[tuple[list[int], list[int]]] = []

    @contextlib.contextmanager
    def round(self, episodes: int):  # the part of rl/backends/base.py's `Backend` an agent sampler uses
        yield self

    def finish(self, key: str) -> None:
        """Nothing to forget: every request is answered by the script."""

    def generate(self, ids: list[int], max_tokens: int, seed: int, key: str) -> Completion:
        g = torch.Generator().manual_seed(seed)
        k = self.tok.decode(ids).count("<tool_response>")
        n = self.R + int(torch.randint(-self.R // 5, self.R // 5 + 1, (1,), generator=g))
        think = "".join(LETTERS[i] for i in torch.randint(len(LETTERS), (n,), generator=g).tolist())
        a, b = torch.randint(1, 1000, (2,), generator=g).tolist()
        if k < self.T - 1:
            text = f"<think>{think}</think><tool_call>{json.dumps({'name': 'add', 'arguments': {'a': a, 'b': b}})}"
            text += "</tool_call>"
        else:
            text = f"<think>{think}</think>The total is {a + b}."
        out = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        assert len(out) <= max_tokens, "rollout.max_new_tokens below the scripted answer"
        self.calls.append((list(ids), out))
        return Completion(out, torch.full((len(out),), -1.0), torch.zeros(len(out), dtype=torch.long), "eos")


def agent_rollout(G: int, P: int, T: int, R: int, S: int, seed: int = 0):
    """G episodes of each of P tasks through the endpoint: the Samples and what each request was fed
    and answered."""
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    g = torch.Generator().manual_seed(seed)
    words = []  # the system prompt: an instruction, then random words up to S characters
    for _ in range(S // 5):
        n = int(torch.randint(2, 9, (1,), generator=g))
        words.append("".join(LETTERS[i] for i in torch.randint(26, (n,), generator=g).tolist()))
    system = ("You are a careful calculator agent. " + " ".join(words))[:S]
    rows = []
    for _ in range(P):
        numbers = torch.randint(1, 1000, (T,), generator=g).tolist()
        rows.append({"system": system, "prompt": "Add up " + ", ".join(map(str, numbers))})
    policy = Scripted(tok, T, R)
    sampler = AgentSampler(SamplingParams(max_new_tokens=2 * R + 100), G,
                           EnvConfig(agent="bench.bench_agent:tool_agent", format="chat", max_turns=T), tok,
                           [tok.eos_token_id], None, policy)
    try:
        r = sampler.sample(rows, list(range(P)), [torch.Generator().manual_seed(seed + j) for j in range(P)]).samples
    finally:
        sampler.close()
    assert all(e.turns == T and not e.agent_error for e in r.episodes), "an episode did not play its T requests"
    return r, policy.calls


def answers(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The (start, end) of each run of loss tokens: one answer each."""
    out, start = [], None
    for t, m in enumerate([*mask.tolist(), False]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            out.append((start, t))
            start = None
    return out


def unique_bound(seqs: list[torch.Tensor], ws: list[torch.Tensor]) -> int:
    """The tokens of the trie of the inputs the sequences need (each up to its last loss token, which
    is only a target): the fewest any layout can forward."""
    xs = sorted(tuple(s[: int(torch.nonzero(w)[-1])].tolist()) for s, w in zip(seqs, ws))
    return sum(len(x) - common_prefix(x, prev) for prev, x in zip([(), *xs], xs))


def layouts(r, calls, seed: int = 0) -> dict:
    """The three layouts' (sequences, per-token weights): one advantage per episode times the loss mask."""
    view = r.training(0)
    adv = torch.randn(len(r), generator=torch.Generator().manual_seed(seed)) / 1000
    ws = [m.float() * adv[o] for m, o in zip(view.mask, view.owner)]
    req_seqs, req_ws = [], []
    for s, w, m in zip(view.seqs, ws, view.mask):
        for a, b in answers(m):  # the transcript keeps each answer right after the ids it was fed
            wk = torch.zeros(b)
            wk[a:b] = w[a:b]
            req_seqs.append(s[:b])
            req_ws.append(wk)
    assert sorted(tuple(s.tolist()) for s in req_seqs) == sorted(tuple(f + a) for f, a in calls)
    return {"tree": (view.seqs, ws), "per-request": (req_seqs, req_ws), "per-divergence": (view.seqs, ws)}


def steps(model, data: dict, stats: dict) -> dict:
    """One training step per layout (each from zeroed gradients)."""
    def tree():
        model.zero_grad(set_to_none=True)
        stats["tree"] = stream_backward(model, *data["tree"], block_size=512).stats

    def samples(name):
        def step():
            model.zero_grad(set_to_none=True)
            logprob_pass(model, *data[name])
            reference_backward(model, *data[name])
        return step

    return {"tree": tree, "per-request": samples("per-request"), "per-divergence": samples("per-divergence")}


def keep_grad(fn, model, grads: dict, name: str):
    """`fn`, keeping its first call's gradient (flattened) in grads[name]."""
    def step():
        fn()
        if name not in grads:
            grads[name] = flat_grad(model)
    return step


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def relative(grads: dict) -> dict:
    """Each layout's gradient against per-divergence's (the obvious one): relative L2 distance."""
    ref = grads["per-divergence"]
    return {name: float((g - ref).norm() / ref.norm()) for name, g in grads.items() if name != "per-divergence"}


QUICK = dict(G=4, P=1, T=2, R=8, S=20)
FULL = dict(G=8, P=2, T=4, R=150, S=400)


def main(layers=2, vocab=32768, rounds=2, quick=False):
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    shape = QUICK if quick else FULL
    r, calls = agent_rollout(**shape)
    data = layouts(r, calls)
    model = qwen3_06b_shaped(1 if quick else layers, 4096 if quick else vocab)
    stats, grads = {}, {}
    fns = steps(model, data, stats)
    if quick:  # one round; its steps' gradients are the check's
        rounds = 1
        fns = {name: keep_grad(fn, model, grads, name) for name, fn in fns.items()}
    else:  # the check on the --quick shape, cheap beside the timed steps
        small, q = qwen3_06b_shaped(1, 4096), agent_rollout(**QUICK)
        for name, fn in steps(small, layouts(*q), {}).items():
            fn()
            grads[name] = flat_grad(small)
    times = common.timed_side_by_side(fns, rounds=rounds)
    rel = relative(grads)
    st = stats["tree"]
    tokens = {name: sum(len(s) for s in seqs) for name, (seqs, _) in data.items()}
    bound = unique_bound(*data["tree"])
    res = {
        "shape": {**shape, "layers": model.config.num_hidden_layers, "vocab": model.config.vocab_size,
                  "hidden": model.config.hidden_size},
        "episodes": {"episodes": len(r), "requests": len(calls), "branches": len(data["tree"][0]),
                     "sampled_tokens": sum(len(a) for _, a in calls)},
        "tokens": {"tree_unique": st.tree_tokens, "unique_bound": bound,
                   "tree_forwarded": st.prefill_tokens + st.backward_tokens,
                   "per_request": tokens["per-request"], "per_request_forwarded": 2 * tokens["per-request"],
                   "per_divergence": tokens["per-divergence"],
                   "per_divergence_forwarded": 2 * tokens["per-divergence"]},
        "step_s": times,
        "token_ratio_vs_per_request": tokens["per-request"] / st.tree_tokens,
        "token_ratio_vs_per_divergence": tokens["per-divergence"] / st.tree_tokens,
        "speedup_vs_per_request": times["per-request"] / times["tree"],
        "speedup_vs_per_divergence": times["per-divergence"] / times["tree"],
        "gradient_rel_vs_per_divergence": rel,
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}",
    }
    res["targets"] = {"tokens_vs_per_request_2x": res["token_ratio_vs_per_request"] >= 2,
                      "speedup_vs_per_request_1.8x": res["speedup_vs_per_request"] >= 1.8,
                      "tree_tokens_at_unique_bound": st.tree_tokens == bound,
                      "same_gradient_1e-3": max(rel.values()) <= 1e-3}
    res["wall_s"] = time.perf_counter() - t0
    print(json.dumps(res, indent=1))
    e = res["episodes"]
    every = " (every request diverged: the template strips earlier reasoning)" if e["requests"] == e["branches"] else ""
    print(f"\n{e['episodes']} episodes, {e['requests']} requests, {e['branches']} branches{every}\n"
          f"| layout | tokens trained | step time (s) | tree: fewer tokens | tree: speed-up |\n|---|---|---|---|---|\n"
          f"| tree (backstream) | {st.tree_tokens:,} unique (bound {bound:,}) | {times['tree']:.2f} | 1.00 | 1.00 |\n"
          f"| per-request | {tokens['per-request']:,} | {times['per-request']:.2f} | "
          f"{res['token_ratio_vs_per_request']:.2f} | {res['speedup_vs_per_request']:.2f} |\n"
          f"| per-divergence | {tokens['per-divergence']:,} | {times['per-divergence']:.2f} | "
          f"{res['token_ratio_vs_per_divergence']:.2f} | {res['speedup_vs_per_divergence']:.2f} |")
    mark = {True: "met", False: "MISSED"}
    t = res["targets"]
    print(f"\ntargets: tree vs per-request ≥ 2× fewer tokens: {res['token_ratio_vs_per_request']:.2f}× "
          f"({mark[t['tokens_vs_per_request_2x']]}); ≥ 1.8× faster: {res['speedup_vs_per_request']:.2f}× "
          f"({mark[t['speedup_vs_per_request_1.8x']]}); tree tokens = unique bound: {st.tree_tokens:,} vs "
          f"{bound:,} ({mark[t['tree_tokens_at_unique_bound']]})\n"
          f"gradients (float32, --quick shape): tree vs per-divergence rel {rel['tree']:.1e}, per-request vs "
          f"per-divergence rel {rel['per-request']:.1e} ({'the same gradient' if t['same_gradient_1e-3'] else 'DIFFER'}"
          f", tolerance 1e-3)")
    if not quick:
        common.save("agent", res)
    return res


def appending_agent(base_url, api_key, model, row):
    """`--reuse`'s agent: four requests, each the conversation so far plus a user note (each extends
    the last one's ids)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=HTTP)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(4):
        answer = client.chat.completions.create(model=model, messages=messages).choices[0]
        messages += [{"role": "assistant", "content": answer.message.content or ""},
                     {"role": "user", "content": "go on"}]


def reuse(rounds: int = 2) -> dict:
    """The in-process backend with and without continuing a request's K/V: the built-in model, 8
    episodes of `appending_agent` on a ~2.3K-token prompt (key=value pairs), 16 tokens an answer; the
    rollout's seconds, best of `rounds` alternating rounds."""
    from openai import DefaultHttpxClient

    from backstream.default_model import load_default
    from backstream.rl.backends.local.backend import LocalBackend

    global HTTP
    HTTP = DefaultHttpxClient()
    torch.set_num_threads(2)
    model, tok = load_default()
    cfg = SamplingParams(max_new_tokens=16)
    prompt = "".join(f"k{i}={i * 7 % 100};" for i in range(300)) + " 12+34="
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, reuse_min in (("prefill whole", 10**9), ("continue the K/V", 256)):
            answers = LocalBackend(cfg, [tok.eos_token_id], tok)
            answers.weights.sync(model, 0)
            answers.reuse_min = reuse_min
            s = AgentSampler(cfg, 8, EnvConfig(agent="bench.bench_agent:appending_agent", format="plain"), tok,
                             [tok.eos_token_id], 4096, answers)
            t = time.perf_counter()
            s.sample([{"prompt": prompt}], [0], [torch.Generator().manual_seed(0)])
            best[name] = min(best.get(name, math.inf), time.perf_counter() - t)
            s.close()
    res = {"prompt_tokens": len(tok(prompt)["input_ids"]), "episodes": 8, "requests": 32, "rollout_s": best,
           "speedup": best["prefill whole"] / best["continue the K/V"]}
    print(json.dumps(res, indent=1))
    common.save("agent_reuse", res)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="the in-process backend's K/V reuse across requests")
    a = ap.parse_args()
    reuse(a.rounds) if a.reuse else main(a.layers, a.vocab, a.rounds, a.quick)

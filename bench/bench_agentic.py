"""Agentic episodes: one trainer step of the same multi-turn episodes in three layouts, side by side.

G = 8 episodes of one task share a system + tools prompt of ~1K tokens; each has 4 sampled turns of
~200 tokens with a ~300-token tool result between two turns (loss on the sampled turns only). The
layouts, each with the no-grad log-prob pass a PPO-style trainer runs before its backward:
  tree      backstream: the episodes on one token tree, stream_backward (its prefill is that pass;
            the shared prompt is forwarded and backpropagated once)
  rows      one row per episode (TRL's layout): a no-grad forward per episode, then one forward and
            backward per episode (reference_backward)
  per-turn  one sample per turn (verl's, slime's and AReaL's layout): turn k's sample holds the whole
            context up to it with the loss on turn k only; a no-grad forward and a forward+backward each
The three give the same gradient (tests/rl/agent/test_episodes.py checks it in float64); what differs is the
tokens forwarded and the time. Targets (issue 21): tree ≥ 3× faster than per-turn; against rows, a
speed-up ≥ 85% of the token ratio rows/tree (the bound for the linear layers, ≈ 1.4 for this shape).

The model is random with Qwen3-0.6B's shape per layer (hidden 1024, 16 query and 8 K/V heads of 128,
MLP 3072) and, to fit a CPU, `--layers` of its 28 layers (default 2) and a `--vocab` of 32K (151,936
with --vocab 151936). Times are the best of `--rounds` round-robin rounds.

    python -m bench.bench_agentic [--layers 2] [--vocab 32768] [--rounds 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from backstream import reference_backward, stream_backward
from bench import common


def qwen3_06b_shaped(layers: int, vocab: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval()


def episodes(G: int, prompt: int, turns: int, turn_len: int, tool_len: int, vocab: int, seed: int = 0):
    """G episodes: (sequence, per-token loss weights, the (start, end) of each sampled turn)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (prompt,), generator=g)
    out = []
    for _ in range(G):
        parts, spans, pos = [shared], [], prompt
        for k in range(turns):
            n = turn_len + int(torch.randint(-turn_len // 5, turn_len // 5 + 1, (1,), generator=g))
            parts.append(torch.randint(0, vocab, (n,), generator=g))
            spans.append((pos, pos + n))
            pos += n
            if k < turns - 1:
                m = tool_len + int(torch.randint(-tool_len // 5, tool_len // 5 + 1, (1,), generator=g))
                parts.append(torch.randint(0, vocab, (m,), generator=g))
                pos += m
        seq = torch.cat(parts)
        w = torch.zeros(len(seq))
        adv = float(torch.randn((), generator=g))
        for a, b in spans:
            w[a:b] = adv / 1000
        out.append((seq, w, spans))
    return out


def per_turn_samples(eps):
    """Turn k of each episode as its own sample: the context up to the turn's end, loss on the turn."""
    seqs, ws = [], []
    for seq, w, spans in eps:
        for a, b in spans:
            wk = torch.zeros(b)
            wk[a:b] = w[a:b]
            seqs.append(seq[:b])
            ws.append(wk)
    return seqs, ws


def logprob_pass(model, seqs, ws):
    """The no-grad pass a PPO-style trainer runs for π_old: logits from the first loss position on."""
    with torch.no_grad():
        for s, w in zip(seqs, ws):
            first = int(torch.nonzero(w)[0])
            model(input_ids=s[None], logits_to_keep=len(s) - first + 1)


def main(layers=2, vocab=32768, rounds=2, quick=False):
    torch.set_num_threads(2)
    G, P, T, S, R = (8, 1024, 4, 200, 300) if not quick else (2, 64, 2, 16, 24)
    model = qwen3_06b_shaped(layers if not quick else 1, vocab if not quick else 1024)
    eps = episodes(G, P, T, S, R, model.config.vocab_size)
    rows, row_w = [e[0] for e in eps], [e[1] for e in eps]
    turn_seqs, turn_w = per_turn_samples(eps)
    stats = {}

    def tree():
        model.zero_grad(set_to_none=True)
        stats["tree"] = stream_backward(model, rows, row_w, block_size=512).stats

    def by_rows():
        model.zero_grad(set_to_none=True)
        logprob_pass(model, rows, row_w)
        reference_backward(model, rows, row_w)

    def by_turns():
        model.zero_grad(set_to_none=True)
        logprob_pass(model, turn_seqs, turn_w)
        reference_backward(model, turn_seqs, turn_w)

    t0 = time.perf_counter()
    times = common.timed_side_by_side({"tree": tree, "rows": by_rows, "per-turn": by_turns}, rounds=rounds)
    st = stats["tree"]
    row_tokens = sum(len(s) for s in rows)
    turn_tokens = sum(len(s) for s in turn_seqs)
    loss_tokens = sum(int((w != 0).sum()) for w in row_w)
    res = {
        "shape": {"G": G, "prompt": P, "turns": T, "turn_tokens": S, "tool_tokens": R,
                  "layers": model.config.num_hidden_layers, "vocab": model.config.vocab_size, "hidden": 1024},
        "tokens": {"tree_unique": st.tree_tokens, "tree_forwarded": st.prefill_tokens + st.backward_tokens,
                   "rows": row_tokens, "rows_forwarded": 2 * row_tokens, "per_turn": turn_tokens,
                   "per_turn_forwarded": 2 * turn_tokens, "loss_tokens": loss_tokens},
        "step_s": times,
        "speedup_vs_rows": times["rows"] / times["tree"],
        "speedup_vs_per_turn": times["per-turn"] / times["tree"],
        "token_ratio_rows_over_tree": row_tokens / st.tree_tokens,
        "fraction_of_token_ratio": (times["rows"] / times["tree"]) / (row_tokens / st.tree_tokens),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}",
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(res, indent=1))
    print(f"\n| layout | tokens in its batch | step time (s) | tree's speed-up |\n|---|---|---|---|\n"
          f"| tree (backstream) | {st.tree_tokens:,} unique | {times['tree']:.1f} | 1.00 |\n"
          f"| one row per episode | {row_tokens:,} | {times['rows']:.1f} | {res['speedup_vs_rows']:.2f} "
          f"(token ratio {res['token_ratio_rows_over_tree']:.2f}: "
          f"{100 * res['fraction_of_token_ratio']:.0f}% of it) |\n"
          f"| one sample per turn | {turn_tokens:,} | {times['per-turn']:.1f} | {res['speedup_vs_per_turn']:.2f} |")
    if not quick:
        with open(os.path.join(common.RESULTS, "agentic.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    main(a.layers, a.vocab, a.rounds, a.quick)

"""Memory per token, counted exactly: the peak live tensor bytes of one streamed call, what is alive
at that peak, the growth per extra token against the floor, and the planner's estimate.

One trajectory (the first 1K tokens without loss, the rest with loss), block 512, on three shapes:
  small — a Qwen3 of hidden 256, 4 layers, 8 heads, 4 K/V heads × 32, MLP 768, 4K vocabulary;
  large — the README's long-trajectory model (bench.common.model, 32K vocabulary);
  moe   — bench.bench_moe's Qwen3-MoE (8 experts, top 2, 8K vocabulary).
Counted by `backstream.stream.memory.LiveBytes` (every tensor storage from the operator that
returns it until nothing holds it; deterministic on CPU). The floor of a trajectory is its K/V in
the model's dtype plus their float32 gradient accumulators; "block" is the peak of a call on one
block alone (activations, logits, their gradients), weights and `.grad` excluded. Targets
(issue 20): peak − weights − grad ≤ 1.3 × floor + block; growth per token ≤ 1.3 × the floor per
token; at 8K on the small shape, peak ≤ 1/8 of `reference_backward`'s at ≤ 1.2× its time (both
timed side by side in this process, best of 2, without the counter). The planner's estimate
(`stats.peak_bytes_predicted`) is checked against the counted peak with a fixed block size and
under budgets.

    python -m bench.bench_memory [--shapes small,large,moe] [--lengths 4096,8192,16384] [--label after]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from backstream import reference_backward, stream_backward
from backstream.stream.memory import LiveBytes
from backstream.stream.planner import plan
from backstream.stream.tree import TokenTree
from bench import common

PROMPT = 1024
BLOCK = 512
MiB = 2**20


def small_model():
    return common.model(vocab=4096, hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, inter=768)


def moe_model():
    from bench.bench_moe import moe_model as build

    return build()


SHAPES = {"small": small_model, "large": lambda: common.model(vocab=32000), "moe": moe_model}


def data(length, vocab, prompt=PROMPT, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (length,), generator=g)
    w = torch.randn(length, generator=g)
    w[: min(prompt, length - 1)] = 0
    w[0] = 0
    return seq, w


def kv_bytes_per_token(model) -> tuple[int, int]:
    """(K/V bytes per token in the model's dtype, their float32 accumulators' bytes per token)."""
    c = model.config.get_text_config()
    H = c.num_attention_heads
    D = getattr(c, "head_dim", None) or c.hidden_size // H
    n = c.num_hidden_layers * 2 * (c.num_key_value_heads or H) * D
    elt = next(model.parameters()).element_size()
    return n * elt, n * max(4, elt)


def param_bytes(model) -> tuple[int, int]:
    w = sum(p.numel() * p.element_size() for p in model.parameters())
    g = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return w, g


def counted(model, fn, seqs, weights, **kw) -> tuple[dict, object]:
    model.zero_grad(set_to_none=True)
    with LiveBytes(model) as m:
        r = fn(model, seqs, weights, **kw)
    model.zero_grad(set_to_none=True)
    return m.report(), r


def mib(x) -> float:
    return round(x / MiB, 1)


def measure(shape: str, lengths: list[int], block: int, reference_at: set[int]) -> dict:
    model = SHAPES[shape]()
    V = model.config.vocab_size
    kv_tok, g_tok = kv_bytes_per_token(model)
    w_bytes, g_bytes = param_bytes(model)
    one_seq, one_w = data(block + 1, V, prompt=0)  # one block: every position predicts a target
    one, _ = counted(model, stream_backward, [one_seq], [one_w], block_size=block, batch_tokens=block)
    # what one block costs on its own: its peak comes before any `.grad` exists
    block_bytes = one["peak"] - one["at_peak"].get("weights", 0) - one["at_peak"].get("grad", 0)
    rows = []
    for n in lengths:
        seq, w = data(n, V)
        rep, r = counted(model, stream_backward, [seq], [w], block_size=block, batch_tokens=block)
        predicted = plan(model, TokenTree([seq[:-1].tolist()]), block_size=block, batch_tokens=block).breakdown
        floor = n * (kv_tok + g_tok)
        body = rep["peak"] - w_bytes - g_bytes
        row = {"shape": shape, "tokens": n, "block": block, "peak_MiB": mib(rep["peak"]),
               "weights+grad_MiB": mib(w_bytes + g_bytes), "floor_MiB": mib(floor), "block_MiB": mib(block_bytes),
               "excess_x": round((body - block_bytes) / floor, 3),
               "predicted_MiB": mib(r.stats.peak_bytes_predicted),
               "predicted_breakdown_MiB": {k: mib(v) for k, v in predicted.items()},
               "pred_err": round(r.stats.peak_bytes_predicted / rep["peak"] - 1, 3),
               "at_peak_MiB": {k: mib(v) for k, v in rep["at_peak"].items()},
               "saved_at_peak_MiB": mib(rep["saved_at_peak"]), "peak_in": rep["peak_label"], "peak": rep["peak"]}
        if n in reference_at:
            ref, _ = counted(model, reference_backward, [seq], [w])
            row["reference_MiB"] = mib(ref["peak"])
            row["peak_vs_ref"] = round(rep["peak"] / ref["peak"], 4)
            row["reference_at_peak_MiB"] = {k: mib(v) for k, v in ref["at_peak"].items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for a, b in zip(rows, rows[1:]):
        b["slope_B_per_token"] = round((b["peak"] - a["peak"]) / (b["tokens"] - a["tokens"]))
        b["slope_x_floor"] = round(b["slope_B_per_token"] / (kv_tok + g_tok), 3)
    return {"shape": shape, "floor_B_per_token": kv_tok + g_tok, "kv_B_per_token": kv_tok, "block_bytes": block_bytes,
            "weights_bytes": w_bytes, "grad_bytes": g_bytes, "rows": rows}


def budgets(shape: str, length: int) -> list[dict]:
    """The planner under budgets: the plan it picks, its estimate, the counted peak. Each budget is
    the planner's own estimate at a fixed block size, so the search must land on that size."""
    model = SHAPES[shape]()
    seq, w = data(length, model.config.vocab_size)
    tree = TokenTree([seq[:-1].tolist()])  # the inputs: up to the last target's predecessor
    out = []
    for block in (256, 1024):
        budget = plan(model, tree, block_size=block, batch_tokens=block).peak_bytes
        rep, r = counted(model, stream_backward, [seq], [w], memory_budget=budget)
        predicted = plan(model, tree, block_size=block, batch_tokens=block).breakdown
        row = {"shape": shape, "tokens": length, "budget_MiB": mib(budget), "block": r.stats.block_size,
               "predicted_MiB": mib(r.stats.peak_bytes_predicted),
               "predicted_breakdown_MiB": {k: mib(v) for k, v in predicted.items()}, "peak_MiB": mib(rep["peak"]),
               "pred_err": round(r.stats.peak_bytes_predicted / rep["peak"] - 1, 3), "fits": rep["peak"] <= budget}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def timing(shape: str, length: int, block: int, rounds: int) -> dict:
    model = SHAPES[shape]()
    seq, w = data(length, model.config.vocab_size)

    def run(fn, **kw):
        model.zero_grad(set_to_none=True)
        fn(model, [seq], [w], **kw)

    t = common.timed_side_by_side({"stream": lambda: run(stream_backward, block_size=block, batch_tokens=block),
                                   "reference": lambda: run(reference_backward)}, rounds=rounds)
    return {"shape": shape, "tokens": length, "stream_s": round(t["stream"], 2),
            "reference_s": round(t["reference"], 2), "time_x": round(t["stream"] / t["reference"], 3)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="small,large,moe")
    ap.add_argument("--lengths", default="4096,8192,16384")
    ap.add_argument("--block", type=int, default=BLOCK)
    ap.add_argument("--reference-at", default="8192", help="lengths at which the reference is counted too")
    ap.add_argument("--label", default="after", help="the key these results are saved under in memory.json")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--no-budgets", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lengths = [int(x) for x in a.lengths.split(",")]
    ref_at = {int(x) for x in a.reference_at.split(",") if x}
    res = {"args": vars(a), "shapes": [], "budgets": [], "timing": []}
    for shape in a.shapes.split(","):
        res["shapes"].append(measure(shape, lengths, a.block, ref_at))
    if not a.no_budgets:
        for shape in a.shapes.split(","):
            res["budgets"] += budgets(shape, 8192)
    if not a.no_time:
        res["timing"].append(timing("small", 8192, a.block, rounds=2))
        print(json.dumps(res["timing"][-1]), flush=True)

    rows = [r for s in res["shapes"] for r in s["rows"]]
    for r in rows:
        r.setdefault("slope_x_floor", "-")
        r.setdefault("peak_vs_ref", "-")
    print(common.table(rows, ["shape", "tokens", "peak_MiB", "weights+grad_MiB", "floor_MiB", "block_MiB", "excess_x",
                              "slope_x_floor", "peak_vs_ref", "predicted_MiB", "pred_err", "peak_in"]))
    for r in rows:
        print(r["shape"], r["tokens"], "at the peak (MiB):", r["at_peak_MiB"])
    if res["budgets"]:
        print(common.table(res["budgets"], ["shape", "tokens", "budget_MiB", "block", "predicted_MiB", "peak_MiB",
                                            "pred_err", "fits"]))
    path = os.path.join(common.RESULTS, "memory.json")
    saved = json.load(open(path)) if os.path.exists(path) else {}
    saved[a.label] = res
    print("saved", common.save("memory", saved))


if __name__ == "__main__":
    main()

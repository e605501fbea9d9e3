"""A hybrid model (issue 39): Qwen3.5-0.8B's shape, streamed against the reference.

The shape (the issue's numbers for Qwen3.5-0.8B): hidden 1024, attention layers of 8 query and 2 K/V
heads of 256 (rotary on a quarter of each head), Gated DeltaNet layers of 16 key and 16 value heads of
128 with a 4-tap convolution, three Gated DeltaNet layers before each attention layer, MLP 3584, a tied
248,320-token vocabulary; float32, random init. transformers' `Qwen3_5TextConfig` defaults (hidden 4096,
32 layers of the same 3 + 1 pattern, 16/4 heads of 256, Gated DeltaNet 16 key / 32 value heads of 128,
the same vocabulary) share every per-head size and the pattern; the 0.8B's Gated DeltaNet head counts
are not in transformers (16/16 assumed). On CPU the Gated DeltaNet layers run transformers' torch
fallbacks (no flash-linear-attention); `bench/gpu_check.sh` runs the GPU kernels.

memory   one trajectory of N tokens (N = 8192, 16384), loss on its last 1024 (a long prompt, then
         the response), 4 layers (one 3 + 1 group: fewer layers, as the issue allows): peak live
         tensor bytes counted by `LiveBytes` (deterministic) for `stream_backward` (blocks 256, 512) and
         `reference_backward`, the planner's prediction beside the stream's count, and the time of
         each (the counted runs: the counter slows both alike). A reference that cannot fit the
         machine is not run: its peak is then the 8K count extrapolated by its growth per token,
         marked as such.
prefix   G = 8 responses sharing a prompt, share 0.9 of L = 512 tokens, loss on the responses, the
         whole 24-layer shape: `reference_backward` vs `stream_backward` time (best of 2,
         round-robin), and per trainer step (each side with the no-grad log-prob pass a PPO/GRPO
         trainer runs anyway: the reference's forward per sequence, the stream's own prefill), against
         the linear-layer bound G(P+S)/(P+GS). A hybrid's K/V cannot come from the rollout (its states
         at the block boundaries are not in them), so the stream always runs its prefill.

    python -m bench.bench_hybrid [--parts memory,prefix] [--lengths 8192,16384]
    python -m bench.bench_hybrid --family jamba --parts memory --lengths 1024,8192 --blocks 256   # Mamba 1 (issue 55)

jamba    `--family jamba`: the memory part on a Jamba-shaped miniature (`jamba_model`: one period of
         Jamba's layers, 7 Mamba 1 and 1 attention, MoE on every other; hidden 256, MLP 896; its 65,536-token
         vocabulary), whose Mamba 1 scan the engine continues from each block's state (stream/scan.py).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from backstream import reference_backward, stream_backward
from backstream.stream.adapter import probe_layout
from backstream.stream.engine import measured_activations
from backstream.stream.memory import LiveBytes
from backstream.stream.planner import plan
from backstream.stream.tree import TokenTree
from bench import common

MiB = 2**20
VOCAB = 248320
SHAPE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=256, intermediate_size=3584,
             linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=65536)
LOSS = 1024


def model(groups: int, vocab: int = VOCAB, seed: int = 0):
    """Qwen3.5-0.8B's shape with `groups` × (3 Gated DeltaNet + 1 attention) layers (6 in the 0.8B)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    types = (["linear_attention"] * 3 + ["full_attention"]) * groups
    cfg = AutoConfig.for_model("qwen3_5_text", vocab_size=vocab, num_hidden_layers=len(types), layer_types=types,
                               **SHAPE)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


JAMBA_VOCAB = 65536
JAMBA_SHAPE = dict(hidden_size=256, intermediate_size=896, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=2, attn_layer_period=8, attn_layer_offset=4, expert_layer_period=2,
                   expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
                   mamba_expand=2, tie_word_embeddings=False, use_mamba_kernels=False)


def jamba_model(seed: int = 0):
    """A Jamba-shaped miniature (issue 55): one period of Jamba's layers (7 Mamba 1 layers and an attention
    layer, MoE on every other layer, 4 experts of which 2 per token), hidden 512, its 65,536-token
    vocabulary; float32, random init."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("jamba", vocab_size=JAMBA_VOCAB, **JAMBA_SHAPE)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def trajectory(n: int, vocab: int, loss: int = LOSS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (n,), generator=g)
    w = torch.randn(n, generator=g)
    w[: max(1, n - loss)] = 0
    return seq, w


def counted(m, fn, seqs, weights, **kw) -> tuple[dict, object, float]:
    m.zero_grad(set_to_none=True)
    t = time.perf_counter()
    with LiveBytes(m) as lb:
        r = fn(m, seqs, weights, **kw)
    dt = time.perf_counter() - t
    m.zero_grad(set_to_none=True)
    return lb.report(), r, dt


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info["MemAvailable"]


def part_memory(lengths: list[int], blocks: list[int], family: str = "qwen3_5") -> list[dict]:
    m, vocab = (jamba_model(), JAMBA_VOCAB) if family == "jamba" else (model(groups=1), VOCAB)
    layout = probe_layout(m)
    rows, ref_rows = [], []
    for n in lengths:
        seq, w = trajectory(n, vocab)
        row = {"tokens": n, "loss_tokens": LOSS}
        for b in blocks:
            rep, r, dt = counted(m, stream_backward, [seq], [w], block_size=b, batch_tokens=b)
            predicted = plan(m, TokenTree([seq[:-1].tolist()], stateful=True), block_size=b, batch_tokens=b,
                             layout=layout, act_per_token=measured_activations(m, layout))
            row[f"stream_b{b}"] = {"peak_MiB": round(rep["peak"] / MiB), "s": round(dt, 1),
                                   "predicted_MiB": round(predicted.peak_bytes / MiB),
                                   "pred_err": round(predicted.peak_bytes / rep["peak"] - 1, 4),
                                   "at_peak_MiB": {k: round(v / MiB) for k, v in rep["at_peak"].items()},
                                   "predicted_breakdown_MiB": {k: round(v / MiB)
                                                               for k, v in predicted.breakdown.items()},
                                   "peak": rep["peak"]}
        # the reference: run while its extrapolated peak fits the machine (with 2 GiB to spare)
        need = None
        if len(ref_rows) >= 1:
            a = ref_rows[-1]
            need = a["peak"] + (n - a["tokens"]) * a["per_token"]
        if need is None or need < available_bytes() - 2 * 2**30:
            ref, _, rdt = counted(m, reference_backward, [seq], [w])
            row.update(reference_peak_MiB=round(ref["peak"] / MiB), reference_s=round(rdt, 1), reference_run=True,
                       reference_at_peak_MiB={k: round(v / MiB) for k, v in ref["at_peak"].items()})
            ref_rows.append({"tokens": n, "peak": ref["peak"], "per_token": None})
            if len(ref_rows) == 1:  # growth per token: one more, shorter reference run
                short, sw = trajectory(n // 2, vocab)
                half, _, _ = counted(m, reference_backward, [short], [sw])
                ref_rows[-1]["per_token"] = (ref["peak"] - half["peak"]) / (n - n // 2)
                row["reference_growth_B_per_token"] = round(ref_rows[-1]["per_token"])
            else:
                ref_rows[-1]["per_token"] = ref_rows[-2]["per_token"]
            ref_peak = ref["peak"]
        else:
            ref_peak = need
            row.update(reference_peak_MiB=round(need / MiB), reference_run=False,
                       reference_note=f"extrapolated from {ref_rows[-1]['tokens']} tokens: more than this machine "
                                      f"has free ({available_bytes() / 2**30:.1f} GiB)")
        for b in blocks:
            row[f"stream_b{b}"]["peak_ratio"] = round(row[f"stream_b{b}"].pop("peak") / ref_peak, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def part_prefix(G: int = 8, L: int = 512, share: float = 0.9, groups: int = 6, rounds: int = 2) -> dict:
    from bench.bench_prefix import batch

    m = model(groups=groups)
    seqs, weights, P, S = batch(G, L, share, VOCAB)

    def call(fn, **kw):
        def go():
            m.zero_grad(set_to_none=True)
            fn(m, seqs, weights, **kw)
        return go

    def logprob_pass():
        with torch.no_grad():
            for s in seqs:
                m(input_ids=s[None], use_cache=False, logits_to_keep=S + 1)

    fns = {"reference": call(reference_backward), "stream": call(stream_backward, batch_tokens=L),
           "logprob_pass": logprob_pass}
    t = common.timed_side_by_side(fns, rounds=rounds)
    m.zero_grad(set_to_none=True)
    bound = G * (P + S) / (P + G * S)
    speedup = t["reference"] / t["stream"]
    step = (t["reference"] + t["logprob_pass"]) / t["stream"]
    row = {"G": G, "L": L, "share": share, "P": P, "S": S, "layers": 4 * groups, "bound": round(bound, 2),
           "reference_s": round(t["reference"], 1), "stream_s": round(t["stream"], 1),
           "logprob_pass_s": round(t["logprob_pass"], 1), "speedup": round(speedup, 2),
           "of_bound": round(speedup / bound, 3), "trainer_step_speedup": round(step, 2),
           "trainer_step_of_bound": round(step / bound, 3)}
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="memory,prefix")
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--blocks", default="256,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--family", default="qwen3_5", choices=["qwen3_5", "jamba"],
                    help="memory: Qwen3.5-0.8B's shape, or a Jamba-shaped miniature (Mamba 1 layers)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"args": vars(a), "cpu": cpu_name(), "torch": torch.__version__}
    parts = a.parts.split(",")
    if "memory" in parts:
        blocks = [int(x) for x in a.blocks.split(",")]
        res["memory"] = part_memory([int(x) for x in a.lengths.split(",")], blocks, a.family)
        flat = [{"tokens": r["tokens"], "block": b, **{k: v for k, v in r[f"stream_b{b}"].items() if "MiB" not in k
                                                        or k == "peak_MiB" or k == "predicted_MiB"},
                 "reference_MiB": r["reference_peak_MiB"], "reference_run": r["reference_run"],
                 "reference_s": r.get("reference_s", "-")} for r in res["memory"] for b in blocks]
        print(common.table(flat, ["tokens", "block", "peak_MiB", "predicted_MiB", "pred_err", "reference_MiB",
                                  "reference_run", "peak_ratio", "s", "reference_s"]))
    if "prefix" in parts:
        res["prefix"] = part_prefix()
    print("saved", common.save("hybrid" if a.family == "qwen3_5" else f"hybrid_{a.family}", res))


if __name__ == "__main__":
    main()

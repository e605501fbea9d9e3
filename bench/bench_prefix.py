"""Prefix sharing: stream_backward vs reference_backward on GRPO-shaped batches, side by side.

G responses share a prompt of P tokens; each response has S tokens; L = P + S, share = P / L.
Loss on the response tokens only. A streamed batch holds at most L tokens (`batch_tokens=L`), as
many as one reference forward. The bound on the speed-up of the linear layers is
G(P+S) / (P+GS). Three streamed timings:
  stream       — stream_backward as called, prefill included (it also yields the log-probs);
  stream+kv    — the K/V handed in (from the rollout at the same weights): no prefill;
  trainer step — both sides with the no-grad log-prob pass a PPO/GRPO trainer runs anyway
                 (reference: one no-grad forward per sequence; streamed: its prefill is that pass).
Peak memory: growth of the resident set during one call (sampled every ms), each in a fresh process.

    python -m bench.bench_prefix [--quick]
"""

from __future__ import annotations

import json
import sys

import torch

from backstream import reference_backward, stream_backward
from backstream.stream.hf import returned_cache
from bench import common


def batch(G, L, share, vocab, seed=0):
    P = int(round(share * L))
    S = L - P
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (P,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(0, vocab, (S,), generator=g)]) for _ in range(G)]
    weights = [torch.cat([torch.zeros(P), torch.randn(S, generator=g)]) for _ in range(G)]
    return seqs, weights, P, S


def logprob_pass(model, seqs):
    with torch.no_grad():
        for s in seqs:
            model(input_ids=s[None])


def one_call(args):
    """Child process: peak RSS growth of one call."""
    torch.set_num_threads(args["threads"])
    model = common.model()
    seqs, weights, _, _ = batch(args["G"], args["L"], args["share"], model.config.vocab_size)
    fn = stream_backward if args["method"] == "stream" else reference_backward
    kw = {"batch_tokens": args["L"]} if args["method"] == "stream" else {}
    with common.PeakRSS() as peak:
        fn(model, seqs, weights, **kw)
    print(json.dumps({"peak_growth": peak.growth}))


def main(quick=False):
    torch.set_num_threads(2)
    model = common.model()
    V = model.config.vocab_size
    L = 512
    rows = []
    for G in ([8] if quick else [4, 8, 16]):
        for share in ([0.9] if quick else [0.5, 0.9, 0.95]):
            seqs, weights, P, S = batch(G, L, share, V)
            with torch.no_grad():
                caches = [returned_cache(model(input_ids=s[None], use_cache=True)) for s in seqs]

            def run(fn, **kw):
                def go():
                    model.zero_grad(set_to_none=True)
                    fn(model, seqs, weights, **kw)
                return go

            # the streamed batches hold as many tokens as one reference sequence (L)
            t = common.timed_side_by_side({
                "ref": run(reference_backward), "stream": run(stream_backward, batch_tokens=L),
                "kv": run(stream_backward, batch_tokens=L, kv=caches), "lp": lambda: logprob_pass(model, seqs)})
            t_ref, t_st, t_kv, t_lp = t["ref"], t["stream"], t["kv"], t["lp"]
            bound = G * (P + S) / (P + G * S)
            mem = {m: common.peak_in_subprocess("bench.bench_prefix",
                                                {"G": G, "L": L, "share": share, "method": m, "threads": 2})
                   for m in ("reference", "stream")}
            rows.append({
                "G": G, "share": share, "P": P, "S": S, "bound": round(bound, 2),
                "ref_s": round(t_ref, 3), "stream_s": round(t_st, 3), "speedup": round(t_ref / t_st, 2),
                "of_bound": f"{100 * t_ref / t_st / bound:.0f}%",
                "speedup_kv": round(t_ref / t_kv, 2),
                "trainer_step": round((t_ref + t_lp) / t_st, 2),
                "peak_ref_MiB": round(mem["reference"]["peak_growth"] / 2**20),
                "peak_stream_MiB": round(mem["stream"]["peak_growth"] / 2**20),
                "peak_ratio": round(mem["stream"]["peak_growth"] / max(mem["reference"]["peak_growth"], 1), 2),
            })
            print(rows[-1], flush=True)
    cols = ["G", "share", "bound", "ref_s", "stream_s", "speedup", "of_bound", "speedup_kv", "trainer_step",
            "peak_ref_MiB", "peak_stream_MiB", "peak_ratio"]
    print(common.table(rows, cols))
    name = "prefix" + ("_quick" if quick else "")
    print("saved", common.save(name, {"L": L, "model": model.config.to_dict(), "rows": rows}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("{"):
        one_call(json.loads(sys.argv[1]))
    else:
        main(quick="--quick" in sys.argv)

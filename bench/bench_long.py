"""One long trajectory: peak memory and time of stream_backward vs reference_backward, and a sweep
of block sizes (the shape of MetroRLHF's memory/time table).

An 8K-token trajectory (1K prompt without loss, 7K response with loss) on the bench's Qwen3 with
a 32K vocabulary. Every measurement runs in a fresh process: peak = growth of the resident set
during the first call (sampled every ms); time = the best of that call and a second one.

    python -m bench.bench_long [--length 8192] [--blocks 128,256,512,1024,2048,8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from backstream import reference_backward, stream_backward
from backstream.stream.hf import returned_cache
from bench import common


def data(length, vocab, prompt=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (length,), generator=g)
    w = torch.randn(length, generator=g)
    w[:prompt] = 0
    return seq, w


def child(args):
    torch.set_num_threads(args["threads"])
    model = common.model(vocab=32000)
    seq, w = data(args["length"], model.config.vocab_size)
    kw = {}
    if args["method"] == "stream":
        kw["block_size"] = args["block"]
        kw["batch_tokens"] = args["block"]
    if args.get("kv"):
        with torch.no_grad():
            kw["kv"] = [returned_cache(model(input_ids=seq[None], use_cache=True, logits_to_keep=1))]
    fn = stream_backward if args["method"] == "stream" else reference_backward
    times = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with common.PeakRSS() as p:
            t = time.perf_counter()
            r = fn(model, [seq], [w], **kw)
            times.append(time.perf_counter() - t)
        if len(times) == 1:
            peak = p.growth
    print(json.dumps({"peak_growth": peak, "time": min(times), "predicted": r.stats.peak_bytes_predicted}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--blocks", default="128,256,512,1024,2048,8192")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    base = {"length": a.length, "threads": a.threads}
    ref = common.peak_in_subprocess("bench.bench_long", {**base, "method": "reference"})
    model = common.model(vocab=32000)
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = [{"method": "reference", "block": "-", "time_s": round(ref["time"], 2), "time_x": 1.0,
             "peak_MiB": round(ref["peak_growth"] / 2**20), "peak_x": 1.0, "predicted_MiB": "-"}]
    for T in [int(x) for x in a.blocks.split(",")]:
        for kv in (False, True):
            if kv and T != 512:
                continue
            r = common.peak_in_subprocess("bench.bench_long", {**base, "method": "stream", "block": T, "kv": kv})
            rows.append({
                "method": "stream+kv" if kv else "stream", "block": T, "time_s": round(r["time"], 2),
                "time_x": round(r["time"] / ref["time"], 2), "peak_MiB": round(r["peak_growth"] / 2**20),
                "peak_x": round(r["peak_growth"] / ref["peak_growth"], 3),
                # the prediction counts the weights, which exist before the call; the gradients
                # are allocated during it (zero_grad(set_to_none=True)), so both sides count them
                "predicted_MiB": round((r["predicted"] - weights_bytes) / 2**20),
            })
            print(rows[-1], flush=True)
    print(common.table(rows, ["method", "block", "time_s", "time_x", "peak_MiB", "peak_x", "predicted_MiB"]))
    print("saved", common.save(f"long_{a.length}", {"args": vars(a), "rows": rows}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("{"):
        child(json.loads(sys.argv[1]))
    else:
        main()

"""How far fp32 and bf16 gradients are from the float64 truth, streamed and reference side by side.

The same weights in float32 and bfloat16, and each dtype's weights again in float64 (the truth for
exactly those weights, so that the error is the computation's, not the rounding of the weights); a
GRPO-shaped batch (G=8, 256-token prompt, 64..192-token responses). Relative error = ‖g − g64‖ /
‖g64‖ over all parameters; per-token log-prob max abs error beside it. The streamed path runs with
block size 64 and 16; `grad accum` says where a bfloat16 gradient is gathered over the block
batches: a float32 buffer rounded once (the default) or the bfloat16 `.grad` itself
(`grad_dtype=None`, one rounding per block batch).

    python -m bench.bench_precision
"""

from __future__ import annotations

import torch

from backstream import reference_backward, stream_backward
from bench import common


def flat_grad(model):
    return torch.cat([p.grad.double().flatten() for p in model.parameters()])


def main():
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    V = 4096
    prompt = torch.randint(0, V, (256,), generator=g)
    lengths = torch.randint(64, 193, (8,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(0, V, (int(n),), generator=g)]) for n in lengths]
    weights = [torch.cat([torch.zeros(256), torch.randn(len(s) - 256, generator=g)]) for s in seqs]
    base = common.model(vocab=V, dtype=torch.float64)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        state = {k: v.to(dtype) for k, v in base.state_dict().items()}
        truth_model = common.model(vocab=V, dtype=torch.float64)
        truth_model.load_state_dict({k: v.double() for k, v in state.items()})
        r64 = reference_backward(truth_model, seqs, [w.double() for w in weights])
        g64 = flat_grad(truth_model)
        runs = [("reference", reference_backward, {}, "-")]
        for block in (64, 16):
            runs.append((f"stream, block {block}", stream_backward, {"block_size": block}, "float32"))
            if dtype == torch.bfloat16:
                runs.append((f"stream, block {block}", stream_backward, {"block_size": block, "grad_dtype": None},
                             "bfloat16 .grad"))
        for name, fn, kw, accum in runs:
            m = common.model(vocab=V, dtype=dtype)
            m.load_state_dict(state)
            r = fn(m, seqs, [w.to(dtype) for w in weights], **kw)
            gd = flat_grad(m)
            lp_err = max(float((a.double() - b).abs().nan_to_num().max()) for a, b in zip(r.logprobs, r64.logprobs))
            rows.append({"dtype": str(dtype).split(".")[1], "path": name, "grad accum": accum,
                         "blocks": getattr(r.stats, "batches_run", "-"),
                         "grad_rel_err": f"{float((gd - g64).norm() / g64.norm()):.2e}",
                         "logprob_max_err": f"{lp_err:.2e}"})
            print(rows[-1], flush=True)
    print(common.table(rows, ["dtype", "path", "grad accum", "blocks", "grad_rel_err", "logprob_max_err"]))
    print("saved", common.save("precision", rows))


if __name__ == "__main__":
    main()

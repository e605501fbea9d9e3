"""How far fp32 and bf16 gradients are from the float64 truth, streamed and reference side by side.

The same weights in float64 (truth, reference path), float32 and bfloat16; a GRPO-shaped batch
(G=8, 256-token prompt, 64..192-token responses). Relative error = ‖g − g64‖ / ‖g64‖ over all
parameters; per-token log-prob max abs error beside it.

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
    truth_model = common.model(vocab=V, dtype=torch.float64)
    r64 = reference_backward(truth_model, seqs, [w.double() for w in weights])
    g64 = flat_grad(truth_model)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, fn in (("reference", reference_backward), ("stream", stream_backward)):
            m = common.model(vocab=V, dtype=dtype)
            m.load_state_dict({k: v.to(dtype) for k, v in truth_model.state_dict().items()})
            r = fn(m, seqs, [w.to(dtype) for w in weights], **({"block_size": 64} if fn is stream_backward else {}))
            gd = flat_grad(m)
            lp_err = max(float((a.double() - b).abs().nan_to_num().max()) for a, b in zip(r.logprobs, r64.logprobs))
            rows.append({"dtype": str(dtype).split(".")[1], "path": name,
                         "grad_rel_err": f"{float((gd - g64).norm() / g64.norm()):.2e}",
                         "logprob_max_err": f"{lp_err:.2e}"})
            print(rows[-1], flush=True)
    print(common.table(rows, ["dtype", "path", "grad_rel_err", "logprob_max_err"]))
    print("saved", common.save("precision", rows))


if __name__ == "__main__":
    main()

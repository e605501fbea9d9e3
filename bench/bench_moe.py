"""MoE router load-balancing loss: what turning it on costs, streamed vs reference, side by side.

A Qwen3-MoE of small width (8 experts, top-2) on GRPO-shaped batches: G responses of S tokens share
a prompt of P tokens; loss on the responses, plus `router_aux_coef` × the load-balancing loss over
every token. With the loss on, the streamed engine must forward every token (the counts need
them all) but still forwards the shared prompt once; the reference forwards it G times and holds
every sequence's graph until its single backward (the loss couples the sequences).

    python -m bench.bench_moe [--quick]
"""

from __future__ import annotations

import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from backstream import TokenWeights, reference_backward, stream_backward
from bench import common
from bench.bench_prefix import batch


def moe_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=256, decoder_sparse_step=1,
                         max_position_embeddings=8192, tie_word_embeddings=True)
    return Qwen3MoeForCausalLM(cfg).eval()


def grads(model, fn, seqs, weights, coef, **kw):
    model.zero_grad(set_to_none=True)
    res = fn(model, seqs, objective=TokenWeights(weights, router_aux_coef=coef), **kw)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), res


def main(quick=False):
    torch.set_num_threads(2)
    model = moe_model()
    rows = []
    for G, L, share in ([(8, 512, 0.875)] if quick else [(8, 512, 0.875), (8, 1024, 0.9375)]):
        seqs, weights, P, S = batch(G, L, share, model.config.vocab_size)
        for coef in (0.0, 0.01):
            g_ref, r_ref = grads(model, reference_backward, seqs, weights, coef)
            g, r = grads(model, stream_backward, seqs, weights, coef, batch_tokens=L)
            err = float((g - g_ref).norm() / g_ref.norm())
            t = common.timed_side_by_side({
                "reference": lambda: grads(model, reference_backward, seqs, weights, coef),
                "stream": lambda: grads(model, stream_backward, seqs, weights, coef, batch_tokens=L),
            }, rounds=2 if quick else 3)
            rows.append({"G": G, "P": P, "S": S, "router_aux_coef": coef, "reference_s": round(t["reference"], 2),
                         "stream_s": round(t["stream"], 2), "speedup": round(t["reference"] / t["stream"], 2),
                         "grad_rel_err_fp32": f"{err:.1e}",
                         "tokens_fwd_stream": r.stats.backward_tokens + r.stats.prefill_tokens,
                         "aux_loss": None if r.stats.router_aux_loss is None else round(r.stats.router_aux_loss, 4)})
            print(rows[-1], flush=True)
    print(common.table(rows, list(rows[0])))
    print(common.save("moe", rows))


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)

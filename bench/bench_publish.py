"""One publish of the learner's weights to a vLLM server, by disk and by transfer, side by side (issue 47).

The model: Qwen3-0.6B's shape (28 layers, hidden 1024, 16 heads / 8 K/V heads of 128, MLP 3072, a tied
151,936-token vocabulary: 596M parameters, 2.4 GB in float32) with random weights, built from its config
(no download). One server the run starts (`backstream`'s own arguments, `--skip-tokenizer-init`: the
requests are token ids), on this machine; both syncs publish to it, alternately, each after an
"optimizer step" (every weight moved in place), so that every publish is a real one:

- disk (`DiskSync`): the whole state dict written as safetensors in the run folder, reloaded by the
  server's worker (the path every publish took before);
- transfer (`TransferSync`): vLLM's weight-transfer engine, no file (on one host through shared memory).

Each publish includes what a run's does: the pause, the sending, the check that the server holds the
weights sent (rl/backends/vllm/weights/ledger.py), the version label, the prefix cache's reset, the resume. The
server's log-probs of a probe after each are compared with the learner's (float32: ~1e-5 here).

    python -m bench.bench_publish [--rounds 5]      # prints one JSON line: disk_s, transfer_s (medians)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

from bench import common


def qwen3_06b():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from backstream import config
    from backstream.default_model import load_default
    from backstream.rl.backends import build_backend
    from backstream.rl.backends.vllm.weights.sync import DiskSync
    from backstream.rl.parallel.dataparallel import DataParallel

    model = qwen3_06b()
    tok = load_default()[1]  # (the server skips its tokenizer: token ids in and out)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = config.load(None, ['rollout.backend="vllm"', 'vllm.extra_args=["--skip-tokenizer-init"]',
                                 "vllm.max_model_len=256", "vllm.kv_cache_gb=1", f'train.output_dir="{run_dir}"'])
        sampling = build_backend(cfg.rollout, cfg.vllm, policy=cfg.model, quant=cfg.quant, seed=0, tokenizer=tok,
                                 eos=[0], run_dir=run_dir, model=model, dp=DataParallel())
        transfer = sampling.weights
        disk = DiskSync(transfer.pool, transfer.launcher, DataParallel(), transfer.folder)
        probe = torch.arange(3, 67)
        times = {"disk": [], "transfer": []}
        gaps = []
        try:
            with torch.no_grad():
                transfer.sync(model, 0)  # the server started from the initial weights
                step = 0
                for _ in range(a.rounds):
                    for name, way in (("disk", disk), ("transfer", transfer)):
                        for p in model.parameters():  # an optimizer step: every weight moved in place
                            p.mul_(1.0001)
                        step += 1
                        for m in transfer.pool.members:  # the server holds what the other way published: stale
                            m.weights = -1
                        t = time.perf_counter()
                        way.sync(model, step)
                        times[name].append(time.perf_counter() - t)
                        gaps.append(_gap(model, transfer.pool.alive()[0].server, probe))
                        print(json.dumps({"publish": name, "s": round(times[name][-1], 3), "gap": gaps[-1]}),
                              flush=True)
        finally:
            disk.close()
            sampling.close()
    res = {"disk_s": round(statistics.median(times["disk"]), 3),
           "transfer_s": round(statistics.median(times["transfer"]), 3),
           "ratio": round(statistics.median(times["transfer"]) / statistics.median(times["disk"]), 3),
           "max_logprob_gap": max(gaps), "model": "Qwen3-0.6B shape, float32",
           "bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "rounds": a.rounds,
           "runs": times, "cpu": platform.processor() or platform.machine()}
    common.save("publish", res)
    print(json.dumps({k: res[k] for k in ("disk_s", "transfer_s", "ratio", "max_logprob_gap", "model", "bytes")}))


def _gap(model, server, probe: torch.Tensor) -> float:
    """max |learner - server| log-prob over a probe's tokens (the server's prompt_logprobs)."""
    answer = server.post("/v1/completions", {"model": "policy", "prompt": [probe.tolist()], "max_tokens": 1,
                                             "prompt_logprobs": 0, "temperature": 1.0})
    served = answer["choices"][0]["prompt_logprobs"][1:]
    got = torch.tensor([d[str(int(t))]["logprob"] for d, t in zip(served, probe[1:])], dtype=torch.float64)
    with torch.no_grad():
        want = model(probe[None]).logits[0, :-1].double().log_softmax(-1).gather(-1, probe[1:, None])[:, 0]
    return float((got - want).abs().max())


if __name__ == "__main__":
    main()

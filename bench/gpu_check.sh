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
# torch with CUDA, transformers >= 5.23); set PYTHON to use another interpreter. On a machine without
# network whose transformers is older, bring the wheels first: bench/gpu_wheels.sh here, carry .whl/.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT="${1:-bench/results}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python || command -v python3)}"
WHEELS="${GPU_WHEELS:-.whl}"
{
  echo "gpu_check: $(date -u +%FT%TZ) on $(hostname); out: $OUT"
  # wheels brought for a machine without network (bench/gpu_wheels.sh): installed into a folder of
  # their own, first on the path, so that the check runs the transformers and peft CI tests
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    SITE="$(mktemp -d /tmp/gpu_check_site.XXXXXX)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
      || { echo "gpu_check: could not install the wheels in $WHEELS"; exit 1; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "gpu_check: from $WHEELS: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
  fi
  "$PY" -c "import sys, torch, transformers, peft; print('gpu_check: python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
  # 520 s for the parts, 10 s of slack for the interpreter and this script: 9 minutes in all
  timeout --signal=TERM --kill-after=5 525 "$PY" -m bench.bench_gpu --out "$OUT" --total 520 "${@:2}"
  echo "gpu_check: exit $? at $(date -u +%FT%TZ)"
} 2>&1 | tee "$OUT/gpu_check.log"

#!/usr/bin/env bash
# The wheels a GPU machine without network needs for the GPU check (bench/gpu_check.sh), made here,
# where pip reaches PyPI: transformers and peft at the versions this environment (CI's) has, pure
# Python, for whatever Python the GPU machine runs. GPU images often hold an older transformers
# (5.17 on this workplace's H200 image; backstream needs >= 5.23: backstream/stream/hf.py).
#   bench/gpu_wheels.sh [DIR]     # default .whl/ (git ignores it); then carry DIR to the GPU machine
# gpu_check.sh installs every wheel in .whl/ (or $GPU_WHEELS) into a folder of its own and puts it
# first on PYTHONPATH, so the check runs the versions CI tests; the machine's torch stays its own.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PY="${PYTHON:-python}"
mkdir -p "$DIR"
pins=$("$PY" - <<'PY'
import importlib.metadata as m
print(" ".join(f"{n}=={m.version(n)}" for n in ("transformers", "peft")))
PY
)
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" $pins
ls -la "$DIR"

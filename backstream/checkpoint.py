"""Checkpoints in Hugging Face format, written atomically.

A checkpoint is a folder `checkpoints/step-N/` holding `save_pretrained` weights (or only the LoRA
adapter), the tokenizer, and `trainer_state.pt` (optimizer, LR schedule, RNG states, data
position, step). It is written under a temporary name and renamed into place only when complete,
so a kill during the write leaves the previous checkpoint as the latest loadable one.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import warnings

import torch

STATE = "trainer_state.pt"
MANIFEST = "step.json"


def _ckpt_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save(run_dir: str, step: int, model, tokenizer, state: dict, keep: int = 2) -> str:
    root = _ckpt_dir(run_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{step}")
    tmp = os.path.join(root, f".tmp-step-{step}")
    shutil.rmtree(tmp, ignore_errors=True)  # a write that a kill interrupted
    try:
        os.makedirs(tmp)
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(state, os.path.join(tmp, STATE))
        sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in os.listdir(tmp)
                 if os.path.isfile(os.path.join(tmp, name))}
        with open(os.path.join(tmp, MANIFEST), "w") as f:  # what resume checks the folder against
            json.dump({"step": step, "sizes": sizes}, f)
        for name in os.listdir(tmp):  # durable before the rename makes it visible
            if os.path.isfile(os.path.join(tmp, name)):
                with open(os.path.join(tmp, name), "rb") as f:
                    os.fsync(f.fileno())
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest(run_dir)
        raise OSError(e.errno, f"checkpoint: writing step {step} failed ({e.strerror or e}); nothing was "
                               f"replaced, the latest checkpoint is still {prev or 'none'}") from e
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first (temporary folders are not checkpoints)."""
    root = _ckpt_dir(run_dir)
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step-") and os.path.exists(os.path.join(path, STATE)):
            steps.append((int(name.split("-", 1)[1]), path))
    return [p for _, p in sorted(steps)]


def latest(run_dir: str) -> str | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def damage(path: str) -> str | None:
    """What is wrong with a checkpoint folder (a file missing or of another size than written), or None."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            sizes = json.load(f)["sizes"]
    except (OSError, ValueError, KeyError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, {size} were written"
    return None


def latest_intact(run_dir: str) -> str | None:
    """The newest checkpoint whose files are as written; a damaged newer one is skipped with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        bad = damage(path)
        if bad is None:
            return path
        warnings.warn(f"resume: skipping the damaged checkpoint {path}: {bad}", stacklevel=2)
    return None


def load_state(path: str) -> dict:
    """The trainer state of a checkpoint: tensors, numbers, strings and containers only
    (`weights_only=True`), so that a checkpoint folder from anywhere cannot run code when loaded."""
    file = os.path.join(path, STATE)
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"resume: {file} holds objects other than tensors, numbers and containers; it was refused "
                         "because loading it could run code. Resume only from checkpoints backstream wrote") from e


def rng_state(generator: torch.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "sampler": generator.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng(state: dict, generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    generator.set_state(state["sampler"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

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

import torch

STATE = "trainer_state.pt"


def _ckpt_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save(run_dir: str, step: int, model, tokenizer, state: dict, keep: int = 2) -> str:
    root = _ckpt_dir(run_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{step}")
    tmp = os.path.join(root, f".tmp-step-{step}")
    shutil.rmtree(tmp, ignore_errors=True)  # a write that a kill interrupted
    os.makedirs(tmp)
    model.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(state, os.path.join(tmp, STATE))
    with open(os.path.join(tmp, "step.json"), "w") as f:
        json.dump({"step": step}, f)
    for name in os.listdir(tmp):  # durable before the rename makes it visible
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
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

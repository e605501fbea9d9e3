"""`backstream export`: a run's policy as the quantized model a sampler serves (docs/design.md §6, QaRL).

`export(RUN_DIR, "w4a16")` takes the run's latest intact checkpoint, quantizes it as the learner's
forward does (`quantize_model` with the run's [quant] targets; the weight codes and scales written
are `QuantLinear.qweight()`'s tensors, bit for bit) and writes a Hugging Face folder in the
compressed-tensors layout that vLLM (and transformers, with compressed-tensors installed) loads:

  format  compressed-tensors  tensors of each quantized linear [N out, K in]         activations
  w8a8    int-quantized       weight int8 [N,K], weight_scale f32 [N,1]              dynamic per-token int8
  fp8     float-quantized     weight float8_e4m3fn [N,K], weight_scale f32 [N,1]     dynamic per-token fp8
  w4a16   pack-quantized      weight_packed int32 [N,K/8], weight_scale f32 [N,K/g], the model dtype
                              weight_shape int64 [2] = (N, K)

(each row is its format's `export_tensors`, and `scheme` for config.json: quant/formats.py; the writing
is quant/compressed.py's)

Every other tensor (embeddings, norms, biases, lm_head, the layers [quant].targets leaves out)
stays in the run's dtype; the layers not quantized are listed in `ignore`, so the
config's `targets = ["Linear"]` minus `ignore` is exactly the set `quantize_model` replaced. The
folder also holds the tokenizer, the generation config, and `backstream_export.json` (which run,
step and format). A LoRA run keeps its adapter in full precision over the quantized base layers, as
the learner does: the base (`model.name`) is exported quantized and the checkpoint's adapter is
copied unchanged into OUT/adapter/ (vLLM: `--enable-lora` and a LoRARequest on that folder).

What the runtimes do with it (read 2026-11): vLLM keeps w8a8/fp8 weight scales in float32 and
quantizes activations as our learner does (docs/design.md §6); it holds w4a16 scales in the model dtype,
which `quantize_weight` already rounds them to for a 16-bit model (checked here: a scale that would
round is warned about). transformers (compressed-tensors installed) decompresses the weights to
dense ones on the first forward, bit for bit codes · scale, and fake-quantizes w8a8/fp8 activations
with compressed-tensors' formula, not vLLM's: int8 scale absmax/127.5 (so its w8a8 logits are an
approximation of the sampler's: 0.2-0.7% of the largest logit on tiny models), fp8 a division by
absmax/448 (the same e4m3 codes but within an ulp of a tie). w4a16 through transformers is the
learner's forward exactly. tests/quant/test_export.py checks each.

Refused, before anything is written: MoE models (transformers 5 keeps experts as fused 3-D weights,
which the learner does not quantize; transformers cannot load such a folder with dense experts), a
[quant].targets that quantizes part of a group vLLM fuses (q/k/v, gate/up), a LoRA run whose learner
quantized adapter layers. The folder is written under a temporary name beside OUT and renamed into
place when complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings

import torch

from backstream import checkpoint
from backstream import config as cfgmod
from backstream.checks import UserError, choice
from backstream.log import log
from backstream.quant.compressed import (
    ADAPTER_FILES,
    compress,
    quantization_config,
    warn_scale_rounding,
    write_folder,
)
from backstream.quant.formats import GROUP_SIZES, get_format
from backstream.quant.linear import quantize_model
from backstream.stream.hf import base_model


def _run_config(run_dir: str):

    path = os.path.join(run_dir, "config.toml")
    if not os.path.isfile(path):
        raise UserError(f"export: {run_dir} is not a run folder (no config.toml)")
    return cfgmod.load(path)


def _learner(cfg, ckpt: str, quant_cfg):
    """(model, tokenizer): the run's policy at checkpoint `ckpt`, quantized by `quant_cfg`, built as
    the trainer builds it (`model.build`, LoRA, then `quantize_model`). A full fine-tune loads the
    checkpoint folder itself (a `save_pretrained` folder: its safetensors hold the master weights);
    a LoRA run loads the base `model.name` and the checkpoint's adapter."""
    mc = cfg.model
    if mc.lora_r == 0:
        model, tok = dataclasses.replace(mc, name=ckpt).build()
        quantize_model(model, quant_cfg)
        return model, tok
    from peft import set_peft_model_state_dict  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    model, tok = mc.build()
    quantize_model(model, quant_cfg)  # after LoRA: the base layers, as the trainer does
    misfit = (f"export: the adapter in {ckpt} does not fit the model {mc.name!r} that the run's config.toml "
              "names (was the run trained on a model object passed in?)")
    try:
        res = set_peft_model_state_dict(model, load_file(os.path.join(ckpt, "adapter_model.safetensors")))
    except RuntimeError as e:  # a shape mismatch
        raise UserError(f"{misfit}: {e}") from None
    unexpected = getattr(res, "unexpected_keys", [])
    if unexpected:
        raise UserError(f"{misfit}: unexpected keys {unexpected[:3]}")
    return model, tok


def _check_out(out: str, overwrite: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"export: --out {out} is a file, not a folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise UserError(f"export: --out {out} exists and is not empty; choose another --out or pass "
                         "--overwrite to move the old folder aside")


def _move_aside(path: str) -> str:
    aside = f"{path.rstrip(os.sep)}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while os.path.exists(aside):
        aside, n = f"{aside.rsplit('~', 1)[0]}~{n}", n + 1
    os.rename(path, aside)
    return aside


def export(run_dir: str, quant: str, out: str | None = None, group_size: int | None = None,
           overwrite: bool = False) -> str:
    """Write RUN_DIR's latest intact checkpoint, quantized to `quant` (w8a8, w4a16 or fp8) as the
    learner's forward quantizes it, as a compressed-tensors model folder; returns the folder.
    `out`: default RUN_DIR/export-QUANT-step-N; an existing non-empty folder is refused unless
    `overwrite` (it is then moved aside to OUT.old-TIME, never deleted). `group_size` (w4a16 only):
    default the run's quant.group_size. Every check runs before anything is written."""
    fmt = get_format(quant, "export: --quant")
    cfg = _run_config(run_dir)
    ckpt = checkpoint.latest_intact(run_dir)
    if ckpt is None:
        raise UserError(f"export: {run_dir} holds no intact checkpoint (checkpoints/step-N); train it first, "
                         "or keep the run going until it saves one")
    if group_size is not None and not fmt.grouped:
        raise UserError(f"export: --group-size applies to w4a16 only; {quant} has one scale per output channel")
    gs = cfg.quant.group_size if group_size is None else group_size
    choice("export: --group-size", gs, list(GROUP_SIZES))
    with open(os.path.join(ckpt, checkpoint.MANIFEST)) as f:
        step = json.load(f)["step"]
    out = out or os.path.join(run_dir, f"export-{quant}-step-{step}")
    _check_out(out, overwrite)
    run_q = cfg.quant
    sampled = run_q.format  # None: a full-precision sampler, which no export claims to be
    if sampled is not None and (sampled is not fmt or (fmt.grouped and gs != run_q.group_size)):
        trained = run_q.rollout + (f" (group {run_q.group_size})" if sampled.grouped else "")
        warnings.warn(f"export: the run sampled with {trained}; this {quant} export is a quantization of its "
                      "weights that the run never saw", stacklevel=2)
    qcfg = dataclasses.replace(run_q, rollout=quant, group_size=gs)

    model, tok = _learner(cfg, ckpt, qcfg)
    lora = cfg.model.lora_r > 0
    tensors, ignore, dtype = compress(model, fmt, gs, lora)
    if fmt.scales_in_model_dtype and dtype in (torch.bfloat16, torch.float16):
        warn_scale_rounding(tensors, dtype)
    if lora:
        model = model.unload()  # the transformers model, its quantized layers in place of PEFT's wrappers
    base = base_model(model)
    record = {"run_dir": os.path.abspath(run_dir), "checkpoint": os.path.abspath(ckpt), "step": step,
              "format": quant, "group_size": gs if fmt.grouped else None,
              "quantized_modules": len({k.rsplit(".", 1)[0] for k in tensors if k.endswith("weight_scale")}),
              "adapter": "adapter" if lora else None}

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    aside = None
    try:
        write_folder(tmp, base, tok, tensors, quantization_config(fmt, gs, ignore), record)
        if lora:
            os.makedirs(os.path.join(tmp, "adapter"))
            for name in ADAPTER_FILES:  # the learner's adapter, byte for byte
                shutil.copyfile(os.path.join(ckpt, name), os.path.join(tmp, "adapter", name))
        if os.path.isdir(out) and os.listdir(out):
            aside = _move_aside(out)
        elif os.path.isdir(out):
            os.rmdir(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not os.path.exists(out):
            os.rename(aside, out)  # the old folder back where it was
        raise
    if aside is not None:
        log.info(f"moved the earlier {out} aside to {aside}")
    return out

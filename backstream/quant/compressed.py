"""A quantized model as the compressed-tensors folder a sampler serves (docs/design.md §6, QaRL): the codes
and scales the learner's forward computes (`QuantLinear.qweight()`'s tensors, bit for bit) written in
the layout vLLM (and transformers, with compressed-tensors installed) loads:

  format  compressed-tensors  tensors of each quantized linear [N out, K in]         activations
  w8a8    int-quantized       weight int8 [N,K], weight_scale f32 [N,1]              dynamic per-token int8
  fp8     float-quantized     weight float8_e4m3fn [N,K], weight_scale f32 [N,1]     dynamic per-token fp8
  w4a16   pack-quantized      weight_packed int32 [N,K/8], weight_scale f32 [N,K/g], the model dtype
                              weight_shape int64 [2] = (N, K)

(each row is its format's `export_tensors`, and `scheme` for config.json: quant/formats.py). Every other
tensor (embeddings, norms, biases, lm_head, the layers [quant].targets leaves out) stays in the run's
dtype; the layers not quantized are listed in `ignore`, so the config's `targets = ["Linear"]` minus
`ignore` is exactly the set `quantize_model` replaced. `write_compressed` is what a vLLM run publishes
low-bit weights with; backstream/export.py (`backstream export`) writes a run's checkpoint so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import torch
from torch import nn

from backstream.checks import UserError
from backstream.quant.formats import Format
from backstream.quant.linear import quant_linears
from backstream.stream.hf import base_model

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
RECORD = "backstream_export.json"
# vLLM runs these HF projections as one fused layer; its shards must all be quantized or all not
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# ---- the compressed-tensors config ---------------------------------------------------------------

def quantization_config(fmt: Format, group_size: int, ignore: list[str]) -> dict:
    """config.json's `quantization_config` for `fmt`: its compressed-tensors scheme (`Format.scheme`),
    targets every `Linear` but `ignore`."""
    scheme = {"targets": ["Linear"], **fmt.scheme(group_size), "output_activations": None, "format": fmt.ct_format}
    return {"quant_method": "compressed-tensors", "format": fmt.ct_format, "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": ignore, "kv_cache_scheme": None,
            "global_compression_ratio": None}


def _is_linear(module: nn.Module) -> bool:
    """What compressed-tensors' and vLLM's target "Linear" matches: a class named Linear in the MRO."""
    return any(c.__name__ == "Linear" for c in type(module).__mro__)


def _fused_split(quantized: set[str], linears: list[str]) -> list[str]:
    """Fused groups (q/k/v, gate/up) of which some shards are quantized and some not."""
    bad = []
    for name in linears:
        parent, _, leaf = name.rpartition(".")
        for shards in FUSED.values():
            if leaf == shards[0]:
                present = [f"{parent}.{s}" for s in shards if f"{parent}.{s}" in linears]
                if len({n in quantized for n in present}) > 1:
                    bad.append(f"{parent}.{{{','.join(shards)}}}")
    return bad


# ---- export ---------------------------------------------------------------------------------------


def compress(model: nn.Module, fmt: Format, group_size: int, lora: bool):
    """The compressed tensors of every quantized linear, by checkpoint name, and the names of the
    Linear modules left unquantized (the config's `ignore`). Refuses what vLLM could not load."""
    base = base_model(model)
    experts = [n for n, p in base.named_parameters() if p.dim() > 2]
    if experts:
        raise UserError(f"export: {type(base).__name__} keeps MoE experts as fused 3-D weights ({experts[0]}, ...), "
                         "which the learner leaves in full precision; transformers cannot load a compressed-tensors "
                         "folder whose experts are dense beside quantized linears, and vLLM applies the 'Linear' "
                         "scheme to fused experts. Export supports dense (non-MoE) models")
    qlins = quant_linears(base)
    if not qlins:
        raise UserError("export: quantize_model replaced no layer; check quant.targets in the run's config.toml")
    names = {}
    for name, mod in qlins.items():
        if lora and ".lora_" in name:
            raise UserError(f"export: {name} is a LoRA adapter layer quantized by the learner; the export keeps "
                             "adapters in full precision, so it would not be the learner's model")
        names[name] = name.removesuffix(".base_layer") if lora else name
    hf = {n: m for n, m in base.named_modules() if ".lora_" not in n}
    linears = [n.removesuffix(".base_layer") for n, m in hf.items()
               if (_is_linear(m) or n in qlins) and not (lora and n + ".base_layer" in hf)]
    quantized = set(names.values())
    split = _fused_split(quantized, linears)
    if split:
        raise UserError(f"export: vLLM fuses {split[0]} into one layer and needs all of its parts quantized or "
                         f"none; quant.targets quantizes only some ({len(split)} such groups). Retrain with "
                         "targets that take whole groups, or export from a run that did")
    shared = {}
    for p_name, p in base.named_parameters(remove_duplicate=False):
        shared.setdefault(p.data_ptr(), []).append(p_name)
    tensors = {}
    dtype = next(base.parameters()).dtype
    with torch.no_grad():
        for name, mod in qlins.items():
            out_name = names[name]
            if len(shared.get(mod.weight.data_ptr(), [])) > 1:
                raise UserError(f"export: {out_name}'s weight is tied to {shared[mod.weight.data_ptr()]}; a tied "
                                 "weight cannot be stored both quantized and not; leave it out of quant.targets")
            qw = mod.qweight()
            assert qw.format is fmt and qw.group_size == (group_size if fmt.grouped else None), (name, qw.fmt)
            qw = dataclasses.replace(qw, codes=qw.codes.detach().cpu().contiguous(),
                                     scale=qw.scale.detach().cpu().contiguous())
            N, K = mod.out_features, mod.in_features
            assert qw.codes.shape == (N, K) and qw.scale.dtype == torch.float32, (name, qw.codes.shape, qw.scale.dtype)
            tensors.update(fmt.export_tensors(out_name, qw))  # QWeight as it is, in the format's layout
            if mod.bias is not None:
                tensors[f"{out_name}.bias"] = mod.bias.detach().cpu()
    ignore = [n for n in linears if n not in quantized]
    return tensors, ignore, dtype


def write_compressed(model: nn.Module, fmt: Format, group_size: int, out: str, tokenizer=None) -> None:
    """A live quantized model (its QuantLinear layers, as the learner's forward quantizes them) written
    to `out` as a compressed-tensors folder, as `export` writes one: what the vLLM backend starts its
    server from and publishes after every optimizer step (rl/backends/vllm/weights/sync.py `DiskSync`)."""
    tensors, ignore, _ = compress(model, fmt, group_size, lora=False)
    write_folder(out, base_model(model), tokenizer, tensors, quantization_config(fmt, group_size, ignore), None)


def write_folder(tmp: str, base: nn.Module, tok, tensors: dict, qconfig: dict, record: dict | None) -> None:
    quantized = {k.rsplit(".", 1)[0] for k in tensors}
    state = {k: v for k, v in base.state_dict().items() if k.rsplit(".", 1)[0] not in quantized}
    state.update(tensors)
    old = getattr(base.config, "quantization_config", None)
    base.config.quantization_config = qconfig
    try:
        base.save_pretrained(tmp, state_dict=state)  # drops tied copies (lm_head), shards, generation config
    finally:
        if old is None:
            del base.config.quantization_config
        else:
            base.config.quantization_config = old
    if tok is not None:
        tok.save_pretrained(tmp)
    if record is not None:
        with open(os.path.join(tmp, RECORD), "w") as f:
            json.dump(record, f, indent=1)


def warn_scale_rounding(tensors: dict, dtype: torch.dtype) -> None:
    scales = [v for k, v in tensors.items() if k.endswith("weight_scale")]
    rounded = sum(int((s.to(dtype).float() != s).sum()) for s in scales)
    if rounded:
        total = sum(s.numel() for s in scales)
        warnings.warn(f"export: vLLM holds w4a16 scales in the model dtype ({dtype}); {rounded} of {total} float32 "
                      "scales round in it, so the sampler's weights will differ slightly from the learner's",
                      stacklevel=3)

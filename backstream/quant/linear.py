"""Low-bit linear layers whose numerics copy vLLM's kernels, with a straight-through backward onto
the full-precision master weights: the sampler and the learner of QaRL (QaRL/TBPO §3.1, docs/design.md §6).

The sampler (rollout) runs the quantized forward; with `quant.aligned` the learner runs the very same
forward, so the two distributions agree (mismatch 0 up to float rounding), and the backward treats
quantization as the identity (straight-through estimator) so the optimizer trains master weights:
grad_x = grad_y · W_deq, grad_W = grad_yᵀ · x_deq, grad_b = Σ grad_y.
A `QuantLinear` holds the nn.Linear's own weight/bias Parameters (the master weights: the optimizer,
the checkpoint and LoRA see nothing new) and caches their quantized form until they change. What a
format computes (codes and scales, activation quantizer, GEMM, what the backward reads) is its
`Format` object's, with every formula and its vLLM source: quant/formats.py.

The default targets are the nn.Linear modules inside the decoder layers: never embeddings, the LM head
or MoE routers (llm-compressor's recipes leave them out and vLLM runs them in full precision), and never
LoRA's adapters (PEFT's `...q_proj.base_layer` is quantized, lora_A/lora_B stay full precision).
transformers 5 MoE experts are fused 3-D parameters, not nn.Linear, and stay full precision. More, with
the traps and measured speeds: docs/quant.md.
"""

from __future__ import annotations

import fnmatch
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backstream.checks import UserError, choice, literals
from backstream.quant.formats import FORMATS, GROUP_SIZES, INT8_GEMMS, Format, QWeight, get_format, saturating_pairs
from backstream.quant.formats import dequantize_weight as dequantize_weight

# the quantizers live in formats.py and are imported from here too (tests, bench): `x as x` re-exports
from backstream.quant.formats import int8_mm as int8_mm
from backstream.quant.formats import quantize_fp8_act as quantize_fp8_act
from backstream.quant.formats import quantize_int8_act as quantize_int8_act
from backstream.quant.formats import quantize_weight as quantize_weight
from backstream.stream.hf import base_model, decoder_layers, num_experts, text_config


@dataclass(kw_only=True)
class QuantConfig:
    rollout: Literal[("none", *FORMATS)] = "none"
    """The sampler's (rollout's) forward: "none", "w8a8" (int8 weights per channel, int8 activations per
    token), "w4a16" (int4 weights per group, activations as they are) or "fp8" (e4m3 weights per channel,
    e4m3 activations per token); numerics copied from vLLM (docs/quant.md)."""
    aligned: bool = False
    """The learner's forward uses the sampler's quantized numerics, with a straight-through backward onto
    the full-precision master weights (QaRL); false: a full-precision learner."""
    group_size: int = 128
    """w4a16: inputs sharing one weight scale (32, 64 or 128); must divide every target's in_features."""
    targets: list[str] = field(default_factory=list)
    """fnmatch patterns on module names (model.named_modules()) of the nn.Linear layers to quantize;
    [] = every nn.Linear inside the decoder layers. Embeddings, the LM head and MoE routers never are."""

    def __post_init__(self):
        literals(self, "quant")
        if not isinstance(self.aligned, bool):
            raise UserError(f"quant.aligned: got {self.aligned!r}, expected true or false")
        if isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES:
            raise UserError(f"quant.group_size: got {self.group_size!r}, expected one of {list(GROUP_SIZES)}")
        if not isinstance(self.targets, list) or not all(isinstance(t, str) and t for t in self.targets):
            raise UserError(f"quant.targets: got {self.targets!r}, expected a list of non-empty fnmatch patterns "
                             "(e.g. [\"*.mlp.*\"]); [] = every linear of the decoder layers")
        if self.aligned and not self.enabled:
            raise UserError("quant.aligned = true needs quant.rollout = w8a8|w4a16|fp8 (the learner aligns to a "
                             "quantized sampler); set quant.rollout or quant.aligned = false")

    @property
    def format(self) -> Format | None:
        """The rollout's format; None for "none"."""
        return FORMATS.get(self.rollout)

    @property
    def enabled(self) -> bool:
        return self.format is not None


class _QuantLinearFn(torch.autograd.Function):
    """Quantized forward, straight-through backward: the gradients of y = x_deq · W_deqᵀ + b, with
    W_deq's gradient delivered to the master weight and x_deq's to x."""

    @staticmethod
    def forward(ctx, x_MK: Tensor, weight: Tensor, bias: Tensor | None, q: QWeight, operand: Tensor | None):
        y_MN, saved = q.format.forward(x_MK, bias, q, operand)
        ctx.q, ctx.x_dtype, ctx.w_dtype, ctx.has_bias = q, x_MK.dtype, weight.dtype, bias is not None
        ctx.operand = operand  # w4a16's is W_deq, which the backward reuses
        ctx.save_for_backward(*saved)  # int8/e4m3 codes + scales: 1 byte per element, not x's 2 to 8
        return y_MN

    @staticmethod
    def backward(ctx, grad_MN: Tensor):
        q, dtype = ctx.q, ctx.x_dtype
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_MN @ q.format.w_for_input_grad(q, ctx.operand, dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_MN.t() @ q.format.x_for_weight_grad(ctx.saved_tensors, dtype)).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_MN.sum(0).to(ctx.w_dtype)
        return grad_x, grad_w, grad_b, None, None


# ---------------------------------------------------------------------------------------------
# The module


class QuantLinear(nn.Module):
    """An nn.Linear whose forward runs `fmt`'s low-bit numerics (`enabled`) or plain F.linear on the
    master weight (not enabled). It holds the linear's own weight/bias Parameters, so parameter names,
    the optimizer and checkpoints are unchanged; the quantized weight is recomputed only when the
    weight changed (its version counter, storage or dtype), i.e. once per optimizer step.
    In-place edits through `.data` (and fused optimizers) bypass the version counter: call `invalidate()`."""

    def __init__(self, linear: nn.Linear, fmt: str, group_size: int = 128):
        super().__init__()
        self.format = get_format(fmt)
        self.group_size = self.format.check_group_size(group_size)  # None: one scale per output channel
        self.format.check_in_features(linear.in_features, self.group_size)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.enabled = True
        self.gemm = "exact"  # how the sampler's int8 GEMM sums (formats.INT8_GEMMS; `set_int8_gemm`)
        self._q: QWeight | None = None
        self._key: tuple | None = None
        self._operands: dict[torch.dtype, Tensor] = {}  # by operand dtype: what the GEMM reads

    @property
    def fmt(self) -> str:
        return self.format.name

    def invalidate(self) -> None:
        """Forget the quantized weight (after an edit the version counter cannot see)."""
        self._q, self._key, self._operands = None, None, {}

    def qweight(self) -> QWeight:
        w = self.weight
        key = (w._version, w.data_ptr(), w.dtype, w.device, self.gemm)
        if self._q is None or key != self._key:
            self._q = self.format.quantize_weight(w.detach(), self.group_size)
            if self.gemm == "int16-pairs":
                self._q.pairs = saturating_pairs(self._q.codes)
            self._key, self._operands = key, {}
        return self._q

    def _operand(self, q: QWeight, x_dtype: torch.dtype) -> Tensor | None:
        """The weight as the GEMM reads it, kept beside the codes (one more copy of the weight):
        the codes as float (w8a8's float path, fp8) or W_deq in `x_dtype` (w4a16)."""
        dtype = self.format.operand_dtype(q, x_dtype)
        if dtype is None:
            return None
        if dtype not in self._operands:
            self._operands[dtype] = self.format.operand(q, dtype)
        return self._operands[dtype]

    def forward(self, x: Tensor) -> Tensor:
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        q = self.qweight()
        x_MK = x.reshape(-1, self.in_features)
        y_MN = _QuantLinearFn.apply(x_MK, self.weight, self.bias, q, self._operand(q, x.dtype))
        return y_MN.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt}{group}, enabled={self.enabled}")


# ---------------------------------------------------------------------------------------------
# Whole models


def quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}


def set_quantized(model: nn.Module, on: bool) -> None:
    """Every QuantLinear runs its quantized forward (on) or full precision (off)."""
    if not isinstance(on, bool):
        raise UserError(f"on: got {on!r}, expected True or False")
    mods = quant_linears(model)
    if on and not mods:
        raise UserError("model: has no QuantLinear modules to switch on; call quantize_model(model, cfg) first")
    for m in mods.values():
        m.enabled = on


def set_int8_gemm(model: nn.Module, gemm: str) -> int:
    """Every w8a8 QuantLinear sums its int8 products as the sampler's kernel does (formats.INT8_GEMMS:
    "exact", or oneDNN's "int16-pairs" on a CPU without VNNI), so that an aligned learner computes
    what that server computes; returns how many layers it set. Other formats have no int8 GEMM."""
    choice("gemm", gemm, INT8_GEMMS)
    mods = [m for m in quant_linears(model).values() if m.format.int8_gemm]
    for m in mods:
        if m.gemm != gemm:
            m.gemm = gemm
            m.invalidate()
    return len(mods)


@contextmanager
def quantized(model: nn.Module, on: bool):
    """`set_quantized(model, on)` for the block; each module's previous state comes back on exit.
    A model without QuantLinear modules and on=False is left as it is."""
    before = {m: m.enabled for m in quant_linears(model).values()}
    set_quantized(model, on)
    try:
        yield model
    finally:
        for m, state in before.items():
            m.enabled = state


def _logical(name: str) -> str:
    """PEFT's `x.q_proj.base_layer` is the model's `x.q_proj`."""
    return name.replace(".base_layer", "")


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear except adapters' own (LoRA's lora_A/lora_B: anything under a module with a
    `base_layer` other than that base layer)."""
    mods = dict(model.named_modules())
    out = {}
    for name, m in mods.items():
        if not isinstance(m, nn.Linear):
            continue
        parts = name.split(".")
        inside_adapter = any(hasattr(mods.get(".".join(parts[:i])), "base_layer") and parts[i] != "base_layer"
                             for i in range(1, len(parts)))
        if not inside_adapter:
            out[name] = m
    return out


def _never(model: nn.Module) -> dict[str, str]:
    """name → why: the LM head and MoE routers, which vLLM keeps in full precision."""
    base = base_model(model)
    experts = num_experts(text_config(model))
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    mods = dict(model.named_modules())
    out = {}
    for name, m in _linears(model).items():
        parent, _, leaf = _logical(name).rpartition(".")
        # one logit per expert, beside the experts: a router even under another name
        beside_experts = experts is not None and m.out_features == experts and hasattr(mods.get(parent), "experts")
        if m is head or leaf == "lm_head":
            out[name] = "the LM head"
        elif leaf in ("gate", "router") or beside_experts:
            out[name] = "an MoE router"
    return out


def _decoder_layers(model: nn.Module) -> list[str]:
    """Names of the decoder layers (`hf.decoder_layers`), or an error naming what to set instead."""
    names = list(decoder_layers(model))
    if not names:
        raise UserError(f"model: found no decoder layers in {type(base_model(model)).__name__}; name the linears "
                         "with quant.targets")
    return names


def _targets(model: nn.Module, cfg: QuantConfig) -> list[str]:
    linears, never = _linears(model), _never(model)
    if not cfg.targets:
        layers = _decoder_layers(model)
        return [n for n in linears if n not in never and any(n.startswith(f"{lay}.") for lay in layers)]
    chosen = []
    for pat in cfg.targets:
        hits = [n for n in linears if fnmatch.fnmatchcase(n, pat) or fnmatch.fnmatchcase(_logical(n), pat)]
        if not hits:
            some = ", ".join(list(linears)[:4])
            raise UserError(f"quant.targets: {pat!r} matches no nn.Linear (module names look like {some}, ...)")
        kept = [n for n in hits if n not in never]
        if not kept:
            why = sorted({never[n] for n in hits})
            raise UserError(f"quant.targets: {pat!r} matches only {' and '.join(why)} ({', '.join(hits[:3])}), which "
                             "stay in full precision (as in vLLM); remove the pattern")
        chosen += [n for n in kept if n not in chosen]
    return [n for n in linears if n in chosen]  # model order


def quantize_model(model: nn.Module, cfg: QuantConfig) -> list[str]:
    """Replace the target nn.Linear modules of `model` (after PEFT wrapping: LoRA's base layers) by
    QuantLinear modules of `cfg.rollout`'s format, in place, enabled; returns the replaced names.
    Every check runs before anything is modified."""
    QuantConfig(**{k: getattr(cfg, k) for k in ("rollout", "aligned", "group_size", "targets")})  # re-validate
    if not cfg.enabled:
        raise UserError(f"quant.rollout: got 'none', which quantizes nothing; expected one of {list(FORMATS)}")
    already = quant_linears(model)
    if already:
        raise UserError(f"model: already has {len(already)} QuantLinear modules (e.g. {next(iter(already))}); "
                         "quantizing twice is refused: switch formats on a fresh model, and use "
                         "set_quantized / quantized to turn the quantized forward on or off")
    names = _targets(model, cfg)
    if not names:
        raise UserError("quant.targets: no nn.Linear to quantize in the decoder layers; name them with quant.targets")
    mods = dict(model.named_modules())
    for name in names:
        lin = mods[name]
        if not lin.weight.is_floating_point() or lin.weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise UserError(f"model: {name}.weight is {lin.weight.dtype}, not a full-precision master weight; "
                             "quantize a float32/bfloat16/float16/float64 model")
        cfg.format.check_layer(name, lin.in_features, cfg.group_size)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear(mods[name], cfg.rollout, cfg.group_size))
    return names

"""Low-bit linear layers whose numerics copy vLLM's kernels, with a straight-through backward onto
the full-precision master weights: the sampler and the learner of QaRL (QaRL/TBPO §3.1, DESIGN §6).

The sampler (rollout) runs the quantized forward; with `quant.aligned` the learner runs the very same
forward, so the two distributions agree (mismatch 0 up to float rounding), and the backward treats
quantization as the identity (straight-through estimator) so the optimizer trains master weights.
A `QuantLinear` holds the nn.Linear's own weight/bias Parameters (the master weights: the optimizer,
the checkpoint and LoRA see nothing new) and caches their quantized form until they change.

Numerics (x: activations [M, K] per token row; W: weight [N, K]; ct = float32, float64 for a float64
model so that float64 tests stay exact; round = round half to even, torch.round / cvt.rni):

  int8 activations (w8a8), vLLM `dynamic_scaled_int8_quant` (csrc/quantization/w8a8/int8/scaled_quant.cu):
      s_x = absmax(x_row) / 127,  q_x = sat±127(round(x · (127 / absmax)))   (absmax = 0: s_x = 0, q_x = 0)
    The kernel multiplies by 127/absmax, not by 1/s_x (they differ by an ulp at most; we copy the kernel).
    Not compressed-tensors'/torchao's fake-quant, which use absmax/127.5 (DESIGN §6: 98.8% differ).
  fp8 activations, vLLM `QuantFP8.forward_native` (model_executor/layers/quantization/input_quant_fp8.py),
    the per-token twin of the CUDA `dynamic_per_token_scaled_fp8_quant` (csrc/quantization/w8a8/fp8/common.cu):
      s_x = max(absmax / 448, 1 / (448·512)),  q_x = e4m3(clamp(x · (1 / s_x), ±448))
    (the current CUDA kernel divides x / s_x instead: a different e4m3 only within an ulp of a tie).
  weights, symmetric, as compressed-tensors' `calculate_qparams` + `_quantize` write them (what
  llm-compressor exports and vLLM loads): s = absmax / ((q_max − q_min) / 2), q = round(clamp(w / s, q_min, q_max))
      w8a8  int8 per output channel:  s = absmax/127.5, q ∈ [−128, 127]   (−absmax → −128, +absmax → 127)
      w4a16 int4 per group of `group_size` inputs: s = absmax/7.5, q ∈ [−8, 7]; s rounded to the
            model's dtype first when that is 16-bit (vLLM's Marlin/Machete kernels hold bf16/fp16 scales)
      fp8   e4m3 per output channel: s = absmax/448, q = e4m3(clamp(w / s, ±448))
    a zero scale becomes float32 eps (compressed-tensors' zero guard); scales are stored in float32.
    An exporter writes `QWeight` as it is (never re-quantizes): w8a8/fp8 scales in float32 (vLLM loads
    them into float32 parameters; bf16 would change them), w4a16 scales in the model dtype (lossless).
  GEMMs: w8a8 accumulates q_x·q_Wᵀ exactly in int32 (`torch._int_mm` on CUDA, padded to its shape
    limits; on CPUs without VNNI/AMX, where `_int_mm` is 8–30× slower than sgemm, the same integers from
    float32 GEMMs over K-chunks of ≤ 1024, every partial sum < 2²⁴ so exact), then vLLM's CUTLASS
    epilogue (`ScaledEpilogue[Bias]`: s_x · (s_W · float(acc)) + bias) in ct, cast to x.dtype. The int32
    is exact, so a row's output does not depend on the other rows (the sampler decodes one token per
    row, the learner forwards blocks: they agree bitwise on the same rows).
    w4a16: dequantize (q·s in the activation dtype) and matmul in the activation dtype: torch's int4
    weight-only kernels (`_weight_int4pack_mm`) want an asymmetric scales-and-zeros layout, not this one.
    fp8: the e4m3 codes as ct (exact), one ct GEMM, then the same epilogue as w8a8 (a CPU float8
    `torch._scaled_mm` is emulated and slow).
  backward (straight through): grad_x = grad_y · W_deq, grad_W = grad_yᵀ · x_deq (x_deq = q_x·s_x the
    forward used; x itself for w4a16), grad_b = Σ grad_y: the master weight gets the gradient w.r.t. the
    dequantized weight, unclipped (torchao's int4 fake-quant clips it at the top code; its fp8 one
    returns fp8(s)/s instead of 1).

Not copied: vLLM's epilogue fuses the bias add (one fma, ≤ 1 float32 ulp apart); its GPU GEMMs' float
accumulation orders (w4a16, fp8) are theirs. The default targets are the nn.Linear modules inside the
decoder layers: never embeddings, the LM head or MoE routers (llm-compressor's recipes leave them out
and vLLM runs them in full precision), and never LoRA's adapters (PEFT's `...q_proj.base_layer` is
quantized, lora_A/lora_B stay full precision). transformers 5 MoE experts are fused 3-D parameters, not
nn.Linear, and stay full precision. More, with the traps and measured speeds: docs/quant.md.
"""

from __future__ import annotations

import fnmatch
import functools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backstream.checks import choice
from backstream.stream.hf import base_model, decoder_layers, num_experts, text_config

FORMATS = ("w8a8", "w4a16", "fp8")
GROUP_SIZES = (32, 64, 128)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
INT8_ACT_MAX = 127  # activation codes saturate at ±127 (the scale is absmax/127)
_WEIGHT_RANGE = {"w8a8": (-128, 127), "w4a16": (-8, 7)}  # compressed-tensors' q_min, q_max for int8/int4
# the exact CPU int path: |q_x·q_W| ≤ 127·128 = 16256, and 1024 of them sum below 2^24 (float32 exact)
_EXACT_CHUNK = 1024
_MAX_K = (2**31 - 1) // (127 * 128)  # beyond this an int32 accumulator could overflow


@dataclass(kw_only=True)
class QuantConfig:
    rollout: str = "none"
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
        choice("quant.rollout", self.rollout, ["none", *FORMATS])
        if not isinstance(self.aligned, bool):
            raise ValueError(f"quant.aligned: got {self.aligned!r}, expected true or false")
        if isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES:
            raise ValueError(f"quant.group_size: got {self.group_size!r}, expected one of {list(GROUP_SIZES)}")
        if not isinstance(self.targets, list) or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"quant.targets: got {self.targets!r}, expected a list of non-empty fnmatch patterns "
                             "(e.g. [\"*.mlp.*\"]); [] = every linear of the decoder layers")
        if self.aligned and not self.enabled:
            raise ValueError("quant.aligned = true needs quant.rollout = w8a8|w4a16|fp8 (the learner aligns to a "
                             "quantized sampler); set quant.rollout or quant.aligned = false")

    @property
    def enabled(self) -> bool:
        return self.rollout != "none"


@dataclass
class QWeight:
    """The exact tensors the forward uses and an exporter writes (compressed-tensors layouts, int4
    before packing): dequantized W = codes · scale (scale broadcast over each group for w4a16)."""

    codes: Tensor  # w8a8: int8 [N, K]; w4a16: int8 in [-8, 7] [N, K] (unpacked); fp8: float8_e4m3fn [N, K]
    scale: Tensor  # float32; w8a8/fp8: [N, 1] per output channel; w4a16: [N, K // group_size]
    fmt: str
    group_size: int | None  # w4a16 only


def _ct(dtype: torch.dtype) -> torch.dtype:
    """The dtype scales and epilogues compute in: float32 as vLLM, float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Quantizers


def quantize_int8_act(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token dynamic int8 (vLLM `dynamic_scaled_int8_quant`): codes int8 [..., K], scale [..., 1]
    (float32, float64 for float64 x). A zero row gets scale 0 and codes 0, as vLLM's kernel: its
    multiplier is 0 there (older kernels computed 0·inf = NaN, which cvt.rni.sat turns into 0)."""
    x = x.to(_ct(x.dtype))
    absmax = x.abs().amax(dim=-1, keepdim=True)
    scale = absmax / INT8_ACT_MAX
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), INT8_ACT_MAX / absmax)
    codes = torch.round(x * inv).clamp_(-INT8_ACT_MAX, INT8_ACT_MAX).to(torch.int8)
    return codes, scale


def quantize_fp8_act(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token dynamic e4m3 (vLLM `QuantFP8.forward_native`, per token): codes float8_e4m3fn [..., K],
    scale [..., 1]; the scale floor 1/(448·512) keeps a zero row finite (codes 0)."""
    ct = _ct(x.dtype)
    x = x.to(ct)
    floor = torch.tensor(1.0, dtype=ct) / (FP8_MAX * 512.0)  # in ct, as the kernel's 1.0f / (448.f * 512.f)
    scale = torch.maximum(x.abs().amax(dim=-1, keepdim=True) / FP8_MAX, floor)
    codes = (x * scale.reciprocal()).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def _check_format(fmt: str, group_size: int | None) -> None:
    choice("fmt", fmt, list(FORMATS))
    if fmt == "w4a16" and (isinstance(group_size, bool) or group_size not in GROUP_SIZES):
        raise ValueError(f"group_size: got {group_size!r}, expected one of {list(GROUP_SIZES)} (quant.group_size)")


def quantize_weight(w: Tensor, fmt: str, group_size: int = 128) -> QWeight:
    """Symmetric weight quantization as compressed-tensors writes it (module docstring); w [N, K]."""
    _check_format(fmt, group_size)
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w: expected a floating-point [out_features, in_features] weight, got {w.dtype} "
                         f"{tuple(w.shape)}")
    N, K = w.shape
    if fmt == "w4a16" and K % group_size:
        raise ValueError(f"group_size: {group_size} does not divide in_features {K}")
    ct = _ct(w.dtype)
    w_ = w.detach().to(ct)
    if fmt == "w4a16":
        w_ = w_.reshape(N, K // group_size, group_size)  # [N, groups, g]
    absmax = w_.abs().amax(dim=-1, keepdim=True)
    if fmt == "fp8":
        scale = (absmax / FP8_MAX).float()
    else:
        q_min, q_max = _WEIGHT_RANGE[fmt]
        scale = absmax / ((q_max - q_min) / 2)  # /127.5, /7.5
        if fmt == "w4a16" and w.dtype in (torch.bfloat16, torch.float16):
            scale = scale.to(w.dtype)  # the dtype vLLM's w4a16 kernels hold the scales in
        scale = scale.float()
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    scaled = w_ / scale.to(ct)
    if fmt == "fp8":
        codes = scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        codes = torch.round(scaled.clamp_(q_min, q_max)).to(torch.int8)
    if fmt == "w4a16":
        return QWeight(codes=codes.reshape(N, K), scale=scale.reshape(N, K // group_size), fmt=fmt,
                       group_size=group_size)
    return QWeight(codes=codes, scale=scale, fmt=fmt, group_size=None)


def dequantize_weight(q: QWeight, dtype: torch.dtype) -> Tensor:
    """codes · scale in `dtype` [N, K] (the product rounds in `dtype`, as a dequantizing kernel's)."""
    N, K = q.codes.shape
    if q.fmt == "w4a16":
        g = q.group_size
        return (q.codes.reshape(N, K // g, g).to(dtype) * q.scale.to(dtype)[..., None]).reshape(N, K)
    return q.codes.to(dtype) * q.scale.to(dtype)


# ---------------------------------------------------------------------------------------------
# GEMMs


@functools.cache
def _cpu_has_int8_dot() -> bool:
    """VNNI/AMX CPUs have int8 dot products for `torch._int_mm` (DESIGN §6 reports it 6–9× faster than
    sgemm on its machine); on plain AVX2 it is 8–30× slower than sgemm (measured, torch 2.13)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def _exact_float() -> torch.dtype:
    """float32 unless torch was told to round float32 matmuls to bf16/tf32 (then integers > 2^8 would not
    be exact): float64 then, exact for any K."""
    lowered = torch.get_float32_matmul_precision() != "highest"
    for backend in ("mkldnn", "cuda"):  # torch ≥ 2.9 also has per-backend settings
        matmul = getattr(getattr(torch.backends, backend, None), "matmul", None)
        lowered |= getattr(matmul, "fp32_precision", "none") not in ("none", "ieee")
    return torch.float64 if lowered else torch.float32


def _int8_mm(a: Tensor, b: Tensor, b_float: Tensor | None) -> Tensor:
    """Exact int32 a [M, K] · bᵀ (b [N, K], int8 codes); `b_float` = b in `_exact_float()` (CPU path)."""
    M, K = a.shape
    N = b.shape[0]
    if a.is_cuda:
        # cuBLASLt's int8 GEMM wants M > 16 and K, N multiples of 8: zero padding adds zero terms
        Mp, Kp, Np = max(M, 17), -(-K // 8) * 8, -(-N // 8) * 8
        try:
            return torch._int_mm(F.pad(a, (0, Kp - K, 0, Mp - M)), F.pad(b, (0, Kp - K, 0, Np - N)).t())[:M, :N]
        except RuntimeError:
            pass  # an older GPU or torch: the exact float path below
    elif b_float is None and _cpu_has_int8_dot():
        return torch._int_mm(a, b.t())
    if b_float is None:
        b_float = b.to(_exact_float())
    acc = None
    for k0 in range(0, K, _EXACT_CHUNK):  # every partial sum of a chunk is an integer below 2^24: exact
        part = (a[:, k0:k0 + _EXACT_CHUNK].to(b_float.dtype) @ b_float[:, k0:k0 + _EXACT_CHUNK].t()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc


def _epilogue(acc_MN: Tensor, s_x_M1: Tensor, s_w_N1: Tensor, bias: Tensor | None, ct, out_dtype) -> Tensor:
    """vLLM's CUTLASS ScaledEpilogue[Bias]: s_x · (s_W · float(acc)) + bias in float32 (ct), then cast."""
    out = acc_MN.to(ct) * s_w_N1.to(ct).t()
    out = out * s_x_M1.to(ct)
    if bias is not None:
        out = out + bias.to(ct)
    return out.to(out_dtype)


def _forward(x_MK: Tensor, bias: Tensor | None, q: QWeight, operand: Tensor | None):
    """The quantized forward; returns (y [M, N], what the backward needs to rebuild x_deq)."""
    ct = _ct(x_MK.dtype)
    if q.fmt == "w8a8":
        q_x, s_x = quantize_int8_act(x_MK)
        y = _epilogue(_int8_mm(q_x, q.codes, operand), s_x, q.scale, bias, ct, x_MK.dtype)
        return y, (q_x, s_x)
    if q.fmt == "fp8":
        q_x, s_x = quantize_fp8_act(x_MK)
        w_codes = operand if operand is not None else q.codes.to(ct)  # e4m3 → float: exact
        y = _epilogue(q_x.to(ct) @ w_codes.t(), s_x, q.scale, bias, ct, x_MK.dtype)
        return y, (q_x, s_x)
    w_deq = operand if operand is not None else dequantize_weight(q, x_MK.dtype)
    return F.linear(x_MK, w_deq, bias), (x_MK,)


class _QuantLinearFn(torch.autograd.Function):
    """Quantized forward, straight-through backward: the gradients of y = x_deq · W_deqᵀ + b, with
    W_deq's gradient delivered to the master weight and x_deq's to x."""

    @staticmethod
    def forward(ctx, x_MK: Tensor, weight: Tensor, bias: Tensor | None, q: QWeight, operand: Tensor | None):
        y_MN, saved = _forward(x_MK, bias, q, operand)
        ctx.q, ctx.x_dtype, ctx.w_dtype, ctx.has_bias = q, x_MK.dtype, weight.dtype, bias is not None
        ctx.w_deq = operand if q.fmt == "w4a16" else None  # the cached W_deq: the backward reuses it
        ctx.save_for_backward(*saved)  # int8/e4m3 codes + scales: 1 byte per element, not x's 2 to 8
        return y_MN

    @staticmethod
    def backward(ctx, grad_MN: Tensor):
        q, dtype = ctx.q, ctx.x_dtype
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_MN @ (ctx.w_deq if ctx.w_deq is not None else dequantize_weight(q, dtype))
        if ctx.needs_input_grad[1]:
            if q.fmt == "w4a16":
                (x_deq,) = ctx.saved_tensors
            else:
                q_x, s_x = ctx.saved_tensors
                x_deq = q_x.to(s_x.dtype) * s_x  # exactly the x the quantized GEMM saw
            grad_w = (grad_MN.t() @ x_deq.to(dtype)).to(ctx.w_dtype)
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
        _check_format(fmt, group_size)
        if fmt == "w4a16" and linear.in_features % group_size:
            raise ValueError(f"group_size: {group_size} does not divide in_features {linear.in_features}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fmt = fmt
        self.group_size = group_size if fmt == "w4a16" else None
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.enabled = True
        self._q: QWeight | None = None
        self._key: tuple | None = None
        self._operands: dict[tuple, Tensor] = {}  # per activation dtype: what the GEMM reads

    def invalidate(self) -> None:
        """Forget the quantized weight (after an edit the version counter cannot see)."""
        self._q, self._key, self._operands = None, None, {}

    def qweight(self) -> QWeight:
        w = self.weight
        key = (w._version, w.data_ptr(), w.dtype, w.device)
        if self._q is None or key != self._key:
            self._q = quantize_weight(w.detach(), self.fmt, self.group_size or 128)
            self._key, self._operands = key, {}
        return self._q

    def _operand(self, q: QWeight, dtype: torch.dtype) -> Tensor | None:
        """The weight as the GEMM reads it, kept beside the codes (one more copy of the weight):
        w8a8 (CPU, float path) the codes as float; fp8 the codes as float; w4a16 W_deq in `dtype`."""
        if q.fmt == "w8a8" and (q.codes.is_cuda or _cpu_has_int8_dot()):
            return None  # torch._int_mm reads the int8 codes themselves
        key = (dtype, _exact_float() if q.fmt == "w8a8" else None)
        if key not in self._operands:
            if q.fmt == "w8a8":
                op = q.codes.to(key[1])
            elif q.fmt == "fp8":
                op = q.codes.to(_ct(dtype))
            else:
                op = dequantize_weight(q, dtype)
            self._operands[key] = op
        return self._operands[key]

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
        raise ValueError(f"on: got {on!r}, expected True or False")
    mods = quant_linears(model)
    if on and not mods:
        raise ValueError("model: has no QuantLinear modules to switch on; call quantize_model(model, cfg) first")
    for m in mods.values():
        m.enabled = on


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
        raise ValueError(f"model: found no decoder layers in {type(base_model(model)).__name__}; name the linears "
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
            raise ValueError(f"quant.targets: {pat!r} matches no nn.Linear (module names look like {some}, ...)")
        kept = [n for n in hits if n not in never]
        if not kept:
            why = sorted({never[n] for n in hits})
            raise ValueError(f"quant.targets: {pat!r} matches only {' and '.join(why)} ({', '.join(hits[:3])}), which "
                             "stay in full precision (as in vLLM); remove the pattern")
        chosen += [n for n in kept if n not in chosen]
    return [n for n in linears if n in chosen]  # model order


def quantize_model(model: nn.Module, cfg: QuantConfig) -> list[str]:
    """Replace the target nn.Linear modules of `model` (after PEFT wrapping: LoRA's base layers) by
    QuantLinear modules of `cfg.rollout`'s format, in place, enabled; returns the replaced names.
    Every check runs before anything is modified."""
    QuantConfig(**{k: getattr(cfg, k) for k in ("rollout", "aligned", "group_size", "targets")})  # re-validate
    if not cfg.enabled:
        raise ValueError(f"quant.rollout: got 'none', which quantizes nothing; expected one of {list(FORMATS)}")
    already = quant_linears(model)
    if already:
        raise ValueError(f"model: already has {len(already)} QuantLinear modules (e.g. {next(iter(already))}); "
                         "quantizing twice is refused: switch formats on a fresh model, and use "
                         "set_quantized / quantized to turn the quantized forward on or off")
    names = _targets(model, cfg)
    if not names:
        raise ValueError("quant.targets: no nn.Linear to quantize in the decoder layers; name them with quant.targets")
    mods = dict(model.named_modules())
    for name in names:
        lin = mods[name]
        if not lin.weight.is_floating_point() or lin.weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"model: {name}.weight is {lin.weight.dtype}, not a full-precision master weight; "
                             "quantize a float32/bfloat16/float16/float64 model")
        if cfg.rollout == "w4a16" and lin.in_features % cfg.group_size:
            raise ValueError(f"quant.group_size: {cfg.group_size} does not divide in_features {lin.in_features} of "
                             f"{name}; pick a group size that divides it or leave the module out of quant.targets")
        if cfg.rollout == "w8a8" and lin.in_features > _MAX_K:
            raise ValueError(f"quant.rollout: w8a8 on {name} with in_features {lin.in_features} > {_MAX_K} could "
                             "overflow the int32 accumulator; use w4a16 or fp8")
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear(mods[name], cfg.rollout, cfg.group_size))
    return names

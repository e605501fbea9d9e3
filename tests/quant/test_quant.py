"""backstream.quant.linear: each quantizer against a float64 reference of its formula written here (ties,
saturation, zero rows), the QuantLinear forward against the dequantized reference and its batch
invariance, the straight-through gradients, the weight cache, model surgery (plain and LoRA), the
aligned sampler/learner agreement (QaRL: mismatch 0 aligned, > 0 unaligned) and the K/V hand-over,
and the bad inputs refused before anything changes."""

import math
import warnings

import pytest
import torch
from helpers import lora, make
from torch import nn

from backstream.quant.linear import (
    FORMATS,
    QuantConfig,
    QuantLinear,
    dequantize_weight,
    int8_mm,
    quant_linears,
    quantize_fp8_act,
    quantize_int8_act,
    quantize_model,
    quantize_weight,
    quantized,
    set_quantized,
)
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local.generate import generate
from backstream.rl.records import Samples
from backstream.stream.engine import logprobs, stream_backward

warnings.filterwarnings("ignore", category=FutureWarning)
F64 = torch.float64
# the tiny models' down_proj has in_features 48, which a w4a16 group of 32 does not divide
W4_TARGETS = ["*.self_attn.*", "*.gate_proj", "*.up_proj"]


def cfg_for(fmt: str, **kw) -> QuantConfig:
    return QuantConfig(rollout=fmt, group_size=32, targets=W4_TARGETS if fmt == "w4a16" else [], **kw)


# ---------------------------------------------------------------------------------------------
# Plain float64 references, element by element (Python's round() is round-half-to-even)


def ref_int8_act(row: list[float]) -> tuple[list[int], float]:
    absmax = max(abs(v) for v in row)
    inv = 0.0 if absmax == 0 else 127 / absmax  # vLLM: 127/absmax, and 0 for a zero row
    return [max(-127, min(127, round(v * inv))) for v in row], absmax / 127


def ref_e4m3(v: float) -> float:
    """Round-half-to-even onto float8_e4m3fn (3 mantissa bits, exponent ≥ −6, subnormals 2^−9 apart)."""
    a = min(abs(v), 448.0)
    if a == 0:
        return 0.0
    quantum = 2.0 ** (max(math.floor(math.log2(a)), -6) - 3)
    return math.copysign(round(a / quantum) * quantum, v)


def ref_fp8_act(row: list[float]) -> tuple[list[float], float]:
    scale = max(max(abs(v) for v in row) / 448, 1 / (448 * 512))
    return [ref_e4m3(max(-448.0, min(448.0, v * (1 / scale)))) for v in row], scale


def ref_weight(row: list[float], fmt: str) -> tuple[list[float], float]:
    """compressed-tensors' calculate_qparams + _quantize for one channel/group, scale in float32."""
    absmax = max(abs(v) for v in row)
    div = {"w8a8": 127.5, "w4a16": 7.5, "fp8": 448.0}[fmt]
    scale = float(torch.tensor(absmax / div, dtype=torch.float32)) or float(torch.finfo(torch.float32).eps)
    if fmt == "fp8":
        return [ref_e4m3(v / scale) for v in row], scale
    lo, hi = (-128, 127) if fmt == "w8a8" else (-8, 7)
    return [round(max(lo, min(hi, v / scale))) for v in row], scale


# ---------------------------------------------------------------------------------------------
# Quantizers


def test_int8_activations_match_vllm_formula():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=gen, dtype=F64) * torch.tensor([1e-3, 0.1, 1, 3, 50, 1e4], dtype=F64)[:, None]
    tie = [127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5] + [0.0] * 30  # absmax 127: multiplier 1
    x = torch.cat([x, torch.tensor([tie], dtype=F64), torch.zeros(1, 40, dtype=F64)])
    codes, scale = quantize_int8_act(x)
    assert codes.dtype == torch.int8 and scale.dtype == F64 and scale.shape == (8, 1)
    for i, row in enumerate(x.tolist()):
        want, s = ref_int8_act(row)
        assert codes[i].tolist() == want and scale[i, 0].item() == s, f"row {i}"
    assert codes[6, :10].tolist() == [127, 2, 4, -2, -4, 0, 0, 2, 126, -126]  # half to even
    assert codes[7].abs().sum() == 0 and scale[7, 0] == 0  # a zero row: scale 0, codes 0, no NaN
    assert codes.abs().amax(-1)[:7].tolist() == [127] * 7  # the absmax element lands on ±127
    # float32 / bfloat16 activations: scales in float32, as vLLM's kernel
    for dt in (torch.float32, torch.bfloat16):
        c, s = quantize_int8_act(x.to(dt))
        assert s.dtype == torch.float32 and (c.to(F64) - codes.to(F64)).abs().max() <= 1


def test_fp8_activations_match_vllm_formula():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 24, generator=gen, dtype=F64) * torch.tensor([1e-2, 1, 7, 300, 2e5], dtype=F64)[:, None]
    # absmax 448: scale 1, so the ties are e4m3's own: 1.0625 → 1 and 1.1875 → 1.25 (even mantissa),
    # 2^-10 (half the smallest subnormal) → 0, 3·2^-10 → 2^-8; and a row under the scale floor
    tie = [448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 17.0, -300.0] + [0.0] * 16
    tiny = [1e-9] * 24
    x = torch.cat([x, torch.tensor([tie, tiny], dtype=F64), torch.zeros(1, 24, dtype=F64)])
    codes, scale = quantize_fp8_act(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == F64
    for i, row in enumerate(x.tolist()):
        want, s = ref_fp8_act(row)
        assert codes[i].to(F64).tolist() == want and scale[i, 0].item() == s, f"row {i}"
    assert codes[5, :8].to(F64).tolist() == [448, 1, 1.25, -1, 0, 2.0 ** -8, 16, -288]
    assert scale[6, 0].item() == scale[7, 0].item() == 1 / (448 * 512)  # the floor: no 0 scale, no NaN
    assert codes[7].to(F64).abs().sum() == 0
    assert codes.to(F64).abs().amax(-1)[:6].tolist() == [448] * 6  # saturates exactly at the absmax


@pytest.mark.parametrize("fmt", FORMATS)
def test_weight_quantizers_match_compressed_tensors_formula(fmt):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(6, 64, generator=gen, dtype=F64) * torch.tensor([1e-3, 0.02, 0.1, 1, 4, 9], dtype=F64)[:, None]
    # rows whose absmax makes the scale exactly 1: the tie and saturation cases of each code range
    top = {"w8a8": 127.5, "w4a16": 7.5, "fp8": 448.0}[fmt]
    ties = {"w8a8": [0.5, 1.5, 2.5, -2.5, -0.5, 126.5], "w4a16": [0.5, 1.5, 2.5, -2.5, 3.5, -6.5],
            "fp8": [1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 12.5]}[fmt]
    crafted = torch.zeros(2, 64, dtype=F64)
    for g in range(2):  # both w4a16 groups of the row get the same values
        crafted[0, 32 * g: 32 * g + 8] = torch.tensor([top, -top, *ties], dtype=F64)
    w = torch.cat([w, crafted])  # row 7: all zero
    q = quantize_weight(w, fmt, group_size=32)
    assert q.scale.dtype == torch.float32 and q.fmt == fmt
    assert q.codes.dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    assert q.scale.shape == ((8, 2) if fmt == "w4a16" else (8, 1)) and q.codes.shape == (8, 64)
    for i, row in enumerate(w.tolist()):
        for g in range(q.scale.shape[1]):
            k = 64 // q.scale.shape[1]
            want, s = ref_weight(row[g * k:(g + 1) * k], fmt)
            assert q.codes[i, g * k:(g + 1) * k].to(F64).tolist() == want and q.scale[i, g].item() == s, (i, g)
    got = q.codes[6, :8].to(F64).tolist()
    assert got == {"w8a8": [127, -128, 0, 2, 2, -2, 0, 126], "w4a16": [7, -8, 0, 2, 2, -2, 4, -6],
                   "fp8": [448, -448, 1, 1.25, -1, 0, 2.0 ** -8, 12]}[fmt]  # +top saturates, −top takes q_min
    assert q.codes[7].to(F64).abs().sum() == 0 and (q.scale[7] == torch.finfo(torch.float32).eps).all()
    deq = dequantize_weight(q, F64)
    scale_NK = q.scale.to(F64).repeat_interleave(64 // q.scale.shape[1], dim=1)
    assert deq.shape == (8, 64) and torch.equal(deq, q.codes.to(F64) * scale_NK)


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_equal_compressed_tensors_own_output(fmt):
    """float32 weights: our codes and scales are compressed-tensors' (what llm-compressor exports)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    kind = dict(num_bits=4, type="int", strategy="group", group_size=32) if fmt == "w4a16" else \
        dict(num_bits=8, type="float" if fmt == "fp8" else "int", strategy="channel")
    args = QuantizationArgs(symmetric=True, **kind)
    w_ = w.reshape(16, 4, 32) if fmt == "w4a16" else w[:, None, :]
    scale, zp = calculate_qparams(w_.amin(-1), w_.amax(-1), args)
    codes = quantize(w, scale, zp, args, dtype=None)
    q = quantize_weight(w, fmt, group_size=32)
    assert torch.equal(q.scale, scale.reshape(q.scale.shape)) and torch.equal(q.codes.float(), codes.float())


def test_w4a16_scales_are_exact_in_a_bfloat16_model():
    """vLLM's w4a16 kernels hold the scales in the activation dtype: round them there first."""
    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(4)) * 0.05).bfloat16()
    q = quantize_weight(w, "w4a16", group_size=32)
    assert torch.equal(q.scale.bfloat16().float(), q.scale)


def test_exact_int_path_equals_the_integer_product():
    """K over several float32 chunks, every product at its extreme: the int32 result is exact."""
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(-127, 128, (5, 2100), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (7, 2100), generator=gen, dtype=torch.int8)
    a[0], b[0] = -127, -128  # 2100 · 16256 ≈ 2^25: beyond float32's exact integers in one sum
    want = a.long() @ b.long().t()
    for b_float in (None, b.float(), b.double()):
        got = int8_mm(a, b, b_float)
        assert got.dtype == torch.int32 and torch.equal(got.long(), want)


@pytest.mark.parametrize("K", [64, 65, 2100])
def test_int16_pairs_gemm_equals_its_naive_reference(K):
    """oneDNN's int8 GEMM without VNNI (formats.INT8_GEMMS "int16-pairs"): the exact product plus the
    correction on the weight pairs that can saturate equals forming, saturating and summing every pair;
    extreme codes make many pairs saturate (odd K: the last input pairs with a zero)."""
    from backstream.quant.formats import int16_pairs_correction, int16_pairs_mm_naive, saturating_pairs

    gen = torch.Generator().manual_seed(11)
    a = torch.randint(-127, 128, (6, K), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (9, K), generator=gen, dtype=torch.int8)
    a[0], b[0] = 127, 127  # u = 255, the largest: every pair of this row and column saturates
    want = int16_pairs_mm_naive(a, b)
    exact = a.long() @ b.long().t()
    assert (want.long() != exact).float().mean() > 0.5  # the saturation is real, not a rare corner
    got = int8_mm(a, b, None) + int16_pairs_correction(a, b, saturating_pairs(b))
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_w8a8_learner_follows_the_samplers_int8_gemm():
    """`set_int8_gemm(model, "int16-pairs")`: every w8a8 layer's forward is the int16-pairs sum in
    vLLM's epilogue (float64 reference written here); "exact" brings the exact sum back; other
    formats have no int8 GEMM and are left alone."""
    from backstream.quant.formats import int16_pairs_mm_naive
    from backstream.quant.linear import set_int8_gemm

    torch.manual_seed(12)
    lin = nn.Linear(64, 48, dtype=F64)
    with torch.no_grad():
        lin.weight[:, :8] *= 40  # outlier inputs: their weight codes sit near ±127, so pairs saturate
    model = nn.Sequential(QuantLinear(lin, "w8a8"), QuantLinear(nn.Linear(48, 32, dtype=F64), "fp8"))
    x = torch.randn(5, 64, dtype=F64) * 3
    exact = model[0](x)
    assert set_int8_gemm(model, "int16-pairs") == 1
    got = model[0](x)
    q_x, s_x = quantize_int8_act(x)
    q = model[0].qweight()
    want = int16_pairs_mm_naive(q_x, q.codes).to(F64) * q.scale.to(F64).t() * s_x + lin.bias
    assert torch.equal(got, want) and not torch.equal(got, exact)
    assert model[1].gemm == "exact"
    set_int8_gemm(model, "exact")
    assert torch.equal(model[0](x), exact)
    with pytest.raises(Exception, match="gemm"):
        set_int8_gemm(model, "saturating")


# ---------------------------------------------------------------------------------------------
# QuantLinear


def linear(K=64, N=48, bias=True, dtype=F64, seed=6):
    torch.manual_seed(seed)
    return nn.Linear(K, N, bias=bias, dtype=dtype)


def test_w8a8_forward_is_the_dequantized_product_and_batch_invariant():
    lin = linear()
    ql = QuantLinear(lin, "w8a8")
    assert ql.weight is lin.weight and ql.bias is lin.bias
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(7), dtype=F64)
    q_x, s_x = quantize_int8_act(x)
    ref = (q_x.to(F64) * s_x) @ dequantize_weight(ql.qweight(), F64).t() + lin.bias
    y = ql(x)
    assert y.shape == (2, 9, 48) and torch.allclose(y, ref, rtol=1e-13, atol=1e-13)
    # one row alone, or in any batch: bitwise the same (the sampler decodes rows, the learner blocks)
    for dt in (F64, torch.float32):
        ql32 = QuantLinear(linear(dtype=dt), "w8a8")
        xs = torch.randn(300, 64, generator=torch.Generator().manual_seed(8), dtype=dt) * 3
        full = ql32(xs)
        assert torch.equal(torch.cat([ql32(xs[i:i + 1]) for i in range(0, 300, 37)]), full[::37])
        assert torch.equal(ql32(xs[100:117]), full[100:117])
    set_quantized(ql, False)  # off: exactly nn.Linear
    assert torch.equal(ql(x), lin(x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_straight_through_gradients(fmt):
    """grad_W(master) = ∂/∂W_deq of y = x_deq · W_deqᵀ + b, grad_x = grad_y · W_deq, grad_b = Σ grad_y."""
    ql = QuantLinear(linear(), fmt, group_size=32)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 64, generator=gen, dtype=F64, requires_grad=True)
    g = torch.randn(2, 5, 48, generator=gen, dtype=F64)
    (ql(x) * g).sum().backward()

    w_deq = dequantize_weight(ql.qweight(), F64).requires_grad_(True)
    quant_act = {"w8a8": quantize_int8_act, "fp8": quantize_fp8_act}.get(fmt)
    x_deq = x.detach() if quant_act is None else quant_act(x.detach())[0].to(F64) * quant_act(x.detach())[1]
    y_ref = x_deq @ w_deq.t() + ql.bias.detach()
    (y_ref * g).sum().backward()
    assert torch.allclose(ql.weight.grad, w_deq.grad, rtol=1e-13, atol=1e-13)
    assert torch.allclose(x.grad, g @ w_deq.detach(), rtol=1e-13, atol=1e-13)
    assert torch.allclose(ql.bias.grad, g.sum((0, 1)), rtol=1e-13, atol=1e-13)

    frozen = QuantLinear(linear(bias=False), fmt, group_size=32)  # LoRA's base layer: no weight grad
    frozen.weight.requires_grad_(False)
    x2 = x.detach().clone().requires_grad_(True)
    frozen(x2).sum().backward()
    assert frozen.weight.grad is None and x2.grad is not None


def test_quantized_weight_is_cached_until_the_weight_changes():
    ql = QuantLinear(linear(dtype=torch.float32), "w8a8")
    opt = torch.optim.AdamW(ql.parameters(), lr=1e-2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10))
    q0 = ql.qweight()
    ql(x).sum().backward()
    ql(x)
    assert ql.qweight() is q0  # forwards and backwards do not requantize
    opt.step()
    q1 = ql.qweight()
    assert q1 is not q0 and torch.equal(q1.codes, quantize_weight(ql.weight, "w8a8").codes)
    assert ql.qweight() is q1
    with torch.no_grad():
        ql.weight.mul_(2)  # any in-place edit bumps the version counter
    assert ql.qweight() is not q1
    q2 = ql.qweight()
    ql.weight.data.mul_(2)  # `.data` edits do not: invalidate() is the way
    assert ql.qweight() is q2
    ql.invalidate()
    assert torch.equal(ql.qweight().scale, 2 * q2.scale)


# ---------------------------------------------------------------------------------------------
# Models


LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj"]


def test_quantize_model_replaces_the_decoder_linears_only():
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(11))
    plain = make("qwen3")
    with torch.no_grad():
        want = plain(ids).logits
    model = make("qwen3")
    keys = list(model.state_dict())
    names = quantize_model(model, QuantConfig(rollout="w8a8"))
    assert names == [f"model.layers.{i}.{n}" for i in range(2) for n in LINEARS]
    assert list(quant_linears(model)) == names and all(m.enabled for m in quant_linears(model).values())
    assert type(model.lm_head) is nn.Linear and type(model.model.embed_tokens) is nn.Embedding
    assert list(model.state_dict()) == keys  # checkpoints keep nn.Linear's names: the master weights
    with torch.no_grad():
        q = model(ids).logits
        with quantized(model, False):
            off = model(ids).logits
            assert not any(m.enabled for m in quant_linears(model).values())
    assert all(m.enabled for m in quant_linears(model).values())  # restored on exit
    assert torch.equal(off, want)
    assert (q - want).abs().max() > 1e-4
    with quantized(plain, False):  # nothing to switch off: a no-op
        pass


def test_lora_base_layers_are_quantized_and_the_adapters_train():
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(12))
    plain = lora(make("qwen3"))
    with torch.no_grad():
        want = plain(ids).logits
    model = lora(make("qwen3"))
    names = quantize_model(model, QuantConfig(rollout="w4a16", group_size=32, targets=W4_TARGETS))
    prefix = "base_model.model.model.layers"
    adapted = {"self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj"}  # tests/helpers.lora's targets
    assert names == [f"{prefix}.{i}.{n}" + (".base_layer" if n in adapted else "")
                     for i in range(2) for n in LINEARS if n != "mlp.down_proj"]
    assert not any("lora_" in n for n in names)
    with torch.no_grad(), quantized(model, False):
        assert torch.equal(model(ids).logits, want)
    model(ids).logits.square().mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert f"{prefix}.0.self_attn.q_proj.lora_A.default.weight" in grads
    # explicit patterns name the model's modules: `*.q_proj` is LoRA's base layer
    again = lora(make("qwen3"))
    assert quantize_model(again, QuantConfig(rollout="fp8", targets=["*.q_proj"])) == \
        [f"{prefix}.{i}.self_attn.q_proj.base_layer" for i in range(2)]


def test_routers_and_heads_are_never_quantized():
    model = make("qwen3")
    model.model.layers[0].mlp.router = nn.Linear(32, 4, dtype=F64)  # a router-named linear in a layer
    names = quantize_model(model, QuantConfig(rollout="w8a8", targets=["model.layers.0.mlp.*"]))
    assert names == [f"model.layers.0.{n}" for n in LINEARS[4:]]
    moe = make("qwen3-moe")  # transformers 5: router and experts are not nn.Linear; attention is quantized
    assert quantize_model(moe, QuantConfig(rollout="fp8")) == [f"model.layers.{i}.{n}" for i in range(2)
                                                                for n in LINEARS[:4]]


# ---------------------------------------------------------------------------------------------
# QaRL: the aligned learner is the sampler; the unaligned one is not


@pytest.mark.parametrize("fmt", FORMATS)
def test_aligned_learner_matches_the_sampler_and_takes_its_kv(fmt):
    model = make("qwen3")
    quantize_model(model, cfg_for(fmt))
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 61, (6,), generator=gen), torch.randint(0, 61, (3,), generator=gen)]
    with quantized(model, True):
        r = Samples.of_groups([0, 1], prompts, generate(model, prompts, SamplingParams(max_new_tokens=12),
                              eos_token_id=None, generator=torch.Generator().manual_seed(0), return_kv=True,
                              group_size=4), 4, kv=True)
    seqs, mask, sampler = r.sequences(), r.completion_mask(), r.aligned_logprobs()
    with quantized(model, True):
        aligned = logprobs(model, seqs, mask)
    with quantized(model, False):
        unaligned = logprobs(model, seqs, mask)
    gap_aligned = max((a[m] - s[m]).abs().max().item() for a, s, m in zip(aligned, sampler, mask))
    gap_unaligned = max((a[m] - s[m]).abs().max().item() for a, s, m in zip(unaligned, sampler, mask))
    assert gap_aligned < 1e-12, gap_aligned
    assert gap_unaligned > 1e-6, gap_unaligned

    # the streamed backward reading the sampler's K/V is the one with its own prefill
    wgen = torch.Generator().manual_seed(14)
    weights = [torch.randn(len(s), generator=wgen, dtype=F64) * m for s, m in zip(seqs, mask)]

    def grads(**kw):
        model.zero_grad(set_to_none=True)
        with quantized(model, True):
            stream_backward(model, seqs, weights, block_size=5, **kw)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    g_kv, g_own = grads(kv=r.kv), grads()
    assert g_kv.keys() == g_own.keys() and g_kv
    for n in g_own:
        err = (g_kv[n] - g_own[n]).norm() / g_own[n].norm()
        assert err < 1e-10, f"{n}: {err:.3g}"


def test_qarl_covers_a_hybrids_linear_layers():
    """QaRL on a hybrid (issue 39): every nn.Linear is quantized, the Gated DeltaNet projections
    included; the sampler's log-probs are the quantized learner's (float64), and the streamed backward
    through the quantized forward equals the reference's."""
    from helpers import tiny_hybrid

    from backstream import reference_backward
    from backstream.stream.miniature import keep_float64
    from backstream.stream.verify import relative_errors

    model, tok = tiny_hybrid()
    names = quantize_model(model, cfg_for("w8a8"))
    assert {"model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.out_proj",
            "model.layers.2.self_attn.q_proj"} <= set(names)
    prompts = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([11, 12, 13])]
    with quantized(model, True), keep_float64():
        r = Samples.of_groups([0, 1], prompts, generate(model, prompts, SamplingParams(max_new_tokens=8),
                              eos_token_id=None, generator=torch.Generator().manual_seed(0), group_size=2), 2)
        seqs, mask = r.sequences(), r.completion_mask()
        learner = logprobs(model, seqs, mask)
        gap = max((a[m] - b[m]).abs().max().item() for a, b, m in zip(learner, r.aligned_logprobs(), mask))
        assert gap < 1e-12, gap
        weights = [torch.randn(len(s), generator=torch.Generator().manual_seed(i), dtype=F64) * m
                   for i, (s, m) in enumerate(zip(seqs, mask))]

        def grads(fn, **kw):
            model.zero_grad(set_to_none=True)
            fn(model, seqs, weights, **kw)
            return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        errs = relative_errors(grads(stream_backward, block_size=3), grads(reference_backward))
    assert max(errs.values()) <= 1e-10, max(errs.items(), key=lambda kv: kv[1])


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("kw, match", [
    (dict(rollout="w3a3"), r"quant.rollout: got 'w3a3', expected one of \['none', 'w8a8', 'w4a16', 'fp8'\]"),
    (dict(rollout="w4a16", group_size=48), "quant.group_size: got 48"),
    (dict(aligned=True), "quant.aligned = true needs quant.rollout = w8a8|w4a16|fp8"),
    (dict(rollout="w8a8", targets="*"), "quant.targets"),
    (dict(rollout="w8a8", targets=[""]), "quant.targets"),
])
def test_bad_config_names_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kw)


def _int8_weights(model):
    up = model.model.layers[1].mlp.up_proj
    up.weight = nn.Parameter(up.weight.detach().to(torch.int8), requires_grad=False)


@pytest.mark.parametrize("prepare, cfg, match", [
    (None, QuantConfig(rollout="w4a16", group_size=64),
     r"quant.group_size: 64 does not divide in_features 32 of model.layers.0.self_attn.q_proj"),
    (None, QuantConfig(rollout="w4a16", group_size=32),
     r"does not divide in_features 48 of model.layers.0.mlp.down_proj"),
    (None, QuantConfig(rollout="w8a8", targets=["*.q_proj", "*.nothing"]), r"'\*.nothing' matches no nn.Linear"),
    (None, QuantConfig(rollout="w8a8", targets=["*.q_proj", "lm_head"]), "'lm_head' matches only the LM head"),
    (lambda m: setattr(m.model.layers[0].mlp, "gate", nn.Linear(32, 4, dtype=F64)),
     QuantConfig(rollout="w8a8", targets=["*.mlp.gate"]), "matches only an MoE router"),
    (_int8_weights, QuantConfig(rollout="w8a8"), r"model.layers.1.mlp.up_proj.weight is torch.int8, not a full"),
    (None, QuantConfig(), "quant.rollout: got 'none', which quantizes nothing"),
])
def test_bad_model_input_is_refused_before_anything_changes(prepare, cfg, match):
    model = make("qwen3")
    if prepare:
        prepare(model)
    with pytest.raises(ValueError, match=match):
        quantize_model(model, cfg)
    assert quant_linears(model) == {}


def test_other_misuse_is_refused():
    model = make("qwen3")
    with pytest.raises(ValueError, match="no QuantLinear modules"):
        set_quantized(model, True)
    with pytest.raises(ValueError, match="no QuantLinear modules"), quantized(model, True):
        pass
    quantize_model(model, QuantConfig(rollout="fp8"))
    with pytest.raises(ValueError, match="quantizing twice"):
        quantize_model(model, QuantConfig(rollout="w8a8"))
    with pytest.raises(ValueError, match=r"fmt: got 'int4'"):
        quantize_weight(torch.randn(4, 32), "int4")
    with pytest.raises(ValueError, match="group_size: 32 does not divide in_features 48"):
        QuantLinear(nn.Linear(48, 8), "w4a16", group_size=32)
    with pytest.raises(ValueError, match="on: got 1"):
        set_quantized(model, 1)

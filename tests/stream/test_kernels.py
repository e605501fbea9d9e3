"""The attention kernels behind one interface (backstream.stream.attention).

- the kernel choice (`select_kernel`) and the `Band` arithmetic that replaces masks for the CUDA
  kernels (checked against the positions' own mask and against flash-attention's window rule);
- each CUDA kernel's argument building and LSE layouts, run end to end on CPU: `StandIn` has the
  CUDA ops' exact signatures, the argument checks of PyTorch's C++ wrappers (flash_api.cpp,
  attention.cu / attention_backward.cu, as read from PyTorch's sources; ../shared/CUDA.md) and
  their output layouts (padded lse [B, H, ⌈M/32⌉·32], varlen [H, total_q], flash's +inf lse of an
  empty row, its one-query varlen layout), computed with plain math. The kernel classes take it
  in place of `torch.ops.aten`; in float64 (which the real ops refuse: `exact=True` lets it
  through) their merged attention equals the naive path in value and every gradient, and so does
  the whole engine; in bfloat16 (every check on) it is as close to float64 as the naive path;
- no [Q × K] tensor is saved for the backward;
- tests marked `cuda` compare the real kernels with the naive path on a GPU (bench/gpu_check.sh
  runs them); they skip without one.
"""

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import torch
from helpers import REPO, assert_same, group_batch, lora, make
from hypothesis import given, settings
from hypothesis import strategies as st

from backstream import reference_backward, stream_backward
from backstream.checks import UserError
from backstream.stream import attention as A
from backstream.stream.attention import Band, Part, merged_attention, merged_attention_math, select_kernel

INF = float("inf")
HALF = (torch.float16, torch.bfloat16)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (bench/gpu_check.sh)")


# ---------------------------------------------------------------------------------------------
# The stand-in: PyTorch's CUDA attention ops, computed with plain math on any device.


def _attend(q, k, v, keep, scale):
    """One sequence: q [Sq, H, D], k/v [Sk, Hk, D] (GQA: head h reads K/V head h // (H/Hk)), keep
    [Sq, Sk] → (out [Sq, H, Dv], lse [H, Sq]) in float64; a query that sees no key: out 0, lse −inf."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    s = s.masked_fill(~keep[None], -INF)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v), lse


def _attend_backward(dout, q, k, v, out, lse, keep, scale):
    """What a fused backward computes from the out and lse it is given (merged ones, here):
    P = exp(S − lse), dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)); dK/dV summed over each GQA group."""
    Hk, g = k.shape[1], q.shape[1] // k.shape[1]
    kr, vr = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    q, dout, out = q.double(), dout.double(), out.double()
    s = (torch.einsum("qhd,khd->hqk", q, kr) * scale).masked_fill(~keep[None], -INF)
    p = torch.exp(s - lse.double()[..., None])
    dp = torch.einsum("qhd,khd->hqk", dout, vr)
    delta = (dout * out).sum(-1).T  # [H, Sq]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kr) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    dv = torch.einsum("hqk,qhd->khd", p, dout)
    fold = lambda x: x.reshape(x.shape[0], Hk, g, x.shape[-1]).sum(2)  # noqa: E731
    return dq, fold(dk), fold(dv)


def _flash_keep(Sq, Sk, left, right):
    """flash-attention's mask (mask.h, after set_params_fprop): bottom-right aligned; a negative
    bound with the other one set means the whole sequence (seqlen_k); both negative: no mask."""
    if left < 0 and right < 0:
        return torch.ones(Sq, Sk, dtype=torch.bool)
    left, right = (Sk if left < 0 else left), (Sk if right < 0 else right)
    i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    return (j >= i + Sk - Sq - left) & (j <= i + Sk - Sq + right)


class StandIn:
    """`torch.ops.aten`'s `_flash_attention_forward/backward` and `_efficient_attention_forward/
    backward` with the same schemas, the same argument checks (the ones our layouts could break)
    and the same output layouts, computed with plain math. `exact=True` lets float64 through (the
    real ops refuse it) and keeps the lse in float64, for 1e-12 comparisons; everything else is
    checked in both modes. `calls` counts what was called, and how (dense / varlen)."""

    def __init__(self, exact=False):
        self.exact = exact
        self.calls = Counter()

    def _dtype_ok(self, t, allowed):
        assert t.dtype in allowed or (self.exact and t.dtype == torch.float64), t.dtype

    def _lse_dtype(self, like):
        return torch.float64 if like.dtype == torch.float64 else torch.float32

    # flash (flash_api.cpp: mha_fwd / mha_varlen_fwd / mha_bwd / mha_varlen_bwd)

    def _flash_checks(self, q, k, v):
        self._dtype_ok(q, HALF)
        assert k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype"
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "Input tensor must have contiguous last dimension"
        D = q.shape[-1]
        assert D % 8 == 0 and D <= 256, "head_size must be a multiple of 8 (padding is the caller's), at most 256"
        assert k.shape[-1] == v.shape[-1] == D and k.shape == v.shape
        assert q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query"

    @staticmethod
    def _windows(Sq, Sk, is_causal, left, right, forward):
        left, right = (-1 if left is None else left), (-1 if right is None else right)
        if forward and Sq == 1:
            is_causal = False  # mha_fwd: "causal=true is the same as causal=false in this case"
        if is_causal:
            right = 0
        left, right = (-1 if left >= Sk else left), (-1 if right >= Sk else right)
        return left, right

    def _flash_seqs(self, q, cu_q, cu_k):
        """(q slice, k slice) per sequence: dense [B, S, H, D] or varlen [total, H, D]."""
        if cu_q is None:
            return [(b, b) for b in range(q.shape[0])]
        for cu in (cu_q, cu_k):
            assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(), "cu_seqlens: int32, contiguous"
        assert len(cu_q) == len(cu_k) and int(cu_q[-1]) == q.shape[0]
        return [(slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1])))
                for i in range(len(cu_q) - 1)]

    def _flash_attention_forward(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                                 seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
        self._flash_checks(query, key, value)
        assert dropout_p == 0.0 and not return_debug_mask and seqused_k is None and alibi_slopes is None
        varlen = cum_seq_q is not None
        self.calls["flash_fwd_" + ("varlen" if varlen else "dense")] += 1
        assert query.dim() == (3 if varlen else 4) == key.dim()
        H, Hk = query.shape[-2], key.shape[-2]
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out = torch.zeros(query.shape[:-1] + value.shape[-1:], dtype=query.dtype)
        lse = torch.empty((H, query.shape[0]) if varlen else (query.shape[0], H, query.shape[1]),
                          dtype=self._lse_dtype(query))
        swapped = False
        for qs, ks in self._flash_seqs(query, cum_seq_q, cum_seq_k):
            q, k, v = query[qs], key[ks], value[ks]
            Sq, Sk = q.shape[0], k.shape[0]
            # one query per sequence, GQA, no window (as given, causal applied): flash swaps the group into
            # the query axis (seqlenq_ngroups_swapped)
            given_right = 0 if is_causal and max_q > 1 else (-1 if window_size_right is None else window_size_right)
            swapped = swapped or (max_q == 1 and H > Hk and (window_size_left is None or window_size_left < 0)
                                  and given_right < 0)
            left, right = self._windows(Sq, max_k if varlen else Sk, is_causal, window_size_left, window_size_right,
                                        forward=True)
            o, l_ = _attend(q, k, v, _flash_keep(Sq, Sk, left, right), scale)
            out[qs] = o.to(query.dtype)
            l_ = torch.where(torch.isneginf(l_), INF, l_)  # a row that sees no key: lse +inf (softmax.h)
            if varlen:
                lse[:, qs] = l_.to(lse.dtype)
            else:
                lse[qs] = l_.to(lse.dtype)
        if varlen and swapped:  # mha_varlen_fwd: softmax_lse.reshape({num_heads * max_seqlen_q, batch_size})
            B = len(cum_seq_q) - 1
            lse = lse.reshape(Hk, H // Hk, B).permute(0, 2, 1).reshape(H, B)
        rng = torch.zeros(2, dtype=torch.uint64)
        return out, lse, rng, torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=query.dtype)

    def _flash_attention_backward(self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                  max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
                                  window_size_left=None, window_size_right=None):
        self._flash_checks(query, key, value)
        assert out.dtype == grad_out.dtype == query.dtype, "query and out / dout must have the same dtype"
        assert out.shape == grad_out.shape == query.shape[:-1] + value.shape[-1:] and dropout_p == 0.0
        grad_out, out = grad_out.contiguous(), out.contiguous()  # what attention_backward.cu does
        varlen = cum_seq_q is not None
        self.calls["flash_bwd_" + ("varlen" if varlen else "dense")] += 1
        H = query.shape[-2]
        want = (H, query.shape[0]) if varlen else (query.shape[0], H, query.shape[1])
        assert logsumexp.shape == want and logsumexp.is_contiguous(), (logsumexp.shape, want)
        assert logsumexp.dtype == self._lse_dtype(query)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        for qs, ks in self._flash_seqs(query, cum_seq_q, cum_seq_k):
            q, k = query[qs], key[ks]
            left, right = self._windows(q.shape[0], max_k if varlen else k.shape[0], is_causal, window_size_left,
                                        window_size_right, forward=False)
            lse = logsumexp[:, qs] if varlen else logsumexp[qs]
            g = _attend_backward(grad_out[qs], q, k, value[ks], out[qs], lse,
                                 _flash_keep(q.shape[0], k.shape[0], left, right), scale)
            for d, x in zip((dq, dk, dv), g):
                d[qs if d is dq else ks] = x.to(d.dtype)
        return dq, dk, dv

    # memory-efficient (attention.cu / attention_backward.cu, xformers' cutlass kernels)

    @staticmethod
    def _efficient_keep(M, N, custom_mask_type):
        i, j = torch.arange(M)[:, None], torch.arange(N)[None, :]
        return {0: torch.ones(M, N, dtype=torch.bool), 1: j <= i, 2: j <= i + N - M}[custom_mask_type]

    def _efficient_checks(self, q, k, v, bias, cu_q, custom_mask_type):
        assert q.dim() == k.dim() == v.dim() == 4
        assert q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1]
        assert q.shape[2] == k.shape[2] == v.shape[2], "no GQA: as many K/V heads as query heads"
        assert q.shape[3] == k.shape[3]
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "last dimension must be contiguous"
        self._dtype_ok(q, (torch.float32, *HALF))
        assert k.dtype == v.dtype == q.dtype
        assert cu_q is None and custom_mask_type in (0, 1, 2)
        if bias is not None:
            B, M, H, _ = q.shape
            assert bias.dim() == 4 and tuple(bias.shape) == (B, H, M, k.shape[1]), "attn_bias: wrong shape"
            assert bias.dtype == q.dtype, "invalid dtype for bias - should match query's dtype"
            assert bias.stride(3) == 1 and bias.stride(2) % 16 == 0, "attn_bias: wrong alignment"

    def _efficient_attention_forward(self, query, key, value, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, dropout_p, custom_mask_type, compute_log_sumexp=False, *,
                                     scale=None, seqlen_k=None, window_size=None):
        self._efficient_checks(query, key, value, bias, cu_seqlens_q, custom_mask_type)
        assert dropout_p == 0.0 and compute_log_sumexp and seqlen_k is None and window_size is None
        self.calls["efficient_fwd" + ("_bias" if bias is not None else f"_mask{custom_mask_type}")] += 1
        B, M, H, _ = query.shape
        N = key.shape[1]
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out = torch.empty(B, M, H, value.shape[-1], dtype=query.dtype)
        # the tail of each lse row is padding: NaN, so that a path that read it would show
        lse = torch.full((B, H, math.ceil(M / 32) * 32), math.nan, dtype=self._lse_dtype(query))
        keep = self._efficient_keep(M, N, custom_mask_type)
        for b in range(B):
            kb = keep if bias is None else keep & ~torch.isneginf(bias[b, 0])
            assert bias is None or bool((bias[b] == torch.where(kb, 0.0, -INF)[None]).all()), "a 0 / −inf bias only"
            o, l_ = _attend(query[b], key[b], value[b], kb, scale)
            o[torch.isneginf(l_).T] = math.nan  # a row that sees no key: left undefined here
            out[b], lse[b, :, :M] = o.to(out.dtype), l_.to(lse.dtype)
        return out, lse, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), M, N

    def _efficient_attention_backward(self, grad_out_, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, logsumexp, dropout_p, philox_seed, philox_offset,
                                      custom_mask_type, bias_requires_grad, *, scale=None, num_splits_key=None,
                                      window_size=None, shared_storage_dqdkdv=False):
        self._efficient_checks(query, key, value, bias, cu_seqlens_q, custom_mask_type)
        assert dropout_p == 0.0 and not bias_requires_grad and window_size is None and not shared_storage_dqdkdv
        self.calls["efficient_bwd"] += 1
        B, M, H, _ = query.shape
        N, Kv = key.shape[1], value.shape[-1]
        assert grad_out_.shape == out.shape == (B, M, H, Kv) and out.dtype == query.dtype
        # kernel_backward.h reads out with o_strideM() = head_dim_value * num_heads
        assert (M == 1 or out.stride(1) == H * Kv) and out.stride(3) == 1, "out: [B, M, H, Kv], rows H·Kv apart"
        assert logsumexp.shape == (B, H, math.ceil(M / 32) * 32) and logsumexp.is_contiguous(), logsumexp.shape
        assert logsumexp.dtype == self._lse_dtype(query)
        grad_out = grad_out_.contiguous()
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        dq, dk, dv = (torch.empty(x.shape, dtype=x.dtype) for x in (query, key, value))
        keep = self._efficient_keep(M, N, custom_mask_type)
        for b in range(B):
            kb = keep if bias is None else keep & ~torch.isneginf(bias[b, 0])
            g = _attend_backward(grad_out[b], query[b], key[b], value[b], out[b], logsumexp[b, :, :M], kb, scale)
            dq[b], dk[b], dv[b] = (x.to(query.dtype) for x in g)
        return dq, dk, dv, torch.empty(0)


def flash(exact=True):
    return A.CudaFlash(ops=StandIn(exact))


def efficient(exact=True):
    return A.CudaEfficient(ops=StandIn(exact))


# ---------------------------------------------------------------------------------------------
# The choice of kernel


@pytest.mark.parametrize("name, device, dtype, dk, cap, want", [
    ("auto", "cpu", torch.float64, 8, None, "cpu-flash"),
    ("auto", "cpu", torch.bfloat16, 128, None, "cpu-flash"),
    ("flash", "cpu", torch.float32, 8, None, "cpu-flash"),
    ("math", "cpu", torch.float32, 8, None, "math"),
    ("auto", "cuda", torch.bfloat16, 128, (9, 0), "cuda-flash"),
    ("auto", "cuda", torch.float16, 60, (8, 0), "cuda-flash"),  # padded to 64
    ("auto", "cuda", torch.bfloat16, 512, (9, 0), "cuda-efficient"),  # over flash's 256
    ("auto", "cuda", torch.float16, 128, (7, 5), "cuda-efficient"),  # flash needs sm80
    ("auto", "cuda", torch.float32, 128, (9, 0), "cuda-efficient"),
    ("auto", "cuda", torch.float64, 128, (9, 0), "math"),  # no fused kernel takes float64
    ("math", "cuda", torch.bfloat16, 128, (9, 0), "math"),
    ("auto", "mps", torch.float32, 64, None, "math"),
])
def test_select_kernel(name, device, dtype, dk, cap, want):
    assert select_kernel(name, torch.device(device), dtype, dk, capability=cap).name == want


def test_select_kernel_refusals_and_softcap():
    dev = torch.device("cuda")
    assert select_kernel("auto", dev, torch.bfloat16, 128, softcap=30.0, capability=(9, 0)).name == "math"
    assert select_kernel(flash(), dev, torch.bfloat16, 128, softcap=30.0).name == "math"  # no fused soft-capping
    with pytest.raises(UserError, match="no fused attention kernel for torch.float64 on cuda"):
        select_kernel("flash", dev, torch.float64, 128, capability=(9, 0))
    with pytest.raises(UserError, match="kernel: expected one of"):
        select_kernel("fast", dev, torch.float32, 128)
    k = efficient()
    assert select_kernel(k, dev, torch.float32, 64) is k


def test_capabilities():
    """What each kernel declares is what the module's docstring table says (the CUDA ops' facts)."""
    assert (A.CUDA_FLASH.native_gqa, A.CUDA_FLASH.masks, A.CUDA_FLASH.empty_row_lse) == (True, ("band",), INF)
    assert A.CUDA_FLASH.head_dim(60, 60) == 64 and A.CUDA_FLASH.head_dim(264, 264) is None
    assert not A.CUDA_EFFICIENT.native_gqa and torch.float32 in A.CUDA_EFFICIENT.dtypes
    assert A.CPU_FLASH.empty_row_lse == 0.0 and A.CPU_FLASH.masks == ("dense", "causal")
    assert A.CPU_FLASH.head_dim(5, 12) == 12 and A.CUDA_EFFICIENT.head_dim(5, 12) == 16


# ---------------------------------------------------------------------------------------------
# Band: the mask as positions


@settings(max_examples=400, deadline=None)
@given(Q=st.integers(1, 9), Lk=st.integers(1, 12), off=st.integers(-3, 20), causal=st.booleans(),
       window=st.one_of(st.none(), st.integers(1, 14)))
def test_band_is_the_positions_mask_and_flash_says_it(Q, Lk, off, causal, window):
    """`Band.of(…).keep` is `_mask` of the positions; `cut` is the smallest rectangle holding every
    visible pair, every row and column of it non-empty; flash's window rule (flash_api.cpp's
    conversions, mask.h's bounds) over `flash_pieces`' rectangles gives exactly that mask, for every
    part the engine makes (history before the queries; causal keys ending at the last query)."""
    q0, k0 = 100 + off, 100
    qpos, kpos = torch.arange(q0, q0 + Q), torch.arange(k0, k0 + Lk)
    m = A._mask(qpos, kpos, causal, window, torch.float64)
    want = torch.ones(Q, Lk, dtype=torch.bool) if m is None else ~torch.isinf(m)
    band = Band.of(Q, Lk, off, causal, window)
    assert torch.equal(band.keep("cpu"), want)
    assert band.full == bool(want.all())
    cut = band.cut()
    if cut is None:
        assert not want.any() and band.flash_pieces() == []
        return
    i0, i1, j0, j1, inner = cut
    assert want.sum() == want[i0:i1, j0:j1].sum()
    assert torch.equal(inner.keep("cpu"), want[i0:i1, j0:j1])
    assert inner.keep("cpu").any(1).all() and inner.keep("cpu").any(0).all()
    pieces = band.flash_pieces()
    if off >= Lk or (causal and off == Lk - Q):
        assert pieces is not None
    if pieces is None:
        return
    got = torch.zeros(Q, Lk, dtype=torch.bool)
    for a0, a1, c0, c1, b in pieces:
        assert not got[a0:a1].any()  # rows of one piece only
        left, right = StandIn._windows(b.Q, b.Lk, False, *b.flash_window(), forward=True)
        got[a0:a1, c0:c1] = _flash_keep(b.Q, b.Lk, left, right)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# The CUDA kernels' code paths, on CPU through the stand-in


def leaf(*shape, dtype=torch.float64, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype).requires_grad_(True)


def problem(B, H, Hkv, Q=5, Ls=7, Lp=4, D=8, Dv=None, per_row=False, dtype=torch.float64, starts=True):
    """A block batch: shared history (batch 1), private history (stacked, or one part per row),
    the block's own causal keys; positions consecutive."""
    Dv = Dv or D
    q = leaf(B, H, Q, D, dtype=dtype)
    ks, vs = leaf(1, Hkv, Ls, D, dtype=dtype), leaf(1, Hkv, Ls, Dv, dtype=dtype)
    kb, vb = leaf(B, Hkv, Q, D, dtype=dtype), leaf(B, Hkv, Q, Dv, dtype=dtype)
    qpos, ppos = torch.arange(Ls + Lp, Ls + Lp + Q), torch.arange(Ls, Ls + Lp)
    st_ = (lambda x: x) if starts else (lambda x: None)
    parts = [Part(ks, vs, torch.arange(Ls), shared=True, start=st_(0))]
    leaves = [q, ks, vs]
    if per_row:
        for r in range(B):
            k, v = leaf(1, Hkv, Lp, D, dtype=dtype), leaf(1, Hkv, Lp, Dv, dtype=dtype)
            parts.append(Part(k, v, ppos, row=r if B > 1 else None, start=st_(Ls)))
            leaves += [k, v]
    else:
        kp, vp = leaf(B, Hkv, Lp, D, dtype=dtype), leaf(B, Hkv, Lp, Dv, dtype=dtype)
        parts.append(Part(kp, vp, ppos, start=st_(Ls)))
        leaves += [kp, vp]
    parts.append(Part(kb, vb, qpos, causal=True, start=st_(Ls + Lp)))
    return q, parts, qpos, leaves + [kb, vb]


def compare(kernel, q, parts, qpos, leaves, window, tol=1e-12, sinks=None, scale=0.3):
    """The kernel's merged attention against the naive path: values and every gradient."""
    out = merged_attention(q, parts, qpos, scale, window, kernel=kernel, sinks_H=sinks, q_start=int(qpos[0]))
    ref = merged_attention_math(q, parts, qpos, scale, window, sinks_H=sinks)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out - ref).abs().max() < tol
    probe = torch.randn_like(out)
    inputs = leaves + ([sinks] if sinks is not None else [])
    for a, b in zip(torch.autograd.grad((out * probe).sum(), inputs), torch.autograd.grad((ref * probe).sum(), inputs)):
        assert (a - b).abs().max() < tol
    return out


@pytest.mark.parametrize("make_kernel", [flash, efficient], ids=["flash", "efficient"])
@pytest.mark.parametrize("window", [None, 12, 9, 6, 3, 1])
@pytest.mark.parametrize("B, H, Hkv", [(1, 4, 4), (3, 4, 2), (2, 6, 1)])
@pytest.mark.parametrize("per_row", [False, True])
def test_standin_equals_math(make_kernel, window, B, H, Hkv, per_row):
    torch.manual_seed(0)
    kernel = make_kernel()
    q, parts, qpos, leaves = problem(B, H, Hkv, per_row=per_row)
    compare(kernel, q, parts, qpos, leaves, window)
    calls = kernel.ops.calls
    if kernel.name == "cuda-flash":
        seen = window is None or window > 1  # the private history, one position before the block
        assert calls["flash_fwd_varlen"] == calls["flash_bwd_varlen"] == (1 if per_row and B > 1 and seen else 0)
    else:  # the plain causal block needs no bias; a window that cuts it does
        assert calls["efficient_fwd_mask2"] == (1 if window is None or window >= 5 else 0)


@pytest.mark.parametrize("make_kernel", [flash, efficient], ids=["flash", "efficient"])
@pytest.mark.parametrize("Dk, Dv", [(8, 5), (6, 10), (12, 12)])
@pytest.mark.parametrize("window", [None, 3])
def test_standin_sinks_and_head_sizes(make_kernel, Dk, Dv, window):
    """Sinks (one more lse term), K and V of other head sizes (MLA) and a head size that is not a
    multiple of 8 (zero-padded for the CUDA kernels)."""
    torch.manual_seed(1)
    q, parts, qpos, leaves = problem(3, 4, 2, D=Dk, Dv=Dv, per_row=True)
    compare(make_kernel(), q, parts, qpos, leaves, window, sinks=leaf(4, scale=2.0))


@pytest.mark.parametrize("make_kernel", [flash, efficient], ids=["flash", "efficient"])
@pytest.mark.parametrize("Q, window", [(1, None), (1, 3), (2, None), (16, 5), (16, 12)])
def test_standin_short_and_long_blocks(make_kernel, Q, window):
    """One-query blocks over per-row parts (flash's varlen lse has another layout then: the kernel
    must not use varlen) and blocks longer than the window (16, 12: the first rows see the whole
    history, the later ones a window starting inside it; flash attends those in two calls)."""
    torch.manual_seed(2)
    kernel = make_kernel()
    q, parts, qpos, leaves = problem(3, 4, 2, Q=Q, Ls=9, Lp=6, per_row=True)
    compare(kernel, q, parts, qpos, leaves, window)
    if kernel.name == "cuda-flash":
        assert kernel.ops.calls["flash_fwd_varlen"] == (0 if Q == 1 else 2 if window == 12 else 1)


def test_standin_concat_part_and_positions_without_hints():
    """One causal part of history ⊕ block (a concat layer: more keys than queries, ending at the
    last query), positions read from the tensors when no hint is given; positions with a gap fall
    back to the naive path."""
    torch.manual_seed(3)
    B, H, Hkv, Q, L = 2, 4, 2, 5, 12
    q, k, v = leaf(B, H, Q, 8), leaf(B, Hkv, L, 8), leaf(B, Hkv, L, 8)
    qpos = torch.arange(L - Q, L)
    for make_kernel in (flash, efficient):
        for window in (None, 4):
            kernel = make_kernel()
            out = merged_attention(q, [Part(k, v, torch.arange(L), causal=True)], qpos, 0.3, window, kernel=kernel)
            ref = merged_attention_math(q, [Part(k, v, torch.arange(L), causal=True)], qpos, 0.3, window)
            assert (out - ref).abs().max() < 1e-12 and sum(kernel.ops.calls.values()) > 0
    gap = torch.cat([torch.arange(3), torch.arange(5, 5 + L - 3)])
    kernel = flash()
    out = merged_attention(q, [Part(k, v, gap, causal=True)], gap[-Q:], 0.3, None, kernel=kernel)
    assert (out - merged_attention_math(q, [Part(k, v, gap, causal=True)], gap[-Q:], 0.3, None)).abs().max() < 1e-12
    assert sum(kernel.ops.calls.values()) == 0


def test_standin_bfloat16_as_close_as_the_naive_path():
    """bfloat16 with every check of the real ops on (dtypes, float32 lse): the fused result's error
    against float64 is within twice the naive bfloat16 path's (values and gradients)."""
    torch.manual_seed(4)
    q, parts, qpos, leaves = problem(3, 8, 2, Q=16, Ls=64, Lp=16, D=32, per_row=True)
    probe = torch.randn(3, 8, 16, 32, dtype=torch.float64)

    def run(kernel, dtype):
        low = [x.detach().to(dtype).requires_grad_(True) for x in leaves]
        it = iter(low[1:])
        ps = [Part(next(it), next(it), p.kpos_K, p.shared, p.causal, p.row, p.start) for p in parts]
        out = merged_attention(low[0], ps, qpos, 32 ** -0.5, 24, kernel=kernel, q_start=int(qpos[0]))
        grads = torch.autograd.grad((out.double() * probe).sum(), low)
        return [out.double()] + [g.double() for g in grads]

    exact = run("math", torch.float64)
    for kernel, dtype in ((flash(exact=False), torch.bfloat16), (efficient(exact=False), torch.bfloat16),
                          (efficient(exact=False), torch.float32)):
        fused, naive = run(kernel, dtype), run("math", dtype)
        for f, n, e in zip(fused, naive, exact):
            err_f, err_n = (f - e).abs().max(), (n - e).abs().max()
            assert err_f <= 2 * err_n + (1e-6 if dtype == torch.float32 else 1e-3), (kernel, dtype, err_f, err_n)


@pytest.mark.parametrize("kernel, dtype", [("flash", torch.bfloat16), ("efficient", torch.float32)])
@pytest.mark.parametrize("window", [None, 3, 12])
@pytest.mark.parametrize("per_row", [False, True])
def test_meta_functions_take_the_calls(kernel, dtype, window, per_row):
    """The real ops on `meta` tensors (PyTorch's own shape functions for them, torch/_meta_registrations.py)
    take the calls the kernel classes make, and return what they expect: a second check of the
    layouts, from PyTorch rather than from the stand-in. Forward and backward for flash; forward
    only for the memory-efficient op, whose meta backward lacks its `out` argument."""
    B, H, Hkv, Q, Ls, Lp, D = 3, 8, 2, 16, 40, 8, 64
    mk = lambda *s: torch.empty(*s, dtype=dtype, device="meta", requires_grad=True)  # noqa: E731
    pos = lambda a, b: torch.arange(a, b, device="meta")  # noqa: E731
    q = mk(B, H, Q, D)
    parts = [Part(mk(1, Hkv, Ls, D), mk(1, Hkv, Ls, D), pos(0, Ls), shared=True, start=0)]
    if per_row:
        parts += [Part(mk(1, Hkv, Lp, D), mk(1, Hkv, Lp, D), pos(Ls, Ls + Lp), row=r, start=Ls) for r in range(B)]
    else:
        parts.append(Part(mk(B, Hkv, Lp, D), mk(B, Hkv, Lp, D), pos(Ls, Ls + Lp), start=Ls))
    parts.append(Part(mk(B, Hkv, Q, D), mk(B, Hkv, Q, D), pos(Ls + Lp, Ls + Lp + Q), causal=True, start=Ls + Lp))
    k = {"flash": A.CudaFlash(), "efficient": A.CudaEfficient()}[kernel]
    out = merged_attention(q, parts, pos(Ls + Lp, Ls + Lp + Q), 0.1, window, kernel=k, q_start=Ls + Lp)
    assert out.shape == (B, H, Q, D) and out.dtype == dtype
    if kernel == "flash":
        out.sum().backward()
        assert q.grad.shape == q.shape and all(p.k.grad.shape == p.k.shape for p in parts)


def saved_bytes(fn) -> list[int]:
    """Bytes of every tensor autograd saves while `fn` runs."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


@pytest.mark.parametrize("kernel", ["math", "flash", "efficient", "cpu"])
def test_no_query_by_key_tensor_saved(kernel):
    """The fused paths save q, the merged out and lse and the K/V as they came: nothing of
    [B, H, Q, K] size, which the naive path does save."""
    torch.manual_seed(5)
    B, H, Q, Ls = 2, 4, 16, 256
    q, parts, qpos, _ = problem(B, H, 2, Q=Q, Ls=Ls, Lp=32, D=8, per_row=True)
    k = {"flash": flash(), "efficient": efficient(), "cpu": A.CPU_FLASH, "math": "math"}[kernel]
    sizes = saved_bytes(lambda: merged_attention(q, parts, qpos, 0.3, None, kernel=k, q_start=int(qpos[0])))
    scores = B * H * Q * Ls * 8
    assert (max(sizes) >= scores) == (kernel == "math"), (max(sizes), scores)


# ---------------------------------------------------------------------------------------------
# The engine through the CUDA kernels' code paths (float64, stand-in)


@pytest.mark.parametrize("make_kernel", [flash, efficient], ids=["flash", "efficient"])
@pytest.mark.parametrize("family, use_lora", [("qwen3", False), ("mistral-window", False),
                                              ("qwen3-mixed-window", True)])
@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_engine_through_standin(make_kernel, family, use_lora, block_size):
    """stream_backward with a CUDA kernel's code path (stand-in ops) equals reference_backward in
    float64: shared prompts, per-row histories, windows shorter than a block, LoRA."""
    model = make(family)
    if use_lora:
        model = lora(model)
    kernel = make_kernel()
    seqs, weights = group_batch(torch.Generator().manual_seed(1))
    assert_same(model, seqs, weights, block_size=block_size, batch_tokens=4 * block_size, kernel=kernel)
    calls = kernel.ops.calls
    assert calls["flash_fwd_dense" if kernel.name == "cuda-flash" else "efficient_bwd"] > 0
    if block_size == 3 and kernel.name == "cuda-flash":  # sibling rows with private histories: varlen
        assert calls["flash_fwd_varlen"] > 0


@pytest.mark.parametrize("make_kernel", [flash, efficient], ids=["flash", "efficient"])
@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3"])
def test_engine_through_standin_sinks_and_mla(make_kernel, model_type):
    """GPT-OSS (sinks, sliding/full layers) and DeepSeek-V3 (MLA: history ⊕ block from the cache,
    K and V of other head sizes, padded to 16) through a CUDA kernel's code path, exact."""
    from test_contract import build  # the contract tests' tiny float64 configs of these families

    if model_type == "gpt_oss":
        model = build("gpt_oss", num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                      layer_types=["sliding_attention", "full_attention"])
    else:
        model = build("deepseek_v3", kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
                      v_head_dim=6, head_dim=4, num_key_value_heads=4, first_k_dense_replace=2, n_routed_experts=4,
                      num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16)
    kernel = make_kernel()
    seqs, weights = group_batch(torch.Generator().manual_seed(1))
    for block_size in (3, 64):
        assert_same(model, seqs, weights, block_size=block_size, kernel=kernel)
    assert sum(kernel.ops.calls.values()) > 0


# ---------------------------------------------------------------------------------------------
# On a GPU (bench/gpu_check.sh): the real kernels against the naive path


def _on_cuda(leaves, dtype):
    return [x.detach().to("cuda", dtype).requires_grad_(True) for x in leaves]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype, kernel", [(torch.bfloat16, "cuda-flash"), (torch.float16, "cuda-flash"),
                                           (torch.bfloat16, "cuda-efficient"), (torch.float32, "cuda-efficient")])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("per_row", [False, True])
def test_cuda_fused_matches_naive(dtype, kernel, window, per_row):
    """Fused vs naive on CUDA, values and every gradient, against float64 on the same GPU.
    Tolerances: the fused error ≤ 2 × the naive path's own error in that dtype + 1e-3 (16-bit) or
    + 1e-5 (fp32)."""
    torch.manual_seed(6)
    q, parts, qpos, leaves = problem(3, 16, 4, Q=96, Ls=512, Lp=64, D=128, per_row=per_row)
    qpos = qpos.cuda()
    probe = torch.randn(3, 16, 96, 128, dtype=torch.float64, device="cuda")
    k = {"cuda-flash": A.CUDA_FLASH, "cuda-efficient": A.CUDA_EFFICIENT}[kernel]
    assert k.available()

    def run(kern, dt):
        low = _on_cuda(leaves, dt)
        it = iter(low[1:])
        ps = [Part(next(it), next(it), p.kpos_K.cuda(), p.shared, p.causal, p.row, p.start) for p in parts]
        out = merged_attention(low[0], ps, qpos, 128 ** -0.5, window, kernel=kern, q_start=int(qpos[0]))
        return [out.double()] + [g.double() for g in torch.autograd.grad((out.double() * probe).sum(), low)]

    exact, naive, fused = run("math", torch.float64), run("math", dtype), run(k, dtype)
    slack = 1e-5 if dtype == torch.float32 else 1e-3
    for f, n, e in zip(fused, naive, exact):
        scale = e.abs().max().clamp_min(1.0)
        err_f, err_n = ((f - e).abs().max() / scale).item(), ((n - e).abs().max() / scale).item()
        assert err_f <= 2 * err_n + slack, (err_f, err_n)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kernel", ["cuda-flash", "cuda-efficient"])
def test_cuda_no_query_by_key_tensor_saved(kernel):
    torch.manual_seed(7)
    B, H, Q, Ls = 2, 16, 256, 4096
    q, parts, qpos, leaves = problem(B, H, 4, Q=Q, Ls=Ls, Lp=64, D=128, per_row=True)
    dtype = torch.bfloat16 if kernel == "cuda-flash" else torch.float32
    low = _on_cuda(leaves, dtype)
    it = iter(low[1:])
    ps = [Part(next(it), next(it), p.kpos_K.cuda(), p.shared, p.causal, p.row, p.start) for p in parts]
    k = {"cuda-flash": A.CUDA_FLASH, "cuda-efficient": A.CUDA_EFFICIENT}[kernel]
    sizes = saved_bytes(lambda: merged_attention(low[0], ps, qpos.cuda(), 0.1, None, kernel=k, q_start=int(qpos[0])))
    assert max(sizes) < B * H * Q * Ls * 2


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("family, use_lora", [("llama", False), ("qwen3", True), ("mistral-window", False),
                                              ("qwen3-moe", False)])
def test_cuda_engine_float64_naive_path(family, use_lora):
    """The engine's float64 suite on CUDA: there the attention takes the naive path (no fused
    kernel takes float64), and streamed = reference to 1e-10."""
    model = make(family).cuda()
    if use_lora:
        model = lora(model)
    seqs, weights = group_batch(torch.Generator().manual_seed(1))
    for block_size in (1, 3, 64):
        assert_same(model, seqs, weights, block_size=block_size)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_engine_fused_close_to_float64(dtype):
    """The whole engine on CUDA with the fused kernels (auto) in bf16 / fp32: its gradient is as
    close to the float64 truth as the reference backward's in the same dtype (≤ 2× + slack)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(8)
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    base = Qwen3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 512, (300,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(0, 512, (100 + 40 * i,), generator=g)]) for i in range(4)]
    weights = [torch.cat([torch.zeros(300), torch.randn(len(s) - 300, generator=g)]) for s in seqs]

    def grads(model, fn, **kw):
        model.zero_grad(set_to_none=True)
        fn(model, seqs, [w.double() if next(model.parameters()).dtype == torch.float64 else w for w in weights], **kw)
        return torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])

    truth = grads(base.double().cuda(), reference_backward)
    low = base.to(dtype).cuda()
    assert select_kernel("auto", torch.device("cuda"), dtype, 64).name != "math"
    err = lambda x: ((x - truth).norm() / truth.norm()).item()  # noqa: E731
    e_stream = err(grads(low, stream_backward, block_size=64))
    e_ref = err(grads(low, reference_backward))
    assert e_stream <= 2 * e_ref + (1e-5 if dtype == torch.float32 else 1e-3), (e_stream, e_ref)


# ---------------------------------------------------------------------------------------------
# The GPU check's plumbing, on CPU


def smoke(out, *args, wheels=None):
    """bench/gpu_check.sh in its CPU dry-run mode (with the wheels in `wheels`, else none: not a
    checkout's .whl/); returns (stdout, the JSON it wrote)."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_WHEELS": str(wheels or out / "no-wheels")}
    proc = subprocess.run(["bash", os.path.join("bench", "gpu_check.sh"), str(out), "--cpu-smoke", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: exit 0" in proc.stdout, proc.stdout[-3000:]
    assert (out / "gpu_check.log").read_text().strip() == proc.stdout.strip()
    return proc.stdout, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow
def test_gpu_check_runs_on_the_wheels_it_is_brought(tmp_path):
    """A GPU machine without network runs the check on the transformers and peft brought as wheels
    (bench/gpu_wheels.sh): installed into a folder of their own, first on the path of every part.
    Here a stand-in `peft` 99.0 wheel shadows the real one, and the check's own version line reads it."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    files = {"peft/__init__.py": "__version__ = '99.0'\n",
             "peft-99.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: peft\nVersion: 99.0\n",
             "peft-99.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n"}
    files["peft-99.0.dist-info/RECORD"] = "".join(f"{name},,\n" for name in files) + "peft-99.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheels / "peft-99.0-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    stdout, res = smoke(tmp_path / "out", "--parts", "vllm-hybrid", wheels=wheels)
    assert "gpu_check: from " + str(wheels) + ": peft-99.0-py3-none-any.whl" in stdout
    assert re.search(r"^gpu_check: python \S+ torch \S+ transformers \S+ peft 99\.0$", stdout, re.M), stdout[:2000]
    assert list(res["parts"]) == ["vllm-hybrid"]
    stdout, _ = smoke(tmp_path / "plain", "--parts", "vllm-hybrid")  # no wheels: the environment's own
    import peft

    assert f" peft {peft.__version__}\n" in stdout and "gpu_check: from" not in stdout


def test_gpu_check_runs_its_parts_side_by_side_on_cpu_only(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.bench_gpu", "--jobs", "2", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "--jobs 2: expected 1, or more with --cpu-smoke only" in proc.stderr


@pytest.mark.slow
def test_gpu_check_cpu_smoke_all_parts(tmp_path):
    """Every part of the GPU check in the tiny CPU mode (the CUDA tests skip): each runs, records
    what the summary reads, and the train step's time split comes back; a shape part (the 8B one:
    LoRA) has its memory rows, the longest-trajectory search and its line in the summary table."""
    stdout, res = smoke(tmp_path, "--jobs", "2")  # two parts at a time: the machine's 2 cores (each part: 1 thread)
    assert set(res["parts"]) == {"tests", "shape:0.6b", "shape:1.7b", "shape:8b", "prefix", "hybrid", "train",
                                 "vllm-hybrid", "vllm-colocate"}
    for name, part in res["parts"].items():
        assert part["error"] is None, (name, part["error"])
    rows = [r for p in res["parts"].values() for r in p["rows"]]
    assert {r["G"] for r in rows if r["kind"] == "prefix"} == {8, 16}
    train = next(r for r in rows if r["kind"] == "train")
    assert {"rollout", "prefill", "backward", "optim", "step"} <= set(train["time"])
    assert (tmp_path / "train_metrics.jsonl").exists() and (tmp_path / "cuda_tests.log").exists()
    hybrid = [r for r in rows if r["kind"] == "hybrid"]
    assert len(hybrid) == 4 and all(r["ok"] for r in hybrid)  # reference and stream at two lengths
    assert all(r["relative_difference"] < 1e-5 for r in rows if r["kind"] == "hybrid_agreement")  # float32 here
    assert next(r for r in rows if r["kind"] == "hybrid_paths")["gated_delta_rule"] == "transformers' torch fallback"
    assert "hybrid (Qwen3.5-0.8B widths" in stdout
    kinds = Counter(r["kind"] for r in res["parts"]["shape:8b"]["rows"])
    assert kinds["model"] == 1 and kinds["memory"] == 4 and kinds["longest"] == 3
    assert next(r for r in res["parts"]["shape:8b"]["rows"] if r["kind"] == "model")["lora_r"] == 16
    assert "GPU check summary" in stdout and "longest single trajectory that trains" in stdout

"""Attention of one block batch over its history, split into parts merged by log-sum-exp.

A block batch of B rows (sibling blocks of a token tree) attends to three parts:
  shared  — the history every row has in common (a GRPO group's prompt), ONE copy, batch 1;
  private — each row's own earlier tokens (earlier chunks of its node), batch B;
  block   — the block's own keys, batch B, causal.
Concatenating an expanded shared part with each row's keys would materialise B copies of the
prefix per layer, and autograd would keep them for the backward (docs/design.md §5, trap 1). Instead each
part is attended separately and the outputs are merged by their log-sum-exp (Hydragen's
decomposition): with lse_i the row log-sum-exp of part i and lse = logaddexp_i lse_i,
    out = Σ_i exp(lse_i − lse) · out_i.
The shared part folds the B rows (and the GQA group) into its query axis, so it reads one copy of
K/V and never repeats KV heads. A private part may also come as one batch-1 part per row (`row=r`,
a run of B parts, rows 0..B−1, same positions): each row's K/V then stay views of wherever they
live (the K/V store) instead of being stacked into a [B, …] copy that autograd would keep; the
fused kernel runs once per row. K/V are handed to the kernel as they are (it reads strided K/V),
so a view of the store is never copied either.

Kernels: on CPU the fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) returns the
lse; its backward, called per part with the *merged* output and lse, gives each part's exact
gradient (the standard ring-attention argument: dS_i = P_i ∘ (dO·V_iᵀ − rowsum(dO ∘ O)) with
P_i = exp(S_i − lse)). Elsewhere, and as the naive reference, `merged_attention_math` materialises
the scores of all parts and lets autograd differentiate them.

Positions are absolute: a query at position p sees a key at position k iff k ≤ p and, with a
sliding window W, p − k < W (the convention of transformers' masks).

Two score modifiers of real families (docs/design.md §6b):
- attention sinks (GPT-OSS `s_aux`): a learned per-head logit with a zero value, one more term of
  the log-sum-exp merge: lse = logaddexp(lse_1, …, lse_n, sink_h); its gradient is
  ∂/∂sink_h = −Σ_{b,q} exp(sink_h − lse) · rowsum(dO ∘ O). Both kernels support it.
- logit soft-capping (Gemma 2): s ↦ c·tanh(s/c) before the mask. The fused kernel cannot apply it,
  so the exact math path runs (it materialises the [Q × K] scores of the batch).
K and V of different head sizes (multi-head latent attention) go to the fused kernel zero-padded to
one head size (zero columns change neither the scores nor the kept output columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from backstream.checks import UserError


@dataclass
class Part:
    """One group of keys. k/v: [1 or B, Hkv, Lk, D]; kpos_K: [Lk] absolute key positions (shared by
    all rows); shared=True when k/v has batch 1 and is read by every row; causal=True for the
    block's own keys; row=r when k/v has batch 1 and only row r reads it (one such part per row, in
    row order)."""

    k: Tensor
    v: Tensor
    kpos_K: Tensor
    shared: bool = False
    causal: bool = False
    row: int | None = None


def _rows_in_runs(parts: list[Part], B: int) -> bool:
    """Do the per-row parts come as runs of rows 0..B−1 (the layout `_FlashMerged` reads)?"""
    expect = 0  # the row the next part must have, inside a run
    for p in parts:
        if p.row != (expect if expect or p.row is not None else None):
            return False
        if p.row is not None:
            expect = (expect + 1) % B
    return expect == 0


def rows_as_batch(parts: list[Part]) -> list[Part]:
    """Each run of per-row parts as one batch-B part (a copy: for the paths that need one tensor)."""
    out, i = [], 0
    while i < len(parts):
        p = parts[i]
        if p.row is None:
            out.append(p)
            i += 1
            continue
        j = i
        while j < len(parts) and parts[j].row == j - i:
            j += 1
        run = parts[i:j]
        out.append(Part(torch.cat([x.k for x in run]), torch.cat([x.v for x in run]), p.kpos_K))
        i = j
    return out


def _mask(qpos_Q: Tensor, kpos_K: Tensor, causal: bool, window: int | None, dtype) -> Tensor | None:
    """Additive [Q, K] mask, or None when every query sees every key."""
    keep = None
    if causal:
        keep = kpos_K[None, :] <= qpos_Q[:, None]
    if window is not None:
        w = (qpos_Q[:, None] - kpos_K[None, :]) < window
        keep = w if keep is None else keep & w
    if keep is None or bool(keep.all()):
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=qpos_Q.device).masked_fill_(~keep, float("-inf"))


def _fold(x_BHQD: Tensor, hkv: int, shared: bool) -> Tensor:
    """[B, H, Q, D] → [B, Hkv, g·Q, D] (rows) or [1, Hkv, B·g·Q, D] (shared)."""
    B, H, Q, D = x_BHQD.shape
    x = x_BHQD.reshape(B, hkv, (H // hkv) * Q, D)
    if shared:
        x = x.transpose(0, 1).reshape(1, hkv, B * (H // hkv) * Q, D)
    return x.contiguous()


def _unfold(x: Tensor, B: int, H: int, Q: int, shared: bool) -> Tensor:
    """Inverse of `_fold` for [.., D] outputs or [..] lse (trailing dim absent)."""
    hkv = x.shape[1]
    tail = x.shape[3:]
    if shared:
        x = x.reshape(hkv, B, (H // hkv) * Q, *tail).transpose(0, 1)
    return x.reshape(B, H, Q, *tail)


def _fold_mask(m_QK: Tensor | None, B: int, g: int, shared: bool) -> Tensor | None:
    """Query axis of the mask in the folded layout: row r ↔ query r % Q."""
    if m_QK is None:
        return None
    m = m_QK.repeat(g * (B if shared else 1), 1)
    return m[None, None]


def _repeat_heads(x: Tensor, g: int) -> Tensor:
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _flash_part(q, k, v, mask, shared: bool, scale):
    """One non-causal part through the fused kernel: (out [B, H, Q, D], lse [B, H, Q])."""
    B, H, Q, D = q.shape
    hkv = k.shape[1]
    g = H // hkv
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _fold(q, hkv, shared), k, v, 0.0, False, attn_mask=_fold_mask(mask, B, g, shared), scale=scale)
    if mask is not None:
        # the kernel reports lse = 0 for a query that sees no key of this part
        empty = torch.isinf(mask).all(-1).repeat(g * (B if shared else 1))
        lse = lse.masked_fill(empty[None, None], float("-inf"))
    return _unfold(o, B, H, Q, shared), _unfold(lse, B, H, Q, shared)


def _flash_part_backward(g_out, q, k, v, out, lse_all, mask, shared: bool, scale):
    """The exact gradient of one part given the merged output and lse: (dq [B, H, Q, D], dk, dv)."""
    B, H, Q, D = q.shape
    hkv = k.shape[1]
    g = H // hkv
    lse_f = _fold(lse_all[..., None], hkv, shared)[..., 0]
    dqf, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _fold(g_out, hkv, shared), _fold(q, hkv, shared), k, v, _fold(out, hkv, shared), lse_f, 0.0, False,
        attn_mask=_fold_mask(mask, B, g, shared), scale=scale,
    )
    return _unfold(dqf, B, H, Q, shared), dk, dv


class _FlashMerged(torch.autograd.Function):
    """Parts marked `causal` in meta are a block's own keys at the queries' own positions with no
    window cutting into them: the kernel's causal flag replaces a [Q × Q] mask (which, per layer,
    would be kept for the backward and grow quadratically with the block). A run of per-row parts
    (rows 0..B−1) is one part whose rows go through the kernel one at a time."""

    @staticmethod
    def forward(ctx, meta, q, sinks, *kv):
        shared, masks, scale, causal, rows = meta
        B, H, Q, D = q.shape
        hkv = kv[0].shape[1]
        g = H // hkv
        outs, lses = [], []
        i = 0
        while i < len(shared):
            if causal[i]:
                o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, _repeat_heads(kv[2 * i], g), _repeat_heads(kv[2 * i + 1], g), 0.0, True, scale=scale)
                outs.append(o)
                lses.append(lse)
                i += 1
            elif rows[i] is not None:
                per_row = [_flash_part(q[r:r + 1], kv[2 * (i + r)], kv[2 * (i + r) + 1], masks[i + r], False, scale)
                           for r in range(B)]
                outs.append(torch.cat([o for o, _ in per_row]))
                lses.append(torch.cat([lse for _, lse in per_row]))
                i += B
            else:
                o, lse = _flash_part(q, kv[2 * i], kv[2 * i + 1], masks[i], shared[i], scale)
                outs.append(o)
                lses.append(lse)
                i += 1
        if sinks is not None:  # one more logit per head, with a zero value
            lses.append(sinks.to(lses[0].dtype).reshape(1, H, 1).expand(B, H, Q))
        lse_all = torch.logsumexp(torch.stack(lses), dim=0)  # [B, H, Q]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = sum(torch.exp(lse - lse_all)[..., None].to(acc) * o.to(acc) for lse, o in zip(lses, outs))
        out = out.to(q.dtype)
        if not out.transpose(1, 2).is_contiguous():
            # the adapter hands transformers [B, Q, H, D]: in that layout the one copy kept here for
            # the backward is also o_proj's input, instead of a second, transposed copy
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.meta = meta
        ctx.save_for_backward(q, out, lse_all, sinks, *kv)
        return out

    @staticmethod
    def backward(ctx, g_out):
        shared, masks, scale, causal, rows = ctx.meta
        q, out, lse_all, sinks, *kv = ctx.saved_tensors
        B, H, Q, D = q.shape
        hkv = kv[0].shape[1]
        g = H // hkv
        g_out = g_out.to(q.dtype)
        dq = torch.zeros_like(q, dtype=torch.promote_types(q.dtype, torch.float32))
        dkv = []
        for i, sh in enumerate(shared):
            if causal[i]:
                dqi, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    g_out, q, _repeat_heads(kv[2 * i], g), _repeat_heads(kv[2 * i + 1], g), out, lse_all,
                    0.0, True, scale=scale)
                dq += dqi
                Lk = dk.shape[2]
                dkv += [x.reshape(B, hkv, g, Lk, D).sum(2) for x in (dk, dv)]
            elif rows[i] is not None:
                r = rows[i]
                dqi, dk, dv = _flash_part_backward(g_out[r:r + 1], q[r:r + 1], kv[2 * i], kv[2 * i + 1],
                                                   out[r:r + 1], lse_all[r:r + 1], masks[i], False, scale)
                dq[r:r + 1] += dqi
                dkv += [dk, dv]
            else:
                dqi, dk, dv = _flash_part_backward(g_out, q, kv[2 * i], kv[2 * i + 1], out, lse_all, masks[i], sh,
                                                   scale)
                dq += dqi
                dkv += [dk, dv]
        dsinks = None
        if sinks is not None:
            acc = lse_all.dtype
            rowsum_BHQ = (g_out.to(acc) * out.to(acc)).sum(-1)
            p_sink = torch.exp(sinks.to(acc).reshape(1, H, 1) - lse_all)
            dsinks = -(p_sink * rowsum_BHQ).sum((0, 2)).to(sinks.dtype)
        return (None, dq.to(q.dtype), dsinks, *dkv)


def merged_attention_math(q_BHQD: Tensor, parts: list[Part], qpos_Q: Tensor, scale: float,
                          window: int | None, softcap: float | None = None, sinks_H: Tensor | None = None) -> Tensor:
    """Naive reference: materialise the scores of every part, one softmax over all keys (and the
    sink logit, whose value is zero)."""
    parts = rows_as_batch(parts)
    B, H, Q, D = q_BHQD.shape
    scores, values = [], []
    for p in parts:
        g = H // p.k.shape[1]
        k = p.k.repeat_interleave(g, dim=1)
        v = p.v.repeat_interleave(g, dim=1)
        s = (q_BHQD @ k.transpose(-1, -2)) * scale  # [B, H, Q, Lk] (shared part broadcast)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        m = _mask(qpos_Q, p.kpos_K, p.causal, window, s.dtype)
        scores.append(s if m is None else s + m)
        values.append(v)
    if sinks_H is not None:
        scores.append(sinks_H.to(scores[0].dtype).reshape(1, H, 1, 1).expand(B, H, Q, 1))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out, start = 0, 0
    for s, v in zip(scores, values):
        out = out + probs[..., start:start + s.shape[-1]] @ v
        start += s.shape[-1]
    return out


KERNELS = ("auto", "flash", "math")


def use_flash(kernel: str, device: torch.device) -> bool:
    """Does `kernel` run the fused flash kernel: "flash" yes, "math" (the naive reference) no, "auto"
    on CPU only (elsewhere the naive path, until a fused GPU path exists). The one place a kernel's
    name is read."""
    if kernel not in KERNELS:
        raise UserError(f"kernel: expected one of {list(KERNELS)}, got {kernel!r}")
    return kernel == "flash" or (kernel == "auto" and device.type == "cpu")


def merged_attention(q_BHQD: Tensor, parts: list[Part], qpos_Q: Tensor, scale: float,
                     window: int | None, kernel: str = "auto", *, softcap: float | None = None,
                     sinks_H: Tensor | None = None) -> Tensor:
    """Attention of q over the union of `parts`; returns [B, H, Q, Dv]. kernel: auto | flash | math.
    softcap: logit soft-capping c (scores c·tanh(s/c)); sinks_H: per-head sink logits [H]."""
    parts = [p for p in parts if p.k.shape[2] > 0]
    assert _rows_in_runs(parts, q_BHQD.shape[0]), "per-row parts come in runs of rows 0..B-1"
    if not use_flash(kernel, q_BHQD.device) or softcap is not None:  # the fused kernel cannot soft-cap its scores
        return merged_attention_math(q_BHQD, parts, qpos_Q, scale, window, softcap, sinks_H)
    Dk, Dv = q_BHQD.shape[-1], parts[0].v.shape[-1]
    if Dk != Dv:  # the kernel wants one head size: zero-pad the narrower side, keep Dv columns
        D = max(Dk, Dv)
        pad = lambda x: torch.nn.functional.pad(x, (0, D - x.shape[-1]))  # noqa: E731
        parts = [Part(pad(p.k), pad(p.v), p.kpos_K, p.shared, p.causal, p.row) for p in parts]
        return merged_attention(pad(q_BHQD), parts, qpos_Q, scale, window, kernel, sinks_H=sinks_H)[..., :Dv]
    Q = q_BHQD.shape[2]
    # the block's own keys at the queries' positions, no window shorter than the block: plain causal
    causal = [p.causal and not p.shared and p.row is None and (window is None or window >= Q) and p.kpos_K.shape[0] == Q
              and bool(torch.equal(p.kpos_K, qpos_Q)) for p in parts]
    masks = [None if c else _mask(qpos_Q, p.kpos_K, p.causal, window, q_BHQD.dtype) for p, c in zip(parts, causal)]
    # views of the K/V store stay views: the kernel reads any strides with a unit last one
    kv = [t if t.stride(-1) == 1 else t.contiguous() for p in parts for t in (p.k, p.v)]
    meta = ([p.shared for p in parts], masks, scale, causal, [p.row for p in parts])
    return _FlashMerged.apply(meta, q_BHQD.contiguous(), sinks_H, *kv)

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
The shared part is attended once for all B rows (its rows folded into the kernel's query or head
axis), so it reads one copy of K/V and never repeats KV heads. A private part may also come as one
batch-1 part per row (`row=r`, a run of B parts, rows 0..B−1, same positions): each row's K/V then
stay views of wherever they live (the K/V store) instead of being stacked into a [B, …] copy that
autograd would keep (cpu-flash runs once per row, cuda-flash one varlen call). K/V are handed to
the kernel as they are (it reads strided K/V), so a view of the store is never copied either.

Kernels. A fused kernel attends one part and returns its output and lse; its backward, called per
part with the *merged* output and lse, gives that part's exact gradient (the ring-attention
argument: dS_i = P_i ∘ (dO·V_iᵀ − rowsum(dO ∘ O)) with P_i = exp(S_i − lse); every fused backward
below takes `out` and `lse` as inputs and recomputes P_i from them). The merge (in float32, or in
the inputs' dtype when wider), the sinks and the per-part backward are one code path (`_Merged`)
for every device; what differs is a `Kernel` object, picked by `select_kernel`:

- `cpu-flash` (`_scaled_dot_product_flash_attention_for_cpu`): CPU, any float dtype; takes a dense
  [Q, K] additive mask or its causal flag; no GQA (the group is folded into the query axis, or the
  K/V heads repeated); lse [B, H, Q], 0 for a query that sees no key.
- `cuda-flash` (`_flash_attention_forward/backward`): CUDA sm80+, fp16/bf16; takes no mask, only a
  bottom-right window (`window_size_left/right`); native GQA; lse [B, H, Q] float32, varlen
  [H, total_q]; +inf for a query that sees no key.
- `cuda-efficient` (`_efficient_attention_forward/backward`): CUDA, fp32 (fp16/bf16 where flash
  cannot run); no mask, a bottom-right causal one, or an additive bias; no GQA; lse float32
  [B, H, ⌈Q/32⌉·32], the tail padding.
- `math` (`merged_attention_math`): anywhere, any dtype, any mask, soft-capping; K/V repeated.

Choices (`select_kernel`, kernel="auto"): CPU → cpu-flash; CUDA fp16/bf16 → cuda-flash (on sm80+,
head size ≤ 256 after padding to a multiple of 8), else cuda-efficient; CUDA fp32 → cuda-efficient;
float64 on CUDA and other devices → math (no fused kernel takes float64; the math path is the
reference anyway); soft-capping → math. kernel="flash" names the device's fused kernel and refuses
a dtype that has none; kernel="math" is the naive reference everywhere.
How the CUDA kernels are fed (no [Q × K] tensor is ever kept for the backward):
- they take no dense mask, so each part's visibility is a `Band` computed from positions (queries
  and keys at consecutive positions, causal, window). A part is first cut to the rectangle of
  queries that see at least one of its keys and keys that some query sees: no kernel ever gets a
  query with no key (cuda-flash reports lse = +inf for one), and inside the rectangle the band is
  exactly flash's bottom-right `window_size_left/right`. Positions come as ints (`Part.start`,
  `q_start`): reading a CUDA tensor would make the host wait for the device in every layer;
- cuda-flash: the shared part folds the B rows into the head axis ([1, Q, Hkv·B·g, D], a GQA group
  of B·g query heads per K/V head): one call, dK/dV once, any band; a run of per-row parts is one
  varlen call (`cum_seq_q/k`; the rows' K/V packed for the call and not kept) except with one-query
  blocks, whose varlen lse layout differs (flash's `seqlenq_ngroups_swapped`); other parts are one
  dense call with K/V as they are (strided views of the store);
- cuda-efficient (no GQA): a part that every query sees whole folds the rows (shared part) and the
  group into the query axis, as cpu-flash does; the block's own keys repeat the K/V heads and use
  its bottom-right causal mask; a sliding window that cuts a part becomes an additive bias over
  that part's rectangle, built in the forward and again in the backward (never saved), K/V heads
  repeated, one call per row for a shared part. Its lse goes back padded to ⌈M/32⌉·32;
- head sizes: zero-padded to a common size the kernel takes (K and V of different sizes, MLA;
  cuda-flash and cuda-efficient want a multiple of 8).

Positions are absolute: a query at position p sees a key at position k iff k ≤ p and, with a
sliding window W, p − k < W (the convention of transformers' masks).

Two score modifiers of real families (docs/design.md §6b):
- attention sinks (GPT-OSS `s_aux`): a learned per-head logit with a zero value, one more term of
  the log-sum-exp merge: lse = logaddexp(lse_1, …, lse_n, sink_h); its gradient is
  ∂/∂sink_h = −Σ_{b,q} exp(sink_h − lse) · rowsum(dO ∘ O). Every kernel supports it (the merge
  adds the term, whatever attended the parts).
- logit soft-capping (Gemma 2): s ↦ c·tanh(s/c) before the mask. No fused kernel applies it, so
  the exact math path runs (it materialises the [Q × K] scores of the batch).
K and V of different head sizes (multi-head latent attention) go to a fused kernel zero-padded to
one head size (zero columns change neither the scores nor the kept output columns).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from backstream.checks import UserError


@dataclass
class Part:
    """One group of keys. k/v: [1 or B, Hkv, Lk, D]; kpos_K: [Lk] absolute key positions (shared by
    all rows); shared=True when k/v has batch 1 and is read by every row; causal=True for the
    block's own keys; row=r when k/v has batch 1 and only row r reads it (one such part per row, in
    row order); start: kpos_K[0] when the positions are consecutive, if the caller knows it (the
    CUDA kernels build their masks from ints, and reading kpos_K would wait for the device)."""

    k: Tensor
    v: Tensor
    kpos_K: Tensor
    shared: bool = False
    causal: bool = False
    row: int | None = None
    start: int | None = None


def _rows_in_runs(parts: list[Part], B: int) -> bool:
    """Do the per-row parts come as runs of rows 0..B−1 (the layout `_Merged` reads)?"""
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
        out.append(Part(torch.cat([x.k for x in run]), torch.cat([x.v for x in run]), p.kpos_K, start=p.start))
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


# ---------------------------------------------------------------------------------------------
# Which keys each query of a part sees, from positions alone (for kernels that take no mask).

INF = float("inf")


@dataclass(frozen=True)
class Band:
    """Queries at consecutive positions q0 … q0+Q−1 and keys at k0 … k0+Lk−1, off = q0 − k0: query i
    sees key j iff d = off + i − j has d ≥ 0 (causal) and d < window (a sliding window). `of` keeps
    only the constraints that bind, so a band that hides nothing says so (`full`)."""

    Q: int
    Lk: int
    off: int
    causal: bool = False
    window: int | None = None

    @staticmethod
    def of(Q: int, Lk: int, off: int, causal: bool, window: int | None) -> Band:
        causal = causal and off < Lk - 1  # some key lies after some query (the smallest d is off − Lk + 1)
        if window is not None and off + Q - 1 < window:  # the largest d is off + Q − 1
            window = None
        return Band(Q, Lk, off, causal, window)

    @property
    def full(self) -> bool:
        return not self.causal and self.window is None

    def cut(self) -> tuple[int, int, int, int, Band] | None:
        """(i0, i1, j0, j1, band): the queries [i0, i1) that see at least one key, the keys [j0, j1)
        that some query sees, and the band of that rectangle, in which every row sees a key; None
        when no query sees any key of the part."""
        i0 = max(0, -self.off) if self.causal else 0
        i1 = min(self.Q, self.Lk + self.window - 1 - self.off) if self.window is not None else self.Q
        if i0 >= i1:
            return None
        j0 = max(0, self.off + i0 - self.window + 1) if self.window is not None else 0
        j1 = min(self.Lk, self.off + i1) if self.causal else self.Lk
        return i0, i1, j0, j1, Band.of(i1 - i0, j1 - j0, self.off + i0 - j0, self.causal, self.window)

    def flash_window(self) -> tuple[int, int] | None:
        """(window_size_left, window_size_right) in flash-attention's bottom-right convention for a
        band as `cut` leaves it: query i sees key j iff i + Lk − Q − left ≤ j ≤ i + Lk − Q + right,
        where −1 (or ≥ Lk) means Lk when the other bound is set, and no mask when both are −1. None
        when that cannot say this band: its right edge cannot reach past i + 2·Lk − Q, which hides
        keys from the first rows when Q > Lk + 1 and only the left edge is wanted; a causal band
        whose edge lies further right than Lk (more queries than keys) likewise."""
        if self.full:
            return -1, -1
        shift = self.Lk - self.Q
        right = self.off - shift if self.causal else -1
        left = self.window - 1 - self.off + shift if self.window is not None else -1
        if self.causal and not 0 <= right < self.Lk:
            return None
        if self.window is not None and (not 0 <= left < self.Lk or (not self.causal and self.Q > self.Lk + 1)):
            return None
        return left, right

    def flash_pieces(self) -> list[tuple[int, int, int, int, Band]] | None:
        """The rectangles (i0, i1, j0, j1, band) flash attends, one call each: [] when no query sees
        a key; usually the one `cut` rectangle. A part before the queries, cut by a window and read
        by more than Lk + 1 queries (a block longer than the window over a short history) splits in
        two: the rows that see all of it (no mask), the rows whose window starts inside it. None
        when flash cannot say the band at all (no part the engine makes)."""
        c = self.cut()
        if c is None:
            return []
        i0, i1, j0, j1, b = c
        if b.flash_window() is not None:
            return [c]
        if b.causal or b.window is None:
            return None
        r = min(max(b.window - b.off, 0), b.Q)  # rows 0 … r−1 of the rectangle see every key of it
        pieces = [(i0, i0 + r, j0, j1, Band.of(r, b.Lk, b.off, False, None))] if r else []
        rest = Band.of(b.Q - r, b.Lk, b.off + r, False, b.window).cut()
        if rest is not None:
            a0, a1, c0, c1, rb = rest
            if rb.flash_window() is None:
                return None
            pieces.append((i0 + r + a0, i0 + r + a1, j0 + c0, j0 + c1, rb))
        return pieces

    def keep(self, device) -> Tensor:
        """[Q, Lk] bool: which keys each query sees."""
        d = self.off + torch.arange(self.Q, device=device)[:, None] - torch.arange(self.Lk, device=device)[None, :]
        keep = torch.ones(self.Q, self.Lk, dtype=torch.bool, device=device)
        if self.causal:
            keep &= d >= 0
        if self.window is not None:
            keep &= d < self.window
        return keep


def _first(pos: Tensor, hint: int | None) -> int | None:
    """The first of consecutive positions, None when they are not consecutive; the caller's hint
    when it has one (reading a CUDA tensor waits for the device)."""
    if hint is not None:
        return hint
    first = int(pos[0])
    run = torch.arange(first, first + len(pos), device=pos.device, dtype=pos.dtype)
    return first if torch.equal(pos, run) else None


# ---------------------------------------------------------------------------------------------
# Kernels: what attends one part. forward → (out [B, H, Q, Dv], lse [B, H, Q], −inf where a query
# sees no key); backward with the merged out and lse → (dq [B, H, Q, D], dk, dv like k and v).


@dataclass
class _PartMeta:
    """What a kernel is told about a part: shared / per-row; for a kernel that takes dense masks,
    `causal` (the block's own keys at the queries' positions, no window cutting into them: the
    kernel's causal flag instead of a [Q × Q] mask, which every layer would keep for the backward)
    or `mask` (additive [Q, Lk], None when every query sees every key); for one that takes none,
    `band`."""

    shared: bool
    row: int | None
    causal: bool = False
    mask: Tensor | None = None
    band: Band | None = None


class Kernel:
    """A fused attention kernel and what it can do. `forward`/`backward` attend one part (k/v:
    [1 or B, Hkv, Lk, D]); `forward_rows`/`backward_rows` a run of per-row parts (ks/vs: B tensors
    [1, Hkv, Lk, D], same positions), by default one row at a time."""

    name = "kernel"
    device_type = ""
    dtypes: tuple[torch.dtype, ...] = ()
    native_gqa = False  # takes fewer K/V heads than query heads
    masks: tuple[str, ...] = ()  # "dense" ([Q, K] additive), "causal" (a flag), "band" (positions)
    head_dim_multiple = 1  # head sizes are zero-padded up to a multiple of this
    max_head_dim: int | None = None
    empty_row_lse = -INF  # what the kernel reports for a query that sees no key of the part

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"

    def head_dim(self, Dk: int, Dv: int) -> int | None:
        """The one head size q, k and v are padded to, None when the kernel cannot take it."""
        m = self.head_dim_multiple
        D = -(-max(Dk, Dv) // m) * m
        return None if self.max_head_dim is not None and D > self.max_head_dim else D

    def available(self) -> bool:
        return True

    def supports(self, band: Band) -> bool:
        return True

    def prepare_q(self, q_BHQD: Tensor) -> Tensor:
        """q as the kernel reads it (the tensor autograd keeps for the backward)."""
        return q_BHQD if q_BHQD.stride(-1) == 1 else q_BHQD.contiguous()

    def forward(self, q, k, v, m: _PartMeta, scale: float) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def backward(self, g_out, q, k, v, out, lse, m: _PartMeta, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def forward_rows(self, q, ks, vs, m: _PartMeta, scale: float) -> tuple[Tensor, Tensor]:
        per_row = [self.forward(q[r:r + 1], k, v, m, scale) for r, (k, v) in enumerate(zip(ks, vs))]
        return torch.cat([o for o, _ in per_row]), torch.cat([lse for _, lse in per_row])

    def backward_rows(self, g_out, q, ks, vs, out, lse, m: _PartMeta, scale: float, dq: Tensor):
        """Adds each row's dq into `dq`; returns the rows' (dks, dvs)."""
        dks, dvs = [], []
        for r, (k, v) in enumerate(zip(ks, vs)):
            rows = slice(r, r + 1)
            dqi, dk, dv = self.backward(g_out[rows], q[rows], k, v, out[rows], lse[rows], m, scale)
            dq[rows] += dqi
            dks.append(dk)
            dvs.append(dv)
        return dks, dvs


class MathKernel(Kernel):
    """The naive reference, `merged_attention_math`: not a per-part kernel; `merged_attention` runs
    that path when it is chosen."""

    name = "math"
    masks = ("dense",)


def _fold_mask(m_QK: Tensor | None, B: int, g: int, shared: bool) -> Tensor | None:
    """Query axis of the mask in the folded layout: row r ↔ query r % Q."""
    if m_QK is None:
        return None
    m = m_QK.repeat(g * (B if shared else 1), 1)
    return m[None, None]


def _repeat_heads(x: Tensor, g: int) -> Tensor:
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _sum_groups(dx_BHLD: Tensor, hkv: int) -> Tensor:
    """The gradient of K/V repeated over the GQA group, summed back: [B, H, L, D] → [B, Hkv, L, D]."""
    B, H, L, D = dx_BHLD.shape
    return dx_BHLD.reshape(B, hkv, H // hkv, L, D).sum(2)


class CpuFlash(Kernel):
    """PyTorch's CPU flash kernel: dense masks, no GQA (the group and the rows of a shared part are
    folded into the query axis; the block's own keys repeat their heads under the causal flag)."""

    name = "cpu-flash"
    device_type = "cpu"
    dtypes = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
    masks = ("dense", "causal")
    empty_row_lse = 0.0

    def prepare_q(self, q_BHQD: Tensor) -> Tensor:
        return q_BHQD.contiguous()

    def forward(self, q, k, v, m, scale):
        B, H, Q, D = q.shape
        hkv = k.shape[1]
        g = H // hkv
        if m.causal:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, _repeat_heads(k, g), _repeat_heads(v, g), 0.0, True, scale=scale)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _fold(q, hkv, m.shared), k, v, 0.0, False, attn_mask=_fold_mask(m.mask, B, g, m.shared), scale=scale)
        if m.mask is not None and self.empty_row_lse != -INF:  # 0 for a query that sees no key of the part
            empty = torch.isinf(m.mask).all(-1).repeat(g * (B if m.shared else 1))
            lse = lse.masked_fill(empty[None, None], -INF)
        return _unfold(o, B, H, Q, m.shared), _unfold(lse, B, H, Q, m.shared)

    def backward(self, g_out, q, k, v, out, lse, m, scale):
        B, H, Q, D = q.shape
        hkv = k.shape[1]
        g = H // hkv
        if m.causal:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g_out, q, _repeat_heads(k, g), _repeat_heads(v, g), out, lse, 0.0, True, scale=scale)
            return dq, _sum_groups(dk, hkv), _sum_groups(dv, hkv)
        lse_f = _fold(lse[..., None], hkv, m.shared)[..., 0]
        dqf, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _fold(g_out, hkv, m.shared), _fold(q, hkv, m.shared), k, v, _fold(out, hkv, m.shared), lse_f, 0.0, False,
            attn_mask=_fold_mask(m.mask, B, g, m.shared), scale=scale)
        return _unfold(dqf, B, H, Q, m.shared), dk, dv


class _BandKernel(Kernel):
    """A kernel that takes positions instead of a mask. Each part (or run of per-row parts) is
    attended over the rectangles of `pieces` (its band cut to the queries that see one of its keys
    and the keys some query sees), one call each: the queries outside them get out 0 and lse −inf,
    the keys outside them dk = dv = 0. Subclasses implement `_forward`/`_backward` on one rectangle
    (and may batch rows: `_forward_rows`/`_backward_rows`)."""

    masks = ("band",)

    def __init__(self, ops=None):
        self.ops = ops if ops is not None else torch.ops.aten  # a stand-in with the same ops in tests

    def pieces(self, band: Band) -> list[tuple[int, int, int, int, Band]] | None:
        c = band.cut()
        return [c] if c is not None else []

    def supports(self, band: Band) -> bool:
        return self.pieces(band) is not None

    def forward(self, q, k, v, m, scale):
        return self._pieces_forward(q, [k], [v], m, scale, rows=False)

    def forward_rows(self, q, ks, vs, m, scale):
        return self._pieces_forward(q, ks, vs, m, scale, rows=True)

    def _pieces_forward(self, q, ks, vs, m, scale, rows: bool):
        B, H, Q, _ = q.shape
        out = lse = None
        for i0, i1, j0, j1, band in self.pieces(m.band):
            qc, kc, vc = q[:, :, i0:i1], [k[:, :, j0:j1] for k in ks], [v[:, :, j0:j1] for v in vs]
            o, l_ = self._forward_rows(qc, kc, vc, band, scale) if rows else self._forward(qc, kc[0], vc[0], band,
                                                                                             m.shared, scale)
            if (i0, i1) == (0, Q):
                return o, l_
            if out is None:
                out, lse = o.new_zeros(B, H, Q, o.shape[-1]), l_.new_full((B, H, Q), -INF)
            out[:, :, i0:i1], lse[:, :, i0:i1] = o, l_
        if out is None:  # no query sees any key of the part
            return (q.new_zeros(B, H, Q, vs[0].shape[-1]),
                    q.new_full((B, H, Q), -INF, dtype=torch.promote_types(q.dtype, torch.float32)))
        return out, lse

    def backward(self, g_out, q, k, v, out, lse, m, scale):
        dq = torch.zeros_like(q)
        dks, dvs = self._pieces_backward(g_out, q, [k], [v], out, lse, m, scale, dq, rows=False)
        return dq, dks[0], dvs[0]

    def backward_rows(self, g_out, q, ks, vs, out, lse, m, scale, dq):
        return self._pieces_backward(g_out, q, ks, vs, out, lse, m, scale, dq, rows=True)

    def _pieces_backward(self, g_out, q, ks, vs, out, lse, m, scale, dq, rows: bool):
        Lk = ks[0].shape[2]
        dks = dvs = None
        for i0, i1, j0, j1, band in self.pieces(m.band):
            sl = slice(i0, i1)
            args = (g_out[:, :, sl], q[:, :, sl], [k[:, :, j0:j1] for k in ks], [v[:, :, j0:j1] for v in vs],
                    out[:, :, sl], lse[:, :, sl], band)
            if rows:
                dqc, dkc, dvc = self._backward_rows(*args, scale)
            else:
                dqc, dk, dv = self._backward(*args[:2], args[2][0], args[3][0], *args[4:], m.shared, scale)
                dkc, dvc = [dk], [dv]
            dq[:, :, sl] += dqc
            if (j0, j1) == (0, Lk) and dks is None:
                dks, dvs = dkc, dvc
                continue
            if dks is None:
                dks, dvs = [torch.zeros_like(k) for k in ks], [torch.zeros_like(v) for v in vs]
            for d, c in zip(dks + dvs, dkc + dvc):
                d[:, :, j0:j1] += c
        if dks is None:
            return [torch.zeros_like(k) for k in ks], [torch.zeros_like(v) for v in vs]
        return dks, dvs

    def _forward(self, q, k, v, band: Band, shared: bool, scale: float) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _backward(self, g_out, q, k, v, out, lse, band: Band, shared: bool, scale: float):
        raise NotImplementedError

    def _forward_rows(self, q, ks, vs, band: Band, scale: float) -> tuple[Tensor, Tensor]:
        per_row = [self._forward(q[r:r + 1], k, v, band, False, scale) for r, (k, v) in enumerate(zip(ks, vs))]
        return torch.cat([o for o, _ in per_row]), torch.cat([lse for _, lse in per_row])

    def _backward_rows(self, g_out, q, ks, vs, out, lse, band: Band, scale: float):
        per_row = [self._backward(g_out[r:r + 1], q[r:r + 1], k, v, out[r:r + 1], lse[r:r + 1], band, False, scale)
                   for r, (k, v) in enumerate(zip(ks, vs))]
        return torch.cat([d for d, _, _ in per_row]), [d for _, d, _ in per_row], [d for _, _, d in per_row]


def _op_takes(name: str, *args: str) -> bool:
    """Does this torch build have aten op `name`, with these keyword arguments (they came in later
    releases than the op)?"""
    op = getattr(torch.ops.aten, name, None)
    try:
        names = {a.name for a in op.default._schema.arguments}
    except (AttributeError, RuntimeError):
        return False
    return set(args) <= names


def _rng_placeholders(device) -> tuple[Tensor, Tensor]:
    """The dropout state a CUDA backward takes: unread with dropout 0 (CUDA.md). `empty`, as flash's
    own forward makes it: few kernels exist for uint64."""
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


class CudaFlash(_BandKernel):
    """`aten._flash_attention_forward/backward` (flash-attention 2 in PyTorch): fp16/bf16, native
    GQA, no mask but a bottom-right window. Layouts: q [B, Q, H, D], k/v [B, Lk, Hkv, D] (any strides
    with a unit last one), lse [B, H, Q] float32; varlen: q [total_q, H, D], lse [H, total_q]."""

    name = "cuda-flash"
    device_type = "cuda"
    dtypes = (torch.float16, torch.bfloat16)
    native_gqa = True
    head_dim_multiple = 8
    max_head_dim = 256
    empty_row_lse = INF

    @functools.cache
    def available(self) -> bool:
        return _op_takes("_flash_attention_forward", "window_size_left", "window_size_right") and _op_takes(
            "_flash_attention_backward", "window_size_left", "window_size_right")

    def pieces(self, band: Band):
        return band.flash_pieces()

    def _fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, band, scale):
        left, right = band.flash_window()
        o, lse, *_ = self.ops._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale,
            window_size_left=left, window_size_right=right)
        return o, lse

    def _bwd(self, g, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, band, scale):
        left, right = band.flash_window()
        rng, unused = _rng_placeholders(q.device)
        return self.ops._flash_attention_backward(
            g, q, k, v, out, lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, False, rng, unused, scale=scale,
            window_size_left=left, window_size_right=right)

    @staticmethod
    def _heads(x_BHQD: Tensor, hkv: int) -> Tensor:
        """A shared part's queries: [B, H, Q, D] → [1, Q, Hkv·B·g, D], rows folded into the head
        axis (head (h, b, i) reads K/V head h): the band stays per query position."""
        B, H, Q, D = x_BHQD.shape
        return x_BHQD.reshape(B, hkv, H // hkv, Q, D).permute(3, 1, 0, 2, 4).reshape(1, Q, H * B, D)

    @staticmethod
    def _unheads(y: Tensor, B: int, H: int, hkv: int) -> Tensor:
        """Inverse of `_heads` for [1, Q, Hkv·B·g, D] outputs; [1, Hkv·B·g, Q] lse (D absent)."""
        if y.dim() == 3:
            Q = y.shape[2]
            return y.reshape(hkv, B, H // hkv, Q).permute(1, 0, 2, 3).reshape(B, H, Q)
        Q, D = y.shape[1], y.shape[3]
        return y.reshape(Q, hkv, B, H // hkv, D).permute(2, 1, 3, 0, 4).reshape(B, H, Q, D)

    def _forward(self, q, k, v, band, shared, scale):
        B, H, Q, _ = q.shape
        hkv, Lk = k.shape[1], k.shape[2]
        qf = self._heads(q, hkv) if shared else q.transpose(1, 2)
        o, lse = self._fwd(qf, k.transpose(1, 2), v.transpose(1, 2), None, None, Q, Lk, band, scale)
        if shared:
            return self._unheads(o, B, H, hkv), self._unheads(lse, B, H, hkv)
        return o.transpose(1, 2), lse

    def _backward(self, g_out, q, k, v, out, lse, band, shared, scale):
        B, H, Q, _ = q.shape
        hkv, Lk = k.shape[1], k.shape[2]
        if shared:
            lse_f = lse.reshape(B, hkv, H // hkv, Q).permute(1, 0, 2, 3).reshape(1, H * B, Q)
            x = [self._heads(t, hkv) for t in (g_out, q, out)]
        else:
            lse_f, x = lse, [t.transpose(1, 2) for t in (g_out, q, out)]
        dq, dk, dv = self._bwd(x[0], x[1], k.transpose(1, 2), v.transpose(1, 2), x[2], lse_f, None, None, Q, Lk,
                               band, scale)
        dq = self._unheads(dq, B, H, hkv) if shared else dq.transpose(1, 2)
        return dq, dk.transpose(1, 2), dv.transpose(1, 2)

    def _packed(self, q, ks, vs):
        """A run of rows as one varlen call: q [B·Q, H, D], the rows' K/V packed [B·Lk, Hkv, D]
        (a copy for this call only), cumulative lengths int32 [B + 1]."""
        B, H, Q, D = q.shape
        Lk = ks[0].shape[2]
        pack = lambda xs: torch.cat([x[0].transpose(0, 1) for x in xs])  # noqa: E731
        steps = torch.arange(B + 1, dtype=torch.int32, device=q.device)
        return pack(ks), pack(vs), steps * Q, steps * Lk

    def _forward_rows(self, q, ks, vs, band, scale):
        B, H, Q, D = q.shape
        if Q == 1:  # flash lays out a one-query varlen lse otherwise (seqlenq_ngroups_swapped)
            return super()._forward_rows(q, ks, vs, band, scale)
        k, v, cu_q, cu_k = self._packed(q, ks, vs)
        Lk = ks[0].shape[2]
        o, lse = self._fwd(q.transpose(1, 2).reshape(B * Q, H, D), k, v, cu_q, cu_k, Q, Lk, band, scale)
        return o.reshape(B, Q, H, -1).transpose(1, 2), lse.reshape(H, B, Q).transpose(0, 1)

    def _backward_rows(self, g_out, q, ks, vs, out, lse, band, scale):
        B, H, Q, D = q.shape
        if Q == 1:
            return super()._backward_rows(g_out, q, ks, vs, out, lse, band, scale)
        k, v, cu_q, cu_k = self._packed(q, ks, vs)
        Lk = ks[0].shape[2]
        flat = lambda x: x.transpose(1, 2).reshape(B * Q, H, x.shape[-1])  # noqa: E731
        lse_f = lse.transpose(0, 1).reshape(H, B * Q)
        dq, dk, dv = self._bwd(flat(g_out), flat(q), k, v, flat(out), lse_f, cu_q, cu_k, Q, Lk, band, scale)
        rows = lambda d: [x.transpose(1, 2) for x in d.reshape(B, Lk, *d.shape[1:]).split(1)]  # noqa: E731
        return dq.reshape(B, Q, H, D).transpose(1, 2), rows(dk), rows(dv)


class CudaEfficient(_BandKernel):
    """`aten._efficient_attention_forward/backward` (the memory-efficient kernel): fp32 (and
    fp16/bf16), no GQA, masks: none, causal (custom_mask_type 2: bottom-right) or an additive bias.
    Layouts: q [B, M, H, D], k/v [B, N, H, D], out [B, M, H, Dv] (contiguous for the backward), lse
    float32 [B, H, ⌈M/32⌉·32] (the tail is padding)."""

    name = "cuda-efficient"
    device_type = "cuda"
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    head_dim_multiple = 8
    LSE_ALIGN = 32  # the kernel's kAlignLSE: its backward reads lse in blocks of 32 queries
    BIAS_ALIGN = 16  # the row stride of a bias must be aligned (PyTorch's SDPA pads to 16 too)

    @functools.cache
    def available(self) -> bool:
        return _op_takes("_efficient_attention_forward") and _op_takes("_efficient_attention_backward")

    def _mask(self, band: Band, q: Tensor, B: int, H: int):
        """(bias, custom_mask_type) for a band: the plain causal block needs no bias."""
        if band.window is None and band.causal and band.off == band.Lk - band.Q:
            return None, 2
        Lk = band.Lk
        bias = torch.zeros(band.Q, -(-Lk // self.BIAS_ALIGN) * self.BIAS_ALIGN, dtype=q.dtype, device=q.device)
        bias[:, :Lk].masked_fill_(~band.keep(q.device), -INF)
        return bias[:, :Lk][None, None].expand(B, H, band.Q, Lk), 0

    def _pad_lse(self, lse_BHM: Tensor) -> Tensor:
        M = lse_BHM.shape[-1]
        return F.pad(lse_BHM, (0, -(-M // self.LSE_ALIGN) * self.LSE_ALIGN - M)).contiguous()

    def _call(self, q, k, v, bias, mask_type, scale):
        o, lse, *_ = self.ops._efficient_attention_forward(
            q, k, v, bias, None, None, None, None, 0.0, mask_type, True, scale=scale)
        return o, lse[:, :, : q.shape[1]]

    def _call_backward(self, g, q, k, v, bias, out, lse, mask_type, scale):
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        dq, dk, dv, _ = self.ops._efficient_attention_backward(
            g, q, k, v, bias, out.contiguous(), None, None, q.shape[1], k.shape[1], self._pad_lse(lse), 0.0, seed,
            offset, mask_type, False, scale=scale)
        return dq, dk, dv

    def _forward(self, q, k, v, band, shared, scale):
        B, H, Q, _ = q.shape
        hkv = k.shape[1]
        if band.full:  # one call: the group (and a shared part's rows) in the query axis, K/V as they are
            o, lse = self._call(_fold(q, hkv, shared).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                                0, scale)
            return _unfold(o.transpose(1, 2), B, H, Q, shared), _unfold(lse, B, H, Q, shared)
        if shared and B > 1:  # a band over one copy of K/V read by every row: one call per row
            return self._forward_rows(q, [k] * B, [v] * B, band, scale)
        bias, mask_type = self._mask(band, q, B, H)
        g = H // hkv
        o, lse = self._call(q.transpose(1, 2), _repeat_heads(k, g).transpose(1, 2),
                            _repeat_heads(v, g).transpose(1, 2), bias, mask_type, scale)
        return o.transpose(1, 2), lse

    def _backward(self, g_out, q, k, v, out, lse, band, shared, scale):
        B, H, Q, _ = q.shape
        hkv = k.shape[1]
        if band.full:
            fold = lambda x: _fold(x, hkv, shared).transpose(1, 2)  # noqa: E731
            dq, dk, dv = self._call_backward(fold(g_out), fold(q), k.transpose(1, 2), v.transpose(1, 2), None,
                                             fold(out), _fold(lse[..., None], hkv, shared)[..., 0], 0, scale)
            return _unfold(dq.transpose(1, 2), B, H, Q, shared), dk.transpose(1, 2), dv.transpose(1, 2)
        if shared and B > 1:
            dq, dks, dvs = self._backward_rows(g_out, q, [k] * B, [v] * B, out, lse, band, scale)
            return dq, sum(dks), sum(dvs)
        bias, mask_type = self._mask(band, q, B, H)
        g = H // hkv
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = self._call_backward(t(g_out), t(q), t(_repeat_heads(k, g)), t(_repeat_heads(v, g)), bias,
                                         t(out), lse, mask_type, scale)
        return t(dq), _sum_groups(t(dk), hkv), _sum_groups(t(dv), hkv)


CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT, MATH = CpuFlash(), CudaFlash(), CudaEfficient(), MathKernel()


def _units(metas: list[_PartMeta], B: int):
    """(first part, one past the last, meta): one part, or a run of B per-row parts."""
    i = 0
    while i < len(metas):
        j = i + (B if metas[i].row is not None else 1)
        yield i, j, metas[i]
        i = j


class _Merged(torch.autograd.Function):
    """Every part through `kernel`, merged by log-sum-exp (sinks: one more term); the backward calls
    each part's kernel backward with the merged output and lse. Saved for the backward: q, the
    merged output and lse, the K/V as they came (views of the store stay views): no [Q × K] tensor."""

    @staticmethod
    def forward(ctx, kernel: Kernel, metas: list[_PartMeta], scale: float, q, sinks, *kv):
        B, H, Q, D = q.shape
        outs, lses = [], []
        for i, j, m in _units(metas, B):
            if m.row is not None:
                o, lse = kernel.forward_rows(q, kv[2 * i:2 * j:2], kv[2 * i + 1:2 * j:2], m, scale)
            else:
                o, lse = kernel.forward(q, kv[2 * i], kv[2 * i + 1], m, scale)
            outs.append(o)
            lses.append(lse)
        acc = torch.promote_types(q.dtype, torch.float32)
        lses = [x.to(acc) for x in lses]
        if sinks is not None:  # one more logit per head, with a zero value
            lses.append(sinks.to(acc).reshape(1, H, 1).expand(B, H, Q))
        lse_all = torch.logsumexp(torch.stack(lses), dim=0)  # [B, H, Q]
        out = sum(torch.exp(lse - lse_all)[..., None].to(acc) * o.to(acc) for lse, o in zip(lses, outs))
        out = out.to(q.dtype)
        if not out.transpose(1, 2).is_contiguous():
            # the adapter hands transformers [B, Q, H, D]: in that layout the one copy kept here for
            # the backward is also o_proj's input, instead of a second, transposed copy
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.kernel, ctx.metas, ctx.scale = kernel, metas, scale
        ctx.save_for_backward(q, out, lse_all, sinks, *kv)
        return out

    @staticmethod
    def backward(ctx, g_out):
        kernel, metas, scale = ctx.kernel, ctx.metas, ctx.scale
        q, out, lse_all, sinks, *kv = ctx.saved_tensors
        B, H, Q, D = q.shape
        g_out = g_out.to(q.dtype)
        dq = torch.zeros_like(q, dtype=torch.promote_types(q.dtype, torch.float32))
        dkv = []
        for i, j, m in _units(metas, B):
            if m.row is not None:
                dks, dvs = kernel.backward_rows(g_out, q, kv[2 * i:2 * j:2], kv[2 * i + 1:2 * j:2], out, lse_all, m,
                                                scale, dq)
                dkv += [d for pair in zip(dks, dvs) for d in pair]
            else:
                dqi, dk, dv = kernel.backward(g_out, q, kv[2 * i], kv[2 * i + 1], out, lse_all, m, scale)
                dq += dqi
                dkv += [dk, dv]
        dsinks = None
        if sinks is not None:
            acc = lse_all.dtype
            rowsum_BHQ = (g_out.to(acc) * out.to(acc)).sum(-1)
            p_sink = torch.exp(sinks.to(acc).reshape(1, H, 1) - lse_all)
            dsinks = -(p_sink * rowsum_BHQ).sum((0, 2)).to(sinks.dtype)
        return (None, None, None, dq.to(q.dtype), dsinks, *dkv)


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


def check_kernel(kernel) -> None:
    """Refuse a kernel name it does not know (a `Kernel` object is taken as it is)."""
    if not isinstance(kernel, Kernel) and kernel not in KERNELS:
        raise UserError(f"kernel: expected one of {list(KERNELS)}, got {kernel!r}")


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _fused(device: torch.device, dtype: torch.dtype, Dk: int, Dv: int, capability) -> Kernel | None:
    """The device's fused kernel for this dtype and these head sizes, if it has one."""
    if device.type == "cpu":
        return CPU_FLASH if dtype in CPU_FLASH.dtypes else None
    if device.type != "cuda":
        return None
    cap = capability if capability is not None else _capability(device.index)
    if dtype in CUDA_FLASH.dtypes and tuple(cap) >= (8, 0) and CUDA_FLASH.head_dim(Dk, Dv) and CUDA_FLASH.available():
        return CUDA_FLASH
    if dtype in CUDA_EFFICIENT.dtypes and (dtype != torch.bfloat16 or tuple(cap) >= (8, 0)) and \
            CUDA_EFFICIENT.available():
        return CUDA_EFFICIENT
    return None


def select_kernel(kernel, device: torch.device, dtype: torch.dtype, Dk: int, Dv: int | None = None, *,
                  softcap: float | None = None, capability: tuple[int, int] | None = None) -> Kernel:
    """The one place a kernel's name is read. "auto": the device's fused kernel for `dtype` and head
    sizes Dk/Dv (the module docstring's table), else the naive math path; "flash": that fused
    kernel, or a `UserError` when the device has none for `dtype`; "math": the naive reference.
    Soft-capping always takes the math path (no fused kernel applies it). A `Kernel` object is used
    as it is. `capability` stands in for the CUDA device's (tests)."""
    check_kernel(kernel)
    if softcap is not None or kernel == "math":
        return MATH
    if isinstance(kernel, Kernel):
        return kernel
    fused = _fused(device, dtype, Dk, Dv if Dv is not None else Dk, capability)
    if fused is None and kernel == "flash":
        raise UserError(f"kernel: no fused attention kernel for {dtype} on {device.type} (CUDA: fp16/bf16 flash, fp32 "
                        "memory-efficient; CPU: any float); use kernel=\"auto\", which runs the naive path there, or "
                        "\"math\"")
    return fused or MATH


def merged_attention(q_BHQD: Tensor, parts: list[Part], qpos_Q: Tensor, scale: float,
                     window: int | None, kernel="auto", *, softcap: float | None = None,
                     sinks_H: Tensor | None = None, q_start: int | None = None) -> Tensor:
    """Attention of q over the union of `parts`; returns [B, H, Q, Dv]. kernel: auto | flash | math
    (`select_kernel`) or a `Kernel`. softcap: logit soft-capping c (scores c·tanh(s/c)); sinks_H:
    per-head sink logits [H]; q_start: qpos_Q[0] when the caller knows it (qpos_Q is consecutive)."""
    parts = [p for p in parts if p.k.shape[2] > 0]
    assert _rows_in_runs(parts, q_BHQD.shape[0]), "per-row parts come in runs of rows 0..B-1"
    Dk, Dv = q_BHQD.shape[-1], parts[0].v.shape[-1]
    kern = select_kernel(kernel, q_BHQD.device, q_BHQD.dtype, Dk, Dv, softcap=softcap)
    if isinstance(kern, MathKernel):
        return merged_attention_math(q_BHQD, parts, qpos_Q, scale, window, softcap, sinks_H)
    D = kern.head_dim(Dk, Dv)
    if D is None:
        raise UserError(f"kernel: {kern.name} takes head sizes up to {kern.max_head_dim}, not {max(Dk, Dv)}")
    if D != Dk or D != Dv:  # one head size the kernel takes: zero-pad, keep Dv columns
        pad = lambda x: F.pad(x, (0, D - x.shape[-1]))  # noqa: E731
        parts = [Part(pad(p.k), pad(p.v), p.kpos_K, p.shared, p.causal, p.row, p.start) for p in parts]
        return merged_attention(pad(q_BHQD), parts, qpos_Q, scale, window, kern, sinks_H=sinks_H,
                                q_start=q_start)[..., :Dv]
    Q = q_BHQD.shape[2]
    if "band" in kern.masks:
        q0 = _first(qpos_Q, q_start)
        starts = [_first(p.kpos_K, p.start) for p in parts]
        if q0 is None or None in starts:  # positions with gaps: no band says them
            return merged_attention_math(q_BHQD, parts, qpos_Q, scale, window, softcap, sinks_H)
        bands = [Band.of(Q, p.k.shape[2], q0 - k0, p.causal, window) for p, k0 in zip(parts, starts)]
        if not all(kern.supports(b) for b in bands):
            return merged_attention_math(q_BHQD, parts, qpos_Q, scale, window, softcap, sinks_H)
        metas = [_PartMeta(p.shared, p.row, band=b) for p, b in zip(parts, bands)]
    else:
        # the block's own keys at the queries' positions, no window shorter than the block: plain causal
        causal = [p.causal and not p.shared and p.row is None and (window is None or window >= Q)
                  and p.kpos_K.shape[0] == Q and bool(torch.equal(p.kpos_K, qpos_Q)) for p in parts]
        metas = [_PartMeta(p.shared, p.row, causal=c, mask=None if c else _mask(qpos_Q, p.kpos_K, p.causal, window,
                                                                                q_BHQD.dtype))
                 for p, c in zip(parts, causal)]
    # views of the K/V store stay views: every kernel reads any strides with a unit last one
    kv = [t if t.stride(-1) == 1 else t.contiguous() for p in parts for t in (p.k, p.v)]
    return _Merged.apply(kern, metas, scale, kern.prepare_q(q_BHQD), sinks_H, *kv)

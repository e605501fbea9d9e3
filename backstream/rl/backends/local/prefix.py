"""One copy of a prompt's K/V for all the rows that read it, in the sampler's decode batch (docs/design.md §5,
trap 1, on the sampling side).

The G samples of a GRPO group (and the G episodes of a task) start from one prompt. Repeating its
K/V over the G rows (`batch_select_indices`), then copying every row into a padded buffer, kept 2G
copies of the prompt alive at the rollout's peak: on SmolLM2-135M with an 8K-token prompt and G = 4,
0.4 MiB per prompt token, more than the learner's whole step. Here a batch row's K/V are two parts:

- its prompt's `Prefix`: the prefill's K/V of that prompt, one copy (a view of the prefill batch
  [P, Hkv, L, D], one row per distinct prompt of one length), read by every row of its group;
- the row's own K/V (what it sampled, or an episode's turns), in a growing buffer [B, Hkv, room, D]
  (`DecodeLayer`), rows left-padded among themselves.

The model sees an ordinary left-padded batch: positions, the 2-D attention mask and transformers'
own mask function work on "columns" [pads | prefix | own], each row's real tokens contiguous at the
right, exactly as in a batch whose rows were concatenated (so sliding windows and the model's own
masking rules apply unchanged). Only the attention function (`attention`, registered in
transformers' AttentionInterface under `ATTN_NAME` for the forwards of such a batch) knows that a
row's prefix columns live in its prefix and its own columns in the buffer: it attends to each part
and merges them by log-sum-exp (the decomposition of stream/attention.py; here without gradient).
A prefix is attended once per prefill batch for all its rows (their queries folded into the query
axis, [P, Hkv, rows·group·Q, D]): it is read, never copied.

Prompts shorter than `SHARE_MIN` tokens are copied into their rows' buffers as before (nothing to
save; the model's own attention then runs). A model whose attention this function cannot stand in
for (no AttentionInterface, K/V derived after the cache update, a keyword it does not implement) is
found by a probe on its first use (rl/backends/local/decode.py `shares`) and decodes with copies, as before.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from backstream.stream.adapter import use_backstream_attention
from backstream.stream.family import INERT_KWARGS

ATTN_NAME = "backstream_decode"
SHARE_MIN = 32  # the shortest prompt whose K/V the rows of its group read from one copy


class CannotShare(Exception):
    """The model's attention does something this module's attention function does not stand in for."""


@dataclass(eq=False)
class Prefix:
    """One prompt's K/V, read by every row that continues it: per layer (K, V) of its prefill batch
    ([P, Hkv, L, D], one row per prompt; None for a layer without K/V) and its row `index` there."""

    kv: list[tuple[Tensor, Tensor] | None]
    index: int
    length: int

    def layer(self, i: int) -> tuple[Tensor, Tensor] | None:
        """This prompt's (K, V) [Hkv, L, D] at layer i (views)."""
        kv = self.kv[i]
        return None if kv is None else (kv[0][self.index], kv[1][self.index])


class DecodeLayer(DynamicLayer):
    """A decode batch's K/V of one layer: the rows' prefixes and each row's own K/V.

    Columns: the batch's cache has `C + n` columns, `n` those of the own buffers; row r's own K/V fill
    the last `n - opad[r]` of them, its prefix (of length L) the L columns just before. `keys` /
    `values` are the own buffers' filled views [B, Hkv, n, D], what `update` returns."""

    def __init__(self, own_k: Tensor, own_v: Tensor, opad: Tensor, room: int, prefixes: list[Prefix | None],
                 layer: int, width: int):
        super().__init__()
        self.is_initialized, self.device = True, own_k.device
        self.layer, self.prefixes = layer, prefixes  # per row (shared with the cache and every layer)
        self.bufs = [t.new_empty((*t.shape[:2], t.shape[2] + room, t.shape[3])) for t in (own_k, own_v)]
        self.n, self.opad = 0, opad
        self.C = width - own_k.shape[2]  # the prefix region's columns
        self.update(own_k, own_v)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        n = self.n + key_states.shape[-2]
        if n > self.bufs[0].shape[-2]:
            grown = [b.new_empty((*b.shape[:2], max(n, 2 * b.shape[2]), b.shape[3])) for b in self.bufs]
            for new, old in zip(grown, self.bufs):
                new[:, :, :self.n] = old[:, :, :self.n]
            self.bufs = grown
        self.bufs[0][:, :, self.n:n] = key_states
        self.bufs[1][:, :, self.n:n] = value_states
        self.n = n
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.keys, self.values = self.bufs[0][:, :, :self.n], self.bufs[1][:, :, :self.n]

    def get_seq_length(self) -> int:
        return self.C + self.n

    def batch_select_indices(self, indices: Tensor) -> None:
        self.bufs = [b[indices] for b in self.bufs]
        self.opad = self.opad[indices]
        self._views()

    def drop_front(self, cut: int) -> None:
        """Forget the first `cut` columns, padding in every row: from the prefix region first, then
        from the own buffers' left."""
        k = max(0, cut - self.C)
        self.C -= cut - k
        if k:
            self.bufs = [b[:, :, k:] for b in self.bufs]
            self.n, self.opad = self.n - k, self.opad - k
            self._views()

    def own(self, row: int, end: int) -> tuple[Tensor, Tensor]:
        """Row `row`'s own K/V [Hkv, L, D] up to column `end` of the batch (views)."""
        a, b = int(self.opad[row]), end - self.C
        return self.keys[row, :, a:b], self.values[row, :, a:b]


class DecodeCache(DynamicCache):
    """The cache of a decode batch whose rows may read shared prefixes (`DecodeLayer`s, transformers'
    state layers for a hybrid's recurrent and convolution state); `prefixes[r]`: row r's prompt, or
    None (its whole history in its own buffer); `shared`: some row reads a prefix."""

    def __init__(self, layers: list, prefixes: list[Prefix | None], fed: int):
        super().__init__()
        self.layers, self.prefixes, self.fed = layers, prefixes, fed
        self.last_layer = -1

    @property
    def shared(self) -> bool:
        return any(p is not None for p in self.prefixes)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.last_layer = layer_idx
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def batch_select_indices(self, indices: Tensor) -> None:
        super().batch_select_indices(indices)
        self.prefixes[:] = [self.prefixes[i] for i in indices.tolist()]


# -- the attention of such a batch -------------------------------------------------------------

_ACTIVE: list[DecodeCache] = []


def _keep_mask(*args, **kwargs):
    """transformers' SDPA mask (boolean, True = attend), always built: a row's prefix and own columns
    are read from it separately."""
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


AttentionMaskInterface.register(ATTN_NAME, _keep_mask)


def _attend(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, softcap: float | None) -> tuple[Tensor, Tensor]:
    """Softmax attention of queries q [b, h, M, D] (scaled) over k/v [b, h, L, D]: the output [b, h, M, Dv]
    and the log-sum-exp [b, h, M] (float32 or wider; -inf and a zero output where no key is kept)."""
    s = (q.to(k.dtype) @ k.transpose(-1, -2)).to(q.dtype)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # a row with no key: exp(-inf - -inf)
    return (p.to(v.dtype) @ v).to(q.dtype), lse


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
              softcap=None, s_aux=None, **kwargs):
    """Attention of a decode batch whose rows read shared prefixes (see the module docstring): the own
    part and each prefill batch's prefixes attended apart, merged by log-sum-exp. The window and the
    causal rule come from the mask transformers built over the batch's columns (`sliding_window` is
    what that mask already applies)."""
    cache = _ACTIVE[-1]
    layer = cache.layers[cache.last_layer]
    if not isinstance(layer, DecodeLayer) or key is not layer.keys or value is not layer.values:
        raise CannotShare("its attention reads K/V other than those the cache returned")
    extra = [k for k, v in kwargs.items() if v is not None and k not in INERT_KWARGS and not (k == "is_causal" and v)]
    if extra or (dropout and dropout > 0) or not isinstance(attention_mask, Tensor):
        raise CannotShare(f"its attention takes {extra or 'dropout or no mask'}")
    B, Hq, Q, D = query.shape
    Hkv, n, Dv = key.shape[1], key.shape[2], value.shape[-1]
    g = Hq // Hkv
    dt = torch.promote_types(query.dtype, torch.float32)
    q = query.to(dt) * (scaling if scaling is not None else D ** -0.5)
    keep = attention_mask.expand(B, 1, Q, attention_mask.shape[-1])  # [B, 1, Q, C + n] columns
    cols = torch.arange(n, device=key.device)
    own_keep = keep[..., layer.C:] & (cols >= layer.opad[:, None])[:, None, None, :]

    def fold_keep(m_XQL: Tensor) -> Tensor:  # a [X, Q, L] mask for queries folded as (group, Q)
        X, _, L = m_XQL.shape
        return m_XQL[:, None].expand(X, g, Q, L).reshape(X, 1, g * Q, L)

    out, lse = _attend(q.reshape(B, Hkv, g * Q, D), key, value, fold_keep(own_keep[:, 0]), softcap)
    outs, lses = [out.view(B, Hq, Q, Dv)], [lse.view(B, Hq, Q)]
    for base, rows, slots, m in _prefix_groups(cache, layer.layer):
        K, V = base  # [P, Hkv, L, D]
        P, L = K.shape[0], K.shape[2]
        idx = torch.tensor(rows, device=key.device)
        p_of, s_of = torch.tensor([s[0] for s in slots], device=key.device), torch.tensor([s[1] for s in slots],
                                                                                      device=key.device)
        q_P = q.new_zeros((P, m, Hq, Q, D))
        q_P[p_of, s_of] = q[idx]
        q_P = q_P.view(P, m, Hkv, g, Q, D).permute(0, 2, 1, 3, 4, 5).reshape(P, Hkv, m * g * Q, D)
        start = layer.C + layer.opad[idx] - L  # each row's first prefix column
        where = (start[:, None] + torch.arange(L, device=key.device))[:, None, :].expand(len(rows), Q, L)
        k_P = torch.ones((P, m, Q, L), dtype=torch.bool, device=key.device)
        k_P[p_of, s_of] = keep[idx, 0].gather(-1, where)
        k_P = k_P[:, :, None].expand(P, m, g, Q, L).reshape(P, 1, m * g * Q, L)
        o, l_ = _attend(q_P, K, V, k_P, softcap)
        o = o.view(P, Hkv, m, g, Q, Dv).permute(0, 2, 1, 3, 4, 5).reshape(P, m, Hq, Q, Dv)
        l_ = l_.view(P, Hkv, m, g, Q).permute(0, 2, 1, 3, 4).reshape(P, m, Hq, Q)
        o_B, l_B = out.new_zeros((B, Hq, Q, Dv)), lse.new_full((B, Hq, Q), -math.inf)
        o_B[idx], l_B[idx] = o[p_of, s_of], l_[p_of, s_of]
        outs.append(o_B)
        lses.append(l_B)
    total = torch.stack(lses).logsumexp(0)
    if s_aux is not None:  # attention sinks: a logit per head with a zero value, one more term of the sum
        total = torch.logaddexp(total, s_aux.to(dt).view(1, Hq, 1).expand_as(total))
    merged = sum(o * torch.exp(x - total).nan_to_num_(0.0).unsqueeze(-1) for o, x in zip(outs, lses))
    return merged.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, attention)


def _prefix_groups(cache: DecodeCache, layer: int):
    """The rows reading a prefix, by prefill batch: (its (K, V) [P, Hkv, L, D], the rows, each row's (index
    in the batch, slot among that prompt's rows), the most rows of one prompt)."""
    groups: dict[int, tuple] = {}
    for r, p in enumerate(cache.prefixes):
        if p is None:
            continue
        base, rows, slots, count = groups.setdefault(id(p.kv), (p.kv[layer], [], [], {}))
        slot = count.get(p.index, 0)
        count[p.index] = slot + 1
        rows.append(r)
        slots.append((p.index, slot))
    return [(base, rows, slots, max(count.values())) for base, rows, slots, count in groups.values()
            if base is not None]


@contextlib.contextmanager
def sharing(model, cache):
    """The model's forwards over `cache` attend through `attention` (when some row reads a prefix)."""
    if not isinstance(cache, DecodeCache) or not cache.shared:
        yield
        return
    _ACTIVE.append(cache)
    try:
        with use_backstream_attention(model, ATTN_NAME):
            yield
    finally:
        _ACTIVE.pop()

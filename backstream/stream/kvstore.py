"""The K/V store of the streamed backward and its gradient accumulators (docs/design.md §2, §5): the
attention layers' implementation of `backstream.stream.state.LayerState`.

Per tree node and layer: the K and V of its tokens, from the prefill or the caller; the gradient
that later blocks left for them (gK/gV, fp32 or wider, allocated on first deposit); and a bool
mask of the positions with a pending gradient.

What it holds is the memory floor of the backward (docs/design.md §5), so nothing more:
- only the positions some later block reads (`extent`: a node without children is never read
  past the start of its last chunk);
- position-major ([len, Hkv, D], read as [Hkv, len, D] views): a block's history is a view of it
  (`read`) and the attention kernel's gradient for that view ([1, Lk, Hkv, D] in memory) has the
  view's own strides, so autograd hands it over without a copy;
- a node's K/V and accumulators are freed once its first chunk has run (`spent`): every block that
  reads them has run by then.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from backstream.stream import memory
from backstream.stream.family import ModelContractError
from backstream.stream.schedule import Row
from backstream.stream.tree import TokenTree


class Pieces:
    """The K or V of one sequence given as consecutive pieces [Hkv, L_i, D] (a rollout's prompt, shared
    by its group's samples, then a sample's own tokens: rl/backends/local/decode.py `RowCache.as_kv`), so that the
    prompt is not copied once per sample: a slice [:, a:b] within one piece is a view of it, one across
    pieces a copy of that slice alone."""

    def __init__(self, parts: list[Tensor]):
        self.parts = parts
        self.shape = torch.Size((parts[0].shape[0], sum(p.shape[1] for p in parts), parts[0].shape[2]))
        self.dtype, self.device = parts[0].dtype, parts[0].device

    def dim(self) -> int:
        return 3

    def __getitem__(self, key) -> Tensor:
        heads, span = key
        assert heads == slice(None) and span.step is None, "Pieces: only [:, a:b] slices"
        a, b, _ = span.indices(self.shape[1])
        out, lo = [], 0
        for p in self.parts:
            hi = lo + p.shape[1]
            if a < hi and b > lo:
                out.append(p[:, max(a, lo) - lo:min(b, hi) - lo])
            lo = hi
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)


class KVStore:
    def __init__(self, tree: TokenTree, extent: dict[int, int]):
        self.tree = tree
        self.extent = extent  # node → how many of its first positions a later block reads (schedule.read_extent)
        self.kv: dict[int, dict[int, list[Tensor]]] = {}  # node → layer → [K_LHD, V_LHD]
        self.g: dict[int, dict[int, list[Tensor | None]]] = {}  # node → layer → [gK_LHD, gV_LHD] fp32
        self.touched: dict[int, dict[int, Tensor]] = {}  # node → layer → bool [len]: pending K/V gradient
        self.given = False  # the K/V came from the caller (`kv=`): their shapes are checked on first read

    def read(self, node: int, layer: int, j: int) -> Tensor:
        """K (j = 0) or V (j = 1) of a node at a layer, [Hkv, extent, D] (a view)."""
        return self.kv[node][layer][j].transpose(0, 1)

    def store(self, rows: list[Row], cache) -> None:
        """Keep the K/V a batch's forward produced (`cache.new`: [B, Hkv, Q, D] per layer) at its rows'
        positions that a later block reads."""
        for layer, (k_BHQD, v_BHQD) in cache.new.items():
            for r, row in enumerate(rows):
                hi = min(row.hi, self.extent[row.node])
                if hi <= row.lo:
                    continue
                per_node = self.kv.setdefault(row.node, {})
                if layer not in per_node:
                    L = self.extent[row.node]
                    with memory.label("kv"):
                        per_node[layer] = [x.new_empty((L, x.shape[1], x.shape[3])) for x in (k_BHQD, v_BHQD)]
                for j, x in enumerate((k_BHQD, v_BHQD)):
                    per_node[layer][j][row.lo:hi] = x[r, :, : hi - row.lo].transpose(0, 1)

    def add_grad(self, node: int, layer: int, j: int, a: int, b: int, g_HLD: Tensor) -> None:
        """Deposit a reader's gradient for the K (j = 0) or V (j = 1) of node-local positions [a, b)."""
        per_layer = self.g.setdefault(node, {}).setdefault(layer, [None, None])
        if per_layer[j] is None:
            ref = self.kv[node][layer][j]
            # fp32 whatever the model dtype (bf16 sums of many readers drift); float64 stays float64
            acc_dtype = torch.promote_types(ref.dtype, torch.float32)
            with memory.label("gkv"):
                per_layer[j] = torch.zeros((self.extent[node], *ref.shape[1:]), dtype=acc_dtype, device=ref.device)
        per_layer[j][a:b] += g_HLD.transpose(0, 1)  # in place, widened as it is added: no temporary
        t = self.touched.setdefault(node, {}).setdefault(
            layer, torch.zeros(len(self.tree.nodes[node].tokens), dtype=torch.bool))
        t[a:b] = True

    def pending(self, row: Row, layer: int | None = None) -> bool:
        """Has any reader left a gradient for the K/V of this chunk (at `layer`, or any layer)?"""
        per_node = self.touched.get(row.node, {})
        masks = per_node.values() if layer is None else [per_node[layer]] if layer in per_node else []
        return any(bool(t[row.lo:row.hi].any()) for t in masks)

    def roots(self, rows: list[Row], cache) -> list[tuple[Tensor, Tensor]]:
        """(K or V the batch produced at a layer, its pending gradient) wherever a reader left one."""
        out = []
        for layer, kv in cache.new.items():
            for j, x_BHQD in enumerate(kv):
                if not x_BHQD.requires_grad:
                    continue  # frozen below this layer: no gradient can flow into history
                with memory.label("seed"):
                    seed = self.seed(rows, layer, j, x_BHQD)
                if seed is not None:
                    out.append((x_BHQD, seed))
        return out

    def seed(self, rows: list[Row], layer: int, j: int, x_BHQD: Tensor) -> Tensor | None:
        """The backward seed of a batch's own K or V at a layer: the pending gradients of its rows'
        positions, or None when no reader left one (a zero seed would cost a backward)."""
        seed = None
        for r, row in enumerate(rows):
            acc = self.g.get(row.node, {}).get(layer, [None, None])[j]
            if acc is not None and self.pending(row, layer):
                if seed is None:
                    seed = torch.zeros(x_BHQD.shape, dtype=x_BHQD.dtype, device=x_BHQD.device)
                hi = min(row.hi, acc.shape[0])
                seed[r, :, : hi - row.lo] = acc[row.lo:hi].transpose(0, 1)
        return seed

    def spent(self, rows: list[Row]) -> None:
        """These chunks have run their backward (or were skipped): a node whose first chunk is among
        them has no reader left, so its K/V and accumulators go."""
        for row in rows:
            if row.lo == 0:
                self.g.pop(row.node, None)
                self.touched.pop(row.node, None)
                self.kv.pop(row.node, None)

    def check_given(self, nodes: list[int], layer: int, key_BHQD: Tensor, value_BHQD: Tensor) -> None:
        """Caller-given K/V must have the model's head count and head sizes at this layer."""
        if not self.given:
            return
        for n in nodes:
            for j, own in enumerate((key_BHQD, value_BHQD)):
                x = self.read(n, layer, j)
                if x.shape[0] != own.shape[1] or x.shape[2] != own.shape[3]:
                    raise ModelContractError(
                        f"kv: layer {layer}'s {'KV'[j]} has shape [{x.shape[0]}, length, {x.shape[2]}] but the model's "
                        f"{'KV'[j]} at that layer are [{own.shape[1]}, length, {own.shape[3]}] ([kv_heads, length, "
                        "head_dim]): pass the K/V of this model's own cache")

    def fill(self, kv, sequences, num_layers: int, device, dtype) -> None:
        """The store from caller-given K/V: one entry per sequence, a batch-1 Cache or a list over
        layers of (K, V) of shape [kv_heads, length, head_dim]."""
        if not isinstance(kv, (list, tuple)) or len(kv) != len(sequences):
            raise ModelContractError(
                f"kv: expected one entry per sequence ({len(sequences)}), got {type(kv).__name__}")
        self.given = True
        per_seq = []
        for i, entry in enumerate(kv):
            if isinstance(entry, Cache):
                rows = {layer.keys.shape[0] for layer in entry.layers if getattr(layer, "keys", None) is not None}
                if rows != {1}:
                    raise ModelContractError(
                        f"kv[{i}]: a Cache of batch {sorted(rows)}; each entry is the K/V of one sequence: pass a "
                        "batch-1 Cache per sequence, or per sequence a list over layers of (K, V) of shape "
                        "[kv_heads, length, head_dim]")
                entry = [(layer.keys[0], layer.values[0]) for layer in entry.layers]
            if not isinstance(entry, (list, tuple)) or len(entry) != num_layers:
                raise ModelContractError(f"kv[{i}]: expected a Cache or a list of {num_layers} (K, V) pairs, got "
                                         f"{type(entry).__name__}")
            per_seq.append(entry)
        for i, path in enumerate(self.tree.paths):
            for n in path:
                if n in self.kv:
                    continue
                node = self.tree.nodes[n]
                per_node = {}
                for layer, (k, v) in enumerate(per_seq[i]):
                    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
                        raise ModelContractError(
                            f"kv[{i}][{layer}]: expected K and V of shape [kv_heads, length, head_dim], got "
                            f"{tuple(k.shape)} and {tuple(v.shape)}")
                    if k.shape[1] < node.end:
                        raise ModelContractError(
                            f"kv[{i}][{layer}]: covers {k.shape[1]} positions but sequence {i} needs the K/V of its "
                            f"first {node.end} tokens (a sliding-window cache that dropped history cannot be reused)")
                    # views of the caller's K/V where device and dtype already match
                    per_node[layer] = [x[:, node.start:node.end].to(device, dtype).transpose(0, 1) for x in (k, v)]
                self.kv[n] = per_node

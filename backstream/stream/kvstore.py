"""The K/V store of the streamed backward and its gradient accumulators (DESIGN §2, §5).

Per tree node and layer: the K and V of its tokens ([Hkv, len, D], from the prefill or the caller),
the gradient that later blocks left for them (gK/gV, fp32 or wider, allocated on first deposit), and
a bool mask of the positions with a pending gradient. A node's accumulators are freed once its first
chunk has run: no later batch reads them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from backstream.stream.family import ModelContractError
from backstream.stream.schedule import Row
from backstream.stream.tree import TokenTree


class KVStore:
    def __init__(self, tree: TokenTree):
        self.tree = tree
        self.kv: dict[int, dict[int, list[Tensor]]] = {}  # node → layer → [K_HLD, V_HLD]
        self.g: dict[int, dict[int, list[Tensor | None]]] = {}  # node → layer → [gK_HLD, gV_HLD] fp32
        self.touched: dict[int, dict[int, Tensor]] = {}  # node → layer → bool [len]: pending K/V gradient
        self.given = False  # the K/V came from the caller (`kv=`): their shapes are checked on first read

    def read(self, node: int, layer: int, j: int) -> Tensor:
        """K (j = 0) or V (j = 1) of a node at a layer, [Hkv, len, D]."""
        return self.kv[node][layer][j]

    def store(self, rows: list[Row], new: dict[int, tuple[Tensor, Tensor]]) -> None:
        """Keep the K/V a batch's forward produced ([B, Hkv, Q, D] per layer) at its rows' positions."""
        for layer, (k_BHQD, v_BHQD) in new.items():
            for r, row in enumerate(rows):
                n = row.hi - row.lo
                per_node = self.kv.setdefault(row.node, {})
                if layer not in per_node:
                    L = len(self.tree.nodes[row.node].tokens)
                    per_node[layer] = [x.new_empty((x.shape[1], L, x.shape[3])) for x in (k_BHQD, v_BHQD)]
                per_node[layer][0][:, row.lo:row.hi] = k_BHQD[r, :, :n]
                per_node[layer][1][:, row.lo:row.hi] = v_BHQD[r, :, :n]

    def add_grad(self, node: int, layer: int, j: int, a: int, b: int, g_HLD: Tensor) -> None:
        """Deposit a reader's gradient for the K (j = 0) or V (j = 1) of node-local positions [a, b)."""
        per_layer = self.g.setdefault(node, {}).setdefault(layer, [None, None])
        if per_layer[j] is None:
            ref = self.kv[node][layer][j]
            # fp32 whatever the model dtype (bf16 sums of many readers drift); float64 stays float64
            acc_dtype = torch.promote_types(ref.dtype, torch.float32)
            per_layer[j] = torch.zeros(ref.shape, dtype=acc_dtype, device=ref.device)
        per_layer[j][:, a:b] += g_HLD.to(per_layer[j].dtype)
        t = self.touched.setdefault(node, {}).setdefault(
            layer, torch.zeros(len(self.tree.nodes[node].tokens), dtype=torch.bool))
        t[a:b] = True

    def pending(self, row: Row, layer: int | None = None) -> bool:
        """Has any reader left a gradient for the K/V of this chunk (at `layer`, or any layer)?"""
        per_node = self.touched.get(row.node, {})
        masks = per_node.values() if layer is None else [per_node[layer]] if layer in per_node else []
        return any(bool(t[row.lo:row.hi].any()) for t in masks)

    def seed(self, rows: list[Row], layer: int, j: int, x_BHQD: Tensor) -> Tensor | None:
        """The backward seed of a batch's own K or V at a layer: the pending gradients of its rows'
        positions, or None when no reader left one (a zero seed would cost a backward)."""
        seed = None
        for r, row in enumerate(rows):
            acc = self.g.get(row.node, {}).get(layer, [None, None])[j]
            if acc is not None and self.pending(row, layer):
                if seed is None:
                    seed = torch.zeros(x_BHQD.shape, dtype=x_BHQD.dtype, device=x_BHQD.device)
                seed[r, :, : row.hi - row.lo] = acc[:, row.lo:row.hi].to(x_BHQD.dtype)
        return seed

    def spent(self, rows: list[Row]) -> None:
        """These chunks have run their backward: free the accumulators no other chunk needs."""
        for row in rows:
            if row.lo == 0:
                self.g.pop(row.node, None)
                self.touched.pop(row.node, None)

    def check_given(self, nodes: list[int], layer: int, key_BHQD: Tensor, value_BHQD: Tensor) -> None:
        """Caller-given K/V must have the model's head count and head sizes at this layer."""
        if not self.given:
            return
        for n in nodes:
            for j, (x, own) in enumerate(zip(self.kv[n][layer], (key_BHQD, value_BHQD))):
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
                    per_node[layer] = [x[:, node.start:node.end].to(device, dtype) for x in (k, v)]
                self.kv[n] = per_node

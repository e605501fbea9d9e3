"""Layer state the streamed backward carries from block to block (docs/design.md §2, §2b).

A block's forward reads the state that earlier blocks left, and its backward hands the gradient of
that state back to them. Every kind of layer state implements one protocol, `LayerState`:

    store(rows, cache)   prefill: keep what this batch produced that a later block reads
    roots(rows, cache)   backward: (tensor this batch produced, the gradient its readers left), the
                         extra roots of the batch's `torch.autograd.backward`
    pending(row)         has a reader left a gradient for what this chunk produced?
    spent(rows)          these chunks ran (or were skipped): what they produced has no reader left

and is read as leaf tensors whose gradient is deposited for the chunk that produced it. There are
three kinds:
- attention K/V (`backstream.stream.kvstore.KVStore`): grows with the sequence, and a block reads all
  of its history, as parts handed to the attention function;
- `RecurrentState`: the state of a Gated DeltaNet, Mamba or other linear-attention layer, of a fixed
  size and replaced block by block: the state at a block's start is all the block reads of its past;
- `ConvState`: the last inputs of a short causal convolution (Gated DeltaNet's and Mamba's q/k/v or
  x/B/C convolutions, LFM2's short convolutions).

The two fixed-size kinds live at block boundaries: `Key(n, pos)` is the state after the first `pos`
tokens of tree node n. A chunk [lo, hi) of node n starts from (n, lo); at lo = 0 from its parent's
end, (parent, len(parent)), which every child of the parent reads (its gradient is the sum over
them: the shared-prefix rule), and a root's first chunk from nothing (zeros, the model's own
default). The chunk produces (n, hi). Both are driven through transformers' linear-attention Cache
API (`get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`), which
`adapter.BlockCache` implements without writing into the tensors it hands out.

Exact, not truncated: with S_b the state a block produces, dL/dS_b is the sum over the blocks that
read S_b, and every reader runs before its producer in the reverse order, so the seed of S_b is
complete when its block runs, as for K/V (docs/design.md §2b).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from backstream.stream import memory
from backstream.stream.schedule import Row, read_later
from backstream.stream.tree import TokenTree


class LayerState(Protocol):
    """One kind of layer state between blocks (see the module docstring)."""

    def store(self, rows: list[Row], cache) -> None: ...

    def roots(self, rows: list[Row], cache) -> list[tuple[Tensor, Tensor]]: ...

    def pending(self, row: Row) -> bool: ...

    def spent(self, rows: list[Row]) -> None: ...


class Key(NamedTuple):
    node: int
    pos: int  # node-local: the state after the node's first `pos` tokens


Slot = tuple[int, int]  # (layer, state index): a layer may keep several states of one kind


def start_key(tree: TokenTree, parent: int, row: Row) -> Key | None:
    """The boundary a chunk starts from (None: a root's first chunk, which starts from nothing)."""
    if row.lo > 0:
        return Key(row.node, row.lo)
    return None if parent < 0 else Key(parent, len(tree.nodes[parent].tokens))


def leaf(t: Tensor, deposit, hooks: list) -> Tensor:
    """`t` as a leaf that requires grad, whose gradient goes to `deposit(grad)` (then freed) when
    autograd reaches it; `t` itself when no gradient is being taken."""
    if not torch.is_grad_enabled():
        return t
    x = t.detach().requires_grad_(True)

    def scatter(x: Tensor) -> None:
        deposit(x.grad)
        x.grad = None

    hooks.append(x.register_post_accumulate_grad_hook(scatter))
    return x


class BoundaryState:
    """A fixed-size state per layer, kept at the block boundaries that a later block starts from, with
    the gradient its readers deposit there (float32 or wider, as gK/gV)."""

    kind = ""

    def __init__(self, tree: TokenTree):
        self.tree = tree
        self.value: dict[Key, dict[Slot, Tensor]] = {}  # [1, ...] per boundary and slot
        self.grad: dict[Key, dict[Slot, Tensor]] = {}

    @staticmethod
    def update(prev: Tensor | None, new: Tensor, kernel: int | None = None) -> tuple[Tensor, Tensor]:
        """What the layer's `update_*_state(new)` returns, and the state after it."""
        raise NotImplementedError

    def start(self, parent: int, rows: list[Row], slot: Slot, hooks: list) -> Tensor | None:
        """The state the rows start from at `slot`, [B, ...], a fresh tensor (the model may write into
        it): the boundary values as leaves whose gradient goes back to their boundaries when a
        gradient is being taken; None for a root's first chunk."""
        keys = [start_key(self.tree, parent, r) for r in rows]
        if keys[0] is None:
            return None
        for k in dict.fromkeys(keys):
            assert k in self.value and slot in self.value[k], f"no {self.kind} state stored at {k} for {slot}"
        if len(set(keys)) == 1:  # every row continues one boundary (a branch point's children)
            x = leaf(self.value[keys[0]][slot], lambda g, k=keys[0]: self._deposit(k, slot, g), hooks)
            return x.expand(len(rows), *x.shape[1:]).clone()
        return torch.cat([leaf(self.value[k][slot], lambda g, k=k: self._deposit(k, slot, g), hooks) for k in keys])

    def _deposit(self, key: Key, slot: Slot, g: Tensor) -> None:
        memory.tag(g, "history grad")
        per_key = self.grad.setdefault(key, {})
        acc = per_key.get(slot)
        if acc is None:
            with memory.label("gstate"):
                per_key[slot] = g.to(torch.promote_types(g.dtype, torch.float32), copy=True)
        else:
            acc += g

    def store(self, rows: list[Row], cache) -> None:
        Q = max(r.hi - r.lo for r in rows)
        for slot, end in cache.ends.get(self.kind, {}).items():
            for r, row in enumerate(rows):
                if not read_later(self.tree, row):
                    continue
                assert row.hi - row.lo == Q, "a padded row's final state is not its own (schedule.batches)"
                with memory.label("state"):
                    self.value.setdefault(Key(row.node, row.hi), {})[slot] = end[r:r + 1].detach().clone()

    def roots(self, rows: list[Row], cache) -> list[tuple[Tensor, Tensor]]:
        out = []
        for slot, end in cache.ends.get(self.kind, {}).items():
            if not end.requires_grad:
                continue  # frozen below this layer: no gradient flows into earlier blocks
            seed = None
            for r, row in enumerate(rows):
                g = self.grad.get(Key(row.node, row.hi), {}).get(slot)
                if g is not None:
                    if seed is None:
                        with memory.label("seed"):
                            seed = torch.zeros_like(end)
                    seed[r] = g[0]
            if seed is not None:
                out.append((end, seed))
        return out

    def pending(self, row: Row) -> bool:
        return bool(self.grad.get(Key(row.node, row.hi)))

    def spent(self, rows: list[Row]) -> None:
        for row in rows:
            self.value.pop(Key(row.node, row.hi), None)
            self.grad.pop(Key(row.node, row.hi), None)


class RecurrentState(BoundaryState):
    """A linear-attention or state-space layer's recurrent state ([B, heads, d_k, d_v] for Gated
    DeltaNet, [B, heads, head_dim, d_state] for Mamba 2): the model hands over the state after its
    block, which replaces the one before."""

    kind = "recurrent"

    @staticmethod
    def update(prev: Tensor | None, new: Tensor, kernel: int | None = None) -> tuple[Tensor, Tensor]:
        return new, new


class ConvState(BoundaryState):
    """A short causal convolution's last `kernel` inputs ([B, channels, kernel]). The model hands
    over its block's inputs and convolves what comes back: the previous state ⊕ the new inputs, or
    at a sequence's start the new inputs left-padded with zeros to the kernel (transformers'
    `LinearAttentionLayer.update_conv_state`, without its in-place write)."""

    kind = "conv"

    @staticmethod
    def update(prev: Tensor | None, new: Tensor, kernel: int | None = None) -> tuple[Tensor, Tensor]:
        K = kernel or (prev.shape[-1] if prev is not None else new.shape[-1])
        if prev is None:
            full = F.pad(new, (K - new.shape[-1], 0)) if new.shape[-1] < K else new
        else:
            full = torch.cat([prev, new.to(prev.dtype)], dim=-1)
        return full, full[..., -K:]


STATE_KINDS = (RecurrentState, ConvState)


class GuardSaved:
    """Autograd saves a tensor by reference and refuses a backward through it once it was written in
    place. Models write their conv and recurrent states in place on one-token decode paths (Mamba 2's
    `selective_state_update`, `causal_conv1d_update`), so the saved copies of the states the cache
    handed out (`handed`) are taken by value. A pack hook turns autograd's own check of every other
    saved tensor off, so it is done here: a tensor written in place after it was saved fails the
    backward with PyTorch's error, as it would without the hook."""

    def __init__(self):
        self.handed: set[int] = set()  # data pointers of the storages handed to the model

    def hand(self, t: Tensor) -> Tensor:
        self.handed.add(t.untyped_storage().data_ptr())
        return t

    def _pack(self, t: Tensor):
        # detached (the same storage and version counter): a saved output held with its grad_fn would
        # keep its own graph alive in a cycle through the hook
        memory.saved(t)  # LiveBytes' own pack hook is outside this one: tell it
        if self.handed and t.untyped_storage().data_ptr() in self.handed:
            return t.detach().clone(), None
        return t.detach(), t._version

    @staticmethod
    def _unpack(packed) -> Tensor:
        t, version = packed
        if version is not None and t._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"a tensor of shape {list(t.shape)} is at version {t._version}; expected version {version} "
                "(backstream.stream.state.GuardSaved)")
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


@dataclass(frozen=True)
class StateLayout:
    """Which layers of a model keep K/V and which keep state of another kind, as a short probe
    forward found them (`adapter.probe_layout`): `states[kind][(layer, index)]` = (shape of one
    row's state, dtype); `local_layers`: layers with neither that the probe showed to mix no tokens
    (a hybrid's MLP-only layers)."""

    kv_layers: frozenset[int] = frozenset()
    states: dict = field(default_factory=dict)
    local_layers: frozenset[int] = frozenset()

    @property
    def state_layers(self) -> set[int]:
        return {layer for per_kind in self.states.values() for layer, _ in per_kind}

    def bytes_per_row(self, acc: bool = False) -> int:
        """Bytes of one row's states at one boundary, all layers (`acc`: in the float32-or-wider
        dtype of their gradient accumulators)."""
        total = 0
        for per_kind in self.states.values():
            for shape, dtype in per_kind.values():
                size = torch.promote_types(dtype, torch.float32).itemsize if acc else dtype.itemsize
                total += math.prod(shape) * size
        return total

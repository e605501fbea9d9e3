"""Exact accounting of the tensor memory a call holds (docs/design.md §5): peak live bytes, and what was
alive at the peak, by category.

    with LiveBytes(model) as m:
        stream_backward(model, seqs, weights)
    m.peak, m.at_peak            # bytes; {category: bytes} at the moment of the peak

What is counted: every tensor *storage* that an operator returns during the block and that no input
of that operator already held (a view, an in-place or an `out=` result is not new memory), from the
moment it is returned until nothing holds it any more (a weak reference on the storage fires when
PyTorch frees it, whoever held it: a tensor, a view, autograd's saved tensors, a hook's closure).
The model's parameters and any `.grad` present on entry are counted as live from the start. On
CPU the count is deterministic: the same call gives the same numbers, unlike the resident set,
which also holds what the allocator keeps after a free. Not counted: scratch memory a kernel
allocates and frees inside one operator, and tensors made outside the dispatcher.

How a storage is attributed (first that applies):
1. a tag: the parameters ("weights"), `.grad` ("grad", from a post-accumulate hook), the LM head's
   output ("logits", from a forward hook), and whatever `tag(tensor, category)` names (the engine
   tags each history leaf's gradient "history grad");
2. the innermost `label(name)` open when the storage was allocated: the engine labels its phases
   ("prefill", "forward", "history", "objective", "seed", "backward") and its stores ("kv",
   "gkv"). `label` and `tag` cost nothing when no `LiveBytes` is active.
`saved_at_peak` counts, across categories, the bytes of storages that autograd saved for a
backward (a `saved_tensors_hooks` pack hook marks them) and that were alive at the peak.

Mechanism: a `TorchDispatchMode`, so every aten operator's outputs are seen, in the forward and in
the autograd engine's backward alike (on CPU the backward runs on the calling thread).
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "label", "saved", "tag"]

_ACTIVE: list[LiveBytes] = []  # trackers in force (innermost last)
_LABELS: list[str] = []  # the phase stack the code under measurement pushes


class label:
    """Attribute the storages allocated inside this block to `name` (innermost label wins)."""

    __slots__ = ("name", "on")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.on = bool(_ACTIVE)
        if self.on:
            _LABELS.append(self.name)
        return self

    def __exit__(self, *exc):
        if self.on:
            _LABELS.pop()


def tag(t: Tensor | None, category: str) -> None:
    """Move `t`'s storage to `category` (whatever label it was allocated under)."""
    if t is not None and _ACTIVE:
        for m in _ACTIVE:
            m.tag(t, category)


def saved(t: Tensor) -> None:
    """Autograd saved `t` for a backward: for a `saved_tensors_hooks` pack hook set inside a tracker's
    own (which the innermost hook replaces)."""
    for m in _ACTIVE:
        m._pack(t)


def _key(t: Tensor):
    st = (t._values() if t.is_sparse else t).untyped_storage()  # a sparse gradient: its values (rows)
    return st._cdata, st


_LIFT = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


class LiveBytes(TorchDispatchMode):
    """Live tensor bytes during a `with` block: `live` now, `peak`, and at the peak: `at_peak`
    ({category: bytes}), `saved_at_peak` (bytes autograd held for a backward) and `peak_label`
    (the label stack when it was reached). `model`: count its parameters (and any `.grad`) from the
    start, and tag `.grad` and the LM head's output."""

    def __init__(self, model: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.storages: dict[int, list] = {}  # storage key → [nbytes, category, weakref, saved]
        self.by_cat: Counter = Counter()
        self.live = self.peak = self.saved = 0
        self.at_peak: dict[str, int] = {}
        self.saved_at_peak = 0
        self.peak_label: tuple[str, ...] = ()
        self.ops = 0
        self._handles = []

    # -- bookkeeping ------------------------------------------------------------------------

    def _add(self, t: Tensor, category: str) -> None:
        key, st = _key(t)
        n = st.nbytes()
        entry = self.storages.get(key)
        if entry is not None:
            if entry[0] != n:  # resized in place
                self._move(entry, n - entry[0], entry[1])
                entry[0] = n
            return
        if n == 0:
            return
        ref = weakref.ref(st, lambda _, key=key: self._free(key))
        self.storages[key] = [n, category, ref, False, tuple(t.shape), t.dtype]
        self.live += n
        self.by_cat[category] += n
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = {k: v for k, v in self.by_cat.items() if v}
            self.saved_at_peak = self.saved
            self.peak_label = tuple(_LABELS)

    def _move(self, entry, delta: int, category: str) -> None:
        self.live += delta
        self.by_cat[category] += delta
        if entry[3]:
            self.saved += delta

    def _free(self, key) -> None:
        entry = self.storages.pop(key, None)
        if entry is not None:
            self._move(entry, -entry[0], entry[1])

    def tag(self, t: Tensor, category: str) -> None:
        key, _ = _key(t)
        entry = self.storages.get(key)
        if entry is None:
            self._add(t, category)
        elif entry[1] != category:
            self.by_cat[entry[1]] -= entry[0]
            self.by_cat[category] += entry[0]
            entry[1] = category

    def _pack(self, t: Tensor):
        entry = self.storages.get(_key(t)[0])
        if entry is not None and not entry[3]:
            entry[3] = True
            self.saved += entry[0]
        # detached (the same storage): a saved output held with its grad_fn would keep its own graph
        # alive in a cycle through the hook, after a forward whose backward never runs
        return t.detach()

    # -- the mode ---------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        if outs:
            held = set() if func in _LIFT else {
                _key(t)[0] for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
            where = _LABELS[-1] if _LABELS else "other"
            for t in outs:
                if _key(t)[0] not in held:
                    self._add(t, where)
        return out

    def live_set(self) -> list[tuple]:
        """(category, bytes, shape, dtype, saved) of every live storage, largest first (the shape of
        the tensor that allocated it)."""
        return sorted(((e[1], e[0], e[4], e[5], e[3]) for e in self.storages.values()), key=lambda x: -x[1])

    def __enter__(self):
        if self.model is not None:
            params = list(self.model.parameters())
            for p in params:
                self._add(p, "weights")
                if p.grad is not None:
                    self._add(p.grad, "grad")
            for p in params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(lambda p: tag(p.grad, "grad")))
            head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
            if head is not None:
                self._handles.append(head.register_forward_hook(lambda mod, i, o: tag(o, "logits")))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
            self._saved_hooks.__exit__(*exc)
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def report(self) -> dict:
        """The numbers as plain data: peak, the breakdown at the peak, what autograd held then."""
        return {"peak": self.peak, "at_peak": dict(sorted(self.at_peak.items(), key=lambda kv: -kv[1])),
                "saved_at_peak": self.saved_at_peak, "peak_label": "/".join(self.peak_label),
                "live_at_exit": self.live, "ops": self.ops}

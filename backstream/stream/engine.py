"""The exact streamed backward over a shared-prefix token tree (docs/design.md §2; MetroRLHF §3; the
schedule-level shared-prefix reuse paper).

    stream_backward(model, sequences, weights)  ⇒  p.grad += ∂/∂p Σ_i Σ_t w_i,t · log πθ(x_i,t | x_i,<t)

without ever holding the activations of more than one block batch, and forwarding/backpropagating a
prefix shared by several sequences once.

1. Tree: the sequences' input prefixes (up to their last active target) are merged into a radix
   trie; each node is cut into chunks of at most `block_size` tokens. Sibling chunks at the same
   offset (the G responses of a prompt) form one *batch*: they share the parent path as history.
2. Prefill (no grad), batches in forward order: the K/V of every tree token at every layer, and
   the log-probs of the active targets (which `Objective.setup` may use). Skipped when the caller
   passes the K/V (`kv=`), e.g. from the rollout at the same weights.
3. Backward, batches in reverse order. A batch's forward reads the stored K/V of its history as
   leaf tensors; `torch.autograd.backward` then starts from the batch's objective term and from its
   own K/V at every layer, seeded with the gradient that later batches left for those positions;
   the gradient reaching the history leaves is added to those positions' accumulators (fp32).
   By the time a batch runs, every batch that reads its K/V has run, so its seeds are complete and
   the chain rule is exact.
A batch with no target and no pending K/V gradient does nothing (the "zero-reward shortcut"); with
a sliding window, history outside every query's window is not read at all.

Layers that keep a recurrent or convolution state instead of (or beside) K/V (Gated DeltaNet, Mamba 2,
short convolutions; docs/design.md §2b) follow the same rule through `backstream.stream.state`: the
prefill stores each block boundary's states, a batch's forward starts from them as leaves, and its
backward seeds its final states with the gradient the batches after it left there.

FSDP2 (docs/design.md §6c): every call runs inside one `fsdp.FSDPCall` (parameters gathered once, gradients
reduced once at the end, also on a rank without sequences); see backstream/stream/fsdp.py.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from backstream.checks import UserError
from backstream.stream import family, fsdp, memory
from backstream.stream.adapter import (
    ATTN_NAME,
    BlockCache,
    check_model,
    concat_layers,
    probe_layout,
    run_model,
    use_backstream_attention,
)
from backstream.stream.attention import Part, check_kernel, rows_as_batch
from backstream.stream.grads import gathered_grads
from backstream.stream.hf import base_model, takes_logits_mask
from backstream.stream.kvstore import KVStore
from backstream.stream.objective import BlockView, Objective, Terms, TokenWeights, flat_offsets
from backstream.stream.router import router_term
from backstream.stream.schedule import Row, batches, has_targets, read_extent, read_later
from backstream.stream.state import STATE_KINDS, GuardSaved, LayerState
from backstream.stream.tree import TokenTree

__all__ = ["ATTN_NAME", "StreamResult", "StreamStats", "check_model", "logprobs", "stream_backward"]


@dataclass
class StreamStats:
    sequences: int = 0
    active_sequences: int = 0
    input_tokens: int = 0  # Σ of the inputs the sequences need: what a per-sequence pass forwards
    tree_tokens: int = 0  # distinct tokens after prefix sharing
    prefill_tokens: int = 0
    backward_tokens: int = 0  # tokens forwarded+backpropagated in the backward (padding excluded)
    skipped_tokens: int = 0  # tree tokens whose block did no work in the backward
    blocks_run: int = 0
    blocks_skipped: int = 0
    batches_run: int = 0
    block_size: int = 0
    batch_tokens: int = 0
    peak_bytes_predicted: int = 0  # the planner's estimate (0: none, its config sizes unreadable)
    prefill_s: float = 0.0
    backward_s: float = 0.0
    router_aux_loss: float | None = None  # the load-balancing loss at the current weights (when on)


@dataclass
class StreamResult:
    logprobs: list[Tensor]  # per sequence [len_i]: log π(x_i,t | x_i,<t) at the current weights; NaN where not active
    stats: StreamStats = field(default_factory=StreamStats)


# ---------------------------------------------------------------------------------------------
# The block batch: what the adapter's attention function and cache see during one forward.


class _Batch:
    """One batch of sibling chunks: rows share the parent path (shared history, one copy) and each
    reads its own node's earlier tokens (private history)."""

    def __init__(self, engine: _Engine, parent: int, rows: list[Row]):
        self.engine, self.parent, self.rows = engine, parent, rows
        self.model, self.kernel, self.concat_layers = engine.model, engine.kernel, engine.concat_layers
        tree = engine.tree
        self.base = tree.nodes[rows[0].node].start  # same for all siblings
        lo = rows[0].lo
        self.Q = max(r.hi - r.lo for r in rows)
        if self.Q == 1 and engine.stateful and (parent >= 0 or lo > 0):
            self.Q = 2  # one padded position: a one-token forward from a state would take the decode path
        self.p0 = self.base + lo
        self.qpos = torch.arange(self.p0, self.p0 + self.Q, device=engine.device)
        self.shared_nodes = (tree.ancestors(rows[0].node)) if parent >= 0 else []
        self.cache = BlockCache(self)
        self.guard = GuardSaved()
        self.attn_calls = 0
        self.hooks = []
        self.input_hooks = []  # the image rows' leaves (made once before the forward and its retries)

    def reset_cache(self) -> None:
        """A fresh cache before a forward (a retry drops what the failed attempt registered)."""
        self._drop_cache()
        self.cache = BlockCache(self)
        self.attn_calls = 0

    # -- layer state that is not K/V (backstream.stream.state), asked for by the cache ----------

    def state_class(self, kind: str):
        return type(self.engine.state[kind])

    def state_start(self, kind: str, slot: tuple[int, int]) -> Tensor | None:
        """The state of `kind` at `slot` the rows start from ([B, ...], fresh; None at a root)."""
        if self.engine.store.given:
            raise family.ModelContractError(
                f"kv: {type(self.engine.base).__name__} keeps {kind} state in layer {slot[0]} besides K/V, and "
                "caller-given K/V do not hold it at each block boundary; let the prefill compute it: do not pass "
                "kv= (trainer: engine.reuse_rollout_kv = false)")
        with memory.label("history"):
            return self.engine.state[kind].start(self.parent, self.rows, slot, self.hooks)

    def history_parts(self, layer: int, key_BHQD: Tensor, value_BHQD: Tensor, window: int | None) -> list[Part]:
        """The history this batch reads at `layer`, as leaves whose gradients go to the store, every
        one a view of the store (a copy would be kept by autograd for the whole batch, per layer:
        the history's K/V once more): shared (one part per node of the parent path, [1, Hkv, Ls, D])
        and private (each row's own node before the chunk: [1, Hkv, Lp, D] per row); positions
        outside every query's window are not read."""
        with memory.label("history"):
            return self._history_parts(layer, key_BHQD, value_BHQD, window)

    def _history_parts(self, layer: int, key_BHQD: Tensor, value_BHQD: Tensor, window: int | None) -> list[Part]:
        store, tree, dev = self.engine.store, self.engine.tree, self.engine.device
        store.check_given(self.shared_nodes + [r.node for r in self.rows], layer, key_BHQD, value_BHQD)
        first = 0 if window is None else max(0, self.p0 - window + 1)  # earliest visible position
        needs = (key_BHQD.requires_grad, value_BHQD.requires_grad)
        parts = []

        def leaves(node: int, a: int, b: int) -> list[Tensor]:
            return [self._leaf(store.read(node, layer, j)[None, :, a:b], needs[j], layer, j, node, a, b)
                    for j in (0, 1)]

        for n in self.shared_nodes:
            node = tree.nodes[n]
            a = max(node.start, first) - node.start
            if a < len(node.tokens):
                k, v = leaves(n, a, len(node.tokens))
                parts.append(Part(k, v, torch.arange(node.start + a, node.end, device=dev), shared=True,
                                  start=node.start + a))
        a, b = max(self.base, first) - self.base, self.rows[0].lo
        if a < b:
            kpos = torch.arange(self.base + a, self.base + b, device=dev)
            for r, row in enumerate(self.rows):
                k, v = leaves(row.node, a, b)
                parts.append(Part(k, v, kpos, row=r if len(self.rows) > 1 else None, start=self.base + a))
        return parts

    def concat_history(self, layer: int, key_BHQD: Tensor, value_BHQD: Tensor) -> tuple[Tensor, Tensor]:
        """History ⊕ block per row, [B, Hkv, Lh + Q, D], for a concat layer (the shared prefix
        expanded over the rows: the memory trap of docs/design.md §5, accepted for the layers that need it)."""
        parts = rows_as_batch(self.history_parts(layer, key_BHQD, value_BHQD, None))
        B = key_BHQD.shape[0]
        out = [torch.cat([(p.k if j == 0 else p.v).expand(B, -1, -1, -1) for p in parts] + [x], dim=2)
               for j, x in enumerate((key_BHQD, value_BHQD))]
        self.cache.kpos[layer] = torch.cat([p.kpos_K for p in parts] + [self.qpos])
        return out[0], out[1]

    def _leaf(self, t: Tensor, needs_grad: bool, layer: int, j: int, node: int, a: int, b: int) -> Tensor:
        """History K or V ([1, Hkv, b − a, D], node-local positions [a, b)) as a leaf whose gradient
        goes to those positions' accumulators. A layer whose own K/V need no gradient (frozen
        weights below it) gets no leaf."""
        if not (needs_grad and torch.is_grad_enabled()):
            return t
        leaf = t.detach().requires_grad_(True)
        store = self.engine.store

        def scatter(x: Tensor) -> None:
            memory.tag(x.grad, "history grad")
            store.add_grad(node, layer, j, a, b, x.grad[0])
            x.grad = None  # free it now, layer by layer

        self.hooks.append(leaf.register_post_accumulate_grad_hook(scatter))
        return leaf

    def release(self) -> None:
        """Break the leaf → hook → batch → cache → graph → leaf cycle, and the batch ↔ cache one, so
        that this batch's tensors are freed now rather than at the next garbage collection (whose
        moment would also make the memory count of a call differ from run to run)."""
        for h in self.input_hooks:
            h.remove()
        self.input_hooks.clear()
        self._drop_cache()

    def _drop_cache(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.cache.new.clear()
        self.cache.ends.clear()
        self.guard.handed.clear()
        self.cache.batch = None

    def forward(self, with_logits: bool):
        """Run the model on the batch; returns (logits [P, V] of the predicting positions, keep mask
        [B, Q] of those positions, (router logits per layer [R, E], multiplicities [R]) or (None, None))."""
        eng = self.engine
        B = len(self.rows)
        ids = torch.full((B, self.Q), eng.pad_id, dtype=torch.long)
        keep = torch.zeros((B, self.Q), dtype=torch.bool)
        for r, row in enumerate(self.rows):
            toks = eng.tree.nodes[row.node].tokens[row.lo:row.hi]
            ids[r, : len(toks)] = torch.tensor(toks)
            tg = eng.tree.targets.get(row.node)
            if tg is not None and with_logits:
                for off in tg.offset:
                    if row.lo <= off < row.hi:
                        keep[r, off - row.lo] = True
        ids, keep = ids.to(eng.device), keep.to(eng.device)
        kwargs = dict(input_ids=ids, position_ids=self.qpos[None], use_cache=True)
        if eng.images is not None:  # image rows as leaves of the input (stream/vision.py)
            kwargs["inputs_embeds"] = eng.images.block_embeds(eng.embed, kwargs.pop("input_ids"), self.input_hooks)
            if eng.node_pos is not None:
                kwargs["position_ids"] = self._rope_positions()
        if eng.has_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        if eng.every_token:
            kwargs["output_router_logits"] = True
        with self.guard:
            out = run_model(self, kwargs)
        logits = out.logits if eng.has_logits_to_keep else out.logits[keep]
        kv_layers, state_layers = set(self.cache.new), self.cache.state_layers()
        if kv_layers - self.cache.attended or not (kv_layers or state_layers):
            raise family.ModelTypeError(
                f"model: {type(eng.model).__name__} did not route attention through transformers' "
                "AttentionInterface and the Cache it was passed; stream_backward needs both"
            )
        if state_layers and not eng.layout.states:
            raise family.Unsupported(
                f"model: {type(eng.base).__name__} kept layer state through the Cache in layers {sorted(state_layers)} "
                f"although its probe forward did not; {family.ENGINE_HINT}")
        missing = sorted(set(range(eng.num_layers)) - kv_layers - state_layers - eng.layout.local_layers)
        if missing:
            layer_types = getattr(eng.text_config, "layer_types", None)
            raise family.layers_without_kv(type(eng.base).__name__, missing, layer_types)
        router = self._router_rows(getattr(out, "router_logits", None), B) if eng.every_token else (None, None)
        return logits, keep, router

    def _rope_positions(self) -> Tensor:
        """The rows' rotary positions [n, B, Q] (M-RoPE), read from their nodes; padding continues
        each row's last position."""
        pos = self.engine.node_pos
        out = []
        for row in self.rows:
            p = pos[row.node][:, row.lo:row.hi]
            if p.shape[1] < self.Q:
                p = torch.cat([p, p[:, -1:] + torch.arange(1, self.Q - p.shape[1] + 1)], 1)
            out.append(p)
        return torch.stack(out, 1).to(self.engine.device)

    def _router_rows(self, router_logits, B: int) -> tuple:
        """The router logits of the batch's real tokens ([R, E] per layer) and how many sequences
        contain each ([R])."""
        eng = self.engine
        if not router_logits:
            raise TypeError(f"objective.router_aux_coef: {type(eng.model).__name__} returned no router logits "
                            "with output_router_logits=True")
        mult = torch.zeros((B, self.Q), dtype=torch.float64)
        for r, row in enumerate(self.rows):
            mult[r, : row.hi - row.lo] = eng.mult[row.node][row.lo:row.hi]
        mult = mult.flatten()
        idx = torch.nonzero(mult > 0).flatten()
        for x in router_logits:
            if x.dim() != 2 or x.shape[0] != B * self.Q:
                raise TypeError(f"objective.router_aux_coef: expected router logits of shape [{B * self.Q}, experts] "
                                f"per layer, got {tuple(x.shape)}")
        idx_d = idx.to(eng.device)
        return [x[idx_d] for x in router_logits], mult[idx]

    def view(self, logits_PV: Tensor, keep: Tensor, router: tuple) -> BlockView | None:
        """Targets of this batch, mapped to rows of logits_PV (row-major order of `keep`), and the
        router rows when the objective needs them; None when there is nothing to read."""
        eng = self.engine
        index = torch.cumsum(keep.flatten().to(torch.long), 0) - 1
        Q = self.Q
        pos, target, seq, tok = [], [], [], []
        for r, row in enumerate(self.rows):
            tg = eng.tree.targets.get(row.node)
            if tg is None:
                continue
            for off, tk, s, t in zip(tg.offset, tg.token, tg.seq, tg.tok):
                if row.lo <= off < row.hi:
                    pos.append(r * Q + off - row.lo)
                    target.append(tk)
                    seq.append(s)
                    tok.append(t)
        if not pos and router[0] is None:
            return None
        dev = logits_PV.device
        as_t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        seq_t, tok_t = as_t(seq), as_t(tok)
        return BlockView(
            logits_PV=logits_PV, row_pos_N=index[as_t(pos)], target_N=as_t(target), seq_N=seq_t,
            tok_N=tok_t, flat_N=eng.offsets_t.to(dev)[seq_t] + tok_t,
            router_logits_LRE=router[0], mult_R=router[1],
        )


# ---------------------------------------------------------------------------------------------


def validate_sequences(model, sequences, name: str = "sequences", allow_empty: bool = False) -> int:
    """Checks shared by stream_backward and reference_backward; returns the vocabulary size. An
    empty list is allowed under FSDP (`allow_empty`): that rank still joins the reduction."""
    base = check_model(model)
    if not isinstance(sequences, (list, tuple)) or (len(sequences) == 0 and not allow_empty):
        n = len(sequences) if isinstance(sequences, (list, tuple)) else "n/a"
        raise UserError(f"{name}: expected a non-empty list of 1-D integer tensors, got "
                         f"{type(sequences).__name__} of length {n}")
    vocab = base.get_input_embeddings().num_embeddings
    for i, s in enumerate(sequences):
        if not isinstance(s, Tensor):
            raise TypeError(f"{name}[{i}]: expected a torch.Tensor of token ids, got {type(s).__name__}")
        if s.dim() != 1 or s.numel() == 0:
            raise UserError(f"{name}[{i}]: expected a non-empty 1-D tensor, got shape {tuple(s.shape)}")
        if s.dtype.is_floating_point or s.dtype.is_complex or s.dtype == torch.bool:
            raise TypeError(f"{name}[{i}]: token ids must be an integer tensor, got {s.dtype}")
        lo, hi = int(s.min()), int(s.max())
        if lo < 0 or hi >= vocab:
            raise UserError(f"{name}[{i}]: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab})")
    return vocab


def validate_weights(sequences, weights) -> None:
    if not isinstance(weights, (list, tuple)) or len(weights) != len(sequences):
        n = len(weights) if isinstance(weights, (list, tuple)) else "n/a"
        raise UserError(f"weights: expected a list of {len(sequences)} tensors (one per sequence), got "
                         f"{type(weights).__name__} of length {n}")
    for i, (s, w) in enumerate(zip(sequences, weights)):
        if not isinstance(w, Tensor) or not w.dtype.is_floating_point:
            got = getattr(w, "dtype", type(w).__name__)
            raise TypeError(f"weights[{i}]: expected a floating-point tensor, got {got}")
        if w.shape != s.shape:
            raise UserError(f"weights[{i}]: shape {tuple(w.shape)} does not match sequences[{i}] shape "
                             f"{tuple(s.shape)}")
        if w[0] != 0:
            raise UserError(f"weights[{i}][0] = {float(w[0])}: the first token has no prediction; "
                             "its weight must be 0")
        if not torch.isfinite(w).all():
            raise UserError(f"weights[{i}]: contains NaN or inf")


def objective_from(weights, objective) -> Objective:
    if (weights is None) == (objective is None):
        raise UserError("weights / objective: pass exactly one of them")
    if objective is not None and not isinstance(objective, Objective):
        raise TypeError(f"objective: expected a backstream.Objective, got {type(objective).__name__}")
    return objective if objective is not None else TokenWeights(list(weights))


class _Engine:
    """The two passes over one token tree: the prefill (forward order) and the backward (reverse)."""

    def __init__(self, model, sequences, tree: TokenTree, block_size, batch_tokens, kernel, pad_id, layout,
                 images=None):
        self.model = model
        self.images = images  # stream/vision.py Images, or None
        self.embed = images.embed_module(model) if images is not None else None
        self.node_pos = _node_positions(tree, images) if images is not None else None
        self.base = base_model(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kernel = kernel  # attention.select_kernel reads it
        self.pad_id = pad_id
        self.tree = tree
        self.layout = layout  # which layers keep K/V, which keep recurrent or conv state (adapter.probe_layout)
        self.stateful = bool(layout.states)
        self.schedule = batches(tree, block_size, batch_tokens, stateful=self.stateful)
        # only the positions a later block reads
        self.store = KVStore(tree, read_extent(tree, block_size, stateful=self.stateful))
        self.state = {cls.kind: cls(tree) for cls in STATE_KINDS}  # fixed-size state at block boundaries
        self.states: list[LayerState] = [self.store, *self.state.values()]
        self.has_logits_to_keep = takes_logits_mask(model)  # a [B, Q] mask: each row keeps its own
        self.text_config = self.base.config.get_text_config()
        self.num_layers = self.text_config.num_hidden_layers
        self.offsets_t = torch.tensor(flat_offsets([len(s) for s in sequences]), dtype=torch.long)
        self.concat_layers = concat_layers(self.base)  # attention reading K/V derived from the cache
        self.every_token = False  # the objective reads every token's router logits (views carry them)
        self.progress = None  # progress(phase, batches done, batches in all), after each block batch
        self.mult: dict[int, Tensor] = {}  # then: node → float64 [len], sequences containing each token

    def needs_work(self, row: Row) -> bool:
        """The zero-reward shortcut: a chunk with no target and no pending K/V gradient does nothing."""
        return self.every_token or has_targets(self.tree, row) or any(s.pending(row) for s in self.states)

    def prefill(self, objective: Objective, logprobs: list[Tensor], stats: StreamStats, all_logprobs: bool) -> None:
        """K/V of every chunk a later block reads, and the log-probs of the targets. A chunk nobody
        reads (the tail of a response) is left to the backward unless the objective asked for
        every log-prob before the backward (`all_logprobs`)."""
        with torch.no_grad():
            for done, (parent, rows) in enumerate(self.schedule, 1):
                if not all_logprobs:
                    rows = [r for r in rows if read_later(self.tree, r)]
                    if not rows:
                        continue
                batch = _Batch(self, parent, rows)
                with memory.label("prefill"):
                    logits, keep, router = batch.forward(with_logits=True)
                for s in self.states:
                    s.store(batch.rows, batch.cache)
                view = batch.view(logits, keep, router)
                if view is not None:
                    objective.observe(view)
                    self.record(view, logprobs)
                batch.release()
                stats.prefill_tokens += sum(r.hi - r.lo for r in rows)
                if self.progress is not None:
                    self.progress("prefill", done, len(self.schedule))

    @staticmethod
    def record(view: BlockView, logprobs: list[Tensor]) -> None:
        lp = view.logprobs().detach()
        for s, t, x in zip(view.seq_N.tolist(), view.tok_N.tolist(), lp.tolist()):
            logprobs[s][t] = x

    def backward(self, objective: Objective, logprobs: list[Tensor], stats: StreamStats, record: bool) -> None:
        for done, (parent, rows) in enumerate(reversed(self.schedule), 1):
            if self.progress is not None:
                self.progress("backward", done, len(self.schedule))
            work = [r for r in rows if self.needs_work(r)]
            stats.blocks_skipped += len(rows) - len(work)
            stats.skipped_tokens += sum(r.hi - r.lo for r in rows if r not in work)
            if work:
                self._backward_batch(parent, work, objective, logprobs, record)
                stats.blocks_run += len(work)
                stats.batches_run += 1
                stats.backward_tokens += sum(r.hi - r.lo for r in work)
            for s in self.states:  # every block that reads these chunks has run (skipped ones too)
                s.spent(rows)

    def _backward_batch(self, parent: int, work: list[Row], objective: Objective, logprobs: list[Tensor],
                        record: bool) -> None:
        """One block batch's forward and backward. A function of its own so that nothing of the
        batch outlives it: a tensor left in a loop variable would keep its graph, and through the
        graph's AccumulateGrad nodes the history leaves (views that pin the store) alive into the next
        batch."""
        batch = _Batch(self, parent, work)
        with memory.label("forward"):
            logits, keep, router = batch.forward(with_logits=True)
        roots, seeds = [], []
        with memory.label("objective"):
            view = batch.view(logits, keep, router)
            loss = None
            if view is not None and objective.reads(view):
                loss = objective.block_loss(view)
        if view is not None and record:
            self.record(view, logprobs)
        if loss is not None and loss.requires_grad:
            roots.append(loss)
            seeds.append(torch.ones_like(loss))
        # the [positions × vocab] logits (and the view's log-softmax) are not needed past this
        # point unless autograd saved them: free them before the backward allocates its own
        del view, logits, loss, router
        for s in self.states:  # what this batch produced (K/V, final states), seeded by its readers
            for x, seed in s.roots(work, batch.cache):
                roots.append(x)
                seeds.append(seed)
        if roots:
            with memory.label("backward"):
                torch.autograd.backward(roots, seeds)
        batch.release()


def stream_backward(
    model: nn.Module,
    sequences: list[Tensor],
    weights: list[Tensor] | None = None,
    *,
    objective: Objective | None = None,
    block_size: int | None = None,
    batch_tokens: int | None = None,
    memory_budget: int | None = None,
    kv: list | None = None,
    kernel: str = "auto",
    grad_dtype: torch.dtype | None = torch.float32,
    progress=None,
    images=None,
) -> StreamResult:
    """Accumulate into `.grad` the gradient of Σ_i Σ_t weights[i][t]·log πθ(x_i[t] | x_i[:t]) — or of
    the sum of `objective`'s block terms — block by block, shared prefixes once.

    sequences: 1-D integer tensors of token ids; weights: float tensors of the same lengths
      (weights[i][0] must be 0). Pass `objective=` instead of weights for RL losses (docs/design.md §3).
    block_size: tokens per block (default 512, or the planner's choice under `memory_budget`).
    batch_tokens: cap on rows × block_size of one sibling batch (default 8 × block_size).
    memory_budget: bytes; the planner picks block_size and batch_tokens to fit (see `plan`).
    kv: the K/V the caller already has (per sequence, a Cache or a list over layers of (K, V) of
      shape [kv_heads, length, head_dim]) computed at the current weights: no prefill runs.
    kernel: attention kernel, "auto" (the device's fused kernel where it has one for the model's dtype:
      `attention.select_kernel`), "flash" (that fused kernel, or an error) or "math" (naive reference).
    grad_dtype: a parameter of lower precision (bfloat16, float16) gathers its gradient over the
      block batches in this dtype and `.grad` receives the sum once, at the end (one rounding
      instead of one per block batch; memory: one such buffer per parameter during the call).
      None: every block batch adds straight into `.grad`. Under FSDP2 its own accumulation applies.
    progress: optional `progress(phase, done, total)`, called as the prefill and the backward go
      through their block batches ("prefill" / "backward"; a progress bar's hook).
    An objective with `router_aux_coef > 0` (MoE models) adds the router load-balancing loss over
    every token (`backstream.stream.router`); its value is in `stats.router_aux_loss`.
    images: a vision-language model's image rows (`backstream.stream.vision.Images`): the positions
      they fill read them instead of their tokens' embeddings; when `images.embeds` requires grad
      (the vision tower trains), its gradient is summed over every block and backpropagated once.
    Returns the log-probs at the current weights (NaN where no target was active) and stats.
    """
    obj = objective_from(weights, objective)
    sharded = bool(fsdp.units(model))
    validate_sequences(model, sequences, allow_empty=sharded)
    if weights is not None:
        validate_weights(sequences, weights)
    if grad_dtype is not None and not (isinstance(grad_dtype, torch.dtype) and grad_dtype.is_floating_point):
        raise UserError(f"grad_dtype: expected a floating torch.dtype or None, got {grad_dtype!r}")
    return _run(model, sequences, obj, block_size=block_size, batch_tokens=batch_tokens,
                memory_budget=memory_budget, kv=kv, kernel=kernel, backward=True,
                grad_dtype=None if sharded else grad_dtype, progress=progress, images=images)


class _Mask(Objective):
    def __init__(self, mask):
        self.mask = mask

    def active(self, sequences):
        return self.mask


def logprobs(model: nn.Module, sequences: list[Tensor], mask: list[Tensor] | None = None, *,
             block_size: int | None = None, batch_tokens: int | None = None, kernel: str = "auto",
             images=None) -> list[Tensor]:
    """log π(x_i[t] | x_i[:t]) at the current weights where `mask[i][t]` (default: every t ≥ 1),
    NaN elsewhere: the prefill alone (no grad), shared prefixes once, logits block by block. This is
    the "old log-prob" / reference-model pass of a PPO trainer."""
    validate_sequences(model, sequences, allow_empty=bool(fsdp.units(model)))
    if mask is None:
        mask = [torch.arange(len(s)) >= 1 for s in sequences]
    return _run(model, sequences, _Mask(mask), block_size=block_size, batch_tokens=batch_tokens,
                memory_budget=None, kv=None, kernel=kernel, backward=False, images=images).logprobs


def _run(model, sequences, obj, **kw) -> StreamResult:
    """One call, inside one FSDP call when the model is sharded (a rank may then have no sequence)."""

    def idle() -> StreamResult:  # nothing here; the router term's counts are still summed with the other ranks'
        result = StreamResult(logprobs=[])
        router = router_term(model, obj, across_ranks=True) if kw["backward"] else None
        if router is not None:
            router.setup(None)
            result.stats.router_aux_loss = router.value
        return result

    return fsdp.run(model, bool(sequences), kw["backward"],
                    lambda across_ranks: _run_local(model, sequences, obj, across_ranks=across_ranks, **kw), idle)


def _run_local(model, sequences, obj, *, block_size, batch_tokens, memory_budget, kv, kernel,
               backward, across_ranks: bool = False, grad_dtype: torch.dtype | None = None,
               progress=None, images=None) -> StreamResult:
    from backstream.stream.planner import plan  # noqa: PLC0415  (planner imports engine stats)

    for name, val in (("block_size", block_size), ("batch_tokens", batch_tokens), ("memory_budget", memory_budget)):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
            raise UserError(f"{name}: expected a positive integer, got {val!r}")
    check_kernel(kernel)  # a name it does not know is refused here, before any work
    active = obj.active(sequences)
    if len(active) != len(sequences) or any(a.shape != s.shape for a, s in zip(active, sequences)):
        raise UserError("objective.active: must return one bool tensor per sequence, of the sequence's shape")
    if any(bool(a[0]) for a in active):
        raise UserError("objective.active: index 0 has no prediction and cannot be active")
    router = router_term(model, obj, across_ranks) if backward else None
    if router is not None:
        if kv is not None:
            raise family.ModelContractError(
                "kv: the router load-balancing loss needs the routing counts of every token, which only the prefill "
                "gives; do not pass kv= (trainer: engine.reuse_rollout_kv = false)")
        obj = Terms(obj, router)
    family.check_deterministic(model)
    family.check_positions(model, max(len(s) for s in sequences))
    family.check_default_positions(model, max(sequences, key=len))

    layout = probe_layout(model)  # layers that keep recurrent or convolution state change the tree's rules
    if kv is not None and layout.states:
        layers = sorted(layout.state_layers)
        raise family.ModelContractError(
            f"kv: {type(base_model(model)).__name__} keeps recurrent or convolution state in layers {layers} besides "
            "K/V, and caller-given K/V do not hold it at each block boundary; let the prefill compute it: do not pass "
            "kv= (trainer: engine.reuse_rollout_kv = false)")
    seqs_cpu = [s.detach().to("cpu", torch.long) for s in sequences]
    if images is not None:
        images.validate(seqs_cpu)
        if kv is not None:
            raise UserError("kv: not with images (the prefill computes the image positions' K/V); do not pass kv=")
    inputs, tree = _tree(seqs_cpu, [a.detach().to("cpu", torch.bool) for a in active], obj.needs_router_logits,
                         stateful=bool(layout.states), images=images)

    stats = StreamStats(sequences=len(sequences), active_sequences=sum(1 for x in inputs if x),
                        input_tokens=sum(len(x) for x in inputs), tree_tokens=tree.num_tokens())
    p = plan(model, tree, block_size=block_size, batch_tokens=batch_tokens, memory_budget=memory_budget,
             layout=layout, act_per_token=measured_activations(model, layout) if layout.states else None)
    stats.block_size, stats.batch_tokens, stats.peak_bytes_predicted = p.block_size, p.batch_tokens, p.peak_bytes

    eng = _Engine(model, seqs_cpu, tree, p.block_size, p.batch_tokens, kernel, pad_id=0, layout=layout,
                  images=images)
    eng.progress = progress
    if obj.needs_router_logits:
        eng.every_token, eng.mult = True, _multiplicities(tree, inputs)
    lp_dtype = torch.promote_types(eng.dtype, torch.float32)
    lps = [torch.full((len(s),), math.nan, dtype=lp_dtype) for s in seqs_cpu]
    if kv is not None:
        eng.store.fill(kv, sequences, eng.num_layers, eng.device, eng.dtype)
    # the objective may read every log-prob in `setup` (sequence-level statistics, ...)
    all_lp = not backward or obj.needs_prefill_logprobs or obj.needs_router_logits
    with use_backstream_attention(model), images.feeding(model) if images is not None else contextlib.nullcontext():
        t = time.perf_counter()
        if kv is None:
            eng.prefill(obj, lps, stats, all_logprobs=all_lp)
        stats.prefill_s = time.perf_counter() - t
        if not backward:
            return StreamResult(logprobs=lps, stats=stats)
        obj.setup([x.clone() for x in lps] if kv is None else None)
        if router is not None:
            stats.router_aux_loss = router.value
        t = time.perf_counter()
        with gathered_grads(model, grad_dtype, sharded=across_ranks or bool(fsdp.units(model))):
            if images is not None:
                images.start()
            eng.backward(obj, lps, stats, record=kv is not None or not all_lp)
            if images is not None:
                images.finish()  # the vision tower's backward, once
        stats.backward_s = time.perf_counter() - t
    return StreamResult(logprobs=lps, stats=stats)


def measure_block(model, layout, tokens: int) -> int:
    """Bytes a forward of one block of `tokens` tokens leaves alive for its backward (its activations,
    its K/V and final states; no logits), counted by `LiveBytes`; the graph is dropped, no backward runs
    (`measured_activations`)."""
    vocab = base_model(model).get_input_embeddings().num_embeddings
    ids = torch.arange(tokens + 1) % vocab
    tree = TokenTree([ids[:-1].tolist()], stateful=bool(layout.states))
    eng = _Engine(model, [ids], tree, tokens, tokens, "auto", pad_id=0, layout=layout)
    parent, rows = eng.schedule[0]
    batch = _Batch(eng, parent, rows)
    with use_backstream_attention(model), torch.enable_grad(), memory.LiveBytes() as counter:
        start = counter.live
        out = batch.forward(with_logits=False)
        kept = counter.live - start
        del out
        batch.release()
    return kept


_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
PROBE_TOKENS = 128


def measured_activations(model, layout) -> int:
    """Bytes autograd keeps per token of a block in a model whose layers keep recurrent or convolution
    state, measured once per model and dtype: one block of `PROBE_TOKENS` tokens forwarded by the
    engine with gradient on, counted by `LiveBytes` (no logits, no backward: nothing reaches `.grad`).
    The planner's count per layer of a Qwen3-type model is a formula; the token mixers of
    hybrids are many (Gated DeltaNet's chunked kernel, Mamba 2's scan, short convolutions), so they
    are measured rather than written down per family."""
    base = base_model(model)
    dtype = next(model.parameters()).dtype
    known = _MEASURED.setdefault(base, {})
    key = (dtype, tuple(p.requires_grad for p in model.parameters()))
    if key not in known:
        known[key] = -(-measure_block(model, layout, PROBE_TOKENS) // PROBE_TOKENS)
    return known[key]


def _tree(seqs: list[Tensor], active: list[Tensor], every_token: bool,
          stateful: bool = False, images=None) -> tuple[list[list[int]], TokenTree]:
    """The inputs each sequence needs (up to its last active target, or all of it when the
    objective reads every token) merged into the token tree, with the targets placed. Image
    positions enter the tree as virtual tokens (stream/vision.py)."""
    inputs = []
    for i, (s, a) in enumerate(zip(seqs, active)):
        if images is not None:
            s = images.tree_inputs(i, s)
        nz = torch.nonzero(a)
        if every_token:
            inputs.append(s.tolist())  # the router loss reads every token of every sequence
        else:
            inputs.append(s[: int(nz[-1])].tolist() if len(nz) else [])
    tree = TokenTree(inputs, stateful=stateful)
    tree.add_targets(seqs, active)
    return inputs, tree


def _node_positions(tree: TokenTree, images) -> dict[int, Tensor] | None:
    """Per node, its tokens' rotary positions [n, len] (images.positions, M-RoPE), from any sequence
    whose path crosses it; sequences that share a node must agree there (a position is a function of
    the prefix), or the call is refused."""
    if images.positions is None:
        return None
    pos: dict[int, Tensor] = {}
    for i, path in enumerate(tree.paths):
        p_i = images.positions[i].to("cpu", torch.long)
        for n in path:
            node = tree.nodes[n]
            hi = min(node.end, p_i.shape[1])
            mine = p_i[:, node.start:hi]
            if n not in pos or pos[n].shape[1] < mine.shape[1]:
                if n in pos and not torch.equal(pos[n], mine[:, :pos[n].shape[1]]):
                    raise UserError(f"images.positions[{i}]: differs from another sequence's over their shared prefix")
                pos[n] = mine
            elif not torch.equal(pos[n][:, :mine.shape[1]], mine):
                raise UserError(f"images.positions[{i}]: differs from another sequence's over their shared prefix")
    return pos


def _multiplicities(tree: TokenTree, inputs: list[list[int]]) -> dict[int, Tensor]:
    """Per node, how many sequences contain each of its tokens (a path may end inside a node)."""
    mult = {n.id: torch.zeros(len(n.tokens), dtype=torch.float64) for n in tree.nodes}
    for toks, path in zip(inputs, tree.paths):
        for n in path:
            node = tree.nodes[n]
            mult[n][: min(len(node.tokens), len(toks) - node.start)] += 1
    return mult

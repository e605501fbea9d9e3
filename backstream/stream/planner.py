"""Memory planner: picks the block size and the rows per batch from a byte budget (docs/design.md §5).

    peak ≈ weights + grads + K/V of the tree + gK/gV + one block batch
    one block batch = its activations + its K/V seeds + max(its logits' three [P × V] tensors,
                                                            one layer's history gradient)

Every term is counted the way `backstream.stream.memory.LiveBytes` counts the engine (bytes of live
tensor storages; `bench/bench_memory.py` prints estimate beside measurement):
- K/V and gK/gV: the positions some later block reads (a node without children is not read past
  the start of its last chunk), in the model's dtype and in float32 (or wider) respectively; at the
  peak (the first block batches of the backward) all of them are alive;
- activations: what autograd keeps per token of the block, per decoder layer of a Qwen3/Llama-type
  model (measured with LiveBytes, element counts): 6·hidden (two RMSNorms: input, normalised,
  scaled) + 4·(heads·head_dim) + 4·(kv_heads·head_dim) (q/k projections and norms, the attention's
  query, output and o_proj input, k after RoPE, v) + 4·intermediate (gated MLP: gate, up, SiLU,
  product) + 2 + 2·heads + kv_heads (norm and attention statistics); an MoE layer holds
  top_k·(2·hidden + 4·moe_intermediate) in its MLP instead (the routed copies and the experts'
  projections), plus 4·width of a shared expert; after the last layer, 3·hidden (final norm, the
  LM head's input) and 2·head_dim (RoPE tables); routing keeps ~(4·experts + 4·top_k)·4 bytes; in
  a bf16/fp16 model the norms' two saved copies per norm are float32;
- logits: at the start of the backward the log-softmax kept for it, its gradient and the logits'
  gradient, float32 (or wider), [P × V] each, P = the most target positions of one batch of the
  schedule (`batch_sizes`: a prompt's blocks have none, G completions of 16 tokens 16·G; without
  targets in the tree, rows × block size); the block terms (activations, seeds, logits) are those
  of the batch of the schedule that holds the most (rows × its longest chunk tokens, its targets),
  not rows × block size where the chunks are shorter;
- history gradient: the flash backward returns one layer's gradient for the K and V of the whole
  history the batch reads before it is added into gK/gV; it replaces the logits' three tensors as
  the batch's transient when the history is long.
Llama-type layers without q/k norms hold 2·(heads + kv_heads)·head_dim fewer per token and layer:
the estimate is a little high for them. A tree deeper than a group is an upper bound (a node's K/V
and gK/gV are freed once its first block ran, before some of its relatives' blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backstream.checks import UserError
from backstream.stream import fsdp
from backstream.stream.family import Unsupported
from backstream.stream.grads import head_in_place
from backstream.stream.hf import base_model, num_experts
from backstream.stream.schedule import batches, chunks, read_extent

DEFAULT_BLOCK = 512
DEFAULT_ROWS = 8


@dataclass
class Plan:
    block_size: int
    batch_tokens: int
    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)


@dataclass
class _Dims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp: int  # elements a token's MLP keeps per layer, for the backward
    router: int = 0  # bytes a token's routing keeps per layer (MoE: logits, probabilities, top-k)

    @property
    def kv_per_token(self) -> int:
        """Elements of K and V per token, all layers."""
        return self.layers * 2 * self.kv_heads * self.head_dim


def _dims(model) -> _Dims:
    try:
        return _read_dims(base_model(model).config.get_text_config())
    except Exception as e:
        raise Unsupported(f"model: the memory planner cannot read the config's sizes ({type(e).__name__}: {e})") from e


def _widest(x):
    return max(x) if isinstance(x, (list, tuple)) else x  # per-layer widths: plan for the widest


def _read_dims(c) -> _Dims:
    H = c.num_attention_heads
    D = getattr(c, "head_dim", None) or c.hidden_size // H
    Hkv = getattr(c, "num_key_value_heads", None) or H
    inter = _widest(getattr(c, "intermediate_size", None) or 4 * c.hidden_size)
    mlp = 4 * inter
    k = getattr(c, "num_experts_per_tok", None)
    router = 0
    experts = num_experts(c)
    if k and experts:  # routed experts (Mixtral names the expert width intermediate_size)
        width = _widest(getattr(c, "moe_intermediate_size", None) or inter)
        shared = (getattr(c, "shared_expert_intermediate_size", None)
                  or (getattr(c, "n_shared_experts", None) or 0) * width)
        dense_layers = (getattr(c, "mlp_only_layers", None) or (getattr(c, "decoder_sparse_step", None) or 1) > 1
                        or getattr(c, "first_k_dense_replace", None))
        mlp = max(mlp if dense_layers else 0, k * (2 * c.hidden_size + 4 * width) + 4 * shared)
        router = 4 * (4 * experts + 4 * k)
    return _Dims(c.num_hidden_layers, c.hidden_size, H, Hkv, D, c.vocab_size, mlp, router)


def _head_grad_bytes(model) -> int:
    """Bytes of the LM head's weight gradient where a block's backward makes it whole before adding it
    into `.grad`: 0 when the head is frozen, or summed in place (`grads.HeadGradInPlace`)."""
    base = base_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    w = getattr(head, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.requires_grad or head_in_place(model, bool(fsdp.units(model))):
        return 0
    return w.numel() * max(w.element_size(), 4)


def boundaries(tree, block_size: int) -> int:
    """Block boundaries whose state a later block reads (a model with recurrent or convolution state):
    the end of every chunk but a leaf's last."""
    return sum(len(chunks(len(n.tokens), block_size, True)) - (0 if n.children else 1) for n in tree.nodes)


def estimate(model, *, tree_tokens: int, longest_path: int, block_size: int, rows: int,
             stored_tokens: int | None = None, boundaries: int = 0, layout=None,
             act_per_token: int | None = None, batches: list[tuple[int, int]] | None = None) -> Plan:
    """The peak live bytes of a streamed call (weights included). stored_tokens: tree tokens whose
    K/V a later block reads (default: all of them; `plan` counts them for the block size).
    boundaries, layout: the block boundaries whose recurrent / convolution states are kept, and the
    states' sizes (`adapter.probe_layout`). act_per_token: bytes a block keeps per token, measured
    (`engine.measured_activations`: the engine passes it for a model with layer state, whose token
    mixers no formula here covers); None = the Qwen3/Llama-type formula of the module docstring.
    batches: (tokens, targets) of each batch the schedule runs (`batch_sizes`: a prompt's blocks have
    no targets, G completions of 16 tokens are a batch of 16·G tokens): the block terms are those of
    the batch that holds the most; None = a full batch of rows × block_size tokens, every one a target."""
    d = _dims(model)
    params = list(model.parameters())
    elt = params[0].element_size()
    acc = max(elt, 4)  # float32 accumulators (gK/gV, logits, low-precision parameters' gradients)
    weights = sum(x.numel() * x.element_size() for x in params)
    grads = sum(x.numel() * max(x.element_size(), 4) for x in params if x.requires_grad)
    stored = tree_tokens if stored_tokens is None else stored_tokens
    per_layer = (6 * d.hidden + 4 * d.heads * d.head_dim + 4 * d.kv_heads * d.head_dim + d.mlp
                 + 2 + 2 * d.heads + d.kv_heads)
    act_tok = d.layers * per_layer + 3 * d.hidden + 2 * d.head_dim
    history = min(tree_tokens, rows * longest_path)  # keys one batch reads (shared once, private per row)
    stateful = layout is not None and bool(layout.states)
    kv_tok = (len(layout.kv_layers) * 2 * d.kv_heads * d.head_dim) if stateful else d.kv_per_token

    def block(tokens: int, logits: int) -> dict[str, int]:
        return {
            # RMSNorms compute in float32 whatever the model's dtype: their saved input and normalised
            # copies (two per norm) are float32
            "block_activations": tokens * (act_per_token if act_per_token is not None else act_tok * elt
                                           + d.layers * d.router + (acc - elt) * (4 * d.layers + 2) * d.hidden),
            "block_seeds": tokens * kv_tok * elt,
            # the logits' three [P × V] tensors at the start of the backward (P: the batch's targets), or
            # one layer's history gradient, or the LM head's weight gradient beside the logits' (where it
            # is made whole: FSDP, other heads)
            "block_transient": max(3 * logits * d.vocab * acc, 2 * history * d.kv_heads * d.head_dim * elt,
                                   _head_grad_bytes(model) + logits * d.vocab * acc),
        }

    shapes = batches or [(rows * block_size, rows * block_size)]
    b = {
        "weights": weights,
        "grads": grads,
        "kv_store": stored * kv_tok * elt,
        "kv_grads": stored * kv_tok * acc,
        **max((block(*x) for x in shapes), key=lambda terms: sum(terms.values())),
        # per tree token: the returned log-probs and their copy for `setup`, the loss mask, the
        # per-layer pending-gradient masks
        "bookkeeping": tree_tokens * (16 + d.layers),
    }
    if stateful:  # the states at the kept boundaries and their gradients; a batch's start states
        # (handed to the model as copies), their gradients and its end states' seeds
        b["state_store"] = boundaries * layout.bytes_per_row()
        b["state_grads"] = boundaries * layout.bytes_per_row(acc=True)
        b["block_states"] = rows * 3 * layout.bytes_per_row(acc=True)
    return Plan(block_size, rows * block_size, sum(b.values()), b)


def batch_sizes(tree, block_size: int, batch_tokens: int, stateful: bool = False) -> list[tuple[int, int]]:
    """The block batches of the schedule (`schedule.batches`), each as (its tokens: rows × its longest
    chunk, as padded; its target positions: tokens whose log-prob the objective reads, the logits it
    computes), the distinct ones."""
    out = set()
    for _, rows in batches(tree, block_size, batch_tokens, stateful):
        n = 0
        for r in rows:
            tg = tree.targets.get(r.node)
            if tg is not None:
                n += sum(1 for o in tg.offset if r.lo <= o < r.hi)
        out.add((len(rows) * max(r.hi - r.lo for r in rows), n))
    return sorted(out)


def plan(model, tree, *, block_size=None, batch_tokens=None, memory_budget=None, layout=None,
         act_per_token: int | None = None) -> Plan:
    """Resolve block size and batch tokens; with `memory_budget`, the largest that fit. `layout`
    (`adapter.probe_layout`): a model whose layers keep recurrent or convolution state runs blocks
    of at least 2 tokens, and its states at the block boundaries are counted."""
    stateful = bool(layout is not None and layout.states)
    if stateful and block_size is not None:
        block_size = max(block_size, 2)
    longest_node = max((len(n.tokens) for n in tree.nodes), default=1)
    longest_path = max((tree.nodes[p[-1]].end for p in tree.paths if p), default=1)
    siblings = max([len(tree.roots)] + [len(n.children) for n in tree.nodes])

    def est(T, rows):
        # a batch never holds more rows than there are siblings, whatever batch_tokens allows
        rows = max(1, min(rows, siblings))
        return estimate(model, tree_tokens=tree.num_tokens(), longest_path=longest_path, block_size=T,
                        rows=rows, stored_tokens=sum(read_extent(tree, T, stateful).values()),
                        boundaries=boundaries(tree, T) if stateful else 0, layout=layout,
                        act_per_token=act_per_token,
                        batches=batch_sizes(tree, T, rows * T, stateful) if tree.targets else None)

    if memory_budget is None:
        T = block_size or DEFAULT_BLOCK
        bt = batch_tokens or DEFAULT_ROWS * T
        try:
            e = est(T, max(1, bt // T))
        except Unsupported:  # the estimate is only reported here: no estimate (peak_bytes 0)
            return Plan(T, max(1, bt // T) * T, 0)
        return Plan(T, max(1, bt // T) * T, e.peak_bytes, e.breakdown)  # the schedule's cap stays the caller's
    try:
        est(block_size or DEFAULT_BLOCK, 1)
    except Unsupported as e:
        raise UserError(f"memory_budget: {str(e).removeprefix('model: ')}; pass block_size and batch_tokens "
                         "instead (trainer: engine.block_size, engine.memory_budget_mb = 0)") from e
    sizes = [block_size] if block_size else [8192, 4096, 2048, 1024, 512, 256, 128, 64, 32, 16]
    smallest = None
    for T in sizes:
        T_eff = min(T, max(16, longest_node))
        max_rows = max(1, (batch_tokens or T_eff * siblings) // T_eff)
        for rows in range(min(siblings, max_rows), 0, -1):
            e = est(T_eff, rows)
            smallest = e if smallest is None or e.peak_bytes < smallest.peak_bytes else smallest
            if e.peak_bytes <= memory_budget:
                return e
    raise UserError(
        f"memory_budget: {memory_budget / 2**20:.0f} MiB is below the smallest plan's estimate "
        f"({smallest.peak_bytes / 2**20:.0f} MiB at block_size={smallest.block_size}, 1 row): raise it "
        f"(breakdown in MiB: { {k: round(v / 2**20) for k, v in smallest.breakdown.items()} })"
    )

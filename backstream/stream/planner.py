"""Memory planner: picks the block size and the rows per batch from a byte budget (DESIGN §5).

    peak ≈ weights + grads + K/V of the tree + pending gK/gV + one block batch
           (activations + the history it reads + its logits)

The activation term is a per-token constant of the architecture (what autograd keeps per token
per layer). The numbers are estimates; `bench/bench_long.py` prints them beside measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backstream.stream.hf import base_model
from backstream.stream.family import Unsupported

DEFAULT_BLOCK = 512
DEFAULT_ROWS = 8


@dataclass
class Plan:
    block_size: int
    batch_tokens: int
    peak_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)


def _dims(model):
    try:
        return _read_dims(base_model(model).config.get_text_config())
    except Exception as e:  # noqa: BLE001  (per-layer attributes some configs refuse to read globally)
        raise Unsupported(f"model: the memory planner cannot read the config's sizes ({type(e).__name__}: {e})") from e


def _read_dims(c):
    H = c.num_attention_heads
    D = getattr(c, "head_dim", None) or c.hidden_size // H
    Hkv = getattr(c, "num_key_value_heads", None) or H
    inter = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    if isinstance(inter, (list, tuple)):  # per-layer widths: plan for the widest
        inter = max(inter)
    # MoE: the active experts' width is what a token's activations hold
    k = getattr(c, "num_experts_per_tok", None)
    if k and getattr(c, "moe_intermediate_size", None):
        inter = k * c.moe_intermediate_size
    return c.num_hidden_layers, c.hidden_size, inter, H, Hkv, D, c.vocab_size


def estimate(model, *, tree_tokens: int, longest_path: int, block_size: int, rows: int) -> Plan:
    L, hid, inter, H, Hkv, D, V = _dims(model)
    p = next(model.parameters())
    elt = p.element_size()
    weights = sum(x.numel() * x.element_size() for x in model.parameters())
    grads = sum(x.numel() * x.element_size() for x in model.parameters() if x.requires_grad)
    kv_tok = L * 2 * Hkv * D  # elements of K/V per token
    tokens = rows * block_size
    # per token and layer, autograd keeps ~ the inputs of every linear and norm, the MLP's
    # intermediate activations and the attention's q/k/v/out
    act_tok = L * (8 * hid + 4 * inter + 3 * (H + 2 * Hkv) * D)
    b = {
        "weights": weights,
        "grads": grads,
        "kv_store": tree_tokens * kv_tok * elt,
        "pending_grads": tree_tokens * kv_tok * 4,  # bound: every position at once, fp32
        "block_activations": tokens * act_tok * elt,
        "block_history": min(longest_path, tree_tokens) * kv_tok * elt * (1 + rows),
        "block_logits": tokens * V * 4 * 3,  # logits, log-softmax, their gradient
    }
    return Plan(block_size, tokens, sum(b.values()), b)


def plan(model, tree, *, block_size=None, batch_tokens=None, memory_budget=None) -> Plan:
    """Resolve block size and batch tokens; with `memory_budget`, the largest that fit."""
    longest_node = max((len(n.tokens) for n in tree.nodes), default=1)
    longest_path = max((tree.nodes[p[-1]].end for p in tree.paths if p), default=1)
    siblings = max([len(tree.roots)] + [len(n.children) for n in tree.nodes])

    def est(T, rows):
        return estimate(model, tree_tokens=tree.num_tokens(), longest_path=longest_path,
                        block_size=T, rows=rows)

    if memory_budget is None:
        T = block_size or DEFAULT_BLOCK
        bt = batch_tokens or DEFAULT_ROWS * T
        try:
            return est(T, max(1, bt // T))
        except Unsupported:  # the estimate is only reported here: no estimate (peak_bytes 0)
            return Plan(T, max(1, bt // T) * T, 0)
    try:
        est(block_size or DEFAULT_BLOCK, 1)
    except Unsupported as e:
        raise ValueError(f"memory_budget: {str(e).removeprefix('model: ')}; pass block_size and batch_tokens "
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
    raise ValueError(
        f"memory_budget: {memory_budget / 2**20:.0f} MiB is below the smallest plan's estimate "
        f"({smallest.peak_bytes / 2**20:.0f} MiB at block_size={smallest.block_size}, 1 row): raise it "
        f"(breakdown in MiB: { {k: round(v / 2**20) for k, v in smallest.breakdown.items()} })"
    )

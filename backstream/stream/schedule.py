"""The schedule of the streamed backward (docs/design.md §2): which chunks of the token tree form a batch,
in what order, and which of them can be skipped.

Each tree node is cut into chunks of at most `block_size` tokens. Sibling chunks at the same offset
(the G responses of a prompt) form one batch: they share the parent path as history. Forward order
(the prefill) visits parents before children; the backward runs the same batches in reverse, so a
batch runs only after every batch that reads its K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

from backstream.stream.tree import TokenTree


@dataclass
class Row:
    """One chunk of a node: node-local tokens [lo, hi)."""

    node: int
    lo: int
    hi: int


def batches(tree: TokenTree, block_size: int, batch_tokens: int) -> list[tuple[int, list[Row]]]:
    """Forward order: (parent, rows) with parents before children; siblings at the same chunk offset
    together, as many rows as fit in `batch_tokens` (counting the longest row's chunk)."""
    T = block_size
    out, queue = [], [-1]
    while queue:
        p = queue.pop(0)
        kids = tree.roots if p < 0 else tree.nodes[p].children
        if not kids:
            continue
        longest = max(len(tree.nodes[c].tokens) for c in kids)
        for lo in range(0, longest, T):
            rows = [Row(c, lo, min(lo + T, len(tree.nodes[c].tokens))) for c in kids if len(tree.nodes[c].tokens) > lo]
            rows.sort(key=lambda r: r.lo - r.hi)  # longest first: rows of a batch pad less
            k = 0
            while k < len(rows):
                cap = max(1, batch_tokens // (rows[k].hi - rows[k].lo))
                out.append((p, rows[k:k + cap]))
                k += cap
        queue.extend(kids)
    return out


def read_later(tree: TokenTree, row: Row) -> bool:
    """Does any later block read this chunk's K/V (a later chunk of its node, or a child)? If not
    (a response's last chunk), the prefill need not compute it."""
    node = tree.nodes[row.node]
    return row.hi < len(node.tokens) or bool(node.children)


def read_extent(tree: TokenTree, block_size: int) -> dict[int, int]:
    """Per node, how many of its first positions some later block reads (`read_later` over its
    chunks): all of a node with children, a leaf's up to the start of its last chunk. The K/V store
    keeps exactly these, and the planner counts them."""
    return {n.id: len(n.tokens) if n.children else (len(n.tokens) - 1) // block_size * block_size
            for n in tree.nodes}


def has_targets(tree: TokenTree, row: Row) -> bool:
    """Does the chunk predict a token the objective reads?"""
    tg = tree.targets.get(row.node)
    return tg is not None and any(row.lo <= o < row.hi for o in tg.offset)

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


def chunks(length: int, block_size: int, stateful: bool = False) -> list[tuple[int, int]]:
    """A node's chunks [lo, hi): `block_size` tokens each, the last one what remains. `stateful` (a
    model with recurrent or convolution state, docs/design.md §2b): the last chunk takes a one-token
    remainder (block_size + 1 tokens), so that no chunk after the first is one token long (see
    `TokenTree`: a one-token block continuing a state would run the model's decode path)."""
    cuts = list(range(0, length, block_size))
    if stateful and len(cuts) > 1 and length - cuts[-1] == 1:
        cuts.pop()
    return [(lo, min(hi, length)) for lo, hi in zip(cuts, cuts[1:] + [length])]


def batches(tree: TokenTree, block_size: int, batch_tokens: int,
            stateful: bool = False) -> list[tuple[int, list[Row]]]:
    """Forward order: (parent, rows) with parents before children; siblings at the same chunk offset
    together, as many rows as fit in `batch_tokens` (counting the longest row's chunk).

    `stateful` (a model with recurrent or convolution state, docs/design.md §2b): chunks as `chunks`
    cuts them, and since the state after a padded row is the state after its padding, not its own, a
    shorter row whose final state a later block reads (`read_later`) only shares a batch with rows of
    its own length; the tails of responses, which nothing reads, still fill any batch."""
    out, queue = [], [-1]
    while queue:
        p = queue.pop(0)
        kids = tree.roots if p < 0 else tree.nodes[p].children
        if not kids:
            continue
        at: dict[int, list[Row]] = {}  # chunk offset → the kids' chunks starting there
        for c in kids:
            for lo, hi in chunks(len(tree.nodes[c].tokens), block_size, stateful):
                at.setdefault(lo, []).append(Row(c, lo, hi))
        for lo in sorted(at):
            rows = sorted(at[lo], key=lambda r: r.lo - r.hi)  # longest first: rows of a batch pad less
            while rows:
                Q = rows[0].hi - rows[0].lo
                fits = [r for r in rows if not stateful or r.hi - r.lo == Q or not read_later(tree, r)]
                take = fits[:max(1, batch_tokens // Q)]
                out.append((p, take))
                rows = [r for r in rows if r not in take]
        queue.extend(kids)
    return out


def read_later(tree: TokenTree, row: Row) -> bool:
    """Does any later block read this chunk's K/V (a later chunk of its node, or a child)? If not
    (a response's last chunk), the prefill need not compute it."""
    node = tree.nodes[row.node]
    return row.hi < len(node.tokens) or bool(node.children)


def read_extent(tree: TokenTree, block_size: int, stateful: bool = False) -> dict[int, int]:
    """Per node, how many of its first positions some later block reads (`read_later` over its
    chunks): all of a node with children, a leaf's up to the start of its last chunk. The K/V store
    keeps exactly these, and the planner counts them."""
    return {n.id: len(n.tokens) if n.children else chunks(len(n.tokens), block_size, stateful)[-1][0]
            for n in tree.nodes}


def has_targets(tree: TokenTree, row: Row) -> bool:
    """Does the chunk predict a token the objective reads?"""
    tg = tree.targets.get(row.node)
    return tg is not None and any(row.lo <= o < row.hi for o in tg.offset)

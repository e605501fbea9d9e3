"""Token tree: sequences that share a prefix share nodes, so the prefix is computed once.

A GRPO group is a root (the prompt) with G children (the responses); a multi-turn episode is a
deeper path; exact duplicates end on the same node. Nodes are runs of tokens (a radix trie); a
sequence's path may end inside a node. Node tokens are the *inputs* of the model: a target token
x_i[t] is predicted at the position of x_i[t−1], so a node's last position predicts the first
token of each of its children.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Node:
    id: int
    parent: int  # −1 for a root
    start: int  # absolute position of the node's first token
    tokens: list[int]
    children: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class Targets:
    """Targets predicted inside one node: arrays over n targets (offsets are node-local)."""

    offset: list[int] = field(default_factory=list)  # position of the predicting token in the node
    token: list[int] = field(default_factory=list)
    seq: list[int] = field(default_factory=list)
    tok: list[int] = field(default_factory=list)


class TokenTree:
    """Radix trie over the input prefixes of the sequences.

    `inputs[i]` is the part of sequence i the model must read (up to its last active target);
    sequences with no active target have empty inputs and no node.

    `stateful` (a model whose layers keep recurrent or convolution state, docs/design.md §2b): no
    node below a root holds a single token while it has children. Such a node's token goes into each
    of its children instead (computed once per child rather than once), so that no block with a
    state to continue is one token long: the models' one-token paths are their decode paths, which
    may compute otherwise than the multi-token path of the full forward (Zamba 2 clamps Δt in one
    and not in the other).
    """

    def __init__(self, inputs: list[list[int]], stateful: bool = False):
        self.nodes: list[Node] = []
        self.roots: list[int] = []
        for toks in inputs:
            if toks:
                self._insert(toks)
        if stateful:
            self._push_down_singletons()
        # the path of each sequence: nodes from the root to the node holding its last input
        self.paths: list[list[int]] = [self._walk(toks) for toks in inputs]
        self.targets: dict[int, Targets] = {}

    def _child_starting(self, siblings: list[int], token: int) -> int | None:
        for c in siblings:
            if self.nodes[c].tokens[0] == token:
                return c
        return None

    def _new(self, parent: int, start: int, tokens: list[int]) -> int:
        node = Node(len(self.nodes), parent, start, tokens)
        self.nodes.append(node)
        (self.nodes[parent].children if parent >= 0 else self.roots).append(node.id)
        return node.id

    def _insert(self, toks: list[int]) -> None:
        parent, pos = -1, 0
        while pos < len(toks):
            siblings = self.nodes[parent].children if parent >= 0 else self.roots
            c = self._child_starting(siblings, toks[pos])
            if c is None:
                self._new(parent, pos, toks[pos:])
                return
            node = self.nodes[c]
            n = 0
            lim = min(len(node.tokens), len(toks) - pos)
            while n < lim and node.tokens[n] == toks[pos + n]:
                n += 1
            if n < len(node.tokens) and pos + n < len(toks):
                self._split(c, n)
            parent, pos = c, pos + n

    def _split(self, c: int, n: int) -> None:
        """Keep the first n tokens in node c; the rest moves to a new child that takes c's children."""
        node = self.nodes[c]
        tail = Node(len(self.nodes), c, node.start + n, node.tokens[n:], node.children)
        self.nodes.append(tail)
        for gc in tail.children:
            self.nodes[gc].parent = tail.id
        node.tokens, node.children = node.tokens[:n], [tail.id]

    def _push_down_singletons(self) -> None:
        """Give every one-token node below a root that has children to its children (see the class
        docstring), then renumber the nodes in forward order."""
        for node in self.nodes:
            if node.parent >= 0 and len(node.tokens) == 1 and node.children:
                siblings = self.nodes[node.parent].children
                i = siblings.index(node.id)
                for c in node.children:
                    child = self.nodes[c]
                    child.tokens, child.start, child.parent = node.tokens + child.tokens, node.start, node.parent
                siblings[i:i + 1] = node.children
                node.children, node.parent = [], -2  # gone
        old, order, queue = self.nodes, [], list(self.roots)
        while queue:
            n = queue.pop(0)
            order.append(n)
            queue.extend(old[n].children)
        new_id = {n: i for i, n in enumerate(order)}
        self.nodes = [Node(new_id[n], new_id.get(old[n].parent, -1), old[n].start, old[n].tokens,
                           [new_id[c] for c in old[n].children]) for n in order]
        self.roots = [new_id[r] for r in self.roots]

    def _child_matching(self, siblings: list[int], toks: list[int], pos: int) -> int | None:
        """The child whose tokens agree longest with toks[pos:] (children may share a first token
        once singletons were pushed down)."""
        best, best_n = None, 0
        for c in siblings:
            t = self.nodes[c].tokens
            n, lim = 0, min(len(t), len(toks) - pos)
            while n < lim and t[n] == toks[pos + n]:
                n += 1
            if n > best_n:
                best, best_n = c, n
        return best

    def _walk(self, toks: list[int]) -> list[int]:
        path, parent, pos = [], -1, 0
        while pos < len(toks):
            siblings = self.nodes[parent].children if parent >= 0 else self.roots
            c = self._child_matching(siblings, toks, pos)
            assert c is not None, "sequence lost in its own tree"
            path.append(c)
            parent, pos = c, pos + len(self.nodes[c].tokens)
        assert pos >= len(toks)
        return path

    def add_targets(self, sequences: list[Tensor], active: list[Tensor]) -> None:
        """Place every active target (i, t) at the node and offset of position t − 1."""
        for i, (seq, act) in enumerate(zip(sequences, active)):
            ts = torch.nonzero(act).flatten().tolist()
            toks = seq.tolist()
            path = self.paths[i]
            k = 0
            for t in ts:  # ascending, so the path is walked once
                while self.nodes[path[k]].end <= t - 1:
                    k += 1
                node = self.nodes[path[k]]
                tg = self.targets.setdefault(node.id, Targets())
                tg.offset.append(t - 1 - node.start)
                tg.token.append(toks[t])
                tg.seq.append(i)
                tg.tok.append(t)

    def ancestors(self, n: int) -> list[int]:
        """Nodes from the root down to n's parent."""
        out = []
        p = self.nodes[n].parent
        while p >= 0:
            out.append(p)
            p = self.nodes[p].parent
        return out[::-1]

    def num_tokens(self) -> int:
        return sum(len(n.tokens) for n in self.nodes)

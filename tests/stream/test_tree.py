"""The token tree: prefixes shared once, paths, target placement."""

import torch

from backstream.stream.schedule import batches, read_extent, read_later
from backstream.stream.tree import TokenTree


def test_group_is_a_root_with_children():
    P = [1, 2, 3]
    t = TokenTree([P + [4, 5], P + [6], P + [4, 7]])
    assert [t.nodes[r].tokens for r in t.roots] == [[1, 2, 3]]
    root = t.nodes[t.roots[0]]
    kids = sorted(t.nodes[c].tokens for c in root.children)
    assert kids == [[4], [6]]
    assert t.num_tokens() == 3 + 1 + 1 + 1 + 1  # 1 2 3 | 4 | 5, 7 | 6


def test_duplicates_and_prefixes_share_nodes():
    t = TokenTree([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2], [], [9]])
    assert t.num_tokens() == 5
    assert t.paths[0] == t.paths[1]
    assert t.paths[3] == []
    # a sequence may end inside a node
    n = t.paths[2][-1]
    assert t.nodes[n].start <= 1 < t.nodes[n].end


def test_split_moves_children():
    t = TokenTree([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 9]])
    for i, toks in enumerate([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 9]]):
        got = [x for n in t.paths[i] for x in t.nodes[n].tokens]
        assert got == toks
        starts = [t.nodes[n].start for n in t.paths[i]]
        assert starts == sorted(starts) and starts[0] == 0
    for n in t.nodes:
        for c in n.children:
            assert t.nodes[c].parent == n.id and t.nodes[c].start == n.end


def test_targets_sit_at_the_predicting_position():
    seqs = [torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 5])]
    inputs = [[1, 2, 3], [1, 2]]
    t = TokenTree(inputs)
    t.add_targets(seqs, [torch.tensor([False, False, True, True]), torch.tensor([False, True, True])])
    placed = {(s, tok): (n, off, token) for n, tg in t.targets.items()
              for off, token, s, tok in zip(tg.offset, tg.token, tg.seq, tg.tok)}
    # sequence 1's inputs end inside the node [1, 2, 3]: no split is needed; its token 5 and
    # sequence 0's token 3 are both predicted at position 1 of that node
    assert t.num_tokens() == 3
    assert placed[(1, 2)] == (t.roots[0], 1, 5)
    assert placed[(0, 2)] == (t.roots[0], 1, 3)
    assert placed[(0, 3)] == (t.roots[0], 2, 4)


def test_read_extent_is_what_the_schedule_reads_later():
    """The store's extent (closed form) is, per node, the end of its last chunk some later block reads."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        prompt = torch.randint(0, 5, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        seqs = [prompt + torch.randint(0, 5, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g).tolist()
                for _ in range(int(torch.randint(1, 5, (1,), generator=g)))]
        tree = TokenTree(seqs)
        for block in (1, 3, 4, 64):
            read = {n.id: 0 for n in tree.nodes}
            for _, rows in batches(tree, block, 4 * block):
                for r in rows:
                    if read_later(tree, r):
                        read[r.node] = max(read[r.node], r.hi)
            assert read_extent(tree, block) == read


"""Mamba 1's scan continued from a state (backstream/stream/scan.py, issue 55), in float64: the continued
scan is the recurrence from h0 token by token (`selective_scan_reference`), its outputs, its final state
and their gradients with respect to every input and h0; a sequence scanned in two parts, the second
continued from the first's final state, is the whole sequence's scan, where transformers' own scan of the
second part (from zero) is not; and `install` puts it in front of the mixers of Mamba, Falcon-Mamba and
Jamba only."""

import pytest
import torch

from backstream.stream import scan
from backstream.stream.miniature import keep_float64, miniature

MAMBA = "transformers.models.mamba.modeling_mamba"


def inputs(seed: int, B: int = 2, inner: int = 5, N: int = 3, L: int = 9):
    """x, dt, A, B, C, D, z, the dt bias (transformers' layouts: [B, I, L], A [I, N], B and C [B, N, L]),
    every one a leaf that requires grad, and an initial state h0 [B, I, N]."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x, dt, z = r(B, inner, L), r(B, inner, L) * 0.5, r(B, inner, L)
    A = -torch.exp(r(inner, N) * 0.3)
    Bm, C, D, bias, h0 = r(B, N, L), r(B, N, L), r(inner), r(inner) * 0.1, r(B, inner, N)
    return [t.requires_grad_(True) for t in (x, dt, A, Bm, C, D, z, bias, h0)]


def test_the_continued_scan_is_the_recurrence_from_h0():
    x, dt, A, Bm, C, D, z, bias, h0 = leaves = inputs(0)
    with keep_float64():  # transformers' scan casts x and B to float32
        y, h = scan.continued_scan(scan.transformers_scan(MAMBA), h0, x, dt, A, Bm, C, D=D, z=z, delta_bias=bias,
                                   delta_softplus=True, return_last_state=True)
    y_ref, h_ref = scan.selective_scan_reference(x, dt, A, Bm, C, h0, D=D, z=z, delta_bias=bias, delta_softplus=True)
    torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=0)
    g = torch.Generator().manual_seed(1)
    wy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    wh = torch.randn(h.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((y * wy).sum() + (h * wh).sum(), leaves)
    want = torch.autograd.grad((y_ref * wy).sum() + (h_ref * wh).sum(), leaves)
    for name, a, b in zip("x dt A B C D z bias h0".split(), got, want):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11, msg=f"the gradient of {name}")
    assert float(got[-1].norm()) > 0.1  # h0 reaches the loss


@pytest.mark.parametrize("k", [1, 4, 8])
def test_a_sequence_in_two_parts_is_the_whole_sequences_scan(k):
    """Parts [0, k) and [k, L): the second continued from the first's final state equals the whole scan;
    transformers' scan of the second part alone (its multi-token path: from zero) does not."""
    x, dt, A, Bm, C, D, z, bias, _ = (t.detach() for t in inputs(2))
    original = scan.transformers_scan(MAMBA)
    kw = dict(D=D, delta_bias=bias, delta_softplus=True, return_last_state=True)
    head = lambda t: t[..., :k]  # noqa: E731
    tail = lambda t: t[..., k:]  # noqa: E731
    with keep_float64():
        whole, h_whole = original(x, dt, A, Bm, C, z=z, **kw)
        y1, h1 = original(head(x), head(dt), A, head(Bm), head(C), z=head(z), **kw)
        y2, h2 = scan.continued_scan(original, h1, tail(x), tail(dt), A, tail(Bm), tail(C), z=tail(z), **kw)
        from_zero, _ = original(tail(x), tail(dt), A, tail(Bm), tail(C), z=tail(z), **kw)
    torch.testing.assert_close(torch.cat([y1, y2], -1), whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(h2, h_whole, atol=1e-12, rtol=0)
    assert (from_zero - whole[..., k:]).abs().max() > 1e-3  # what the engine would get without the h0 term


def test_install_puts_the_continued_scan_in_front_of_the_mamba1_mixers_only():
    jamba = miniature("jamba")
    n = sum(1 for m in jamba.modules() if type(m).__name__ == "JambaMambaMixer")
    assert n > 0 and scan.install(jamba) == n == scan.install(jamba)  # once per model
    import transformers.models.jamba.modeling_jamba as jm

    assert getattr(jm.mamba_selective_scan, "continues_state", False)
    assert scan.install(miniature("mamba2")) == 0 and scan.install(miniature("qwen3_5_text")) == 0
    twin = miniature("jamba")  # the same weights, its mixers left alone
    ids = torch.arange(5)[None] + 3
    with torch.no_grad():  # no state to continue: transformers' own scan, bitwise
        for use_cache in (False, True):
            a, b = (m(input_ids=ids, use_cache=use_cache).logits for m in (jamba, twin))
            assert torch.equal(a, b)
    assert not getattr(scan._current, "stack", [])  # nothing left on the mixers' stack

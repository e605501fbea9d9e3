"""The merged (shared / private / block) attention against plain SDPA over concatenated keys."""

import pytest
import torch

from backstream.stream.attention import Part, merged_attention


def sdpa_reference(q, parts, qpos, scale, window):
    B, H = q.shape[:2]
    K = torch.cat([p.k.expand(B, -1, -1, -1) for p in parts], 2)
    V = torch.cat([p.v.expand(B, -1, -1, -1) for p in parts], 2)
    g = H // K.shape[1]
    kpos = torch.cat([p.kpos_K for p in parts])
    keep = kpos[None] <= qpos[:, None]
    if window is not None:
        keep &= (qpos[:, None] - kpos[None]) < window
    return torch.nn.functional.scaled_dot_product_attention(
        q, K.repeat_interleave(g, 1), V.repeat_interleave(g, 1), attn_mask=keep, scale=scale)


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("window", [None, 9, 6, 3, 1])
@pytest.mark.parametrize("B, H, Hkv", [(1, 4, 4), (3, 4, 2), (2, 6, 1)])
def test_merged_matches_sdpa(kernel, window, B, H, Hkv):
    torch.manual_seed(0)
    D, Q, Ls, Lp = 8, 5, 7, 4
    dt = torch.float64
    leaf = lambda *s: torch.randn(*s, dtype=dt, requires_grad=True)  # noqa: E731
    q = leaf(B, H, Q, D)
    kv = [leaf(1, Hkv, Ls, D), leaf(1, Hkv, Ls, D), leaf(B, Hkv, Lp, D), leaf(B, Hkv, Lp, D),
          leaf(B, Hkv, Q, D), leaf(B, Hkv, Q, D)]
    qpos = torch.arange(Ls + Lp, Ls + Lp + Q)
    parts = [Part(kv[0], kv[1], torch.arange(Ls), shared=True), Part(kv[2], kv[3], torch.arange(Ls, Ls + Lp)),
             Part(kv[4], kv[5], qpos, causal=True)]
    out = merged_attention(q, parts, qpos, 0.3, window, kernel=kernel)
    ref = sdpa_reference(q, parts, qpos, 0.3, window)
    assert (out - ref).abs().max() < 1e-13
    probe = torch.randn_like(out)
    g = torch.autograd.grad((out * probe).sum(), [q, *kv])
    g_ref = torch.autograd.grad((ref * probe).sum(), [q, *kv])
    for a, b in zip(g, g_ref):
        assert (a - b).abs().max() < 1e-13


def test_bf16_flash_close_to_float64():
    torch.manual_seed(1)
    q = torch.randn(2, 4, 16, 32, dtype=torch.float64)
    k1, v1 = torch.randn(1, 2, 64, 32, dtype=torch.float64), torch.randn(1, 2, 64, 32, dtype=torch.float64)
    k2, v2 = torch.randn(2, 2, 16, 32, dtype=torch.float64), torch.randn(2, 2, 16, 32, dtype=torch.float64)
    qpos = torch.arange(64, 80)
    mk = lambda dt: [Part(k1.to(dt), v1.to(dt), torch.arange(64), shared=True),  # noqa: E731
                     Part(k2.to(dt), v2.to(dt), qpos, causal=True)]
    exact = merged_attention(q, mk(torch.float64), qpos, 32**-0.5, None)
    low = merged_attention(q.bfloat16(), mk(torch.bfloat16), qpos, 32**-0.5, None)
    assert low.dtype == torch.bfloat16
    assert (low.double() - exact).abs().max() < 0.05


def test_causal_block_builds_no_mask(monkeypatch):
    """The block's own keys use the kernel's causal flag: no [Q × Q] mask per layer (it would be kept
    for the backward and grow with the square of the block); a window shorter than the block still
    needs one."""
    from backstream.stream import attention

    built = []
    real = attention._mask
    monkeypatch.setattr(attention, "_mask", lambda qpos, kpos, causal, window, dtype: built.append(causal)
                        or real(qpos, kpos, causal, window, dtype))
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    qpos = torch.arange(10, 16)
    for window, masks in ((None, []), (6, []), (4, [True])):
        built.clear()
        out = merged_attention(q, [Part(k, v, qpos, causal=True)], qpos, 0.3, window, kernel="flash")
        ref = sdpa_reference(q, [Part(k, v, qpos, causal=True)], qpos, 0.3, window)
        assert built == masks and (out - ref).abs().max() < 1e-13


def eager_reference(q, parts, qpos, scale, window, softcap=None, sinks=None):
    """GPT-OSS / Gemma 2's eager attention over concatenated keys: soft-capped scores, a sink logit
    per head appended to the softmax and dropped after it."""
    B, H = q.shape[:2]
    K = torch.cat([p.k.expand(B, -1, -1, -1) for p in parts], 2)
    V = torch.cat([p.v.expand(B, -1, -1, -1) for p in parts], 2)
    g = H // K.shape[1]
    s = q @ K.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.cat([p.kpos_K for p in parts])
    keep = kpos[None] <= qpos[:, None]
    if window is not None:
        keep &= (qpos[:, None] - kpos[None]) < window
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, H, 1, 1).expand(B, H, s.shape[2], 1)], -1)
    p = torch.softmax(s, -1)[..., : K.shape[2]]
    return p @ V.repeat_interleave(g, 1)


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("softcap, use_sinks, Dv", [(None, True, 8), (2.0, False, 8), (2.0, True, 8),
                                                    (None, False, 5), (None, True, 12), (3.0, False, 5)])
@pytest.mark.parametrize("window", [None, 3])
def test_sinks_softcap_and_v_head_size(kernel, softcap, use_sinks, Dv, window):
    """Sinks (a zero-value logit per head), soft-capping and V heads of another size than K's (MLA):
    values and gradients of q, every K/V part and the sinks equal the eager formula's."""
    torch.manual_seed(2)
    B, H, Hkv, D, Q, Ls, Lp = 3, 4, 2, 8, 5, 7, 4
    leaf = lambda *s: (torch.randn(*s, dtype=torch.float64) * 2).requires_grad_(True)  # noqa: E731
    q = leaf(B, H, Q, D)
    kv = [leaf(1, Hkv, Ls, D), leaf(1, Hkv, Ls, Dv), leaf(B, Hkv, Lp, D), leaf(B, Hkv, Lp, Dv),
          leaf(B, Hkv, Q, D), leaf(B, Hkv, Q, Dv)]
    sinks = leaf(H) if use_sinks else None
    qpos = torch.arange(Ls + Lp, Ls + Lp + Q)
    parts = [Part(kv[0], kv[1], torch.arange(Ls), shared=True), Part(kv[2], kv[3], torch.arange(Ls, Ls + Lp)),
             Part(kv[4], kv[5], qpos, causal=True)]
    out = merged_attention(q, parts, qpos, 0.3, window, kernel=kernel, softcap=softcap, sinks_H=sinks)
    ref = eager_reference(q, parts, qpos, 0.3, window, softcap, sinks)
    assert out.shape == (B, H, Q, Dv)
    assert (out - ref).abs().max() < 1e-13
    leaves = [q, *kv] + ([sinks] if use_sinks else [])
    probe = torch.randn_like(out)
    g = torch.autograd.grad((out * probe).sum(), leaves)
    g_ref = torch.autograd.grad((ref * probe).sum(), leaves)
    for a, b in zip(g, g_ref):
        assert (a - b).abs().max() < 1e-12
    if use_sinks:
        assert g[-1].abs().max() > 1e-3  # the sinks do get a gradient

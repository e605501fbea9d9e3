"""Images on the tree (backstream/stream/vision.py, issue 53's engine part), in float64 on a LLaVA
miniature (a 2-layer CLIP tower, its projector, a 2-layer Llama): the naive reference with images is
the model's own forward with pixels (log-probs and every gradient, the tower's included); the streamed
gradient equals the reference at block sizes that cut through an image and beside it, with the tower
trained and frozen, on a group of G = 4 after a prompt with an image plus a second prompt whose image
differs but whose placeholder ids are the same (the tree must not merge them); the engine never runs
the tower, whose output is backpropagated once. Then `verify(model_type, images=True)` on a few of
transformers' own families: exact where the contract covers the family, refused by name where it
uses the image beyond the decoder's input rows (Gemma 3's bidirectional image attention). Qwen3-VL's
deepstack (the tower's features added again after its first decoder layers) is streamed exactly, and
dropping it is caught."""

import re

import pytest
import torch
from helpers import relative_errors
from vlm_miniatures import IMAGE, N_IMG, Q3_THW, Q_END, Q_IMAGE, Q_START, Q_THW, llava, qwen2_vl, qwen3_vl

from backstream import reference_backward, stream_backward
from backstream.checks import UserError
from backstream.stream import vision
from backstream.stream.family import Unsupported
from backstream.stream.miniature import keep_float64
from backstream.stream.verify import Verdict, verify


def group(seed: int = 0):
    """Prompt A (text, an image, text) with G = 4 responses (one a second turn's prefix), prompt B: the
    same text and placeholders around another image, 2 responses. Loss on the responses only."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(5, 250, (n,), generator=g)  # noqa: E731
    prompt = torch.cat([ids(5), torch.full((N_IMG,), IMAGE), ids(4)])
    seqs = [torch.cat([prompt, ids(n)]) for n in (7, 12, 1, 9)] + [torch.cat([prompt, ids(n)]) for n in (6, 8)]
    weights = []
    for s in seqs:
        w = torch.randn(len(s), generator=g, dtype=torch.float64)
        w[: len(prompt)] = 0
        weights.append(w)
    pixels = torch.randn(2, 3, 56, 56, generator=g, dtype=torch.float64)
    return seqs, weights, pixels, [[0]] * 4 + [[1]] * 2


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(model, fn, seqs, weights, pixels, images_of, **kw):
    """fn (stream_backward or reference_backward) with the images encoded once; the gradients and the
    log-probs."""
    model.zero_grad(set_to_none=True)
    with keep_float64():
        feats = vision.encode(model, pixels)
        res = fn(model, seqs, weights, images=vision.place(seqs, IMAGE, feats, images_of), **kw)
    return grads(model), res


def test_the_reference_with_images_is_the_models_own_forward_with_pixels():
    model = llava()
    seqs, weights, pixels, images_of = group()
    g_ref, r_ref = run(model, reference_backward, seqs, weights, pixels, images_of)
    model.zero_grad(set_to_none=True)
    with keep_float64():
        total = 0
        for i, (s, w) in enumerate(zip(seqs, weights)):
            logits = model(input_ids=s[None], pixel_values=pixels[images_of[i]]).logits[0, :-1]
            lp = logits.log_softmax(-1).gather(-1, s[1:, None])[:, 0]
            total = total + (lp * w[1:]).sum()
            m = w[1:] != 0
            torch.testing.assert_close(r_ref.logprobs[i][1:][m], lp[m].detach(), atol=1e-12, rtol=0)
        total.backward()
    g_own = grads(model)
    assert g_own.keys() == g_ref.keys() and any("vision_tower" in n for n in g_own)
    for n, err in relative_errors(g_ref, g_own).items():
        assert err <= 1e-10, f"{n}: {err:.3g}"


@pytest.mark.parametrize("tower", ["trained", "frozen"])
def test_streamed_with_an_image_equals_the_reference(tower):
    model = llava()
    if tower == "frozen":
        for n, p in model.named_parameters():
            if "vision_tower" in n or "multi_modal_projector" in n:
                p.requires_grad_(False)
    seqs, weights, pixels, images_of = group()
    g_ref, r_ref = run(model, reference_backward, seqs, weights, pixels, images_of)
    assert any("vision_tower" in n for n in g_ref) == (tower == "trained")
    calls = []
    handle = model.model.vision_tower.register_forward_hook(lambda *a: calls.append(1))
    # blocks 1 and 3 cut through the image, 16 holds it whole beside text, one row per batch splits its readers
    for block, rows in [(1, None), (3, None), (16, None), (3, 3)]:
        calls.clear()
        g, r = run(model, stream_backward, seqs, weights, pixels, images_of, block_size=block, batch_tokens=rows)
        assert len(calls) == 1  # the tower ran once for the call (both images in one batch), not per sample
        assert g.keys() == g_ref.keys()
        for n, err in relative_errors(g, g_ref).items():
            assert err <= 1e-10, f"block {block}, rows {rows}: {n}: {err:.3g}"
        for a, b, w in zip(r.logprobs, r_ref.logprobs, weights):
            torch.testing.assert_close(a[w != 0], b[w != 0], atol=1e-12, rtol=0)
    handle.remove()
    # A's 25-token prompt is shared by its 4 responses (inputs: each response but its last token); B's
    # shares only the 5 text tokens before its image with A's (same ids, another image)
    P = len(seqs[0]) - 7
    assert r.stats.tree_tokens == P + (6 + 11 + 0 + 8) + (P - 5) + (5 + 7)


def test_an_image_is_not_merged_with_another_behind_the_same_placeholders():
    """The same sequences with B's image swapped for A's: B's responses now share A's prompt, and the
    gradient changes: the image, not the placeholder ids, is what the tree keys on."""
    model = llava()
    seqs, weights, pixels, _ = group()
    g_two, r_two = run(model, stream_backward, seqs, weights, pixels, [[0]] * 4 + [[1]] * 2, block_size=4)
    g_one, r_one = run(model, stream_backward, seqs, weights, pixels, [[0]] * 6, block_size=4)
    assert r_one.stats.tree_tokens < r_two.stats.tree_tokens
    assert max(relative_errors(g_one, g_two).values()) > 1e-3


def test_bad_images_are_refused_by_name():
    model = llava()
    seqs, weights, pixels, images_of = group()
    feats = vision.encode(model, pixels)
    with pytest.raises(UserError, match=r"^sequences\[0\]: 16 image placeholder tokens, but its images \[0, 1\]"):
        vision.place(seqs, IMAGE, feats, [[0, 1]] + images_of[1:])
    images = vision.place(seqs, IMAGE, feats, images_of)
    images.rows[2] = images.rows[2][:-1]
    with pytest.raises(UserError, match=r"^images.rows\[2\]: expected an integer tensor of sequences\[2\]'s shape"):
        stream_backward(model, seqs, weights, images=images)
    images = vision.place(seqs, IMAGE, feats, images_of)
    images.rows[1][5] = 10_000
    with pytest.raises(UserError, match=r"^images.rows\[1\]: a row outside \[-1, 32\)"):
        reference_backward(model, seqs, weights, images=images)


def qwen_group(g):
    """A Qwen-VL prompt (text, vision start, 4 image placeholders, vision end, text) with G = 4 responses,
    loss on the responses only."""
    ids = lambda n: torch.randint(5, 250, (n,), generator=g)  # noqa: E731
    prompt = torch.cat([ids(5), torch.tensor([Q_START]), torch.full((4,), Q_IMAGE), torch.tensor([Q_END]), ids(4)])
    seqs = [torch.cat([prompt, ids(n)]) for n in (7, 12, 3, 9)]
    weights = []
    for s in seqs:
        w = torch.randn(len(s), generator=g, dtype=torch.float64)
        w[: len(prompt)] = 0
        weights.append(w)
    return seqs, weights


def test_mrope_positions_streamed_exactly_against_the_models_own_forward():
    """Qwen2-VL: the positions are the model's own `get_rope_index` (text after the image continues at
    its max + 1); the stream with them equals the model's own forward from pixels at blocks 1, 3, 16."""
    model = qwen2_vl()
    g = torch.Generator().manual_seed(0)
    seqs, weights = qwen_group(g)
    pixels = torch.randn(16, 3 * 2 * 14 * 14, generator=g, dtype=torch.float64)
    with keep_float64():
        kinds = [(s == Q_IMAGE).int()[None] for s in seqs]
        positions = [model.model.get_rope_index(s[None], mm_token_type_ids=k, image_grid_thw=Q_THW)[0][:, 0]
                     for s, k in zip(seqs, kinds)]
        assert positions[0][:, -1].tolist() == [len(seqs[0]) - 3] * 3  # 4 image tokens span 2 positions
        model.zero_grad(set_to_none=True)
        total = 0
        for s, w, k in zip(seqs, weights, kinds):
            logits = model(input_ids=s[None], pixel_values=pixels, image_grid_thw=Q_THW, mm_token_type_ids=k).logits
            total = total + (logits[0, :-1].log_softmax(-1).gather(-1, s[1:, None])[:, 0] * w[1:]).sum()
        total.backward()
        own = grads(model)
        assert any("visual" in n for n in own)
        for block in (1, 3, 16):
            model.zero_grad(set_to_none=True)
            feats = vision.encode(model, pixels, image_grid_thw=Q_THW)
            stream_backward(model, seqs, weights, block_size=block,
                            images=vision.place(seqs, Q_IMAGE, feats, [[0]] * 4, positions=positions))
            g_stream = grads(model)
            assert g_stream.keys() == own.keys()
            for n, err in relative_errors(g_stream, own).items():
                assert err <= 1e-10, f"block {block}: {n}: {err:.3g}"
    bad = [p.clone() for p in positions]
    bad[1][0, 3] += 1  # sequence 1 disagrees with the others inside the shared prompt
    with pytest.raises(UserError, match=r"^images.positions\[1\]: differs from another sequence's"):
        stream_backward(model, seqs, weights, images=vision.place(seqs, Q_IMAGE, feats, [[0]] * 4, positions=bad))


@pytest.mark.parametrize("tower", ["trained", "frozen"])
def test_deepstack_streamed_exactly_against_the_models_own_forward(tower):
    """Qwen3-VL: the tower's deepstack features go into the hidden states after decoder layers 0 and 1
    at the image positions; the stream (through `images_for`, the tower run once) equals the model's own
    forward from pixels at blocks 1, 3, 16, the tower's gradient included, and the same rows without
    their deepstack levels do not (the check can fail)."""
    model = qwen3_vl()
    if tower == "frozen":
        model.model.visual.requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    seqs, weights = qwen_group(g)
    pic = vision.Picture("p", {"pixel_values": torch.randn(16, 3 * 2 * 16 * 16, generator=g, dtype=torch.float64),
                               "image_grid_thw": Q3_THW}, 4)
    with keep_float64():
        model.zero_grad(set_to_none=True)
        total = 0
        for s, w in zip(seqs, weights):
            logits = model(input_ids=s[None], **pic.inputs, mm_token_type_ids=(s == Q_IMAGE).int()[None]).logits
            total = total + (logits[0, :-1].log_softmax(-1).gather(-1, s[1:, None])[:, 0] * w[1:]).sum()
        total.backward()
        own = grads(model)
        assert any("visual.deepstack_merger_list.1" in n for n in own) == (tower == "trained")
        calls = []
        handle = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
        for block in (1, 3, 16):
            model.zero_grad(set_to_none=True)
            calls.clear()
            images = vision.images_for(model, seqs, [[pic.fresh()]] * 4, grad=tower == "trained")
            assert len(images.deep) == 2 and images.deep[0].shape == (4, 32)
            stream_backward(model, seqs, weights, block_size=block, images=images)
            assert len(calls) == 1
            g_stream = grads(model)
            assert g_stream.keys() == own.keys()
            for n, err in relative_errors(g_stream, own).items():
                assert err <= 1e-10, f"block {block}: {n}: {err:.3g}"
        handle.remove()
        model.zero_grad(set_to_none=True)
        images = vision.images_for(model, seqs, [[pic.fresh()]] * 4, grad=tower == "trained")
        images.deep = []
        stream_backward(model, seqs, weights, block_size=3, images=images)
        assert max(relative_errors(grads(model), own).values()) > 1e-3
    feats, deep = vision.tower(model, pic.inputs["pixel_values"], image_grid_thw=Q3_THW)
    with pytest.raises(Unsupported, match=r"deepstack features .* vision.tower and pass place\(deep=\)"):
        vision.encode(model, pic.inputs["pixel_values"], image_grid_thw=Q3_THW)
    with pytest.raises(UserError, match=r"^deep: expected one \[levels, n_k, H\] tensor per image"):
        vision.place(seqs, Q_IMAGE, feats, [[0]] * 4, deep=[deep[0][:, :2]])


# -- `verify` with an image on transformers' own families (scripts/verify_vlm_families.py sweeps them all)


@pytest.mark.parametrize("model_type, frozen", [
    ("qwen2_5_vl", False),  # windowed tower attention: window_size kept a multiple of patch × merge
    ("qwen3_5", False),  # hybrid linear-attention decoder, M-RoPE
    ("idefics3", False),  # a batch of one image [1, 1, C, S, S], pixel shuffle
    ("internvl", True),  # [height, width] image and patch sizes; the tower frozen
    ("lfm2_vl", False),  # a SigLIP-2 NaFlex tower: flattened patches, spatial_shapes
    ("qwen3_vl", False),  # deepstack: the tower's features added again after the first decoder layers
])
def test_verify_with_an_image_is_exact(model_type, frozen):
    rep = verify(model_type, images=True, freeze_vision=frozen)
    assert rep.kind is Verdict.EXACT, rep.verdict
    assert rep.image_tokens and rep.image_forward_error is not None and rep.image_forward_error <= 1e-10
    assert rep.tower_trained is (not frozen)
    assert ("tower frozen" if frozen else "tower trained") in str(rep)


@pytest.mark.parametrize("model_type, reason", [
    ("gemma3", r"image tokens attend to each other both ways"),  # its bidirectional mask over each image
])
def test_verify_refuses_a_family_that_uses_the_image_beyond_the_contract(model_type, reason):
    rep = verify(model_type, images=True)
    assert rep.kind is Verdict.REFUSED and rep.reason.startswith("model: ")
    assert re.search(reason, rep.reason), rep.reason

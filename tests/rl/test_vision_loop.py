"""Images through the RL loop's own parts (issue 53), in float64 on the LLaVA, Qwen2-VL and Qwen3-VL
(deepstack) miniatures: the local sampler prefills a group's prompt with its image once, at the family's
positions, and its log-probs equal the learner's (the streamed engine's) on the same sequences; each
distinct image is encoded once a round (the learner reuses a frozen tower's embeddings); the engine
wrappers of the trainer (rl/update/backward.py) give the same gradient streamed and by the reference,
the tower frozen and trained; a sampled placeholder id is a token, not an image."""

import pytest
import torch
from helpers import relative_errors
from vlm_miniatures import IMAGE, N_IMG, Q_END, Q_IMAGE, Q_START, llava, qwen2_vl, qwen3_vl

from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local import decode as D
from backstream.rl.backends.local.generate import generate
from backstream.rl.update.backward import EngineConfig
from backstream.rl.update.losses import build_objective
from backstream.stream import vision
from backstream.stream.engine import logprobs
from backstream.stream.miniature import keep_float64

FAMILIES = {"llava": llava, "qwen2_vl": qwen2_vl, "qwen3_vl": qwen3_vl}  # qwen3_vl: deepstack


def picture(family: str, seed: int) -> vision.Picture:
    g = torch.Generator().manual_seed(seed)
    if family != "llava":  # 16 patches of 2 frames x 3 channels x 14 (Qwen2-VL) or 16 (Qwen3-VL) px squared
        width = 3 * 2 * (14 if family == "qwen2_vl" else 16) ** 2
        return vision.Picture(f"img{seed}", {"pixel_values": torch.randn(16, width, generator=g, dtype=torch.float64),
                                             "image_grid_thw": torch.tensor([[1, 4, 4]])}, 4)
    return vision.Picture(f"img{seed}", {"pixel_values": torch.randn(1, 3, 56, 56, generator=g, dtype=torch.float64)},
                          N_IMG)


def prompts_of(family: str) -> list[torch.Tensor]:
    """Two prompts of the same ids around an image (each gets another image)."""
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(5, 250, (n,), generator=g)  # noqa: E731
    img = (torch.cat([torch.tensor([Q_START]), torch.full((4,), Q_IMAGE), torch.tensor([Q_END])])
           if family != "llava" else torch.full((N_IMG,), IMAGE))
    p = torch.cat([ids(5), img, ids(4)])
    return [p, p.clone()]


def sample(model, family, G=3, new=6, **kw):
    prompts = prompts_of(family)
    pics = [[picture(family, 1)], [picture(family, 2)]]
    with keep_float64():
        out = generate(model, prompts, SamplingParams(max_new_tokens=new, temperature=1.0), group_size=G,
                       eos_token_id=None, generator=torch.Generator().manual_seed(1), pictures=pics, **kw)
    seqs = [torch.cat([prompts[j // G], torch.tensor(c.ids)]) for j, c in enumerate(out)]
    return out, seqs, [pics[j // G] for j in range(len(out))], pics


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_sampler_prefills_an_image_once_and_agrees_with_the_learner(family):
    model = FAMILIES[family]()
    calls = []
    tower = model.model.vision_tower if family == "llava" else model.model.visual
    hook = tower.register_forward_hook(lambda *a: calls.append(1))
    out, seqs, rows, pics = sample(model, family)
    assert len(calls) == 1 and [p.calls for ps in pics for p in ps] == [1, 1]  # both images, one forward
    with keep_float64():
        lp = logprobs(model, seqs, images=vision.images_for(model, seqs, rows, grad=False))
    hook.remove()
    assert len(calls) == 1  # the learner's log-probs reused the frozen tower's embeddings of the round
    P = len(prompts_of(family)[0])
    worst = max(float((lp[j][P:] - c.logprobs).abs().max()) for j, c in enumerate(out))
    assert worst <= 1e-12
    # the two groups' prompts have the same ids and other images: they sampled differently
    assert [c.ids for c in out[:3]] != [c.ids for c in out[3:]]


def test_text_after_an_image_continues_at_the_images_max_plus_one():
    """Qwen2-VL's decode positions: with the shift dropped (text continuing at the prompt's length), the
    sampler's log-probs leave the learner's."""
    model = qwen2_vl()
    real = D.decode

    def unshifted(*a, **kw):
        kw["shift"] = None
        return real(*a, **kw)

    D.decode = unshifted
    import backstream.rl.backends.local.generate as gen
    gen.decode = unshifted
    try:
        out, seqs, rows, _ = sample(model, "qwen2_vl")
    finally:
        D.decode = gen.decode = real
    with keep_float64():
        lp = logprobs(model, seqs, images=vision.images_for(model, seqs, rows, grad=False))
    P = len(prompts_of("qwen2_vl")[0])
    assert max(float((lp[j][P:] - c.logprobs).abs().max()) for j, c in enumerate(out)) > 1e-6


def test_a_sampled_placeholder_id_is_a_token():
    """A completion that holds the image token's id: the learner places the image at the prompt's
    placeholders only, and agrees with the sampler (which fed the sampled id as a token)."""
    model = llava()
    with torch.no_grad(), keep_float64():  # the placeholder's logit along the final hidden states: sampled often
        h = model(input_ids=prompts_of("llava")[0][None], output_hidden_states=True).hidden_states[-1][0]
        h = model.model.language_model.norm(h).mean(0)
        model.lm_head.weight[IMAGE] = 200 * h / h.norm() ** 2
    out, seqs, rows, _ = sample(model, "llava", new=3)
    assert sum(c.ids.count(IMAGE) for c in out) >= 3
    with keep_float64():
        lp = logprobs(model, seqs, images=vision.images_for(model, seqs, rows, grad=False))
    P = len(prompts_of("llava")[0])
    assert max(float((lp[j][P:] - c.logprobs).abs().max()) for j, c in enumerate(out)) <= 1e-12


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tower", ["frozen", "trained"])
def test_the_trainers_engines_agree_with_images(family, tower):
    """The trainer's two backwards (engine.backward = stream / reference) on a sampled round: the same
    gradient to 1e-10 (float64), the tower's included when it trains; a trained tower is encoded once per
    backward, a frozen one not at all (the round's embeddings)."""
    model = FAMILIES[family]()
    if tower == "frozen":
        for n, p in model.named_parameters():
            if not n.startswith("model.language_model") and not n.startswith("lm_head"):
                p.requires_grad_(False)
    out, seqs, rows, pics = sample(model, family, G=4)
    assert vision.tower_trains(model) == (tower == "trained")
    mask = [torch.arange(len(s)) >= len(prompts_of(family)[0]) for s in seqs]
    adv = torch.randn(len(seqs), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = {}
    for kind, block in (("reference", 0), ("stream", 3), ("stream", 16)):
        engine = EngineConfig(backward=kind, block_size=block).build(torch.device("cpu"))
        for ps in pics:
            ps[0].calls = 0
        model.zero_grad(set_to_none=True)
        obj = build_objective(_loss(), sequences=seqs, completion_mask=mask, advantages=adv)
        with keep_float64():
            engine.backward(model, seqs, obj, kv=None, pictures=rows)
        result[(kind, block)] = grads(model)
        assert [ps[0].calls for ps in pics] == ([1, 1] if tower == "trained" else [0, 0])
    ref = result[("reference", 0)]
    assert any(not n.startswith("model.language_model") and n != "lm_head.weight" for n in ref) == (tower == "trained")
    for key in (("stream", 3), ("stream", 16)):
        assert result[key].keys() == ref.keys()
        for n, err in relative_errors(result[key], ref).items():
            assert err <= 1e-10, f"{key}: {n}: {err:.3g}"


def _loss():
    from backstream.rl.update.losses import PPOClipConfig

    return PPOClipConfig()


def test_vision_metrics_count_each_image_once():
    pics = [picture("llava", 1), picture("llava", 2)]
    pics[0].calls, pics[1].calls = 2, 1
    rows = [[pics[0]]] * 8 + [[pics[1]]] * 8
    assert vision.vision_metrics(rows) == {"vision/images": 2.0, "vision/encoder_calls": 3.0,
                                           "vision/image_tokens": 2.0 * N_IMG}

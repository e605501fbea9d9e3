"""Images in episodes (issue 54, docs/vision.md "Images in episodes"), on the shipped tiny VLM (a Qwen2-VL:
M-RoPE, 16 image tokens a screen) in float64: tools return screenshots (alone, beside text, or broken) and a
text environment answers with one; the in-process sampler feeds each image's rows at its placeholders,
each distinct image encoded once a round; an episode's sampled log-probs are the model's own forward
from pixels; the streamed backward of the episodes (the tower trained and frozen) equals the reference;
a placeholder id the policy sampled before a later image is a token (the episode's image mask).

Turns are scripted (helpers.ScriptedBackend): the tokens are forced, the model computes every log-prob."""

import helpers
import pytest
import torch
from helpers import OPEN_ENVIRONMENTS, backend_for, info, relative_errors, text

from backstream import reference_backward, stream_backward
from backstream.rl.agent.env import EnvConfig, EnvError, Environment
from backstream.rl.backends.base import SamplingParams
from backstream.rl.data.images import Pictures
from backstream.rl.rollout.episodes import EpisodeSampler
from backstream.stream import vision
from backstream.stream.engine import logprobs
from backstream.stream.hf import base_model
from backstream.stream.miniature import exact_norms, keep_float64
from backstream.tiny_vlm import load_tiny_vlm

IMAGE = 101  # the tiny VLM's <|image_pad|>
N = 16  # a 56 x 56 screen in 7-pixel patches, merged 2 x 2
SCREEN = "<|vision_start|>" + "<|image_pad|>" * N + "<|vision_end|>"


def vlm():
    model, processor = load_tiny_vlm(torch.float64)
    return exact_norms(model).eval(), processor


def vlm_sampler(model, processor, env: str, G: int = 3, max_new: int = 24, vision_on: bool = True):
    tok = processor.tokenizer
    env_cfg = EnvConfig(factory=env, images=True, format="plain", max_turns=6)
    environment = Environment.load(env_cfg)
    OPEN_ENVIRONMENTS.append(environment)
    config = SamplingParams(max_new_tokens=max_new)
    pics = Pictures(processor, vision.image_token(model), base_model(model).config) if vision_on else None
    return EpisodeSampler(config, G, env_cfg, environment, tok, [tok.eos_token_id], False, 512,
                          backend_for(config, tok), vision=pics)


def sample(s, model, rows):
    with keep_float64():  # the sampler in float64 throughout (HF's float32 rotary upcast patched away)
        return helpers.sample(s, model, rows)


def own_logprobs(model, seq: torch.Tensor, pictures: list) -> torch.Tensor:
    """The model's own forward from pixels over one episode (every placeholder an image)."""
    inputs = {k: torch.cat([p.inputs[k] for p in pictures]) for k in pictures[0].inputs}
    with torch.no_grad(), keep_float64():
        logits = model(input_ids=seq[None], **inputs, mm_token_type_ids=(seq == IMAGE).int()[None]).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, seq[1:, None])[:, 0]


@pytest.fixture(scope="module")
def tiny_vlm():
    return vlm()


def test_screenshots_from_tools_are_fed_once_and_are_the_models_own_forward(script, tiny_vlm):
    model, processor = tiny_vlm
    tok = processor.tokenizer
    script([["[look 1]<eos>", "[look 2]<eos>", "3<eos>"],
            ["[look 1]<eos>", "[peek 5]<eos>", "[broken 0]<eos>", "2<eos>"],
            ["[look 1]<eos>", "1<eos>"]])
    s = vlm_sampler(model, processor, "envs_for_tests:Screens")
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    r = sample(s, model, [{"prompt": "how many?"}])
    hook.remove()
    assert text(tok, r, 0) == f"how many?[look 1]<eos>\n={SCREEN}\n[look 2]<eos>\n={SCREEN}\n3<eos>"
    assert f"[peek 5]<eos>\n={SCREEN}screen 5\n[broken 0]<eos>\n=error: broken returned an image that cannot be " \
           "read (" in text(tok, r, 1)
    assert info(r, "tool_errors") == [0, 1, 0] and info(r, "tool_calls") == [2, 3, 1]
    # screen 1 (all three episodes), 2 and 5: three distinct images, each encoded once by the sampler
    assert [len(ps) for ps in r.pictures] == [2, 2, 1]
    assert r.pictures[0][0] is r.pictures[1][0] is r.pictures[2][0]
    assert len(calls) == 3 and s.metrics(r)["vision/images"] == 3.0 and s.metrics(r)["vision/encoder_calls"] == 3.0
    assert s.metrics(r)["vision/image_tokens"] == 3 * N
    for seq, m, lp, ps, ep in zip(r.sequences(), r.completion_mask(), r.aligned_logprobs(), r.pictures, r.episodes):
        assert seq.tolist() == ep.fed + seq[-1:].tolist()  # fidelity: what the sampler fed, in order
        assert int(ps.at.sum()) == N * len(ps) == int((seq == IMAGE).sum())
        torch.testing.assert_close(lp[m], own_logprobs(model, seq, ps)[m[1:]], atol=1e-12, rtol=0)


@pytest.mark.parametrize("tower", ["trained", "frozen"])
def test_screenshot_episodes_stream_exactly(script, tiny_vlm, tower):
    """The three episodes on one tree (the prompt, the shared first turn and screen 1 held once): the
    streamed gradient equals the reference's, the tower's included when it trains, at blocks 1 and 5."""
    model, processor = tiny_vlm
    script([["[look 1]<eos>", "[look 2]<eos>", "3<eos>"], ["[look 1]<eos>", "[peek 5]<eos>", "2<eos>"],
            ["[look 1]<eos>", "1<eos>"]])
    r = sample(vlm_sampler(model, processor, "envs_for_tests:Screens"), model, [{"prompt": "how many?"}])
    model.model.visual.requires_grad_(tower == "trained")
    try:
        seqs, mask = r.sequences(), r.completion_mask()
        adv = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
        w = [m.double() * a / 10 for m, a in zip(mask, adv)]

        def grads(fn, **kw):
            model.zero_grad(set_to_none=True)
            with keep_float64():
                images = vision.images_for(model, seqs, [vision.Placed([p.fresh() for p in ps], ps.at)
                                                         for ps in r.pictures], grad=tower == "trained")
                res = fn(model, seqs, w, images=images, **kw)
            return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, res

        ref, _ = grads(reference_backward)
        assert any("visual" in n for n in ref) == (tower == "trained")
        for block in (1, 5):
            g, res = grads(stream_backward, block_size=block)
            assert g.keys() == ref.keys()
            for n, err in relative_errors(g, ref).items():
                assert err <= 1e-10, f"block {block}: {n}: {err:.3g}"
        # the tree holds the prompt, "[look 1]<eos>" and screen 1's result once for the three episodes
        assert res.stats.tree_tokens <= sum(len(x) - 1 for x in seqs) - 2 * (len(r.prompt_ids[0]) + N)
    finally:
        model.model.visual.requires_grad_(True)


def test_a_sampled_placeholder_before_a_later_screenshot_is_a_token(script, tiny_vlm):
    """A text environment answers each turn with a screenshot; the policy's first turn holds the image
    token's id. The episode's image mask places the images after it: the learner agrees with the
    sampler; taking the first placeholders instead (no mask) would not."""
    model, processor = tiny_vlm
    script([["a<|image_pad|>b<eos>", "c<eos>", "d<eos>"]])
    r = sample(vlm_sampler(model, processor, "envs_for_tests:ScreensTalk", G=1), model, [{"prompt": "go"}])
    seq, ps = r.sequences()[0], r.pictures[0]
    assert int((seq == IMAGE).sum()) == 2 * N + 1 and int(ps.at.sum()) == 2 * N and info(r, "turns") == [3]
    mask, lp_s = r.completion_mask()[0], r.aligned_logprobs()[0]
    with keep_float64():
        lp = logprobs(model, [seq], images=vision.images_for(model, [seq], [ps], grad=False))[0]
        assert float((lp[mask] - lp_s[mask]).abs().max()) <= 1e-12
        try:  # the first 2N placeholders: the images shifted by one, or a third image span for M-RoPE
            first = logprobs(model, [seq], images=vision.images_for(model, [seq], [list(ps)], grad=False))[0]
            wrong = float((first[mask] - lp_s[mask]).abs().max()) > 1e-6
        except StopIteration:  # Qwen's get_rope_index: more image spans than grids
            wrong = True
        assert wrong


def test_an_image_for_a_text_policy_stops_the_step_by_name(script, tiny_vlm):
    model, processor = tiny_vlm
    script([["[look 1]<eos>", "1<eos>"]])
    s = vlm_sampler(model, processor, "envs_for_tests:Screens", G=1, vision_on=False)
    with pytest.raises(EnvError, match=r"the tool look returned an image, but the policy is a text model; set "
                                       r"env.images = true"):
        sample(s, model, [{"prompt": "how many?"}])


def test_trainer_with_screenshot_episodes_stream_equals_reference(tmp_path):
    """env.images: the tiny VLM trains through episodes whose every user turn is a screenshot
    (ScreensTalk), the tower trained; the streamed and the reference engine make the same update
    (float64), each screen encoded at most twice a step (the sampler's, and the learner's for the
    tower's graph), the tree shares the group's prompt."""
    import json
    import os

    from helpers import rel, run_cfg, weights

    from backstream import trainer

    results = {}
    for backward in ("stream", "reference"):
        model, processor = vlm()
        with keep_float64():  # (HF's float32 rotary upcast patched away, as in every float64 comparison)
            run = trainer.train(run_cfg(tmp_path, backward, 'env.factory="envs_for_tests:ScreensTalk"',
                                        "env.images=true", 'env.format="chat"', "env.max_turns=3",
                                        f'engine.backward="{backward}"',
                                        "train.steps=2", "rollout.group_size=4", "model.freeze_vision=false",
                                        "reward.functions=['rewards_for_tests:hash_turns']"),
                                model=model, tokenizer=processor)
        results[backward] = weights(model)
        rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
        for row in rows:
            assert row["vision/images"] >= 2 and row["vision/encoder_calls"] <= 2 * row["vision/images"]
            assert row["episode/turns/mean"] == 3
            if backward == "stream":  # (the reference counts every sequence's tokens)
                assert row["tree/tokens_unique"] < row["tree/tokens_total"]
    assert rel(results["stream"], vlm()[0].state_dict()) > 1e-6
    assert rel(results["stream"], results["reference"]) <= 1e-10


# -- agent programs: screenshots as image_url parts through the run's endpoint -------------------------


def agent_sampler(model, processor, agent: str, G: int = 2):
    from backstream.rl.backends.local.backend import LocalBackend
    from backstream.rl.rollout.programs import AgentSampler

    tok = processor.tokenizer
    config = SamplingParams(max_new_tokens=4)
    backend = LocalBackend(config, [tok.eos_token_id], tok)
    backend.weights.sync(model, 0)
    backend.reuse_min = 1
    pics = Pictures(processor, vision.image_token(model), base_model(model).config)
    return AgentSampler(config, G, EnvConfig(agent=agent, format="chat", images=True), tok, [tok.eos_token_id], 512,
                        backend, vision=pics), backend


def test_an_agent_programs_screenshots_train_and_a_resent_one_is_shared(tiny_vlm, monkeypatch):
    """Two episodes of an agent that sends screenshots as data URLs and then rewrites its history (screen
    1 re-sent, screen 3 instead of 2): every trained sequence's sampled log-probs equal the model's own
    forward from pixels; the re-sent screen is one picture, encoded once for the round with the others
    (3 distinct screens); the rewritten history is a branch."""
    from backstream.rl.backends.local.backend import LocalBackend

    model, processor = tiny_vlm
    answer = LocalBackend._answer

    def in_float64(self, *a, **kw):  # the requests decode in the endpoint's threads: keep_float64 (a
        with keep_float64():  # thread-local torch function mode) on there too
            return answer(self, *a, **kw)

    monkeypatch.setattr(LocalBackend, "_answer", in_float64)
    sampler, backend = agent_sampler(model, processor, "agents_for_tests:screenshot_agent")
    try:
        with keep_float64():
            r = sampler.sample([{"prompt": "look"}], [0], [torch.Generator().manual_seed(2)]).samples
    finally:
        sampler.close()
    assert all(e.turns == 3 and e.branches == 1 for e in r.episodes) and backend.reused > 0
    view = r.training(0)
    assert len(view.seqs) == 4 and len(view.pictures) == 4  # each episode: its last history and one fork
    m = sampler.metrics(r)
    assert m["vision/images"] == 3.0 and m["vision/encoder_calls"] == 3.0 and m["vision/image_tokens"] == 3 * N
    firsts = {id(ps[0]) for ps in view.pictures}
    assert len(firsts) == 1  # screen 1, in every sequence, one object
    for seq, mask, lp, ps in zip(view.seqs, view.mask, view.logprobs, view.pictures):
        assert int(ps.at.sum()) == N * len(ps) == int((seq == IMAGE).sum())
        torch.testing.assert_close(lp[mask], own_logprobs(model, seq, ps)[mask[1:]], atol=1e-12, rtol=0)
    with keep_float64():
        images = vision.images_for(model, view.seqs, view.pictures, grad=False)
        w = [mk.double() / 10 for mk in view.mask]
        res = stream_backward(model, view.seqs, w, images=images, block_size=4)
    assert res.stats.tree_tokens < sum(len(s) - 1 for s in view.seqs) - 3 * (N + 2)


def test_an_http_image_url_is_refused_naming_the_part(tiny_vlm):
    import agents_for_tests

    model, processor = tiny_vlm
    agents_for_tests.REFUSED.clear()
    sampler, _ = agent_sampler(model, processor, "agents_for_tests:network_image_agent", G=1)
    try:
        sampler.sample([{"prompt": "look"}], [0], [torch.Generator().manual_seed(0)])
    finally:
        sampler.close()
    (status, body), = agents_for_tests.REFUSED
    assert status == 400 and body["param"] == "messages[0].content[1]"
    assert "is on the network, and a run fetches nothing" in body["message"]

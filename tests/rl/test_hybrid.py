"""A hybrid model (issue 39) through the RL loop: the local sampler decodes a tiny Qwen3.5 (two Gated
DeltaNet layers and one attention layer, the default model's tokenizer), single-turn and in episodes, with
every sampled token's log-prob equal to the learner's full forward in float64; a prompt's states are
computed once for its G rows; `backstream train` runs it with the streamed engine and with the reference,
on arith and on toolcalc episodes."""

import pytest
import torch
from helpers import REPO, episode_sampler, rel, run_cfg, sample, text, tiny_hybrid, tiny_mamba1, weights

from backstream import config, trainer
from backstream.checks import UserError
from backstream.rl.agent.env import EnvConfig
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local.decode import shares
from backstream.rl.backends.local.generate import generate
from backstream.rl.records import Samples
from backstream.stream.adapter import probe_layout
from backstream.stream.miniature import keep_float64


def learner_logprobs(model, seq: torch.Tensor) -> torch.Tensor:
    """log π(x_t | x_<t) for t ≥ 1 from one full forward without a cache: the learner's (the reference's)."""
    with torch.no_grad():
        logits = model(input_ids=seq[None], use_cache=False).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, seq[1:, None])[:, 0]


def test_sampler_logprobs_are_the_learners_float64():
    """Prompts of different lengths (their K/V left-padded in one decode batch, their states not), G = 3
    rows each, rows that finish at different steps: every sampled token's log-prob is the full
    forward's, to 1e-12."""
    model, tok = tiny_hybrid()
    prompts = [torch.tensor(tok("12+34=")["input_ids"]), torch.tensor(tok("7+8+91=")["input_ids"])]
    gen = torch.Generator().manual_seed(0)
    with keep_float64():
        # a fifth of the vocabulary ends a row: rows end at different steps and leave the batch
        out = generate(model, prompts, SamplingParams(max_new_tokens=12, temperature=1.0),
                       eos_token_id=list(range(10, 30)), generator=gen, group_size=3)
        r = Samples.of_groups([0, 1], prompts, out, 3)
        assert len(set(map(len, r.completion_ids))) > 1  # rows ended at different steps
        for seq, m, lp in zip(r.sequences(), r.completion_mask(), r.aligned_logprobs()):
            ref = learner_logprobs(model, seq)
            torch.testing.assert_close(lp[m], ref[m[1:]], atol=1e-12, rtol=0)


def test_a_prompts_states_are_computed_once_for_its_group():
    """G rows of a prompt: the prompt is forwarded once (one prefill per distinct prompt), then every
    decode step forwards one token per row."""
    model, tok = tiny_hybrid(torch.float32)
    prompts = [torch.tensor(tok("12+34=")["input_ids"]), torch.tensor(tok("5+6=")["input_ids"])]
    probe_layout(model)  # its once-per-model probe forwards, before counting
    shares(model)
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    generate(model, prompts, SamplingParams(max_new_tokens=5), eos_token_id=None,
             generator=torch.Generator().manual_seed(0), group_size=4)
    handle.remove()
    prefills = [s for s in seen if s[1] > 1]
    assert sorted(prefills) == [(1, len(prompts[1])), (1, len(prompts[0]))]
    assert all(s == (8, 1) for s in seen if s[1] == 1)


def test_episodes_on_a_hybrid_float64(script):
    """Multi-turn episodes (tool calls, results inserted) on the hybrid: each turn continues the episode's
    states and K/V (a prefill of its new tokens only), the sequence is bitwise what was fed, and every
    sampled token's log-prob is the full forward's."""
    model, tok = tiny_hybrid()
    script([["[add 12 34]<eos>", "46<eos>"], ["[add 1 2]<eos>", "[add 3 4]<eos>", "7<eos>"], ["46<eos>"],
            ["[add 100 200]<eos>", "300<eos>"]])
    s = episode_sampler(tok, SamplingParams(max_new_tokens=40), EnvConfig(factory="envs_for_tests:Calc"), group_size=2)
    with keep_float64():
        r = sample(s, model, [{"prompt": "12+34=", "answer": "46"}, {"prompt": "1+2+4=", "answer": "7"}])
        assert [e.turns for e in r.episodes] == [2, 3, 1, 2]
        assert text(tok, r, 1).startswith("12+34=[add 1 2]<eos>\n=3\n[add 3 4]<eos>\n=7\n7<eos>")
        for i, (seq, m, lp) in enumerate(zip(r.sequences(), r.completion_mask(), r.aligned_logprobs())):
            assert seq.tolist() == r.episodes[i].fed + seq[-1:].tolist()
            torch.testing.assert_close(lp[m], learner_logprobs(model, seq)[m[1:]], atol=1e-12, rtol=0)


def test_rollout_kv_refused_for_a_hybrid(tmp_path):
    model, tok = tiny_hybrid()
    with pytest.raises(UserError, match=r"^return_kv: .*keeps recurrent or convolution state"):
        generate(model, [torch.tensor([5, 6, 7])], SamplingParams(max_new_tokens=3), eos_token_id=None,
                 return_kv=True, group_size=2)
    cfg = run_cfg(tmp_path, "run", "engine.reuse_rollout_kv=true")
    with pytest.raises(UserError, match=r"^engine.reuse_rollout_kv: Qwen3_5ForCausalLM keeps recurrent or convolution "
                                        r"state in layers \[0, 1\]"):
        trainer.train(cfg, model=model, tokenizer=tok)


@pytest.mark.slow
def test_train_a_hybrid_streamed_and_reference_agree_float64(tmp_path):
    """`backstream train` on the hybrid, arith, 3 steps: the streamed engine and the reference give the
    same weights (float64, under keep_float64: the Gated DeltaNet kernels' own float32 would add 1e-7)."""
    results = {}
    for backward in ("stream", "reference"):
        model, tok = tiny_hybrid()
        with keep_float64():
            trainer.train(run_cfg(tmp_path, backward, f'engine.backward="{backward}"', "engine.block_size=3",
                                  "reward.functions=['rewards_for_tests:count_digits']"), model=model, tokenizer=tok)
        results[backward] = weights(model)
    assert rel(results["stream"], weights(tiny_hybrid()[0])) > 1e-4  # the runs did train
    assert rel(results["stream"], results["reference"]) <= 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("backward", ["stream", "reference"])
def test_train_a_hybrid_on_toolcalc_episodes(tmp_path, backward):
    """The built-in multi-turn task on the hybrid (float32), both engines: the run trains and logs its
    episodes' metrics."""
    model, tok = tiny_hybrid(torch.float32)
    start = weights(model)
    cfg = config.load(str(REPO / "examples/toolcalc_default.toml"), [
        f'engine.backward="{backward}"', "train.steps=2", "train.prompts_per_step=2", "rollout.group_size=4",
        "train.progress=false", "train.plots=false", "reward.functions=['rewards_for_tests:count_digits_any']",
        f'train.output_dir="{tmp_path / backward}"'])
    run = trainer.train(cfg, model=model, tokenizer=tok)
    assert rel(weights(model), start) > 0
    lines = (tmp_path / backward / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"episode/turns/mean"' in lines[-1] and run


# -- Mamba 1 layers (issue 55): Jamba, Mamba, Falcon-Mamba ---------------------------------------------

@pytest.mark.parametrize("model_type", ["jamba", pytest.param("mamba", marks=pytest.mark.slow),
                                        pytest.param("falcon_mamba", marks=pytest.mark.slow)])
def test_a_mamba1_sampler_is_the_learner_float64(script, model_type):
    """The local sampler on Mamba 1 layers: a group's prompt prefilled once, then one-token steps; and
    episodes, whose inserted tool results are multi-token forwards continued from the episode's state
    (transformers' own scan would start them from zero: stream/scan.py continues it). Every sampled
    token's log-prob is the full forward's, to 1e-12."""
    model, tok = tiny_mamba1(model_type)
    prompts = [torch.tensor(tok("12+34=")["input_ids"]), torch.tensor(tok("7+8+91=")["input_ids"])]
    with keep_float64():
        out = generate(model, prompts, SamplingParams(max_new_tokens=8, temperature=1.0),
                       eos_token_id=list(range(10, 30)), generator=torch.Generator().manual_seed(0), group_size=3)
        r = Samples.of_groups([0, 1], prompts, out, 3)
        for seq, m, lp in zip(r.sequences(), r.completion_mask(), r.aligned_logprobs()):
            torch.testing.assert_close(lp[m], learner_logprobs(model, seq)[m[1:]], atol=1e-12, rtol=0)
    script([["[add 12 34]<eos>", "46<eos>"], ["[add 1 2]<eos>", "[add 3 4]<eos>", "7<eos>"]])
    s = episode_sampler(tok, SamplingParams(max_new_tokens=40), EnvConfig(factory="envs_for_tests:Calc"), group_size=1)
    with keep_float64():
        r = sample(s, model, [{"prompt": "12+34=", "answer": "46"}, {"prompt": "1+2+4=", "answer": "7"}])
        assert [e.turns for e in r.episodes] == [2, 3]
        for i, (seq, m, lp) in enumerate(zip(r.sequences(), r.completion_mask(), r.aligned_logprobs())):
            assert seq.tolist() == r.episodes[i].fed + seq[-1:].tolist()
            torch.testing.assert_close(lp[m], learner_logprobs(model, seq)[m[1:]], atol=1e-12, rtol=0)


@pytest.mark.slow
def test_train_jamba_streamed_and_reference_agree_float64(tmp_path):
    """`backstream train` on a Jamba miniature (Mamba 1, attention and MoE layers), 3 steps, with the MoE
    load-balancing loss (the router contract): the streamed engine and the reference give the same
    weights and the same router loss."""
    import json
    import os

    results, logged = {}, {}
    for backward in ("stream", "reference"):
        model, tok = tiny_mamba1("jamba")
        with keep_float64():  # the scan's own float32 casts would add 1e-7
            cfg = run_cfg(tmp_path, backward, f'engine.backward="{backward}"', "engine.block_size=3",
                          "loss.router_aux_coef=0.5", "reward.functions=['rewards_for_tests:count_digits']")
            run = trainer.train(cfg, model=model, tokenizer=tok)
        results[backward] = weights(model)
        logged[backward] = [json.loads(x)["loss/router_aux"] for x in open(os.path.join(run, "metrics.jsonl"))]
    assert rel(results["stream"], weights(tiny_mamba1("jamba")[0])) > 1e-4  # the runs did train
    assert rel(results["stream"], results["reference"]) <= 1e-10
    assert len(logged["stream"]) == 3
    assert max(abs(a - b) for a, b in zip(logged["stream"], logged["reference"])) <= 1e-10

"""Multi-turn, tool-using episodes (issue 21, docs/design.md §6d): the environment contract (TRL's habit), the
limits and errors, token-level fidelity (an episode's sequence is bitwise what the sampler fed), the
episodes trained as one token tree (streamed = reference in float64, with the sampler's K/V too), the
three layouts of the same episodes giving the same gradient, and the trainer with environments.

The policy is a real tiny model; where a test needs particular turns (a well-formed call, say), its
sampling is scripted: the tokens are forced, the model still computes every log-prob and cache."""

import json
import os

import pytest
import torch
from helpers import CHAT_TEMPLATE, REPO, episode_sampler, info, rel, run_cfg, sample, sampler, text, tiny, weights

from backstream import reference_backward, stream_backward, trainer
from backstream.rl.agent.env import EnvConfig, EnvError
from backstream.rl.backends.base import SamplingParams
from backstream.stream.verify import relative_errors

# -- the environment contract ---------------------------------------------------------------------------


def test_tools_results_errors_and_rewards(script):
    """Public methods are tools (schemas from transformers); results, an unknown tool, a malformed
    call and a tool that raises come back as text the policy reads, counted; reward functions get the
    messages, the environments, the prompts and the columns, as TRL gives them."""
    model, tok = tiny(torch.float32)
    s = sampler(tok, G=2)
    assert [x["function"]["name"] for x in s.env.schemas] == ["add", "boom"]
    assert s.env.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    script([["[add 12 34]<eos>", "[boom 1]<eos>", "[nope 1]<eos>", "[add 1]<eos>", "46<eos>"],
            ["[add 1 2 ]<eos>", "3<eos>"]])
    r = sample(s, model, [{"prompt": "12+34=", "answer": "46"}])
    assert text(tok, r, 0) == ("12+34=[add 12 34]<eos>\n=46\n[boom 1]<eos>\n=error: boom raised RuntimeError: the tool "
                               "broke\n[nope 1]<eos>\n=error: unknown tool 'nope'; the tools are ['add', 'boom']\n"
                               "[add 1]<eos>\n=error: add takes 2 argument(s) (a, b), got 1\n46<eos>")
    assert (info(r, "turns"), info(r, "tool_calls"), info(r, "tool_errors"), r.finish_reason) == (
        [5, 2], [4, 1], [3, 0], ["eos", "eos"])
    # only sampled tokens carry a log-prob; inserted ones are context
    for c, m, lp in zip(r.completion_ids, r.sampled, r.logprobs):
        assert torch.isfinite(lp[m]).all() and torch.isnan(lp[~m]).all() and 0 < m.sum() < len(c)
    seen = {}

    def reward(completions, environments, prompts, answer, **kw):
        seen.update(completions=completions, environments=environments, prompts=prompts, answer=answer)
        return [float(c[-1]["content"] == a) for c, a in zip(completions, answer)]

    from backstream.rl.scoring.rewards import Rewards

    completions, prompts, extra = s.reward_inputs(r, [{"prompt": "12+34=", "answer": "46"}] * 2)
    total, _ = Rewards([(reward, 1.0), ("env", 0.5)])(completions, prompts, {"answer": ["46", "46"]}, **extra)
    assert total.tolist() == [1.0 + 0.5 * 1, 0.0 + 0.5 * 1]  # env: Calc.get_reward counts the calls that ran
    assert seen["prompts"] == ["12+34=", "12+34="] and seen["answer"] == ["46", "46"]
    assert seen["completions"][0][0] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}]}
    assert seen["completions"][0][1] == {"role": "tool", "name": "add", "content": "46"}
    assert seen["environments"][0] is not seen["environments"][1]  # one instance per episode


def test_a_text_environment_and_the_limits(script):
    """env_response(text) is the text environment's hook: its reply is the next user message, None ends the
    episode; env.max_turns and env.max_episode_tokens cut an episode (`episode/truncated`)."""
    model, tok = tiny(torch.float32)
    script([["a<eos>", "b<eos>", "c<eos>"], ["x<eos>", "y<eos>", "z<eos>"]])
    s = sampler(tok, "envs_for_tests:Game")
    assert s.env.schemas == [] and s.env.has_response
    r = sample(s, model, [{"prompt": "go"}])
    assert text(tok, r, 0) == "go?a<eos>\nmore 1\nb<eos>\nmore 2\nc<eos>" and info(r, "turns") == [3, 3]
    script([["a<eos>", "b<eos>"], ["x<eos>", "y<eos>"]])
    r = sample(sampler(tok, "envs_for_tests:Game", max_turns=2), model, [{"prompt": "go"}])
    assert r.finish_reason == ["turns", "turns"] and info(r, "turns") == [2, 2]
    assert s.metrics(r)["episode/truncated"] == 1.0
    script([["[add 1 2]<eos>"], ["[add 1 2]<eos>"]])
    r = sample(sampler(tok, max_episode_tokens=16), model, [{"prompt": "1+2="}])  # 14 tokens, the result 4 more
    assert r.finish_reason == ["length", "length"] and all(len(p) + len(c) <= 16 for p, c in
                                                            zip(r.prompt_ids, r.completion_ids))
    assert info(r, "tool_calls") == [0, 0] and [e.env.calls for e in r.episodes] == [0, 0]  # no room: not run
    script([["[add 1 2]" + "9" * 40]])  # a turn cut by rollout.max_new_tokens
    r = sample(sampler(tok, G=1, max_new=12), model, [{"prompt": "1+2="}])
    assert r.finish_reason == ["length"] and info(r, "turns") == [1]


def test_reset_that_raises_a_tool_that_hangs_and_reset_text(script):
    model, tok = tiny(torch.float32)
    with pytest.raises(EnvError, match=r"BadReset.reset raised on row 0 \(prompt 'p'\).*KeyError"):
        sample(sampler(tok, "envs_for_tests:BadReset"), model, [{"prompt": "p"}])
    script([["[wait 30]<eos>", "ok<eos>"]])
    s = sampler(tok, "envs_for_tests:Slow", G=1, tool_timeout_s=0.2)
    r = sample(s, model, [{"prompt": "p"}])
    # the timed-out tool's environment is discarded: the episode ends on the call, its result unseen
    assert text(tok, r, 0) == "p (slowly)[wait 30]<eos>" and info(r, "tool_errors") == [1]
    assert r.finish_reason == ["timeout"] and info(r, "timed_out") == [True] and r.episodes[0].env.discarded


def test_function_tools_beside_no_class(script):
    model, tok = tiny(torch.float32)
    s = episode_sampler(tok, SamplingParams(max_new_tokens=24),
                        EnvConfig(tools=["envs_for_tests:double"]), group_size=1)
    script([["[double 21]<eos>", "42<eos>"]])
    r = sample(s, model, [{"prompt": "2*21="}])
    assert text(tok, r, 0) == "2*21=[double 21]<eos>\n=42\n42<eos>" and info(r, "tool_calls") == [1]


# -- token-level fidelity ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["plain", "chat"])
def test_the_sequence_is_bitwise_what_the_sampler_fed(script, fmt):
    """Sampled tokens kept verbatim, only new tokens inserted: the episode's sequence is the tokens
    fed to the model in order plus the last one sampled, its K/V the sampler's cache over them; in
    the chat format the inserted tokens are the template's rendering of the tool message and the next
    turn's opening, cut at the end-of-turn token."""
    model, tok = tiny(torch.float32)
    if fmt == "chat":
        tok.chat_template = CHAT_TEMPLATE
        call = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 34}}</tool_call><eos>'
        script([[call, "46<eos>"], ["46<eos>"]])
    else:
        script([["[add 12 34]<eos>", "46<eos>"], ["46<eos>"]])
    s = sampler(tok, G=2, max_new=80, format=fmt)
    r = sample(s, model, [{"prompt": "12+34=", "answer": "46"}])
    for i in range(2):
        seq = torch.cat([r.prompt_ids[i], r.completion_ids[i]]).tolist()
        assert seq == r.episodes[i].fed + seq[-1:]
        assert all(k.shape[1] == len(seq) - 1 for k, _ in r.kv[i])
    if fmt == "chat":
        assert text(tok, r, 0) == ("<tools>add,boom</tools>\n<u>12+34=</u>\n<a>" + call + "\n<t>46</t>\n<a>46<eos>")
        assert info(r, "tool_calls") == [1, 0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here"))])
def test_a_round_of_turns_of_other_lengths_is_the_learners_forward(script, device):
    """The later turns of a step's episodes decode as one batch whatever their lengths (left-padded;
    an episode that answered leaves the batch): each sampled token's log-prob and each episode's K/V
    are those of one full forward over its sequence, in float64."""
    model, tok = tiny(torch.float64)
    model = model.to(device)
    script([["[add 12 34]<eos>", "46<eos>"], ["[add 1 2]<eos>", "[add 3 4]<eos>", "7<eos>"], ["46<eos>"],
            ["[add 100 200]<eos>", "300<eos>"]])
    s = sampler(tok, G=2, max_new=40)
    r = sample(s, model, [{"prompt": "12+34=", "answer": "46"}, {"prompt": "1+2+4=", "answer": "7"}])
    assert info(r, "turns") == [2, 3, 1, 2]
    for seq, m, lp, kv in zip(r.sequences(), r.completion_mask(), r.aligned_logprobs(), r.kv):
        with torch.no_grad():
            out = model(seq[None].to(device), use_cache=True)
        ref = out.logits[0, :-1].cpu().log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
        torch.testing.assert_close(lp[m], ref[m[1:]], atol=1e-12, rtol=0)
        for (k, v), layer in zip(kv, out.past_key_values.layers):
            torch.testing.assert_close(k, layer.keys[0, :, :-1], atol=1e-12, rtol=0)
            torch.testing.assert_close(v, layer.values[0, :, :-1], atol=1e-12, rtol=0)


# -- episodes on the token tree: exact ------------------------------------------------------------------


def _episodes(tok, model, script, G=3):
    script([["[add 12 34]<eos>", "46<eos>"], ["[add 12 34]<eos>", "47<eos>"], ["46<eos>"]])
    return sample(sampler(tok, G=G), model, [{"prompt": "12+34=", "answer": "46"}])


def test_streamed_equals_reference_on_episodes_and_with_the_samplers_kv(script):
    """Weights on the sampled tokens only, zero-weight tool tokens inside the sequences: the streamed
    backward (blocks of 1 and 3, the prompt and the shared first turn merged in the tree) equals the
    per-sequence reference in float64, and with the sampler's K/V (no prefill) too."""
    model, tok = tiny(torch.float64)
    r = _episodes(tok, model, script)
    seqs, mask = r.sequences(), r.completion_mask()
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    w = [m.double() * a / 10 for m, a in zip(mask, adv)]

    def grads(fn, **kw):
        model.zero_grad(set_to_none=True)
        fn(model, seqs, w, **kw)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(reference_backward)
    for kw in ({"block_size": 1}, {"block_size": 3}, {"block_size": 3, "kv": r.kv}):
        assert max(relative_errors(grads(stream_backward, **kw), ref).values()) <= 1e-10, kw


def test_the_three_layouts_give_the_same_gradient():
    """docs/design.md §6d: an episode as one sequence with weights on every sampled turn (the tree's layout,
    and TRL's one row per episode) equals the sum over turns of "the context up to turn k, loss on
    turn k" (the per-turn layout of verl, slime and AReaL), in float64."""
    model, tok = tiny(torch.float64)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(5, 90, (12,), generator=gen)
    eps, turn_spans = [], []
    for e in range(3):
        parts, spans, pos = [prompt], [], len(prompt)
        for k in range(3):
            turn = torch.randint(5, 90, (4 + e + k,), generator=gen)
            spans.append((pos, pos + len(turn)))
            parts.append(turn)
            pos += len(turn)
            if k < 2:
                tool = torch.randint(5, 90, (5,), generator=gen)
                parts.append(tool)
                pos += len(tool)
        eps.append(torch.cat(parts))
        turn_spans.append(spans)
    coef = torch.randn(3, 3, generator=gen, dtype=torch.float64)

    def weights_of(length, spans):
        w = torch.zeros(length, dtype=torch.float64)
        for (a, b), c in spans:
            w[a:b] = c
        return w

    def grads(fn, seqs, ws):
        model.zero_grad(set_to_none=True)
        fn(model, seqs, ws)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    rows = [weights_of(len(s), zip(sp, c)) for s, sp, c in zip(eps, turn_spans, coef)]
    tree = grads(stream_backward, eps, rows)
    per_row = grads(reference_backward, eps, rows)
    turn_seqs, turn_w = [], []
    for s, sp, c in zip(eps, turn_spans, coef):
        for (a, b), ck in zip(sp, c):
            turn_seqs.append(s[:b])
            turn_w.append(weights_of(b, [((a, b), ck)]))
    per_turn = grads(reference_backward, turn_seqs, turn_w)
    assert max(relative_errors(tree, per_row).values()) <= 1e-10
    assert max(relative_errors(per_turn, per_row).values()) <= 1e-10


# -- the trainer with environments ----------------------------------------------------------------------


def _env_cfg(tmp_path, name, *extra):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(10, 30)))
    # a random policy seldom samples <eos>: stop strings end its turns (and the episode goes on)
    stop = "[" + ", ".join(f'"{c}"' for c in "aeiou0123456789AEIOU") + "]"
    return run_cfg(tmp_path, name, f'data.path="{data}"', 'env.factory="envs_for_tests:Game"',
                   "rollout.max_new_tokens=16", f"rollout.stop={stop}",
                   "reward.functions=['rewards_for_tests:ones_in_turns']", *extra)


def test_trainer_with_a_text_environment_stream_equals_reference(tmp_path):
    """Episodes of three turns through the whole loop: the streamed and the reference engine make the
    same update (float64); the episode and tree metrics are logged, the tree's unique tokens fewer
    than the sequences' (the shared prompt), the tool time on its own line."""
    results = {}
    for backward in ("stream", "reference"):
        model, tok = tiny()
        trainer.train(_env_cfg(tmp_path, backward, f'engine.backward="{backward}"', "engine.block_size=3"),
                      model=model, tokenizer=tok)
        results[backward] = weights(model)
    assert rel(results["stream"], weights(tiny()[0])) > 1e-4
    assert rel(results["stream"], results["reference"]) <= 1e-10
    rows = [json.loads(x) for x in open(os.path.join(str(tmp_path / "stream"), "metrics.jsonl"))]
    for row in rows:
        assert row["episode/turns/mean"] > 2 and row["episode/tool_calls/mean"] == 0.0
        assert row["time/tool"] == 0.0 and row["tree/tokens_total"] > 0
    assert any(0 < row["tree/tokens_unique"] < row["tree/tokens_total"] for row in rows)


@pytest.mark.slow
def test_trainer_with_environments_resumes_bitwise_and_reuses_the_rollouts_kv(tmp_path):
    model, tok = tiny()
    trainer.train(_env_cfg(tmp_path, "straight", "train.steps=2", "train.save_every=1"), model=model, tokenizer=tok)
    straight = weights(model)
    model, tok = tiny()
    run = trainer.train(_env_cfg(tmp_path, "split", "train.steps=1", "train.save_every=1"), model=model,
                        tokenizer=tok)
    model, tok = tiny()  # a fresh process would build a fresh environment per episode: nothing in the checkpoint
    trainer.train(resume=run, overrides=["train.steps=2"], model=model, tokenizer=tok)
    assert all(torch.equal(v, straight[k]) for k, v in weights(model).items())
    # the episodes' K/V handed to the engine (no prefill) make the update a prefill makes
    ws = {}
    for reuse in ("true", "false"):
        model, tok = tiny()
        trainer.train(_env_cfg(tmp_path, f"kv-{reuse}", f"engine.reuse_rollout_kv={reuse}"), model=model,
                      tokenizer=tok)
        ws[reuse] = weights(model)
    assert rel(ws["true"], ws["false"]) <= 1e-10


@pytest.mark.parametrize("extra, words", [
    (['env.factory="no/such/env.py:X"'], "env.factory '.*no/such/env.py:X': no file"),
    (['env.factory="envs_for_tests:Missing"'], "has no attribute 'Missing'"),
    (['env.factory="envs_for_tests:Undocumented"'], "env.factory Undocumented.helper is a tool, but transformers "
                                                     "cannot describe it"),
    (['env.factory="envs_for_tests:double"'], "could not be built with no argument"),
    (['env.format="chat"'], "env.format: 'chat' needs a tokenizer with a chat template"),
    (["env.max_turns=0"], "env.max_turns: got 0"),
    (["env.tools=['envs_for_tests:NOPE']"], "has no attribute 'NOPE'"),
])
def test_bad_env_configs_are_refused_before_anything_is_written(tmp_path, extra, words):
    from helpers import no_run_written

    model, tok = tiny(torch.float32)
    with pytest.raises(ValueError, match=words):
        trainer.train(_env_cfg(tmp_path, "bad", 'model.dtype="float32"', *extra), model=model, tokenizer=tok)
    assert no_run_written(tmp_path / "bad")


def test_evaluation_during_training(tmp_path):
    """[eval]: held-out rows of the built-in task (none of the training prompts), evaluated before the
    first step, every step and at the end, into the same metrics lines, with generators of their own:
    the training run is the same with and without it."""
    base = ['model.dtype="float32"', "train.steps=2", 'data.task="arith"', "data.num_examples=16"]
    model, tok = tiny(torch.float32)
    run = trainer.train(run_cfg(tmp_path, "ev", *base, "eval.every=1", "eval.at_start=true", "eval.prompts=6",
                                "eval.samples=3", "reward.functions=['exact_match']"), model=model, tokenizer=tok)
    with_eval = weights(model)
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[0]["reward/mean"] is None
    for r in rows:
        assert 0 <= r["eval/pass@3"] <= 1 and 0 <= r["eval/avg@3"] <= r["eval/pass@3"] and r["eval/reward/mean"] >= 0
    model, tok = tiny(torch.float32)
    trainer.train(run_cfg(tmp_path, "no-ev", *base, "reward.functions=['exact_match']"), model=model, tokenizer=tok)
    assert all(torch.equal(v, with_eval[k]) for k, v in weights(model).items())
    from backstream.rl.data.prompts import DataConfig
    from backstream.rl.data.tasks import make_dataset
    from backstream.rl.rollout.evaluate import EvalConfig, held_out

    train_rows = make_dataset("arith", 16, 0)
    held = held_out(EvalConfig(every=1, prompts=50), DataConfig(task="arith", num_examples=16), 0)
    assert len(held) == 50 and not {r["prompt"] for r in held} & {r["prompt"] for r in train_rows}


def test_trl_environments_run_unchanged(script):
    """Environments written for TRL's GRPOTrainer: its demo's IncrementEnv (reset() without the row,
    one tool) and the shape of its echo example (a *tool* named step, get_reward); and the example
    environment of examples/calc_env.py."""
    model, tok = tiny(torch.float32)
    s = sampler(tok, "envs_for_tests:IncrementEnv", G=1)
    assert [x["function"]["name"] for x in s.env.schemas] == ["increment"] and not s.env.has_response
    script([["[increment 2]<eos>", "[increment 3]<eos>", "5<eos>"]])
    r = sample(s, model, [{"prompt": "Increment by two, then three."}])
    assert text(tok, r, 0).endswith("[increment 2]<eos>\n=2\n[increment 3]<eos>\n=5\n5<eos>")
    s = sampler(tok, "envs_for_tests:EchoLike", G=1)
    assert [x["function"]["name"] for x in s.env.schemas] == ["step"] and not s.env.has_response
    script([['[step "hi"]<eos>', "done<eos>"]])
    r = sample(s, model, [{"prompt": "echo hi"}])
    from backstream.rl.scoring.builtin import env_reward

    assert info(r, "tool_calls") == [1] and env_reward(info(r, "env")) == [2.0]
    s = sampler(tok, str(REPO / "examples" / "calc_env.py") + ":CalcEnv")
    assert [x["function"]["name"] for x in s.env.schemas] == ["add", "multiply"]


def test_the_tokenizers_response_parser_reads_tool_calls_where_it_has_one(script):
    """A tokenizer that defines a response parser (transformers' `parse_response`, set up by its
    `response_schema`) reads the calls of the chat format; without one, Hermes <tool_call> blocks."""
    model, tok = tiny(torch.float32)
    tok.chat_template = CHAT_TEMPLATE
    s = sampler(tok, G=1, max_new=80, format="chat")
    msg, calls = s.format.parse(tok('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><eos>',
                                    add_special_tokens=False)["input_ids"])
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2})] and msg["content"] == ""
    msg, calls = s.format.parse(tok("<tool_call>{oops</tool_call><eos>", add_special_tokens=False)["input_ids"])
    assert calls[0].error and "malformed tool call" in calls[0].error
    tok.response_schema = {"stand-in": True}
    tok.parse_response = lambda ids: {"content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 5, "b": 6}}}]}
    msg, calls = s.format.parse([7, 8, 9])
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 5, "b": 6})] and msg["role"] == "assistant"


def test_a_template_that_ignores_the_tools_is_refused():
    """A chat template that renders a prompt the same with the tools' schemas as without (SmolLM2's)
    would train a model that never sees its tools: refused at start-up, naming the ways out."""
    model, tok = tiny(torch.float32)
    tok.chat_template = ("{% for m in messages %}<u>{{ m['content'] }}</u>\n{% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}")
    with pytest.raises(ValueError, match=r"^env.format: the chat template of .* ignores the tools: it renders "
                                         r"a prompt the same with their schemas \(add, boom\).*env.chat_template.*"
                                         r'env.format = "plain"'):
        sampler(tok, format="chat")
    tok.chat_template = CHAT_TEMPLATE  # renders them: accepted
    assert sampler(tok, format="chat").format.name == "chat"

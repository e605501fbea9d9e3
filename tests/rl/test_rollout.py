"""The rollout engine against HF's own generate and a teacher-forced full forward: greedy tokens,
sampler log-probs, seeding, top-k/top-p, EOS and stop strings, one prefill per group, and the K/V
it hands to the streamed backward."""

import dataclasses

import pytest
import torch
from helpers import VOCAB, lora, make
from transformers import DynamicCache

from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local.decode import NonFiniteLogits, shares
from backstream.rl.backends.local.generate import generate
from backstream.rl.records import Samples
from backstream.rl.rollout.source import RolloutConfig
from backstream.stream.adapter import probe_layout
from backstream.stream.hf import cache_arg, returned_cache

PROMPTS = [torch.tensor([3, 14, 15, 9, 26]), torch.tensor([5, 35, 8, 9, 7, 9, 3])]


def model32(family="qwen3"):
    return make(family, dtype=torch.float32)


def run(model, config, seed=0, group_size=1, return_kv=False, prompts=PROMPTS, **kw):
    """generate()'s completions of `prompts` as the record a sampler makes of them (`Samples.of_groups`)."""
    kw.setdefault("eos_token_id", None)
    kw.setdefault("generator", torch.Generator().manual_seed(seed))
    out = generate(model, prompts, config, group_size=group_size, return_kv=return_kv, **kw)
    return Samples.of_groups(list(range(len(prompts))), prompts, out, group_size, return_kv)


def teacher_forced(model, seq, temperature):
    """log_softmax(logits / T) of every token of seq given the tokens before it: [len(seq) - 1]."""
    with torch.no_grad():
        logits_LV = model(seq[None]).logits[0, :-1].float()
    return (logits_LV / temperature).log_softmax(-1).gather(-1, seq[1:, None]).squeeze(-1), logits_LV


@pytest.mark.parametrize("family", ["qwen3", "mistral-window", "qwen3-mixed-window"])
def test_greedy_equals_hf_generate(family):
    # the windowed families decode past their window (4): HF uses sliding cache layers, we keep it all
    model = model32(family)
    model.generation_config.eos_token_id = None
    r = run(model, SamplingParams(temperature=0, max_new_tokens=12), group_size=2)
    refs = [model.generate(p[None], do_sample=False, max_new_tokens=12, pad_token_id=0)[0] for p in PROMPTS]
    for i, seq in enumerate(r.sequences()):
        assert torch.equal(seq, refs[r.prompt_index[i]])
        assert r.finish_reason[i] == "length"


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (0, 0, 1.0)])
def test_logprobs_match_teacher_forced(temperature, top_k, top_p):
    model = model32()
    r = run(model, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10), group_size=3)
    for seq, mask, lp, aligned in zip(r.sequences(), r.completion_mask(), r.logprobs, r.aligned_logprobs()):
        assert lp.dtype == torch.float32 and len(lp) == int(mask.sum())
        ref, logits_LV = teacher_forced(model, seq, temperature or 1.0)
        torch.testing.assert_close(lp, ref[mask[1:]], atol=1e-5, rtol=0)
        assert aligned[~mask].isnan().all() and torch.equal(aligned[mask], lp)
        if top_k:  # truncation shapes the sampling only: every sampled token is within the top k
            rank = (logits_LV[mask[1:]] > logits_LV[mask[1:]].gather(-1, seq[mask][:, None])).sum(-1)
            assert (rank < top_k).all()


def test_peft_model():
    model = lora(model32())
    r = run(model, SamplingParams(temperature=0.8, max_new_tokens=6), group_size=2)
    for seq, mask, lp in zip(r.sequences(), r.completion_mask(), r.logprobs):
        torch.testing.assert_close(lp, teacher_forced(model, seq, 0.8)[0][mask[1:]], atol=1e-5, rtol=0)


def test_seeding():
    model = model32()
    cfg = SamplingParams(max_new_tokens=16)
    a, b, c = (run(model, cfg, seed=s, group_size=4) for s in (1, 1, 2))
    assert all(torch.equal(x, y) for x, y in zip(a.completion_ids, b.completion_ids))
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs))
    assert any(not torch.equal(x, y) for x, y in zip(a.completion_ids, c.completion_ids))
    # the G rows of a group are different samples, not copies
    assert len({tuple(x.tolist()) for x in a.completion_ids[:4]}) > 1


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6)])
def test_extreme_truncation_is_greedy(kw):
    model = model32()
    greedy = run(model, SamplingParams(temperature=0, max_new_tokens=10))
    r = run(model, SamplingParams(temperature=1.0, max_new_tokens=10, **kw))
    assert all(torch.equal(x, y) for x, y in zip(greedy.completion_ids, r.completion_ids))
    # both report log-probs at T = 1 before truncation
    assert all(torch.allclose(x, y) for x, y in zip(greedy.logprobs, r.logprobs))


def test_eos_ends_row_and_is_kept():
    model = model32()
    eos = list(range(0, VOCAB, 3))  # a third of the vocabulary: some rows end early, some not
    r = run(model, SamplingParams(max_new_tokens=6), eos_token_id=eos, group_size=8)
    assert r.prompt_index == [0] * 8 + [1] * 8 and r.group_size == 8
    assert {"eos", "length"} == set(r.finish_reason)
    for c, reason in zip(r.completion_ids, r.finish_reason):
        ends = [int(t) in eos for t in c]
        if reason == "eos":
            assert ends[-1] and not any(ends[:-1])
        else:
            assert len(c) == 6 and not any(ends)
    # an int eos works too
    r1 = run(model, SamplingParams(max_new_tokens=6), eos_token_id=eos[1], group_size=8)
    assert all((reason == "eos") == (int(c[-1]) == eos[1]) for c, reason in zip(r1.completion_ids, r1.finish_reason))


class MultiCharTokenizer:
    """Token i decodes to a fixed piece of one or two characters, so stop strings can span tokens."""

    pieces = [chr(97 + i % 26) * (1 + i // 26) if i < 52 else str(i % 10) for i in range(VOCAB)]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids)


def test_stop_strings_cut_after_completing_token():
    model, tok = model32(), MultiCharTokenizer()
    cfg = dict(max_new_tokens=30)
    free = run(model, SamplingParams(**cfg), seed=3, group_size=4)
    # stop strings from the middle of two unconstrained completions of the first group; with the same
    # seed that group samples the same tokens until a row stops (each row's draw ignores the others)
    stop = [tok.decode(free.completion_ids[0].tolist())[8:11], tok.decode(free.completion_ids[1].tolist())[12:14]]
    r = run(model, SamplingParams(**cfg, stop=stop), seed=3, tokenizer=tok, group_size=4)
    for i in range(4):
        ids = free.completion_ids[i].tolist()
        first = next((n for n in range(1, len(ids) + 1) if any(s in tok.decode(ids[:n]) for s in stop)), None)
        if first is None:
            assert torch.equal(r.completion_ids[i], free.completion_ids[i]) and r.finish_reason[i] == "length"
        else:
            assert r.completion_ids[i].tolist() == ids[:first] and r.finish_reason[i] == "stop"
            assert r.texts(tok)[i] == tok.decode(ids[:first])
    assert r.finish_reason[:2] == ["stop", "stop"]
    with pytest.raises(ValueError, match="tokenizer"):
        run(model, SamplingParams(stop=["x"], max_new_tokens=64))


def spy_shapes(model) -> list:
    """The input_ids shape of every forward call `model` makes from now on (`del model.forward` stops it),
    after its once-per-model probes (`probe_layout`, rl/backends/local/prefix.py `shares`)."""
    probe_layout(model)
    shares(model)
    shapes, forward = [], model.forward

    def spy(*args, **kw):
        shapes.append(tuple(kw["input_ids"].shape))
        return forward(*args, **kw)

    model.forward = spy
    return shapes


def test_one_prefill_per_group():
    model = model32()
    shapes = spy_shapes(model)
    r = run(model, SamplingParams(max_new_tokens=5), group_size=4)
    # one prefill per prompt, then the 8 rows of both groups (prompts of 5 and 7 tokens) as one batch
    assert shapes == [(1, 5), (1, 7)] + [(8, 1)] * 4
    assert len(r) == 8


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_one_batch_equals_each_group_alone(device):
    # rows of other lengths (left-padded) and rows that finished (dropped) change no row's samples:
    # a call with three prompts of 3, 5 and 7 tokens = each prompt sampled alone with its generator
    model = make("qwen3", dtype=torch.float64).to(device)
    prompts = [PROMPTS[1], torch.tensor([4, 2, 9]), PROMPTS[0]]
    cfg = SamplingParams(max_new_tokens=9, temperature=0.9)
    eos = list(range(0, VOCAB, 5))
    shapes = spy_shapes(model)
    together = run(model, cfg, group_size=4, eos_token_id=eos, return_kv=True, prompts=prompts,
                   generator=[torch.Generator().manual_seed(10 + j) for j in range(3)])
    decode_rows = [s[0] for s in shapes if s[1] == 1]
    assert decode_rows == sorted(decode_rows, reverse=True) and decode_rows[0] <= 12 and decode_rows[-1] < 12
    sizes = sorted(set(decode_rows), reverse=True)  # finished rows leave together, a quarter at least
    assert all(4 * (a - b) >= a for a, b in zip(sizes, sizes[1:]))
    del model.forward
    assert {"eos", "length"} <= set(together.finish_reason)
    for j, p in enumerate(prompts):
        alone = run(model, cfg, group_size=4, eos_token_id=eos, return_kv=True, prompts=[p],
                    generator=torch.Generator().manual_seed(10 + j))
        for k in range(4):
            i = j * 4 + k
            assert torch.equal(together.completion_ids[i], alone.completion_ids[k])
            assert together.finish_reason[i] == alone.finish_reason[k]
            torch.testing.assert_close(together.logprobs[i], alone.logprobs[k], atol=1e-12, rtol=0)
            for (k1, v1), (k2, v2) in zip(together.kv[i], alone.kv[k]):
                torch.testing.assert_close(k1, k2, atol=1e-12, rtol=0)
                torch.testing.assert_close(v1, v2, atol=1e-12, rtol=0)
        for seq, m, lp in zip(together.sequences()[j * 4:j * 4 + 4], together.completion_mask()[j * 4:j * 4 + 4],
                              together.logprobs[j * 4:j * 4 + 4]):  # the learner's forward, on the device
            with torch.no_grad():
                logits_LV = model(seq[None].to(device)).logits[0, :-1].cpu()
            ref = (logits_LV / 0.9).log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
            torch.testing.assert_close(lp, ref[m[1:]], atol=1e-12, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "mistral-window"])
def test_return_kv_matches_full_forward(family):
    model = model32(family)
    eos = list(range(0, VOCAB, 4))  # uneven lengths within a group
    r = run(model, SamplingParams(max_new_tokens=9), eos_token_id=eos, return_kv=True, group_size=3)
    layers = model.config.num_hidden_layers
    assert len(set(len(c) for c in r.completion_ids)) > 1
    for seq, kv in zip(r.sequences(), r.kv):
        with torch.no_grad():  # a cache without config, so the windowed layers keep every position
            full = returned_cache(model(seq[None], use_cache=True, **{cache_arg(model): DynamicCache()}))
        assert len(kv) == layers
        for (k, v), layer in zip(kv, full.layers):
            assert k.shape == (2, len(seq) - 1, 8)
            torch.testing.assert_close(k, layer.keys[0, :, :-1], atol=1e-6, rtol=0)
            torch.testing.assert_close(v, layer.values[0, :, :-1], atol=1e-6, rtol=0)


def test_rollout_kv_feeds_stream_backward():
    # docs/design.md §4: at the same weights the sampler's K/V replace the engine's prefill
    from backstream import stream_backward

    model = model32()
    r = run(model, SamplingParams(max_new_tokens=6), eos_token_id=list(range(0, VOCAB, 4)),
            return_kv=True, group_size=3)
    weights = [m.float() * (i - 2.5) for i, m in enumerate(r.completion_mask())]
    grads, logprobs = [], []
    for kv in (None, r.kv):
        model.zero_grad()
        res = stream_backward(model, r.sequences(), weights, kv=kv, block_size=4)
        grads.append([p.grad.clone() for p in model.parameters()])
        logprobs.append(res.logprobs)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for learner, sampler in zip(logprobs[0], r.aligned_logprobs()):  # sampler/learner agreement
        torch.testing.assert_close(learner, sampler, atol=1e-5, rtol=0, equal_nan=True)


def test_no_prompt_no_sample():
    # a rank's share of a round can be empty (torchrun: DAPO refills, an eval smaller than the world)
    assert generate(model32(), [], SamplingParams(max_new_tokens=64), eos_token_id=None, return_kv=True,
                    group_size=3) == []


def test_nonfinite_logits_stop_the_sampler():
    model = model32()
    with torch.no_grad():
        model.lm_head.weight[3] = float("nan")  # tied: token 3's embedding too
    with pytest.raises(NonFiniteLogits, match="logits hold NaN/inf.*optim.lr"):
        run(model, SamplingParams(max_new_tokens=4), group_size=2)


def test_bf16_model():
    model = make("qwen3", dtype=torch.bfloat16)
    r = run(model, SamplingParams(max_new_tokens=4), group_size=2)
    assert all(lp.dtype == torch.float32 and (lp <= 0).all() for lp in r.logprobs)


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(stop="abc"), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(group_size=0), "group_size"),
    (dict(group_size=True), "group_size"),
])
def test_config_validation_names_field(kw, field):
    with pytest.raises(ValueError, match=rf"rollout\.{field}: got .*expected"):  # the run file's key
        RolloutConfig(**kw)
    if field != "group_size":  # the sampling parameters alone check theirs the same way
        with pytest.raises(ValueError, match=rf"rollout\.{field}: got .*expected"):
            SamplingParams(**{"max_new_tokens": 8, **kw})


def test_rollout_helpers():
    r = Samples(prompt_index=[0], prompt_ids=[torch.tensor([1, 2])], completion_ids=[torch.tensor([3, 4, 5])],
                logprobs=[torch.zeros(3)], finish_reason=["length"])
    assert r.sequences()[0].tolist() == [1, 2, 3, 4, 5]
    assert r.completion_mask()[0].tolist() == [False, False, True, True, True]
    assert r.kv is None and len(r) == 1


def test_select_and_concat_keep_whole_groups():
    def rollout(n_groups, kv=True):
        rows = range(2 * n_groups)
        return Samples(prompt_index=[i // 2 for i in rows], prompt_ids=[torch.tensor([i // 2]) for i in rows],
                       completion_ids=[torch.tensor([10 + i]) for i in rows], logprobs=[torch.zeros(1) for _ in rows],
                       finish_reason=["eos" if i % 2 else "length" for i in rows],
                       kv=[[(torch.full((1, 1, 1), float(i)),) * 2] for i in rows] if kv else None, group_size=2)

    r = rollout(3)
    assert r.group_rows([2, 0]) == [4, 5, 0, 1]
    s = r.select([2, 0])
    assert s.prompt_index == [2, 2, 0, 0] and [int(c) for c in s.completion_ids] == [14, 15, 10, 11]
    assert s.finish_reason == ["length", "eos"] * 2 and s.kv == [r.kv[i] for i in (4, 5, 0, 1)]
    c = Samples.concat([s, r.select([]), r.select([1])])  # an empty selection keeps its (empty) K/V
    assert c.prompt_index == [2, 2, 0, 0, 1, 1] and len(c.kv) == 6 and c.group_size == 2
    assert Samples.concat([r, rollout(1, kv=False)]).kv is None  # K/V only where every part has them
    versioned = dataclasses.replace(rollout(1), weight_version=[0, 0])
    assert Samples.concat([versioned, versioned]).weight_version == [0] * 4
    with pytest.raises(AssertionError, match="weight_version"):  # a field one part lacks is a bug, not dropped
        Samples.concat([r, versioned])

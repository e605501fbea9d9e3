"""One copy of a prompt's K/V for the rows of its group in the sampler (rl/backends/local/prefix.py, issue
46): the shared path decodes what the copying one decodes, to the token and to 1e-12 in the log-probs, on families whose
attention differs (sliding windows, soft-capping, sinks, hybrids with state beside K/V); the sampler's
log-probs are the learner's; its K/V feed the engine without a copy per sample; episodes and agent
requests that continue a history keep reading its prompt where it is; and the rollout holds one copy of
the prompt instead of 2G."""

import math

import pytest
import torch
from helpers import make
from transformers import AutoConfig

from backstream import reference_backward, stream_backward
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local.backend import LocalBackend
from backstream.rl.backends.local.decode import Rows, decode, shares
from backstream.rl.backends.local.generate import generate
from backstream.rl.backends.local.prefix import SHARE_MIN, Prefix
from backstream.rl.records import Completion, Samples
from backstream.stream.kvstore import Pieces
from backstream.stream.memory import LiveBytes
from backstream.stream.miniature import keep_float64, miniature, miniature_config

LENGTHS = (40, 33, 40, 50)  # two prompts of one length share a prefill batch; two others have their own
G = 4


def family(name: str):
    """A float64 model of `name`: the helpers' tiny ones, or transformers' own family as a miniature."""
    if name in ("qwen3", "mistral-window", "qwen3-mixed-window"):
        return make(name, dtype=torch.float64, window=8)
    cfg = miniature_config(AutoConfig.for_model(name) if name != "lfm2" else AutoConfig.for_model(
        "lfm2", layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3))
    cfg.get_text_config().max_position_embeddings = 512
    return miniature(cfg, seed=0)


def prompts(vocab=(7, 50), lengths=LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(*vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["qwen3", "mistral-window", "qwen3-mixed-window", "gemma2", "gpt_oss",
                                  "qwen3_5_text", "falcon_h1", "lfm2"])
def test_shared_prefixes_decode_what_copies_decode(name):
    """Rows that read their prompt from one copy sample the tokens and log-probs of rows that hold a copy
    each: windows (Mistral's 8, a layer with and one without), Gemma 2's soft-capping, GPT-OSS's sinks,
    Gated DeltaNet, Mamba 2 beside attention in one layer (Falcon-H1), LFM2's short convolutions; rows end
    at different steps and leave the batch."""
    model = family(name)
    rows_p = [p for p in prompts() for _ in range(G)]
    cfg = SamplingParams(max_new_tokens=12)
    with keep_float64():
        assert shares(model)
        out = []
        for share_min in (1, math.inf):
            rows = Rows.of_prompts(model, rows_p, False, 12, share_min=share_min)
            assert rows.cache.shared == (share_min == 1)
            gens = [torch.Generator().manual_seed(j) for j in range(len(LENGTHS))]
            out.append(decode(model, rows, cfg, set(range(7, 60, 9)), None, [gens[i // G] for i in range(len(rows_p))],
                              False, [12] * len(rows_p)))
    shared, copied = out
    assert len(set(map(len, shared.tokens))) > 2  # rows ended at different steps
    assert shared.tokens == copied.tokens and shared.reasons == copied.reasons
    for a, b in zip(shared.logprobs, copied.logprobs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_a_model_whose_attention_reads_derived_kv_copies():
    """DeepSeek-V3's multi-head latent attention pads V after the cache update: the attention function
    cannot stand in for it, the probe says so, and its rows hold copies as before."""
    model = family("deepseek_v3")
    with keep_float64():
        assert not shares(model)
        rows = Rows.of_prompts(model, [p for p in prompts() for _ in range(2)], False, 4)
    assert not rows.cache.shared


def test_the_samplers_logprobs_and_kv_are_the_learners():
    """generate() on prompts of 33-50 tokens (shared): every sampled token's log-prob is the learner's
    (float64, 1e-12), and the rollout's K/V (the shared prompt, then each sample's own, `Pieces`) give
    the engine the reference gradient with no prefill."""
    model = make("qwen3", dtype=torch.float64)
    ps = [torch.tensor(p) for p in prompts((3, 60))]
    out = generate(model, ps, SamplingParams(max_new_tokens=8), eos_token_id=list(range(0, 64, 6)),
                   return_kv=True, generator=[torch.Generator().manual_seed(j) for j in range(len(ps))], group_size=3)
    r = Samples.of_groups(list(range(len(ps))), ps, out, 3, kv=True)
    assert all(isinstance(k, Pieces) for kv in r.kv for k, _ in kv)
    for seq, m, lp in zip(r.sequences(), r.completion_mask(), r.logprobs):
        with torch.no_grad():
            ref = model(seq[None]).logits[0, :-1].log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
        torch.testing.assert_close(lp, ref[m[1:]], atol=1e-12, rtol=0)
    weights = [m.double() * (i % 5 - 2) for i, m in enumerate(r.completion_mask())]
    grads = []
    for fn, kw in ((reference_backward, {}), (stream_backward, {"kv": r.kv, "block_size": 16})):
        model.zero_grad()
        fn(model, r.sequences(), weights, **kw)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_episodes_and_requests_keep_reading_their_prompt():
    """Episodes on a 40-token prompt: every later turn still reads the prompt where the first prefill left
    it (their K/V are the prompt's `Prefix`, then their own), and every sampled token's log-prob is the
    learner's. An agent request that continues an earlier one's history takes over its K/V, prompt shared."""
    model = make("qwen3", dtype=torch.float64)
    cfg = SamplingParams(max_new_tokens=5)
    backend = LocalBackend(cfg, [63], None)
    backend.weights.sync(model, 0)
    start = prompts((3, 60), (40,))[0]
    seen = []

    def turn(k: int, c: Completion):
        seen.append((k, c))
        return [7, 8, 9] if sum(1 for x, _ in seen if x == k) < 3 else None

    played = backend.play([start] * 4, [torch.Generator().manual_seed(k) for k in range(4)], turn, lambda n: 5, 3,
                          return_kv=True)
    for p in played:
        assert all(isinstance(k, Pieces) and k.parts[0].shape[1] == 40 for k, _ in p.kv)
    for k, p in enumerate(played):  # the learner's log-probs of what each turn sampled, after what was fed
        sampled = [c for x, c in seen if x == k]
        seq = torch.tensor(p.fed + sampled[-1].ids[-1:])
        with torch.no_grad():
            ref = model(seq[None]).logits[0, :-1].log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
        at, ends = [], len(start)
        for c in sampled:
            at += list(range(ends - 1, ends - 1 + len(c.ids)))
            ends += len(c.ids) + 3
        got = torch.cat([c.logprobs.double() for c in sampled])
        torch.testing.assert_close(got, ref[at], atol=1e-12, rtol=0)
    with backend.round(1) as requests:
        backend.reuse_min = 8
        first = requests.generate(start, 4, 0, "a")
        continued = start + first.ids + [7, 8]
        again = requests.generate(continued, 4, 1, "a")
        assert backend.reused == len(start) + len(first.ids) - 1
        seq = torch.tensor(continued + again.ids)
        with torch.no_grad():
            ref = model(seq[None]).logits[0, :-1].log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
        torch.testing.assert_close(again.logprobs.double(), ref[len(continued) - 1:], atol=1e-12, rtol=0)


def _kv_storages(cache) -> int:
    """Bytes of the distinct storages a decode cache's K/V live in (prefix batches, own buffers)."""
    seen = {}
    for layer in cache.layers:
        for t in [*layer.bufs, *[x for p in cache.prefixes if p is not None for x in p.kv[layer.layer]]]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_the_rollout_holds_one_copy_of_the_prompt():
    """8 samples of a 1,024-token prompt: the decode batch's K/V are one copy of the prompt and what each
    sample adds, and the rollout's peak is 7 copies of the prompt lower than with a copy per row (the
    code before held 2 per row at once: the prompt repeated to every row, then copied into a padded
    buffer)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=4, head_dim=16))
    prompt = torch.randint(3, 60, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    copy_bytes = 2 * 4 * 4 * 16 * 4 * len(prompt)  # K and V of the prompt: layers, K/V heads, head size, float32
    new = 4
    peaks, held = {}, {}
    for share_min in (SHARE_MIN, math.inf):
        with torch.no_grad(), LiveBytes(model) as m:
            rows = Rows.of_prompts(model, [prompt] * G * 2, False, new, share_min)
            held[share_min] = _kv_storages(rows.cache)
            decode(model, rows, SamplingParams(max_new_tokens=new), set(), None, [None] * 2 * G, False, [new] * 2 * G)
            del rows
        peaks[share_min] = m.peak
    own = 2 * G * copy_bytes / len(prompt) * new  # what the samples add, room for `new` tokens each
    assert held[SHARE_MIN] <= copy_bytes + own < 2 * G * copy_bytes <= held[math.inf]
    assert peaks[math.inf] - peaks[SHARE_MIN] >= (2 * G - 1) * copy_bytes


def test_a_prefix_is_read_as_views():
    """A shared prompt's K/V per layer are views of its prefill batch, never copies."""
    model = make("qwen3", dtype=torch.float64)
    rows = Rows.of_prompts(model, [p for p in prompts((3, 60)) for _ in range(2)], False, 2, share_min=1)
    p = rows.cache.prefixes[0]
    assert isinstance(p, Prefix) and p.length == 40
    k, v = p.layer(0)
    assert k.untyped_storage().data_ptr() == p.kv[0][0].untyped_storage().data_ptr()
    assert rows.cache.prefixes[1] is p and rows.cache.prefixes[4] is not p

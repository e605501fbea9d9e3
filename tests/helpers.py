"""What the tests share: tiny random models of several families (`make`, `lora`, `exact_norms`: float64
with HF's float32 norm upcast patched away), the trainer's tiny Qwen3 and run files (`tiny`, `run_cfg`),
the engine's, the losses' and the off-policy tests' problems, the agentic tests' chat template, episode
sampler and scripted turns (`scripted_turns`, the body of conftest's `script` fixture), and `REPO`.
Fixture modules that run files name by module (`rewards_for_tests`, `envs_for_tests`) and the workers
that tests spawn (`dist`, `*_workers`) stay modules of their own."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from backstream import config, reference_backward, stream_backward
from backstream.default_model import build_tokenizer
from backstream.rl.agent.env import EnvConfig, Environment
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local import decode as D
from backstream.rl.backends.local.backend import LocalBackend
from backstream.rl.rollout import episodes as E
from backstream.rl.update.losses import (
    build_objective,
)
from backstream.stream.miniature import exact_norms
from backstream.stream.objective import BlockView, flat_offsets
from backstream.stream.verify import relative_errors, token_tree

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)


def make(family: str, dtype=torch.float64, seed: int = 0, window: int = 4):
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON))
    elif family == "qwen3-mixed-window":  # per-layer windows: layer 0 sliding, layer 1 full
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, use_sliding_window=True, sliding_window=window,
                                             layer_types=["sliding_attention", "full_attention"]))
    elif family == "mistral-window":
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=window))
    elif family == "qwen3-moe":
        cfg = Qwen3MoeConfig(**{**COMMON, "intermediate_size": 32}, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, decoder_sparse_step=1)
        cfg._experts_implementation = "eager"  # grouped_mm has no float64 CPU kernel
        model = Qwen3MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = MixtralConfig(**{**COMMON, "intermediate_size": 16}, num_local_experts=4, num_experts_per_tok=2)
        cfg._experts_implementation = "eager"
        model = MixtralForCausalLM(cfg)
    else:
        raise KeyError(family)
    model = model.to(dtype).eval()
    # random init of norms too, so that a missed norm weight would show
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return exact_norms(model) if dtype == torch.float64 else model


def lora(model, r: int = 4, seed: int = 1, layers=None):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    # no k_proj: K of every layer stays frozen, so some K/V roots need no gradient; with
    # `layers`, the layers below are frozen entirely
    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                          layers_to_transform=layers, init_lora_weights=False))
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(next(model.parameters()).dtype)
    return pm


FAMILIES = ["llama", "qwen3", "qwen3-mixed-window", "mistral-window", "qwen3-moe", "mixtral"]
MOE = ["qwen3-moe", "mixtral"]


# ---------------------------------------------------------------------------------------------
# The wider family matrix (tests/stream/test_families.py): tiny configs of more HF families, each with
# the feature that sets it apart switched on, so that an engine assuming Llama would show.

SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the vocabulary
BOS, EOS = SPECIAL["bos_token_id"], SPECIAL["eos_token_id"]
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # wavelengths 6, 63, 628, 6283: kept, smoothed, scaled
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128)
GEMMA3_WINDOW = 5
GEMMA3_QUERY_SCALAR = 12  # scaling 12^-0.5, not head_dim^-0.5
GRANITE_ATTENTION = 0.2  # scaling 0.2, not 8^-0.5 ≈ 0.354


def _family_model(family: str):
    """The float32 model of `family`, with HF's own numerics (nothing patched)."""
    import transformers as tf

    common = {**COMMON, **SPECIAL}
    mha = {k: v for k, v in common.items() if k not in ("num_key_value_heads", "head_dim")}  # head_dim 32/4 = 8
    if family == "qwen2":  # q/k/v biases
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if family == "qwen2-tied":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=True))
    if family == "gemma3":  # layer 0 sliding (local RoPE), layer 1 full; (1 + w) norms, on q/k too; tied
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **common, sliding_window=GEMMA3_WINDOW, query_pre_attn_scalar=GEMMA3_QUERY_SCALAR,
            layer_types=["sliding_attention", "full_attention"]))
    if family == "olmo2":  # RMSNorm on the whole q and k projections, post-norm blocks
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**common))
    if family == "gpt-neox":  # rotary on half of each head, parallel residual, LayerNorm, biases
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**mha, partial_rotary_factor=0.5))
    if family == "gpt2":  # learned positions, Conv1D with biases, LayerNorm, tied; layer l scaled by 1/(l+1)
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                                                scale_attn_by_inverse_layer_idx=True, **SPECIAL))
    if family == "granite":
        return tf.GraniteForCausalLM(tf.GraniteConfig(**common, attention_multiplier=GRANITE_ATTENTION,
                                                      embedding_multiplier=4.0, residual_multiplier=0.5,
                                                      logits_scaling=2.0))
    if family == "starcoder2":  # LayerNorm with biases, sliding window on every layer, tied
        return tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**common, sliding_window=6))
    if family == "phi3":  # fused qkv and gate_up projections, plain RoPE
        return tf.Phi3ForCausalLM(tf.Phi3Config(**common))
    if family == "llama-rope-llama3":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=LLAMA3_ROPE))
    if family == "llama-rope-yarn":  # yarn also scales cos/sin (its attention factor)
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=YARN_ROPE))
    raise KeyError(family)


def _is_norm(mod) -> bool:
    return isinstance(mod, torch.nn.LayerNorm) or "norm" in type(mod).__name__.lower()


def make_family(family: str, dtype=torch.float64, seed: int = 0):
    """Tiny random model of `family` in `dtype`; norm weights random in 0.5..1.5 and every bias
    random (so that a missed one would show); in float64 the RMSNorms (Gemma's (1 + w) form, OLMo 2's
    on q and k) keep their formula and compute in float64, as test_families checks."""
    torch.manual_seed(seed)
    model = _family_model(family).to(dtype).eval()
    with torch.no_grad():
        for mod in model.modules():
            if _is_norm(mod) and getattr(mod, "weight", None) is not None:
                mod.weight.uniform_(0.5, 1.5)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.2, 0.2)
    return exact_norms(model) if dtype == torch.float64 else model


def same_weights(family: str, model, dtype):
    """A fresh, unpatched copy of `make_family(family)`'s weights in another dtype (HF's own
    numerics). Not `copy.deepcopy`: a patched norm's forward would still use the original module."""
    other = _family_model(family).to(dtype).eval()
    other.load_state_dict(model.state_dict())
    return other


LORA_TARGETS = {"gpt2": ["c_attn", "c_proj"], "phi3": ["qkv_proj", "o_proj"], "gpt-neox": ["query_key_value", "dense"]}


def lora_family(model, family: str, r: int = 4, seed: int = 1):
    """PEFT LoRA on the family's attention projections (names differ by family)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    targets = LORA_TARGETS.get(family, ["q_proj", "v_proj", "o_proj"])
    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                          fan_in_fan_out=family == "gpt2"))
    for n, p in pm.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(next(model.parameters()).dtype)
    return pm


FAMILY_MATRIX = ["qwen2", "qwen2-tied", "gemma3", "olmo2", "gpt-neox", "gpt2", "granite", "starcoder2", "phi3",
                 "llama-rope-llama3", "llama-rope-yarn"]






CHAT_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}</tools>\n"
    "{% endif %}{% for m in messages %}{% if m['role'] == 'assistant' %}<a>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}<eos>\n"
    "{% elif m['role'] == 'tool' %}<t>{{ m['content'] }}</t>\n{% else %}<u>{{ m['content'] }}</u>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


SCRIPT: dict | None = None  # the running test's scripted turns (the `script` fixture), None: sampled


class ScriptedBackend(LocalBackend):
    """The local backend with the episodes' tokens forced (`SCRIPT`: one list of turn texts per episode,
    in the order the sampler starts them); the model still computes every log-prob and cache. A round
    of turns is one decode call: the first turns of the episodes not started yet, or else the next turn
    of every started episode with turns left."""

    def __init__(self, config, eos, tok, state: dict):
        super().__init__(config, eos, tok)
        self.state = state

    def decode_rows(self, model, rows, generators, keep_last, budgets, shift=None):
        B, qs, state = len(rows.lengths), self.state["queues"], self.state
        if not any(q for q in qs[: state["next"]]):
            episodes = list(range(state["next"], state["next"] + B))  # first turns
            state["next"] += B
        else:
            episodes = [i for i, q in enumerate(qs[: state["next"]]) if q]
            assert len(episodes) == B, "the script's turns do not match the episodes the sampler plays"
        forced = [self.tok(qs[e].pop(0), add_special_tokens=False)["input_ids"] for e in episodes]
        live, t = list(range(B)), [0]

        def choose(logits, temperature, top_k, top_p, u):
            toks = torch.tensor([forced[i][min(t[0], len(forced[i]) - 1)] for i in live], device=logits.device)
            t[0] += 1
            lp = torch.log_softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), -1)
            return toks, lp.gather(-1, toks[:, None])[:, 0]

        return D.decode(model, rows, self.config, self.eos, self.tok, generators, keep_last, budgets,
                        keep_kv=True, finished=live.remove, choose=choose, shift=shift)


def scripted_turns():
    """`script(turns)`: the next episodes' turns, forced in the samplers `backend_for` builds from now
    (ScriptedBackend)."""
    global SCRIPT
    SCRIPT = {"queues": [], "next": 0}
    state = SCRIPT

    def add(turns):
        state["queues"] += [list(t) for t in turns]

    return add


def backend_for(config, tok, eos=None, model=None):
    """The local backend (scripted while a test's `script` runs), synced with `model` if given."""
    eos = [tok.eos_token_id] if eos is None else eos
    backend = ScriptedBackend(config, eos, tok, SCRIPT) if SCRIPT is not None else LocalBackend(config, eos, tok)
    if model is not None:
        backend.weights.sync(model, 0)
    return backend


OPEN_ENVIRONMENTS: list = []  # the environments `episode_sampler` loaded, closed after each test (conftest)


def episode_sampler(tok, config, env_cfg, return_kv=False, context=256, eos=None, group_size=1):
    eos = [tok.eos_token_id] if eos is None else eos
    environment = Environment.load(env_cfg)
    OPEN_ENVIRONMENTS.append(environment)
    return E.EpisodeSampler(config, group_size, env_cfg, environment, tok, eos, return_kv, context,
                            backend_for(config, tok, eos))


def sampler(tok, env="envs_for_tests:Calc", G=2, max_new=24, **env_kw):
    return episode_sampler(tok, SamplingParams(max_new_tokens=max_new), EnvConfig(factory=env, **env_kw),
                           True, group_size=G)


def sample(s, model, rows, seed=0):
    """The sampler's samples of `rows` at `model`'s weights (its backend synced first)."""
    s.backend.weights.sync(model, 0)
    return s.sample(rows, list(range(len(rows))), [torch.Generator().manual_seed(seed) for _ in rows]).samples


def text(tok, r, i):
    return tok.decode(torch.cat([r.prompt_ids[i], r.completion_ids[i]]))


def info(r, key):
    """Per episode, one field of its EpisodeInfo."""
    return [getattr(e, key) for e in r.episodes]




def tiny(dtype=torch.float64, seed=0):
    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    return (exact_norms(model) if dtype == torch.float64 else model), tok


def tiny_moe(seed=0):
    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg._experts_implementation = "eager"  # grouped_mm has no float64 CPU kernel
    return exact_norms(Qwen3MoeForCausalLM(cfg).to(torch.float64).eval()), tok


def run_cfg(tmp_path, name, *extra):
    return config.load(None, [
        'model.dtype="float64"', "train.steps=3", "train.prompts_per_step=2", "rollout.group_size=4",
        "rollout.max_new_tokens=6", "data.num_examples=32", "optim.lr=1e-2", "train.progress=false",
        "reward.functions=['rewards_for_tests:count_ones']", f'train.output_dir="{tmp_path / name}"',
        "train.plots=false", *extra])  # the plots' own tests turn them on


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rel(a, b):
    num = sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a) ** 0.5
    den = sum(float(b[k].double().norm() ** 2) for k in b) ** 0.5
    return num / den


def kill_the_server_then_step(t) -> None:
    """Kill the vLLM server of trainer `t` (its whole process group) and check that the next step stops
    with the error that names vllm.log and --resume; `t` is closed after."""
    import signal

    import pytest

    from backstream.rl.backends.vllm.server import ServerError

    server = t.parts.sampling.weights.pool.members[0].server
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    with pytest.raises(ServerError, match=r"vLLM .*(died|no answer).*vllm.log.*--resume"):
        t.train_step()
    t.close()
    t.run_folder.release()


def no_run_written(path):
    return not os.path.exists(path) or not os.listdir(path)


TOL = 1e-10


def assert_same(model, seqs, weights, **kw):
    g_ref, r_ref = grads(model, reference_backward, seqs, weights)
    g, r = grads(model, stream_backward, seqs, weights, **kw)
    assert g.keys() == g_ref.keys() and g
    # a parameter whose true gradient is 0 (q_proj when every query sees one key) holds rounding
    # noise only: relative_errors judges it against a thousandth of the largest gradient instead
    for n, err in relative_errors(g, g_ref).items():
        assert err <= TOL, f"{n}: relative error {err:.3g}"
    for i, (a, b) in enumerate(zip(r.logprobs, r_ref.logprobs)):
        active = weights[i] != 0
        assert torch.isnan(a[~active]).all()
        assert torch.allclose(a[active], b[active], atol=1e-12, rtol=0), f"log-probs of sequence {i}"
    return r


def rand_ids(n, gen):
    return torch.randint(0, VOCAB, (n,), generator=gen)


def group_batch(gen, prompt=9, lens=(5, 7, 3, 7)):
    """A GRPO group (shared prompt, unequal responses), a duplicate, a multi-turn continuation, an
    unrelated sequence, a one-token sequence and an all-zero-weight sequence: `verify`'s token tree
    over the whole vocabulary (the same draws as `rand_ids`)."""
    return token_tree(gen, torch.arange(VOCAB), prompt, lens)


V = 7


def problem(seed):
    """Three samples of one prompt (positions 0..3 shared) + one unrelated sequence."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (4,), generator=g)
    seqs, pos_index, n_pos = [], [], 4
    for n in (3, 5, 2):
        seqs.append(torch.cat([prompt, torch.randint(0, V, (n,), generator=g)]))
        pos_index.append(torch.cat([torch.arange(4), torch.arange(n_pos, n_pos + n)]))
        n_pos += n
    seqs.append(torch.randint(0, V, (6,), generator=g))
    pos_index.append(torch.arange(n_pos, n_pos + 6))
    n_pos += 6
    mask = [torch.arange(len(s)) >= 4 for s in seqs[:3]] + [torch.arange(6) >= 2]
    logits = torch.randn(n_pos, V, generator=g, dtype=torch.float64)
    adv = torch.tensor([0.7, -1.3, 0.0, 0.4], dtype=torch.float64)
    noise = lambda: [torch.randn(len(s), generator=g, dtype=torch.float64) * 0.3 for s in seqs]  # noqa: E731
    return seqs, pos_index, mask, logits, adv, noise(), noise(), g


def current_logprobs(logits, seqs, pos_index, active):
    out = []
    for s, p, a in zip(seqs, pos_index, active):
        lp = torch.full((len(s),), float("nan"), dtype=torch.float64)
        t = torch.nonzero(a).flatten()
        lp[t] = torch.log_softmax(logits[p[t - 1]], -1).gather(-1, s[t, None])[:, 0]
        out.append(lp)
    return out


def streamed_total(obj, logits_leaf, seqs, pos_index, parts, g, temperature=1.0):
    """Σ of obj's block terms over a random partition of its active targets into `parts` views,
    after `setup` with the current log-probs (what the engine's prefill hands it)."""
    active = obj.active(seqs)
    obj.setup(current_logprobs(logits_leaf.detach() / temperature, seqs, pos_index, active))
    offsets = flat_offsets([len(s) for s in seqs])
    targets = [(i, t) for i, a in enumerate(active) for t in torch.nonzero(a).flatten().tolist()]
    order = torch.randperm(len(targets), generator=g).tolist()
    cuts = sorted(torch.randint(0, len(targets) + 1, (parts - 1,), generator=g).tolist())
    total = logits_leaf.new_zeros(())
    for a, b in zip([0] + cuts, cuts + [len(targets)]):
        chunk = [targets[k] for k in order[a:b]]
        if not chunk:
            continue
        pos = [int(pos_index[i][t - 1]) for i, t in chunk]
        uniq = sorted(set(pos))
        view = BlockView(
            logits_PV=logits_leaf[uniq], row_pos_N=torch.tensor([uniq.index(p) for p in pos]),
            target_N=torch.tensor([int(seqs[i][t]) for i, t in chunk]), seq_N=torch.tensor([i for i, _ in chunk]),
            tok_N=torch.tensor([t for _, t in chunk]), flat_N=torch.tensor([offsets[i] + t for i, t in chunk]))
        total = total + obj.block_loss(view)
    return total


def engine_problem():
    gen = torch.Generator().manual_seed(3)
    P = torch.randint(0, 61, (7,), generator=gen)
    seqs = [torch.cat([P, torch.randint(0, 61, (n,), generator=gen)]) for n in (6, 4, 7, 5)]
    seqs.append(torch.randint(0, 61, (9,), generator=gen))
    mask = [torch.arange(len(s)) >= 7 for s in seqs[:4]] + [torch.arange(9) >= 3]
    adv = torch.tensor([1.2, -0.6, 0.0, -0.9, 0.5], dtype=torch.float64)
    return seqs, mask, adv, gen


def assert_streamed_equals_reference(model, cfg, seqs, **kw) -> dict:
    """The streamed backward (blocks of 3) against the naive one, each with its own objective of
    `cfg` over `kw`: every gradient within 1e-10 relative, the same metrics; returns the metrics."""
    obj = build_objective(cfg, sequences=seqs, **kw)
    g_ref = grads_of(model, reference_backward, seqs, obj)
    obj2 = build_objective(cfg, sequences=seqs, **kw)
    g = grads_of(model, stream_backward, seqs, obj2, block_size=3)
    assert g.keys() == g_ref.keys() and g
    for n, err in relative_errors(g, g_ref).items():
        assert err <= 1e-10, f"{n}: relative error {err:.3g}"
    m = obj2.metrics()
    for k, v in obj.metrics().items():
        assert abs(v - m[k]) < 1e-9, k
    return m


REPO = Path(__file__).resolve().parent.parent  # the repository: examples/, scripts/


def grads(model, fn, seqs, weights, **kw):
    model.zero_grad(set_to_none=True)
    res = fn(model, seqs, weights, **kw)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, res


def grads_of(model, fn, seqs, obj, **kw):
    model.zero_grad(set_to_none=True)
    fn(model, seqs, objective=obj, **kw)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def tiny_hybrid(dtype=torch.float64, seed=0):
    """A tiny Qwen3.5 (Gated DeltaNet, Gated DeltaNet, attention) with the default model's tokenizer: a
    hybrid with the states of issue 39. Float64 needs `keep_float64` around its calls (the Gated
    DeltaNet kernels compute in float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "linear_attention", "full_attention"], tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    return (exact_norms(model) if dtype == torch.float64 else model), tok


def tiny_mamba1(model_type: str = "jamba", dtype=torch.float64, seed: int = 0):
    """A Mamba 1 family's miniature (Jamba: Mamba 1 and attention layers, MoE every other; Mamba;
    Falcon-Mamba) with the default model's tokenizer (issue 55)."""
    from transformers import AutoModelForCausalLM

    from backstream.stream.miniature import miniature_config

    tok = build_tokenizer()
    cfg = miniature_config(model_type)
    cfg.vocab_size, cfg.eos_token_id, cfg.pad_token_id = len(tok), tok.eos_token_id, tok.pad_token_id
    cfg.tie_word_embeddings = True
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").to(dtype).eval()
    return (exact_norms(model) if dtype == torch.float64 else model), tok


# -- vLLM servers (tests/rl/vllm/) ----------------------------------------------------------------

KEY = "test-key-1"


def vllm_python() -> str:
    """The vLLM environment's python: built here if it is missing (a few minutes, once per machine)."""
    from backstream.rl.backends.vllm.setup import default_dir, python_of, setup

    python = python_of(default_dir())
    return str(python if python.is_file() else setup())


def children(pid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
        except (OSError, IndexError):
            continue
    return out

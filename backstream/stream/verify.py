"""`verify`: does the streamed backward compute the exact gradient on this architecture? (issue 7,
DESIGN §6b.)

The engine drives a model through transformers' Cache and attention interface, which is exact only
if the model keeps the family contract (plain softmax attention over the K/V the cache returned,
positions only through `position_ids`, a deterministic forward). The run-time guards refuse what they
can see; this module checks the rest by experiment, per architecture:

1. `miniature(config)` builds a tiny random model of the same architecture from config.json alone:
   same `model_type` and the same attention / RoPE (type and parameters, the head-dim-sized ones
   resized) / sliding-window / chunked / MoE / MLA / soft-capping settings, 2 layers (more when that
   is what it takes to keep one layer of every `layer_types` entry), width 32, 4 heads, 2 K/V heads,
   head_dim 8, vocabulary 61, windows and chunks of 4 and RoPE lengths of 8–12 so that the test
   sequences cross them; float64, eager attention, random weights (norms and other constant-initialised
   tensors included, so that a missed one shows).
2. `verify(model_or_config)` runs `stream_backward` against `reference_backward` on a token tree with
   every shape a trainer makes (a GRPO group on a shared prompt, a second turn on top of one response,
   a duplicate, a one-token and a zero-weight sequence, an unrelated sequence) at block sizes 1, 3 and
   16, and compares every parameter's gradient with the rule of the engine tests (relative error,
   judged against a thousandth of the largest gradient for parameters whose true gradient is ~0).

Verdicts: `exact` (every error ≤ 1e-10), `refused: <reason>` (the engine said it cannot: a
`model:` error), `wrong` (it ran and differs: the worst outcome), `could not build: <reason>` (the
miniature or the reference itself failed) and `error: <exception>` (stream_backward crashed).

HF code computes norms, routers and the eager softmax in float32 even in a float64 model; that 1e-7
noise would hide a real error (or fake one), so the comparison runs under `keep_float64`, which turns
every float32/16 cast into float64.
"""

from __future__ import annotations

import copy
import math
import os
import time
import types
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from backstream.stream.hf import EXPERT_KEYS, TOP_K_KEYS, base_model

TOL = 1e-10
BLOCK_SIZES = (1, 3, 16)
VERIFY_KINDS = ("exact", "refused", "could not build", "wrong", "error")  # the values of VerifyReport.kind

# the miniature's sizes
WIDTH, HEADS, HEAD_DIM, FFN, MOE_FFN, VOCAB, RANK = 32, 4, 8, 48, 16, 61, 16
EXPERTS, TOP_K = 4, 2
WINDOW = 4  # sliding window and attention chunk: the test sequences (up to 18 tokens) cross it
MAX_POSITIONS = 64
ROPE_ORIGINAL = 8  # longrope / yarn / llama3 pretraining length: sequences cross it
ROPE_DYNAMIC_MAX = 12  # dynamic NTK grows its frequencies past max_position_embeddings
MAX_LAYERS = 6


# ---------------------------------------------------------------------------------------------
# float64 all the way down


_LOW = (torch.float32, torch.float16, torch.bfloat16)


class keep_float64(TorchFunctionMode):  # noqa: N801  (used as a context manager, like torch.no_grad)
    """Within this context every cast or allocation in float32/float16/bfloat16 is done in float64
    instead: HF's RMSNorm, MoE routers, RoPE tables and the eager softmax upcast to float32 on purpose,
    which in a float64 model rounds to 1e-7 and would hide (or fake) a real error."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") in _LOW:
            kwargs = {**kwargs, "dtype": torch.float64}
        if func in (Tensor.float, Tensor.half, Tensor.bfloat16):
            func, args = Tensor.double, args[:1]
        elif func in (Tensor.to, Tensor.type) and any(a in _LOW for a in args[1:]):
            args = tuple(torch.float64 if a in _LOW else a for a in args)
        return func(*args, **kwargs)


def exact_norms(model):
    """Run every RMSNorm (and MoE top-k router) of a float64 model under `keep_float64`, so that the
    norm keeps its own formula (Llama's w·x̂, Gemma's (1+w)·x̂, gated or weightless variants) but
    computes in float64. HF computes them in float32 even in a float64 model (DESIGN §2)."""
    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm") or name.endswith("TopKRouter"):
            if getattr(mod.forward, "_keeps_float64", False):
                continue
            mod._forward_before_float64 = mod.__dict__.get("forward")  # an earlier per-instance patch, if any
            mod.forward = types.MethodType(_float64_forward, mod)  # bound: a deepcopy binds to the copy
    return model


def _float64_forward(self, *args, **kwargs):
    inner = self._forward_before_float64 or types.MethodType(type(self).forward, self)
    with keep_float64():
        return inner(*args, **kwargs)


_float64_forward._keeps_float64 = True


# ---------------------------------------------------------------------------------------------
# The miniature


def load_config(model_or_config):
    """A transformers config from a config, a model (PEFT too), "default", a local folder, a
    transformers model_type name ("llama") or a Hub id (only config.json is read; a cached one works
    with HF_HUB_OFFLINE=1)."""
    from transformers import AutoConfig, PretrainedConfig  # noqa: PLC0415
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: PLC0415

    x = model_or_config
    if isinstance(x, PretrainedConfig):
        return copy.deepcopy(x)
    if isinstance(x, nn.Module):
        base = base_model(x)
        if not isinstance(getattr(base, "config", None), PretrainedConfig):
            raise TypeError(f"model: {type(x).__name__} has no transformers config")
        return copy.deepcopy(base.config)
    if not isinstance(x, (str, os.PathLike)):
        raise TypeError("model: expected a config, a model, a folder, a model_type or a Hub id, "
                        f"got {type(x).__name__}")
    name = os.fspath(x)
    if name == "default":
        from backstream.default_model import DEFAULT_MODEL_DIR  # noqa: PLC0415

        return AutoConfig.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    if os.path.isdir(name):
        return AutoConfig.from_pretrained(name, local_files_only=True)
    if name in CONFIG_MAPPING:
        return AutoConfig.for_model(name)
    if name.startswith((".", os.sep, "~")) or name.count("/") > 1:  # a path, not a Hub id "org/name"
        raise FileNotFoundError(f"model: {name!r} is no folder here; pass a folder holding config.json, a "
                                "transformers model_type (e.g. llama) or a Hub id (org/name)")
    return AutoConfig.from_pretrained(name)


def _causal_config(config):
    """The config to build: a multimodal/composite config whose text part is a causal LM of its own
    (Gemma 3, Llama 4, ...) is verified through that text model, whose attention is the one trained."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: PLC0415

    text = config.get_text_config(decoder=True)
    if text is not config and getattr(text, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return text
    return config


_LAYER_COUNT = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_WIDTH = ("hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
          "encoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups")
_FFN = ("ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_ff", "ffn_hidden_size")
_EXPERTS, _TOP_K = EXPERT_KEYS, TOP_K_KEYS
_SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_AT_MOST_ONE = (*_SHARED_EXPERTS, "n_group", "num_expert_group", "topk_group", "first_k_dense_replace",
                "num_dense_layers", "num_kv_shared_layers")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx")
_WINDOWS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "window_size")
_SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
                "unk_token_id": 3, "sep_token_id": 4, "cls_token_id": 5, "mask_token_id": 6}
_NOT_PER_LAYER = ("architectures", "suppress_tokens", "begin_suppress_tokens")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kept_layers(d: dict, L0: int) -> list[int]:
    """Indices of the original layers to keep: one of every `layer_types` entry, then one of every
    value of the other per-layer lists (few distinct values: NoPE flags, MLP kinds), at least 2."""
    lists = [(k, v) for k, v in d.items() if isinstance(v, list) and len(v) == L0 and not _is_index_list(v, L0)
             and k not in _NOT_PER_LAYER and not k.endswith(("token_id", "token_ids"))]
    lists.sort(key=lambda kv: kv[0] != "layer_types")
    kept: list[int] = []
    for k, v in lists:
        distinct = list(dict.fromkeys(map(repr, v)))
        if k != "layer_types" and (len(distinct) > 4 or len(kept) >= MAX_LAYERS):
            continue
        for val in distinct:
            if not any(repr(v[i]) == val for i in kept):
                kept.append(next(i for i in range(L0) if repr(v[i]) == val))
    for i in range(L0):
        if len(kept) >= 2:
            break
        if i not in kept:
            kept.append(i)
    return sorted(kept)


def _is_index_list(v, L0: int) -> bool:
    """[0, 4, 8]: layer indices (strictly increasing ints below the layer count), not one value per layer."""
    return (bool(v) and all(_is_int(x) for x in v) and all(a < b for a, b in zip(v, v[1:]))
            and v[-1] < L0 and not (len(v) == L0 and v[0] != 0))


def _same_width(key, i: int):
    return i if isinstance(key, int) else str(i).zfill(len(key))


def _shrink_override(o, d: dict):
    """A per-layer override ({"head_dim": 512} on some layers): each size keeps its ratio to the global
    value (a head twice as wide stays twice as wide); the caller shrinks the global values after."""
    if not isinstance(o, dict):
        return o
    tiny = _shrink({k: v for k, v in d.items() if k in o})
    out = dict(o)
    for k, v in o.items():
        g, t = d.get(k), tiny.get(k)
        if _is_int(v) and _is_int(g) and _is_int(t) and g > 0:
            out[k] = max(1, t * v // g) if (t * v) % g == 0 else t
    return out


def _resize(values: list, n: int) -> list:
    """A per-frequency list (longrope short/long factors) resampled to n entries."""
    if len(values) == n:
        return list(values)
    return [values[round(i * (len(values) - 1) / max(n - 1, 1))] for i in range(n)]


def _shrink_rope(rp: dict | None, rotary_dim: int, dynamic_max: list) -> dict | None:
    if not isinstance(rp, dict):
        return rp
    rp = dict(rp)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if "original_max_position_embeddings" in rp or kind in ("longrope", "yarn", "llama3"):
        rp["original_max_position_embeddings"] = ROPE_ORIGINAL
    for key in ("short_factor", "long_factor"):
        if isinstance(rp.get(key), list):
            rp[key] = _resize(rp[key], max(rotary_dim // 2, 1))
    if kind == "dynamic":
        dynamic_max.append(True)
    return rp


def _keep_rotary_dims(d: dict) -> None:
    """Partial RoPE (a factor of 1/8 or 1/4 of each head): widen the heads so that at least 4
    channels rotate, rather than none."""
    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    parts = [rp, *(x for x in rp.values() if isinstance(x, dict))]
    factors = [x.get("partial_rotary_factor") for x in parts] + [d.get("partial_rotary_factor"), d.get("rotary_pct")]
    factors = [f for f in factors if isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < 1]
    if not factors:
        return
    head = d["head_dim"] if _is_int(d.get("head_dim")) else WIDTH // HEADS
    need = math.ceil(4 / min(factors))
    need += need % 2
    if head * min(factors) >= 4:
        return
    if _is_int(d.get("head_dim")):
        d["head_dim"] = need
    else:
        for k in _WIDTH:
            if _is_int(d.get(k)):
                d[k] = HEADS * need


def _shrink(d: dict) -> dict:
    """The tiny version of one config dict (see the module docstring); generic by attribute name."""
    d = dict(d)
    L0 = next((d[k] for k in _LAYER_COUNT if _is_int(d.get(k))), None)
    heads0 = next((d[k] for k in _HEADS if _is_int(d.get(k))), None)
    if L0:
        kept = _kept_layers(d, L0)
        for k, v in list(d.items()):
            if not isinstance(v, list) or k in _NOT_PER_LAYER:
                continue
            if _is_index_list(v, L0) and (k.endswith(("layers", "layer_ids", "layers_idx")) or len(v) == L0):
                d[k] = [kept.index(i) for i in v if i in kept]
            elif len(v) == L0 and not k.endswith(("token_id", "token_ids")):
                d[k] = [v[i] for i in kept]
        for k, v in list(d.items()):
            if isinstance(v, dict) and v and all(str(i).isdigit() and int(i) < L0 for i in v):
                # per-layer overrides keyed by layer index ({"05": {"head_dim": 512}}): follow the kept layers
                d[k] = {_same_width(i, kept.index(int(i))): _shrink_override(o, d)
                        for i, o in v.items() if int(i) in kept}
        for k in _LAYER_COUNT:
            if _is_int(d.get(k)):
                d[k] = len(kept)
        for k in ("num_layers_per_stack",):  # layers reused in cycles (HRM): a stack of the kept ones
            if _is_int(d.get(k)):
                d[k] = min(d[k], len(kept))
    # some of transformers' default configs leave these unset (HunYuan, Nemotron)
    if "head_dim" in d and d["head_dim"] is None:
        d["head_dim"] = HEAD_DIM
    for k in _KV_HEADS:
        if k in d and d[k] is None:
            d[k] = HEADS
    if "is_decoder" in d:  # encoder families used as causal LMs (BERT-likes) need it
        d["is_decoder"] = True
    for k, v in list(d.items()):
        if v is None or isinstance(v, bool):
            continue
        if k in _WIDTH and _is_int(v):
            d[k] = WIDTH
        elif k in _HEADS and _is_int(v):
            d[k] = HEADS
        elif k in _KV_HEADS and _is_int(v):
            d[k] = HEADS if v == heads0 else 1 if v == 1 else 2  # keep MHA / MQA / GQA
        elif k in _FFN or (k.endswith("intermediate_size") and _is_int(v)):
            d[k] = MOE_FFN if ("moe" in k or "expert" in k) else FFN
        elif k.endswith(("n_heads", "num_heads")) and _is_int(v) and v > 1:
            d[k] = HEADS  # state-space / linear-attention heads (mamba_n_heads, linear_num_heads)
        elif k.endswith(("d_head", "d_state", "state_size")) and _is_int(v) and v > 1:
            d[k] = HEAD_DIM
        elif k.endswith("head_dim") and _is_int(v):
            d[k] = {"qk_rope_head_dim": 4, "qk_head_dim": 12}.get(k, HEAD_DIM)  # MLA: nope 8 + rope 4
        elif k.endswith("_rank") and _is_int(v) and v > 0:
            d[k] = RANK  # MLA kv_lora_rank / q_lora_rank, low-rank adapters of the architecture
        elif (k.endswith("vocab_size") and k != "type_vocab_size") or k.startswith("vocab_size"):
            d[k] = VOCAB if _is_int(v) else v
        elif k in _EXPERTS and _is_int(v) and v > 1:
            d[k] = EXPERTS
        elif k in _TOP_K and _is_int(v):
            d[k] = min(v, TOP_K)
        elif k in _AT_MOST_ONE and _is_int(v):
            d[k] = min(v, 1)
        elif k in _POSITIONS and _is_int(v):
            d[k] = MAX_POSITIONS
        elif k in _WINDOWS and _is_int(v) and v > 0:
            d[k] = WINDOW
        elif k.endswith("logit_softcapping") and isinstance(v, (int, float)) and v > 0:
            d[k] = 2.0  # a cap the tiny model's logits reach, so that soft-capping does visible work
        elif k == "rotary_dim" and _is_int(v):
            d[k] = 4
        elif k == "hidden_size_per_layer_input" and _is_int(v):
            d[k] = HEAD_DIM
    # transformers' default config of some MoE families leaves the expert counts unset (dots1)
    if _is_int(d.get("moe_intermediate_size")):
        for keys, val in ((_EXPERTS, EXPERTS), (_TOP_K, TOP_K), (_SHARED_EXPERTS, 1)):
            for k in keys:
                if k in d and d[k] is None:
                    d[k] = val
    # MLA (DeepSeek V2/V3, MiniCPM3, ...): the RoPE part of a head is what `head_dim` means there
    if _is_int(d.get("kv_lora_rank")) and _is_int(d.get("qk_rope_head_dim")) and "head_dim" in d:
        d["head_dim"] = d["qk_rope_head_dim"]
    _keep_rotary_dims(d)
    # state-space heads (Mamba 2, Bamba, Granite hybrids) must tile expand × hidden exactly
    for pre in ("", "mamba_"):
        expand, heads = d.get(pre + "expand"), d.get(pre + "n_heads", d.get(pre + "num_heads"))
        head_key = next((pre + k for k in ("d_head", "head_dim") if _is_int(d.get(pre + k))), None)
        width = next((d[k] for k in _WIDTH if _is_int(d.get(k))), WIDTH)
        if _is_int(expand) and _is_int(heads) and head_key and (width * expand) % heads == 0:
            d[head_key] = width * expand // heads
            if _is_int(d.get(pre + "d_ssm")):
                d[pre + "d_ssm"] = width * expand
    if _is_int(d.get("qk_nope_head_dim")) and _is_int(d.get("qk_rope_head_dim")) and "qk_head_dim" in d:
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    # RoPE: lengths the test sequences cross, per-frequency lists resized to the new rotary dim
    head_dim = d.get("head_dim") if _is_int(d.get("head_dim")) else WIDTH // HEADS
    rp = d.get("rope_parameters")
    dynamic: list = []
    if isinstance(rp, dict):
        nested = all(isinstance(x, dict) or x is None for x in rp.values()) and rp
        sub = rp.items() if nested else [(None, rp)]
        out = {}
        for key, p in sub:
            factor = (p or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
            out[key] = _shrink_rope(p, int(head_dim * factor), dynamic)
        d["rope_parameters"] = out if nested else out[None]
    if _is_int(d.get("original_max_position_embeddings")):
        d["original_max_position_embeddings"] = ROPE_ORIGINAL
    if dynamic:
        for k in _POSITIONS:
            if _is_int(d.get(k)):
                d[k] = ROPE_DYNAMIC_MAX
    for k, val in _SPECIAL_IDS.items():
        v = d.get(k)
        if _is_int(v):
            d[k] = val
        elif isinstance(v, list) and v:
            d[k] = [val]
    d.pop("_name_or_path", None)
    return d


def _rebuild(config, d: dict):
    cls = type(config)
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict") and isinstance(d.get(key), dict):
            d[key] = _shrink(sub.to_dict())
    return cls.from_dict(d)


def miniature_config(config):
    """The tiny config of `config`'s architecture (see the module docstring)."""
    config = _causal_config(load_config(config))
    mini = _rebuild(config, _shrink(config.to_dict()))
    for c in [mini, *(getattr(mini, k, None) for k in getattr(mini, "sub_configs", {}) or {})]:
        if c is not None and hasattr(c, "model_type"):
            c._experts_implementation = "eager"  # grouped_mm has no float64 CPU kernel
    return mini


def miniature(config, *, seed: int = 0, training: bool = False):
    """A float64 tiny random model with `config`'s architecture (a config object, "default", a
    folder, a model_type or a Hub id; only config.json is read). Eager attention (the family's own
    reference math: soft-capping, sinks), norms through `exact_norms`, eval mode unless `training`."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    mini = miniature_config(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(mini, attn_implementation="eager")
    model = model.to(torch.float64).train(training)
    _randomize(model)
    return exact_norms(model)


def _randomize(model: nn.Module) -> None:
    """Random values where HF's init puts constants (norm weights at 1, biases and gates at 0,
    attention sinks): a parameter the streamed path mishandles must not hide behind a constant."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point or p.numel() == 0:
                continue
            if "norm" in name.lower() and p.dim() == 1 and not name.endswith("bias"):
                p.uniform_(0.5, 1.5)
            elif bool((p == p.flatten()[0]).all()):
                c = float(p.flatten()[0])
                if c == 0:
                    p.normal_(0.0, 0.02)
                else:
                    p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))


def _special_ids(config) -> set[int]:
    ids = set()
    for c in [config, config.get_text_config()]:
        for k, v in c.to_dict().items():
            if k.endswith(("token_id", "token_index", "token_ids")):
                for x in v if isinstance(v, list) else [v]:
                    if _is_int(x):
                        ids.add(x)
    return ids


# ---------------------------------------------------------------------------------------------
# The comparison


_ROLES = (  # first match wins; names lower-cased
    ("lm_head", ("lm_head", "embed_out", "output_layer")),
    ("embed", ("embed", "wte", "wpe", "word_embeddings", "position_embeddings")),
    ("norm", ("norm", "ln_", ".ln", "layernorm")),
    ("router/experts", ("router", "expert", ".gate.", ".gate_weight", "moe", "e_score_correction")),
)
_ATTN = (("attn.qkv", ("qkv", "c_attn", "query_key_value", "kv_a_proj", "kv_b_proj", "kv_proj")),
         ("attn.q", ("q_proj", "q_a_proj", "q_b_proj", "query", ".wq", ".q.")),
         ("attn.k", ("k_proj", ".key", ".wk", ".k.")),
         ("attn.v", ("v_proj", ".value", ".wv", ".v.")),
         ("attn.o", ("o_proj", "out_proj", "c_proj", "dense", ".wo", ".o.")))
_MLP = ("mlp", "ffn", "feed_forward", "fc1", "fc2", "c_fc", "gate_proj", "up_proj", "down_proj")
ROLE_ORDER = ("embed", "attn.q", "attn.k", "attn.v", "attn.qkv", "attn.o", "attn.other", "mlp",
              "router/experts", "norm", "lm_head", "other")


def role(name: str) -> str:
    """The role of a parameter from its name: embed, attn.q/k/v/qkv/o/other, mlp, router/experts,
    norm, lm_head or other (LoRA tensors take the role of the layer they adapt)."""
    n = name.lower()
    for r, pats in _ROLES:
        if any(p in n for p in pats):
            return r
    if any(p in n for p in ("attn", "attention", "sinks", "mixer")):
        return next((r for r, pats in _ATTN if any(p in n for p in pats)), "attn.other")
    if any(p in n for p in _MLP):
        return "mlp"
    return next((r for r, pats in _ATTN if any(p in n for p in pats)), "other")


def _tree(gen: torch.Generator, allowed: Tensor, prompt=9, lens=(5, 7, 3, 7)):
    """The token tree of tests/test_engine.py's `group_batch`: a GRPO group (shared prompt, unequal
    responses), a duplicate, a second turn on top of response 0, an unrelated sequence, a one-token
    sequence and a zero-advantage response."""
    ids = lambda n: allowed[torch.randint(0, len(allowed), (n,), generator=gen)]  # noqa: E731
    P = ids(prompt)
    seqs = [torch.cat([P, ids(n)]) for n in lens]
    seqs.append(seqs[1].clone())
    seqs.append(torch.cat([seqs[0], ids(4)]))
    seqs.append(ids(6))
    seqs.append(ids(1))
    seqs.append(torch.cat([P, ids(5)]))
    weights = [torch.randn(len(s), generator=gen, dtype=torch.float64) for s in seqs]
    for i, w in enumerate(weights):
        w[0] = 0
        if i < len(lens) + 2:
            w[:prompt] = 0
    weights[-1].zero_()
    weights[-2].zero_()
    return seqs, weights


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _errors(g: dict, g_ref: dict) -> dict[str, float]:
    """Per parameter, the relative error of tests/test_engine.py's `assert_same`: ‖g − g_ref‖ over
    ‖g_ref‖, or over a thousandth of the largest reference gradient when that is larger (a parameter
    whose true gradient is 0 holds rounding noise only)."""
    floor = 1e-3 * max(float(x.norm()) for x in g_ref.values())
    out = {}
    for n in g_ref.keys() | g.keys():
        ref = g_ref.get(n)
        got = g.get(n)
        if ref is None:
            ref = torch.zeros_like(got)
        if got is None:
            got = torch.zeros_like(ref)
        err = float((got - ref).norm()) / max(float(ref.norm()), floor, 1e-300)
        out[n] = err if math.isfinite(err) else math.inf
    return out


def _logprob_error(lp, lp_ref, weights) -> float:
    worst = 0.0
    for a, b, w in zip(lp, lp_ref, weights):
        m = w != 0
        if not m.any():
            continue
        d = (a[m].double() - b[m].double()).abs()
        worst = max(worst, math.inf if torch.isnan(d).any() else float(d.max()))
    return worst


# ---------------------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    """What `verify` found. `errors[role]` holds the worst relative gradient error of that role's
    parameters at each of `block_sizes` (None where that run did not happen)."""

    model_type: str
    verdict: str  # "exact" | "refused: …" | "wrong" | "could not build: …" | "error: …"
    architecture: str = ""
    features: dict = field(default_factory=dict)
    block_sizes: tuple = BLOCK_SIZES
    errors: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # role → number of parameter tensors with a gradient
    logprob_error: list = field(default_factory=list)  # per block size
    worst_parameter: str = ""
    seconds: float = 0.0
    tolerance: float = TOL

    @property
    def ok(self) -> bool:
        return self.verdict == "exact"

    @property
    def kind(self) -> str:
        """exact, refused, wrong, could not build or error."""
        return self.verdict.split(":", 1)[0]

    @property
    def reason(self) -> str:
        if self.kind == "wrong":
            return f"{self.worst_parameter}: relative error {self.worst:.2g}" if self.worst is not None else ""
        return self.verdict.split(":", 1)[1].strip() if ":" in self.verdict else ""

    @property
    def worst(self) -> float | None:
        vals = [x for row in self.errors.values() for x in row if x is not None]
        vals += [x for x in self.logprob_error if x is not None]
        return max(vals) if vals else None

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "verdict": self.verdict, "kind": self.kind, "reason": self.reason,
                "worst_error": self.worst, "architecture": self.architecture, "features": self.features,
                "block_sizes": list(self.block_sizes), "errors": self.errors, "tensors": self.tensors,
                "logprob_error": self.logprob_error, "worst_parameter": self.worst_parameter,
                "seconds": round(self.seconds, 2), "tolerance": self.tolerance}

    def __str__(self) -> str:
        fmt = lambda x: "-" if x is None else f"{x:.1e}"  # noqa: E731
        lines = [f"backstream verify: {self.model_type}" + (f" ({self.architecture})" if self.architecture else "")]
        if self.features:
            lines.append("miniature: " + ", ".join(f"{k} {v}" for k, v in self.features.items()))
        if self.errors:
            lines.append("")
            head = f"{'parameters':<16}{'tensors':>8}" + "".join(f"{f'block {b}':>11}" for b in self.block_sizes)
            lines.append(head)
            lines.append("-" * len(head))
            for r in ROLE_ORDER:
                if r in self.errors:
                    cells = "".join(f"{fmt(x):>11}" for x in self.errors[r])
                    lines.append(f"{r:<16}{self.tensors.get(r, 0):>8}" + cells)
            lines.append(f"{'log-probs':<16}{'':>8}" + "".join(f"{fmt(x):>11}" for x in self.logprob_error))
            lines.append("")
        tail = f"verdict: {self.verdict}"
        if self.kind == "wrong":
            tail += f" ({self.reason}; tolerance {self.tolerance:.0e})"
        elif self.kind == "exact" and self.worst is not None:
            tail += f" (worst relative error {self.worst:.1e} <= {self.tolerance:.0e})"
        lines.append(tail + f"  [{self.seconds:.1f} s]")
        return "\n".join(lines)


def _get(c, key: str):
    try:  # heterogeneous configs raise on per-layer attributes read globally
        return getattr(c, key, None)
    except Exception:  # noqa: BLE001
        return None


def _features(model: nn.Module) -> dict:
    """The miniature's features worth printing (what makes the architecture what it is)."""
    c = model.config.get_text_config()
    out = {"layers": _get(c, "num_hidden_layers")}
    lt = _get(c, "layer_types")
    if lt:
        out["layer_types"] = "/".join(dict.fromkeys(map(str, lt)))
    rp = _get(c, "rope_parameters") or {}
    nested = rp and all(isinstance(x, dict) or x is None for x in rp.values())
    kinds = {p.get("rope_type") for p in (rp.values() if nested else [rp]) if isinstance(p, dict)}
    kinds -= {"default", None}
    if kinds:
        out["rope"] = "/".join(sorted(map(str, kinds)))
    for k in (*_WINDOWS, "kv_lora_rank", "q_lora_rank", "attn_logit_softcapping", "final_logit_softcapping"):
        v = _get(c, k)
        if v is not None and v is not False and v != 0:
            out[k] = v
    for k in _EXPERTS:
        v = _get(c, k)
        if _is_int(v) and v > 1:
            top = next((_get(c, t) for t in _TOP_K if _is_int(_get(c, t))), "?")
            out["experts"] = f"{v} top-{top}"
            break
    peft = getattr(model, "peft_config", None)
    if peft:
        out["lora"] = f"r={next(iter(peft.values())).r}"
    if model.training:
        out["mode"] = "train"
    return {k: v for k, v in out.items() if v is not None}


def _lora(mini: nn.Module, model: nn.Module):
    """The PEFT LoRA config of `model` applied to the miniature (random A and B, float64)."""
    peft_cfg = getattr(model, "peft_config", None)
    if not peft_cfg:
        return mini
    from peft import get_peft_model  # noqa: PLC0415

    name = getattr(model, "active_adapter", None)
    chosen = peft_cfg.get(name) if isinstance(name, str) and name in peft_cfg else next(iter(peft_cfg.values()))
    cfg = copy.deepcopy(chosen)
    if getattr(cfg, "peft_type", None) is None or str(getattr(cfg.peft_type, "value", cfg.peft_type)) != "LORA":
        raise NotImplementedError(f"model: only LoRA adapters are verified, got {cfg.peft_type}")
    cfg.init_lora_weights = False  # B ≠ 0: every LoRA tensor gets a gradient
    cfg.inference_mode = False
    layers = getattr(cfg, "layers_to_transform", None)
    if layers is not None:  # the miniature has 2 layers: adapt the same relative part of the stack
        cfg.layers_to_transform = (None if isinstance(layers, int) and layers > 1
                                   else [0] if isinstance(layers, int) else None)
    pm = get_peft_model(mini, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(torch.float64)
    return pm


def _is_refusal(e: BaseException) -> bool:
    from backstream.stream.family import Unsupported  # noqa: PLC0415

    msg = str(e).lstrip()
    return isinstance(e, (Unsupported, NotImplementedError, TypeError, ValueError)) and msg.startswith(("model:", "kv"))


def _short(e: BaseException, n: int = 300) -> str:
    msg = " ".join(str(e).split())
    return (msg[:n] + "…") if len(msg) > n else msg


def verify(model_or_config, *, seed: int = 0, block_sizes=BLOCK_SIZES, stage=None) -> VerifyReport:
    """Check on a miniature of the architecture that `stream_backward` gives the gradient of
    `reference_backward` (see the module docstring). `model_or_config`: a model (its config; a PEFT
    LoRA model also gets the same LoRA config; a model in train mode is verified in train mode), a
    config, "default", a local folder, a transformers model_type or a Hub id (config.json only).
    `stage`, if given, is called with the name of each step (for progress and time limits)."""
    from backstream.stream.engine import stream_backward  # noqa: PLC0415
    from backstream.stream.reference import reference_backward  # noqa: PLC0415

    t0 = time.perf_counter()
    say = stage or (lambda s: None)
    label = model_or_config if isinstance(model_or_config, str) else ""
    rep = VerifyReport(model_type=str(label), verdict="", block_sizes=tuple(block_sizes))

    def done(verdict: str) -> VerifyReport:
        rep.verdict, rep.seconds = verdict, time.perf_counter() - t0
        return rep

    say("build")
    try:
        config = load_config(model_or_config)
        rep.model_type = getattr(config, "model_type", "") or rep.model_type
        is_model = isinstance(model_or_config, nn.Module)
        mini = miniature(config, seed=seed, training=bool(is_model and model_or_config.training))
        if is_model:
            mini = _lora(mini, model_or_config)
        rep.architecture = type(base_model(mini)).__name__
        rep.features = _features(mini)
        gen = torch.Generator().manual_seed(seed)
        allowed = torch.tensor([i for i in range(VOCAB) if i not in _special_ids(base_model(mini).config)])
        seqs, weights = _tree(gen, allowed)
    except Exception as e:  # noqa: BLE001  (anything the config or transformers raise)
        return done(f"could not build: {type(e).__name__}: {_short(e)}")

    def run(fn, **kw):
        mini.zero_grad(set_to_none=True)
        threads = torch.get_num_threads()
        # a width-32 model gains nothing from threads, and on a busy machine their spinning costs 10x
        torch.set_num_threads(1)
        try:
            with keep_float64():
                res = fn(mini, seqs, weights, **kw)
        finally:
            torch.set_num_threads(threads)
        return _grads(mini), res

    results, failure = {}, None
    for b in block_sizes:
        say(f"stream_backward block {b}")
        try:
            results[b] = run(stream_backward, block_size=b)
        except Exception as e:  # noqa: BLE001
            failure = e
            break
    # the reference decides whether the miniature runs at all: an engine refusal or crash on a
    # model that cannot even run its own forward and backward says nothing about the engine
    say("reference")
    try:
        g_ref, r_ref = run(reference_backward)
    except Exception as e:  # noqa: BLE001
        if _is_refusal(e):  # reference_backward checks the model as stream_backward does
            return done(f"refused: {_short(e)}")
        return done(f"could not build: the reference backward failed: {type(e).__name__}: {_short(e)}")
    if failure is not None and _is_refusal(failure):
        return done(f"refused: {_short(failure)}")
    if not g_ref or max(float(x.norm()) for x in g_ref.values()) == 0:
        return done("could not build: the reference backward computed no gradient")
    if failure is not None:
        return done(f"error: {type(failure).__name__}: {_short(failure)}")

    roles = {n: role(n) for n in g_ref}
    for n, r in roles.items():
        rep.tensors[r] = rep.tensors.get(r, 0) + 1
    rep.errors = {r: [None] * len(block_sizes) for r in rep.tensors}
    worst = (-1.0, "")
    for j, b in enumerate(block_sizes):
        g, res = results[b]
        for n, err in _errors(g, g_ref).items():
            r = roles.get(n) or role(n)
            rep.errors.setdefault(r, [None] * len(block_sizes))
            rep.errors[r][j] = max(err, rep.errors[r][j] or 0.0)
            if err > worst[0]:
                worst = (err, f"{n} (block {b})")
        rep.logprob_error.append(_logprob_error(res.logprobs, r_ref.logprobs, weights))
        if rep.logprob_error[-1] > worst[0]:
            worst = (rep.logprob_error[-1], f"log-probs (block {b})")
    rep.worst_parameter = worst[1]
    return done("exact" if rep.worst is not None and rep.worst <= TOL else "wrong")

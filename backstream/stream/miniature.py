"""`miniature`: a float64 tiny random model of any transformers causal-LM architecture, built from
config.json alone, on which `backstream.stream.verify` checks the streamed backward (issue 7,
docs/design.md §6b).

`miniature(config)` keeps the `model_type` and the attention / RoPE (type and parameters, the
head-dim-sized ones resized) / sliding-window / chunked / MoE / MLA / soft-capping settings, and
shrinks the rest: 2 layers (more when that is what it takes to keep one layer of every
`layer_types` entry), width 32, 4 heads, 2 K/V heads, head_dim 8, vocabulary 61, windows and chunks
of 4 and RoPE lengths of 8–12 so that the test sequences cross them; float64, eager attention,
random weights (norms and other constant-initialised tensors included, so that a missed one shows).
The config is shrunk by key name, not by family: a table of per-key rules (`RULES`, first match
wins) and a few structural passes (kept layers and per-layer lists, MLA and state-space head sizes,
RoPE), so that a family nobody listed gets a miniature too.

HF code computes norms, routers and the eager softmax in float32 even in a float64 model; that 1e-7
noise would hide a real error (or fake one), so `keep_float64` turns every float32/16 cast into
float64 and `exact_norms` runs the norms and routers under it.
"""

from __future__ import annotations

import copy
import math
import os
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from backstream.stream.hf import EXPERT_KEYS, TOP_K_KEYS, base_model, locate

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


class keep_float64(TorchFunctionMode):
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
    computes in float64. HF computes them in float32 even in a float64 model (docs/design.md §2)."""
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
# The config to shrink


def load_config(model_or_config):
    """A transformers config from a config, a model (PEFT too), "default", a local folder, a
    transformers model_type name ("llama") or a Hub id (only config.json is read; a cached one works
    with HF_HUB_OFFLINE=1)."""
    from transformers import AutoConfig, PretrainedConfig  # noqa: PLC0415
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
    kind = locate(name, "model", model_types=True)  # a ValueError, at once, for anything else
    if kind == "folder":
        return AutoConfig.from_pretrained(name, local_files_only=True)
    if kind == "type":
        return AutoConfig.for_model(name)
    return AutoConfig.from_pretrained(name)


def _causal_config(config):
    """The config to build: a multimodal/composite config whose text part is a causal LM of its own
    (Gemma 3, Llama 4, ...) is verified through that text model, whose attention is the one trained."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: PLC0415

    text = config.get_text_config(decoder=True)
    if text is not config and getattr(text, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return text
    return config


# ---------------------------------------------------------------------------------------------
# Shrinking a config dict

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
WINDOW_KEYS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "window_size")
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



# -- the per-key rules: a key's new value from its name and old value ----------------------------


def _any(v) -> bool:
    return True


def _above(n: int) -> Callable[[object], bool]:
    return lambda v: _is_int(v) and v > n


def _in(*names: str) -> Callable[[str], bool]:
    return lambda k: k in names


def _ends(*suffixes: str) -> Callable[[str], bool]:
    return lambda k: k.endswith(suffixes)


@dataclass(frozen=True)
class Rule:
    """A config key the miniature resizes: the rule applies when `key(name)` and `value(old value)`
    hold, and the key becomes `to`: a constant, or a function of (name, old value, the original
    number of attention heads)."""

    key: Callable[[str], bool]
    to: object
    value: Callable[[object], bool] = _is_int

    def resize(self, name: str, v, heads: int | None):
        return self.to(name, v, heads) if callable(self.to) else self.to


def _kv_heads(name, v, heads):
    return HEADS if v == heads else 1 if v == 1 else 2  # keep MHA / MQA / GQA


def _ffn(name, v, heads):
    return MOE_FFN if ("moe" in name or "expert" in name) else FFN


# the first rule that applies wins; None and bools are never resized
RULES = (
    Rule(_in(*_WIDTH), WIDTH),
    Rule(_in(*_HEADS), HEADS),
    Rule(_in(*_KV_HEADS), _kv_heads),
    Rule(_in(*_FFN), _ffn, value=_any),
    Rule(_ends("intermediate_size"), _ffn),
    # state-space / linear-attention heads (mamba_n_heads, linear_num_heads, n_mamba_heads); their
    # groups must divide them; chunked scans get chunks the test sequences cross
    Rule(lambda k: k.endswith(("n_heads", "num_heads")) or k == "n_mamba_heads", HEADS, value=_above(1)),
    Rule(_in("n_groups", "mamba_n_groups", "mamba_ngroups", "ngroups"), lambda name, v, heads: min(v, 2)),
    Rule(_in("chunk_size", "mamba_chunk_size"), 8, value=_above(8)),
    Rule(_ends("d_head", "d_state", "state_size"), HEAD_DIM, value=_above(1)),
    # MLA: a query/key head is nope 8 + rope 4
    Rule(_ends("head_dim"), lambda name, v, heads: {"qk_rope_head_dim": 4, "qk_head_dim": 12}.get(name, HEAD_DIM)),
    Rule(_ends("_rank"), RANK, value=_above(0)),  # MLA kv_lora_rank / q_lora_rank, the architecture's low-rank adapters
    Rule(lambda k: (k.endswith("vocab_size") and k != "type_vocab_size") or k.startswith("vocab_size"),
         lambda name, v, heads: VOCAB if _is_int(v) else v, value=_any),
    Rule(_in(*_EXPERTS), EXPERTS, value=_above(1)),
    Rule(_in(*_TOP_K), lambda name, v, heads: min(v, TOP_K)),
    Rule(_in(*_AT_MOST_ONE), lambda name, v, heads: min(v, 1)),
    Rule(_in(*_POSITIONS), MAX_POSITIONS),
    Rule(_in(*WINDOW_KEYS), WINDOW, value=_above(0)),
    # a cap the tiny model's logits reach, so that soft-capping does visible work
    Rule(_ends("logit_softcapping"), 2.0, value=lambda v: isinstance(v, (int, float)) and v > 0),
    Rule(_in("rotary_dim"), 4),
    # layer kinds set by a period and an offset (Jamba's attention and MoE layers): period 2, so that the
    # two layers kept hold every kind
    Rule(_ends("_layer_period"), 2, value=_above(2)),
    Rule(_ends("_layer_offset"), lambda name, v, heads: v % 2),
    Rule(_in("hidden_size_per_layer_input"), HEAD_DIM),
)


# -- the structural passes -----------------------------------------------------------------------


def _follow_kept_layers(d: dict, L0: int) -> None:
    """Keep the layers of `_kept_layers`: per-layer lists and overrides keep their entries, layer
    index lists are renumbered, the layer counts shrink."""
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


def _fill_unset(d: dict) -> None:
    """Sizes some of transformers' default configs leave unset (HunYuan, Nemotron)."""
    if "head_dim" in d and d["head_dim"] is None:
        d["head_dim"] = HEAD_DIM
    for k in _KV_HEADS:
        if k in d and d[k] is None:
            d[k] = HEADS
    if "is_decoder" in d:  # encoder families used as causal LMs (BERT-likes) need it
        d["is_decoder"] = True


def _fill_unset_experts(d: dict) -> None:
    """transformers' default config of some MoE families leaves the expert counts unset (dots1)."""
    if _is_int(d.get("moe_intermediate_size")):
        for keys, val in ((_EXPERTS, EXPERTS), (_TOP_K, TOP_K), (_SHARED_EXPERTS, 1)):
            for k in keys:
                if k in d and d[k] is None:
                    d[k] = val


def _mla_head_dims(d: dict) -> None:
    """MLA (DeepSeek V2/V3, MiniCPM3, ...): the RoPE part of a head is what `head_dim` means there,
    and a query/key head is its nope part + its RoPE part."""
    if _is_int(d.get("kv_lora_rank")) and _is_int(d.get("qk_rope_head_dim")) and "head_dim" in d:
        d["head_dim"] = d["qk_rope_head_dim"]
    if _is_int(d.get("qk_nope_head_dim")) and _is_int(d.get("qk_rope_head_dim")) and "qk_head_dim" in d:
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]


def _tile_state_space_heads(d: dict) -> None:
    """State-space heads (Mamba 2, Bamba, Granite hybrids) must tile expand × hidden exactly."""
    for pre in ("", "mamba_"):
        expand = d.get(pre + "expand")
        heads = d.get(pre + "n_heads", d.get(pre + "num_heads", d.get("n_mamba_heads") if pre else None))
        head_key = next((pre + k for k in ("d_head", "head_dim", "headdim") if _is_int(d.get(pre + k))), None)
        width = next((d[k] for k in _WIDTH if _is_int(d.get(k))), WIDTH)
        if _is_int(expand) and _is_int(heads) and head_key and (width * expand) % heads == 0:
            d[head_key] = width * expand // heads
            if _is_int(d.get(pre + "d_ssm")):
                d[pre + "d_ssm"] = width * expand


def _shrink_rope_lengths(d: dict) -> None:
    """RoPE: lengths the test sequences cross, per-frequency lists resized to the new rotary dim."""
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


def _shrink(d: dict) -> dict:
    """The tiny version of one config dict (see the module docstring); generic by attribute name."""
    d = dict(d)
    L0 = next((d[k] for k in _LAYER_COUNT if _is_int(d.get(k))), None)
    heads = next((d[k] for k in _HEADS if _is_int(d.get(k))), None)
    width0 = next((d[k] for k in _WIDTH if _is_int(d.get(k))), None)
    if L0:
        _follow_kept_layers(d, L0)
    _fill_unset(d)
    for k, v in list(d.items()):
        if v is None or isinstance(v, bool):
            continue
        rule = next((r for r in RULES if r.key(k) and r.value(v)), None)
        if rule is not None:
            d[k] = rule.resize(k, v, heads)
    for k, v in list(d.items()):  # derived widths (Zamba 2's attention_hidden_size = 2 × hidden) keep their ratio
        if k.endswith("_hidden_size") and _is_int(v) and width0 and v % width0 == 0 and k not in _WIDTH:
            d[k] = WIDTH * (v // width0)
    _fill_unset_experts(d)
    _mla_head_dims(d)
    _keep_rotary_dims(d)
    _tile_state_space_heads(d)
    _shrink_rope_lengths(d)
    for k, val in _SPECIAL_IDS.items():
        v = d.get(k)
        if _is_int(v):
            d[k] = val
        elif isinstance(v, list) and v:
            d[k] = [val]
    d.pop("_name_or_path", None)
    return d


# ---------------------------------------------------------------------------------------------
# The miniature


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

    return _random_float64(AutoModelForCausalLM, miniature_config(config), seed, training)


def _random_float64(auto_class, mini, seed: int, training: bool):
    """`auto_class` built from the config `mini` with eager attention, float64, randomized from `seed`,
    norms exact, in train mode or eval mode."""
    torch.manual_seed(seed)
    model = auto_class.from_config(mini, attn_implementation="eager")
    model = model.to(torch.float64).train(training)
    _randomize(model)
    return exact_norms(model)


def is_image_text(config) -> bool:
    """Whether `config` is a vision-language composite transformers loads as image-text-to-text."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # noqa: PLC0415

    return getattr(config, "vision_config", None) is not None and \
        getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def vision_miniature(config, *, seed: int = 0, training: bool = False):
    """The float64 miniature of a vision-language composite, built as its image-text class: the text
    part shrunk as `miniature` does, the tower to 2 blocks of the miniature's width (a CLIP/SigLIP tower
    on 4 × 4 patches), the composite's own token ids (image, video, vision start and end) moved inside
    the miniature's vocabulary."""
    from transformers import AutoModelForImageTextToText  # noqa: PLC0415

    config = load_config(config)
    d = _shrink(config.to_dict())
    k = 0
    for key in sorted(d):
        if key.endswith(("token_id", "token_index")) and key not in _SPECIAL_IDS and _is_int(d[key]):
            k += 1
            d[key] = VOCAB - k
    if _is_int(d.get("mm_tokens_per_image")):  # Gemma 3 pools the 4 × 4 patches to 2 × 2 tokens
        d["mm_tokens_per_image"] = 4
    mini = _rebuild(config, d)
    _shrink_tower(mini.vision_config, mini.get_text_config())
    for c in (mini, mini.get_text_config()):
        c._experts_implementation = "eager"
    _shrink_mrope(mini.get_text_config(), _reads_mrope(mini))
    return _random_float64(AutoModelForImageTextToText, mini, seed, training)


def _shrink_tower(vc, text) -> None:
    """The vision config cut to 2 blocks: its per-block index lists (Qwen2.5-VL's full-attention
    blocks, Qwen3-VL's deepstack taps) kept inside them (the last block where none would remain, so
    that the feature stays on), a window of one merged token (Qwen2.5-VL's `window_size` is in pixels
    and must hold patch × merge), a CLIP/SigLIP tower on 4 × 4 patches, and the tower's output width
    the decoder's (the rows of E are decoder inputs; PaliGemma's `projection_dim` too)."""
    D0 = next((getattr(vc, k) for k in ("depth", "num_hidden_layers") if _is_int(getattr(vc, k, None))), None)
    if D0 is not None:
        D = min(D0, 2)
        for key in ("depth", "num_hidden_layers"):
            if _is_int(getattr(vc, key, None)):
                setattr(vc, key, D)
        for key, v in vc.to_dict().items():
            if (isinstance(v, (list, tuple)) and v and all(_is_int(x) and 0 <= x < D0 for x in v)
                    and key.endswith(("indexes", "indices", "layers", "layer_ids"))):
                kept = [x for x in v if x < D]
                setattr(vc, key, type(v)(kept or [D - 1]))
    patch, merge = getattr(vc, "patch_size", None), getattr(vc, "spatial_merge_size", None)
    if _is_int(getattr(vc, "window_size", None)) and _is_int(patch) and _is_int(merge):
        vc.window_size = patch * merge
    size = getattr(vc, "image_size", None)
    if _is_int(size) and _is_int(patch):
        vc.image_size = 4 * patch
    elif isinstance(size, (list, tuple)) and isinstance(patch, (list, tuple)) and len(size) == len(patch):
        vc.image_size = type(size)(4 * p for p in patch)  # InternVL's [height, width]
    for key in ("out_hidden_size", "projection_dim"):  # PaliGemma's projector maps to projection_dim
        if _is_int(getattr(vc, key, None)) and _is_int(getattr(text, "hidden_size", None)):
            setattr(vc, key, text.hidden_size)


def _reads_mrope(config) -> bool:
    """Whether the family's modeling code reads M-RoPE sections (whose defaults fit a full-size head)."""
    import importlib  # noqa: PLC0415
    import inspect  # noqa: PLC0415

    try:
        mod = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    except ImportError:
        return False
    return "mrope_section" in inspect.getsource(mod)


def _shrink_mrope(text, reads: bool) -> None:
    """M-RoPE's sections (temporal, height, width) fitted to the miniature's rotary half-dimension (the
    family's default sections fit a full-size head), each at least 1."""
    rp = getattr(text, "rope_parameters", None)
    if not reads or not isinstance(rp, dict):
        return
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    half = int(head * rp.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0) or 1.0)) // 2
    rp["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]


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


def special_ids(config) -> set[int]:
    """The token ids the config names (pad, bos, eos, image tokens, ...): the test tree avoids them."""
    ids = set()
    for c in [config, config.get_text_config()]:
        for k, v in c.to_dict().items():
            if k.endswith(("token_id", "token_index", "token_ids")):
                for x in v if isinstance(v, list) else [v]:
                    if _is_int(x):
                        ids.add(x)
    return ids



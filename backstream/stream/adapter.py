"""The transformers adapter: how the streamed backward drives a Hugging Face model.

A block batch's forward is an ordinary `model(input_ids, position_ids, cache=cache)` call (the
keyword is `past_key_values` before transformers 5.24: `hf.cache_arg`)
with two substitutions:
- `BlockCache` as the cache: it records each layer's new K/V (the roots of the backward) and hands
  them back unchanged, so the history is never concatenated;
- `attention` registered in transformers' AttentionInterface (and `family.mask_info` in its mask
  interface) under `ATTN_NAME`: it checks the family contract (docs/design.md §6b) and attends over the
  batch's history parts and its own keys with the merged attention (`backstream.stream.attention`).
"""

from __future__ import annotations

import weakref

from torch import Tensor, nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import Cache

from backstream.stream import family
from backstream.stream.attention import Part, merged_attention
from backstream.stream.hf import base_model, cache_arg

ATTN_NAME = family.MASK_NAME  # the attention function and the mask function share the name


def check_model(model) -> nn.Module:
    """The model must be a transformers causal LM that accepts a Cache and a registered attention
    function; returns the underlying PreTrainedModel."""
    base = base_model(model)
    if not isinstance(model, nn.Module) or not hasattr(base, "config"):
        raise family.ModelTypeError("model: expected a transformers causal LM (or a PEFT model around one), "
                                    f"got {type(model).__name__}")
    if not getattr(base, "_supports_attention_backend", False) or cache_arg(base) is None:
        raise family.ModelTypeError(
            f"model: {type(base).__name__} does not support transformers' Cache and AttentionInterface "
            "(needs `_supports_attention_backend` and a `cache` or `past_key_values` argument); stream_backward "
            "cannot drive it"
        )
    return base


class BlockCache(Cache):
    """Records each layer's new K/V (the roots of the backward) and returns them unchanged: the
    history is handed to the attention function separately, so it is never concatenated.

    A layer whose attention receives tensors *derived* from what the cache returned (multi-head
    latent attention caches a latent and expands it into K/V after the update) is a *concat* layer:
    for it `update` returns history ⊕ block, as an ordinary cache does, and the model's own code
    turns that into the K/V its attention reads (the history leaves then hold the cached latent)."""

    def __init__(self, batch):
        super().__init__(layers=[])
        self.batch = batch
        self.past_len = batch.p0
        self.new: dict[int, tuple[Tensor, Tensor]] = {}
        self.kpos: dict[int, Tensor] = {}  # concat layers: absolute positions of the returned keys
        self.last_layer = -1

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new[layer_idx] = (key_states, value_states)
        self.last_layer = layer_idx
        if layer_idx in self.batch.concat_layers and self.past_len > 0:
            return self.batch.concat_history(layer_idx, key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past_len

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.past_len + query_length, 0  # (kv_length, kv_offset): the whole history, every layer

    def layer_of(self, key: Tensor, value: Tensor) -> int | None:
        """The layer whose `update` returned exactly these tensors (docs/design.md §6b (c))."""
        for layer, (k, v) in self.new.items():
            if k is key and v is value:
                return layer
        return None


class NeedsConcat(Exception):
    """A layer's attention read tensors derived from the cache's output: rerun the forward with that
    layer in concat mode (see `BlockCache`)."""

    def __init__(self, layer: int, module: nn.Module):
        self.layer, self.module = layer, module

    def layers(self, model: nn.Module) -> set[int]:
        """This layer and every layer whose attention is of the same class: one retry, not one per layer."""
        same = {m.layer_idx for m in model.modules()
                if type(m) is type(self.module) and isinstance(getattr(m, "layer_idx", None), int)}
        return same | {self.layer}


_CONCAT_LAYERS: weakref.WeakKeyDictionary[nn.Module, set[int]] = weakref.WeakKeyDictionary()


def concat_layers(base: nn.Module) -> set[int]:
    """The model's concat layers, learnt on its first forward and kept for the next calls."""
    return _CONCAT_LAYERS.setdefault(base, set())


_ACTIVE: list = []  # the running batch (a stack, so that nothing leaks if a forward raises)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
              sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """Every keyword that does work is implemented or refused, the mask is read, and the K/V must be
    the ones the cache handed out (the family contract, docs/design.md §6b)."""
    if not _ACTIVE:
        raise RuntimeError("the backstream attention function runs only inside stream_backward")
    if dropout and dropout > 0:
        raise family.ModelContractError(
            "model: attention dropout breaks exactness; call model.eval() or set attention_dropout=0")
    family.check_attention_kwargs(module, kwargs)
    batch = _ACTIVE[-1]
    window = family.attention_window(module, attention_mask, sliding_window, batch.p0, batch.Q)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = batch.cache.layer_of(key, value)
    last = batch.cache.last_layer
    if last in batch.concat_layers:  # the keys are history ⊕ block, derived by the model from the cache's output
        kpos = batch.cache.kpos.get(last, batch.qpos)
        if key.shape[2] != len(kpos) or value.shape[2] != len(kpos):
            raise family.kv_not_from_cache(module)
        parts = [Part(key, value, kpos, causal=True)]
    elif layer is None:
        if last < 0:
            raise family.kv_not_from_cache(module)
        raise NeedsConcat(last, module)  # retried with history ⊕ block from the cache
    else:
        parts = batch.history_parts(layer, key, value, window)
        parts.append(Part(key, value, batch.qpos, causal=True, start=batch.p0))
    batch.attn_calls += 1
    out = merged_attention(query, parts, batch.qpos, scale, window, batch.kernel, softcap=softcap, sinks_H=s_aux,
                           q_start=batch.p0)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, attention)


def run_model(batch, kwargs: dict):
    """One forward of `batch` (kwargs without the cache), retried once per attention class that
    reads K/V derived from the cache; a crash inside transformers is named as a model feature."""
    model = batch.model
    base = base_model(model)
    while True:
        batch.reset_cache()
        _ACTIVE.append(batch)
        try:
            return model(**kwargs, **{cache_arg(base): batch.cache})
        except NeedsConcat as e:
            batch.concat_layers.update(e.layers(base))
        except Exception as e:
            if family.package_frame(e):
                raise  # our own checks (and our own bugs) surface as they are
            raise family.Unsupported(
                f"model: {type(base).__name__} failed inside transformers when run block by block over the "
                f"engine's Cache ({type(e).__name__}: {e}). Layers whose state is not K/V (convolution, state-space, "
                f"linear attention) or that read the cache directly cannot be streamed; {family.ENGINE_HINT}") from e
        finally:
            _ACTIVE.pop()


def _configs(model: nn.Module) -> list[PretrainedConfig]:
    seen, out = set(), []
    stack = [m.config for m in model.modules() if isinstance(getattr(m, "config", None), PretrainedConfig)]
    while stack:
        c = stack.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        out.append(c)
        for key in getattr(c, "sub_configs", {}) or {}:
            sub = getattr(c, key, None)
            if isinstance(sub, PretrainedConfig):
                stack.append(sub)
    return out


class use_backstream_attention:
    """Route the model's attention (and mask building) through this adapter for the duration of a call."""

    def __init__(self, model):
        self.configs = _configs(model)

    def __enter__(self):
        self.saved = [c._attn_implementation_internal for c in self.configs]
        for c in self.configs:
            c._attn_implementation_internal = ATTN_NAME

    def __exit__(self, *exc):
        for c, v in zip(self.configs, self.saved):
            c._attn_implementation_internal = v

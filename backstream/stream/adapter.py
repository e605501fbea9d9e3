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

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.cache_utils import Cache

from backstream.stream import family, scan
from backstream.stream.attention import Part, merged_attention
from backstream.stream.hf import base_model, cache_arg, require_transformers, state_api_hint
from backstream.stream.state import ConvState, RecurrentState, StateLayout

require_transformers()  # the engine's and the sampler's way in to transformers' Cache

ATTN_NAME = family.MASK_NAME  # the attention function and the mask function share the name


def check_model(model) -> nn.Module:
    """The model must be a transformers causal LM that accepts a Cache and a registered attention
    function; returns the underlying PreTrainedModel."""
    base = base_model(model)
    if not isinstance(model, nn.Module) or not hasattr(base, "config"):
        raise family.ModelTypeError("model: expected a transformers causal LM (or a PEFT model around one), "
                                    f"got {type(model).__name__}")
    # attention through the AttentionInterface, or a stateful model (hybrids and state-space models do
    # not declare `_supports_attention_backend`: each forward checks that every layer with K/V attended
    # through the engine's function, and that every layer kept K/V or state through the Cache)
    routed = getattr(base, "_supports_attention_backend", False) or getattr(base, "_is_stateful", False)
    if not routed or cache_arg(base) is None:
        raise family.ModelTypeError(
            f"model: {type(base).__name__} does not support transformers' Cache and AttentionInterface "
            "(needs `_supports_attention_backend` or `_is_stateful`, and a `cache` or `past_key_values` argument); "
            "stream_backward cannot drive it"
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
        self.attended: set[int] = set()  # layers whose K/V the engine's attention function read
        # layer state that is not K/V (docs/design.md §2b): kind → (layer, index) → the state after
        # the block ([B, ...]); until the model updates it, the start state it was handed
        self.ends: dict[str, dict[tuple[int, int], Tensor]] = {}
        self.read: set[tuple[str, int, int]] = set()  # states the model asked for

    # -- layer state that is not K/V: transformers' linear-attention Cache API --------------------
    # The model gets fresh tensors (the stored boundaries are leaves that must stay untouched) and
    # what it hands back is recorded, never written into a buffer: `ends` holds the block's final
    # states, the roots of the backward (backstream.stream.state).

    def _state(self, kind: str, layer_idx: int, state_idx: int) -> Tensor | None:
        slot = (layer_idx, state_idx)
        ends = self.ends.setdefault(kind, {})
        if slot in ends or (kind, *slot) in self.read:
            return ends.get(slot)
        self.read.add((kind, *slot))
        start = self.batch.state_start(kind, slot)
        if start is not None:
            ends[slot] = self.batch.guard.hand(start)  # an in-place write by the model makes it the end state
        return start

    def _update(self, kind: str, new: Tensor, layer_idx: int, state_idx: int, kernel: int | None) -> Tensor:
        prev = self._state(kind, layer_idx, state_idx)
        out, end = self.batch.state_class(kind).update(prev, new, kernel)
        self.ends[kind][(layer_idx, state_idx)] = end
        return out

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self._state("conv", layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        return self._state("recurrent", layer_idx, state_idx)

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> Tensor:
        return self._update("conv", conv_states, layer_idx, state_idx, conv_kernel_size)

    def update_recurrent_state(self, recurrent_states: Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> Tensor:
        return self._update("recurrent", recurrent_states, layer_idx, state_idx, None)

    def is_recording_past(self, layer_idx: int) -> bool:
        """True: the models that ask then take their multi-token path (`update_conv_state`) for a
        one-token block too, instead of writing the conv state in place."""
        return True

    def state_layers(self) -> set[int]:
        """Layers that read or updated a state in this forward (`update_*` reads it first)."""
        return {layer for _, layer, _ in self.read}

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


class _ProbeCache(Cache):
    """An ordinary cache for a few short forwards under the model's own attention (the whole K/V
    history per layer, the states replaced): it records which layers store K/V and which keep
    recurrent or convolution state, with its shape."""

    def __init__(self):
        super().__init__(layers=[])
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}
        self.state: dict[tuple[str, int, int], Tensor] = {}
        self.shapes: dict[str, dict[tuple[int, int], tuple]] = {}
        self.past = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.kv:
            k, v = self.kv[layer_idx]
            key_states, value_states = torch.cat([k, key_states], -2), torch.cat([v, value_states], -2)
        self.kv[layer_idx] = key_states, value_states
        return key_states, value_states

    def _update(self, kind: str, new: Tensor, layer_idx: int, state_idx: int, kernel: int | None = None):
        prev = self.state.get((kind, layer_idx, state_idx))
        out, end = (ConvState if kind == "conv" else RecurrentState).update(prev, new, kernel)
        self.state[(kind, layer_idx, state_idx)] = end
        self.shapes.setdefault(kind, {})[(layer_idx, state_idx)] = (tuple(end.shape[1:]), end.dtype)
        return out

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        return self._update("conv", conv_states, layer_idx, state_idx, conv_kernel_size)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        return self._update("recurrent", recurrent_states, layer_idx, state_idx)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.state.get(("conv", layer_idx, state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.state.get(("recurrent", layer_idx, state_idx))

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # as BlockCache: the multi-token path also for one token

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.past + query_length, 0


_LAYOUTS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()
CONTINUATION_CUTS = (0, 37, 38, 80)  # 37 tokens, then 1, then 42: one-token and multi-token paths, across a 64-chunk


def _forward_in_parts(model: nn.Module, ids: Tensor, cuts) -> tuple[Tensor, _ProbeCache]:
    """Logits [L, V] of `ids` [1, L] forwarded in the parts `cuts` delimit, each continuing the cache."""
    base, cache, out = base_model(model), _ProbeCache(), []
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:]):
            cache.past = a
            out.append(model(input_ids=ids[:, a:b], position_ids=torch.arange(a, b, device=ids.device)[None],
                             use_cache=True, **{cache_arg(base): cache}).logits[0])
    return torch.cat(out), cache


def probe_layout(model: nn.Module) -> StateLayout:
    """Which layers of `model` keep K/V and which keep another state (`state.StateLayout`), learnt once
    per model and dtype from a two-token forward without gradient.

    A model with such state must also keep the contract the engine's blocks rest on (docs/design.md
    §6b (f)): a forward continued from the cache's states gives the logits of the full forward (which
    also shows that its layers with neither K/V nor state mix no tokens: `local_layers`).
    That is a property of the architecture's code, checked on its float64 miniature (80 tokens
    forwarded as 37 + 1 + 42, against one forward, to 1e-9); a model whose miniature cannot be built
    is checked on itself, to its dtype's rounding. A multi-token path that ignores the state it is
    handed (Mamba 1's) is refused here."""
    base = base_model(model)
    scan.install(model)  # Mamba 1's multi-token scan continues the state it is handed (stream/scan.py)
    dtype = next(model.parameters()).dtype
    known = _LAYOUTS.setdefault(base, {})
    if dtype in known:
        return known[dtype]
    device = next(model.parameters()).device
    vocab = base.get_input_embeddings().num_embeddings
    try:
        _, cache = _forward_in_parts(model, torch.ones((1, 2), dtype=torch.long, device=device), (0, 2))
        layout = StateLayout(frozenset(cache.kv), cache.shapes)
        if layout.states:
            _check_continuation(model, base, vocab, device, layout)
            # layers with neither (Nemotron-H's MLP and MoE layers): token-local, as the continuation shows
            every = set(range(base.config.get_text_config().num_hidden_layers))
            layout = StateLayout(layout.kv_layers, layout.states,
                                 frozenset(every - layout.kv_layers - layout.state_layers))
    except family.ModelContractError:
        raise
    except Exception as e:
        raise family.Unsupported(
            f"model: {type(base).__name__} failed inside transformers on a short forward over the engine's "
            f"Cache ({type(e).__name__}: {e}); {family.ENGINE_HINT}.{state_api_hint()}") from e
    known[dtype] = layout
    return layout


def _check_continuation(model, base, vocab: int, device, layout: StateLayout) -> None:
    from backstream.stream.miniature import VOCAB, keep_float64, miniature  # noqa: PLC0415  (miniature is heavy)

    with torch.random.fork_rng(devices=[]):  # the miniature's random weights leave the caller's RNG alone
        try:
            mini = miniature(base.config)
        except Exception:  # noqa: BLE001  (no miniature of this config: the model itself is checked)
            mini = None
    layers = sorted(layout.state_layers)
    if mini is not None:
        scan.install(mini)
        ids = (torch.arange(CONTINUATION_CUTS[-1]) * 7 % (VOCAB - 8) + 7)[None]
        with keep_float64(), torch.no_grad():
            full = mini(input_ids=ids, use_cache=False).logits[0]
            parts, _ = _forward_in_parts(mini, ids, CONTINUATION_CUTS)
        family.check_continuation(base, full, parts, layers, tol=1e-9)
    else:
        cuts = (0, 3, 4, 6)
        ids = (torch.arange(cuts[-1], device=device) % max(1, vocab - 1) + 1)[None]
        with torch.no_grad():
            full = model(input_ids=ids, use_cache=False).logits[0]
        family.check_continuation(base, full, _forward_in_parts(model, ids, cuts)[0], layers)


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
    batch.cache.attended.add(last if last in batch.concat_layers else layer)
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
                f"engine's Cache ({type(e).__name__}: {e}). Layers that keep their state outside transformers' Cache "
                f"(in module attributes, or a cache class of their own) or read the cache directly cannot be streamed; "
                f"{family.ENGINE_HINT}") from e
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
    """Route the model's attention (and mask building) through this adapter for the duration of a call
    (`name`: another function registered under that name in both interfaces, the sampler's)."""

    def __init__(self, model, name: str = ATTN_NAME):
        self.configs, self.name = _configs(model), name

    def __enter__(self):
        self.saved = [c._attn_implementation_internal for c in self.configs]
        for c in self.configs:
            c._attn_implementation_internal = self.name

    def __exit__(self, *exc):
        for c, v in zip(self.configs, self.saved):
            c._attn_implementation_internal = v

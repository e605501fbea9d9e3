"""The family contract (docs/design.md §6b): what the streamed backward may assume of a transformers model,
checked while it runs.

The engine drives a model through transformers' `Cache` and attention interface. That computes the
full-sequence gradient only if every layer's attention is softmax(scale·qkᵀ [soft-capped] + causal /
sliding-window mask [+ sink])·v over the K/V that `cache.update` returned, positions enter only
through `position_ids`, and the forward is deterministic. Each guard here checks one of those from
what the engine *sees* (attention keywords, the mask function transformers builds, tensor identity,
the RoPE type, dropout modules), not from a list of class names, so that a family no test names is
covered by the same checks. A model that fails one gets a `ModelContractError` (`Unsupported`, or
the `ModelContractError` itself, a `ValueError`, when the user can fix it in one line), never a
silently different gradient.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from backstream.checks import UserError
from backstream.stream.hf import image_path


class ModelContractError(UserError):
    """The model breaks the family contract or cannot be driven by the engine (or K/V handed over
    with `kv=` do not fit it): the streamed backward refuses rather than compute another gradient.
    The message starts with `model:` (or `kv:` / `kv[i]:`) and names what to do. `backstream
    verify` calls exactly these errors refusals, whatever their message says."""


class Unsupported(ModelContractError, NotImplementedError):
    """The model uses a feature the streamed backward cannot (yet) compute exactly. The message
    starts with `model:` and names the feature and what the user can do."""


class ModelTypeError(ModelContractError, TypeError):
    """The object is not a model the engine can drive (no transformers config, no Cache or
    attention interface)."""


ENGINE_HINT = 'compute this model\'s gradient with reference_backward (trainer: engine.backward = "reference")'

# -- (a) attention keywords ---------------------------------------------------------------------

# keywords that reach the attention function but do no work in it (bookkeeping of the forward)
INERT_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
    "output_router_logits", "return_dict", "logits_to_keep", "past_key_values", "cache", "layer_idx",
})


def layer_name(module: nn.Module) -> str:
    idx = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {idx})" if idx is not None else "")


def check_attention_kwargs(module: nn.Module, kwargs: dict) -> None:
    """(a) Refuse any keyword the merged attention does not implement and that is not None."""
    for key, val in kwargs.items():
        if val is None or key in INERT_KWARGS:
            continue
        if key == "is_causal" and val is True:
            continue
        what = "is_causal=False (bidirectional attention)" if key == "is_causal" else f"keyword {key!r}"
        raise Unsupported(
            f"model: {layer_name(module)} passes the attention function the {what}, which the streamed "
            f"backward does not implement; the gradient would silently differ. {ENGINE_HINT}")


# -- (b) the mask ------------------------------------------------------------------------------

MASK_NAME = "backstream"
_GRID_ELEMENTS = 1 << 22  # mask entries evaluated at once (bounded memory for long histories)


@dataclass(frozen=True)
class MaskInfo:
    """What transformers' mask for one forward says, checked over the whole [queries × keys] grid:
    causal with an optional sliding window (`window`, None when no window bites within the span),
    or `error` for anything else (chunked, bidirectional, padded or custom masks)."""

    window: int | None
    error: str | None = None

    def _as_tensor(self, *_):
        raise Unsupported(
            "model: the model reads the attention mask as a tensor outside the attention function (a sparse-"
            "attention indexer, a mask mixed into other scores); the engine hands layers the mask's meaning, not a "
            f"[queries × keys] tensor; {ENGINE_HINT}")

    __getitem__ = _as_tensor

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._as_tensor()


def _classify(rows, q_offset: int, q_length: int, kv_length: int, kv_offset: int, device) -> MaskInfo:
    """rows(lo, hi) -> bool [.., hi-lo, kv_length]: the mask of queries lo..hi-1 (any leading dims)."""
    last = q_offset + q_length - 1
    row = rows(q_length - 1, q_length).reshape(-1, kv_length)
    seen = int(row[0].sum())
    window = seen if seen < last + 1 - kv_offset and bool((row == row[0]).all()) else None
    kpos = torch.arange(kv_length, device=device) + kv_offset
    step = max(1, _GRID_ELEMENTS // max(1, kv_length))
    for lo in range(0, q_length, step):
        hi = min(q_length, lo + step)
        qpos = torch.arange(lo, hi, device=device)[:, None] + q_offset
        want = kpos[None] <= qpos
        if window is not None:
            want &= (qpos - kpos[None]) < window
        if not bool((rows(lo, hi) == want).all()):
            return MaskInfo(None, "its attention mask is not causal with an optional sliding window (chunked "
                                  "attention shorter than the sequence, bidirectional or custom masks cannot be "
                                  "seen by the merged attention)")
    return MaskInfo(window)


def mask_info(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function=None, attention_mask=None, use_vmap: bool = False, device="cpu", **_) -> MaskInfo:
    """Registered as transformers' mask function for the engine's attention: instead of building
    the 4-D mask it evaluates the model's own mask function (through transformers' `sdpa_mask`,
    so every overlay the model composed is applied) and keeps only what it means."""

    def rows(lo, hi):
        return sdpa_mask(batch_size=batch_size, q_length=hi - lo, kv_length=kv_length, q_offset=q_offset + lo,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         allow_is_causal_skip=False, use_vmap=use_vmap, device=device)

    return _classify(rows, int(q_offset), q_length, kv_length, kv_offset, device)


AttentionMaskInterface.register(MASK_NAME, mask_info)


def _tensor_mask_info(mask: Tensor, q_offset: int) -> MaskInfo:
    """A 4-D mask the model built itself: boolean (True = keep) or additive (0 / -inf)."""
    if mask.dtype == torch.bool:
        keep = mask
    else:
        keep = mask == 0
        if not bool((keep | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            return MaskInfo(None, "its attention mask adds a bias to the scores (ALiBi or similar)")
    Q, K = keep.shape[-2:]
    return _classify(lambda lo, hi: keep[..., lo:hi, :], q_offset, Q, K, 0, keep.device)


def attention_window(module: nn.Module, mask, sliding_window: int | None, q_offset: int, q_length: int) -> int | None:
    """(b) The window the layer's attention applies, from its mask (the truth for transformers'
    eager and SDPA paths) checked against its `sliding_window` keyword (the flash paths' truth).
    A layer that builds a window mask but passes no `sliding_window` gets the mask's window."""
    if isinstance(mask, Tensor):
        mask = _tensor_mask_info(mask, q_offset)
    elif mask is None:
        raise Unsupported(f"model: {layer_name(module)} calls attention without a mask, so its masking cannot be "
                          f"checked; {ENGINE_HINT}")
    elif not isinstance(mask, MaskInfo):
        raise Unsupported(f"model: {layer_name(module)} passes an attention mask of type {type(mask).__name__}, "
                          f"which the streamed backward cannot read; {ENGINE_HINT}")
    if mask.error is not None:
        raise Unsupported(f"model: {layer_name(module)}: {mask.error}; {ENGINE_HINT}")
    if sliding_window is None or sliding_window == mask.window:
        return mask.window
    if mask.window is None and sliding_window > q_offset + q_length - 1:
        return None  # a window longer than every query's history: it does not bite here
    raise Unsupported(f"model: {layer_name(module)} passes sliding_window={sliding_window} but its mask applies "
                      f"{'no window' if mask.window is None else f'a window of {mask.window}'}: the model's own "
                      f"attention implementations disagree; {ENGINE_HINT}")


# -- (c) the K/V the attention reads ------------------------------------------------------------


def kv_not_from_cache(module: nn.Module) -> Unsupported:
    return Unsupported(
        f"model: {layer_name(module)} attends over K/V that are not the ones `cache.update` returned for a "
        "layer of this forward (K/V changed after the cache update, as in differential attention, or read from "
        f"another layer's cache, as in KV-shared layers): the streamed backward cannot give them their gradient; "
        f"{ENGINE_HINT}")


def layers_without_kv(model_name: str, missing: list[int], layer_types) -> Unsupported:
    types = f" (config.layer_types: {sorted(set(layer_types))})" if layer_types else ""
    return Unsupported(
        f"model: {model_name}: layers {missing} stored neither K/V nor a recurrent or convolution state in the "
        f"cache during the forward{types}. Layers that keep their state elsewhere (module attributes, a cache "
        f"class of their own) or read another layer's cache cannot be streamed block by block; {ENGINE_HINT}")


def check_continuation(base: nn.Module, full_LV: Tensor, continued_LV: Tensor, state_layers: list[int],
                       tol: float | None = None) -> None:
    """(f) A model whose layers keep recurrent or convolution state: a forward continued from the
    cache's states must give the logits of the full forward (the blocks rest on it, as they rest on
    (c) for K/V). `tol`, relative to the largest logit: by default 1e-4 (such layers compute in
    float32 whatever the model's dtype), 5e-2 in a 16-bit model."""
    scale = float(full_LV.abs().max()) or 1.0
    err = float((full_LV.double() - continued_LV.double()).abs().max()) / scale
    if tol is None:
        tol = 1e-4 if torch.finfo(full_LV.dtype).bits >= 32 else 5e-2
    if not err <= tol:
        raise Unsupported(
            f"model: {type(base).__name__}'s layers {state_layers} keep recurrent or convolution state, and a forward "
            f"continued from that state does not give the logits of the full forward (relative error {err:.1e}): its "
            "multi-token path ignores or mishandles the state it is handed, so its blocks cannot be streamed; "
            f"{ENGINE_HINT}")


# -- (d) positions, (e) determinism: checked once per call ----------------------------------------

_STATIC_ROPE = (set(ROPE_INIT_FUNCTIONS) | {"default"}) - {"dynamic", "longrope"}


def _rope_limit(mod: nn.Module, rope_type: str, layer_type: str | None) -> tuple[int, bool]:
    """(position threshold, whether reaching it exactly already switches) of a length-dependent RoPE."""
    if rope_type == "longrope":  # long factors once max(position_ids) + 1 > original_max_position_embeddings
        params = mod.config.rope_parameters
        params = params[layer_type] if layer_type is not None else params
        return int(params["original_max_position_embeddings"]), False
    # dynamic NTK: grows past max_seq_len_cached, resets only strictly below original_max_seq_len
    return int(mod.original_max_seq_len), True


def check_positions(model: nn.Module, longest: int) -> None:
    """(d) A RoPE whose frequencies depend on the longest position of the forward (`longrope`,
    `dynamic`) gives a block forwarded alone other frequencies than the whole sequence, unless every
    sequence stays on the same side of its threshold as every one of its blocks."""
    skip = image_path(model)  # a vision tower's rotary embedding runs outside the engine
    for mod in model.modules():
        types = getattr(mod, "rope_type", None) if id(mod) not in skip else None
        if types is None:
            continue
        items = types.items() if isinstance(types, dict) else [(None, types)]
        for layer_type, t in items:
            if t in _STATIC_ROPE:
                continue
            if "dynamic" not in t and t != "longrope":
                raise Unsupported(f"model: rope_type {t!r} of {type(mod).__name__} is not one the engine knows to "
                                  f"depend on positions only; {ENGINE_HINT}")
            try:
                limit, strict = _rope_limit(mod, t, layer_type)
            except (AttributeError, KeyError, TypeError) as e:
                raise Unsupported(f"model: rope_type {t!r}: cannot read its length threshold ({e}); "
                                  f"{ENGINE_HINT}") from e
            if longest > limit or (strict and longest == limit):
                raise Unsupported(
                    f"model: rope_type {t!r} changes its frequencies with the longest position of a forward (threshold "
                    f"{limit} positions), and a sequence here has {longest} tokens: its early blocks, forwarded alone, "
                    f"would be rotated with other frequencies than the whole sequence. Keep sequences "
                    f"{'under' if strict else 'at most'} {limit} tokens, or {ENGINE_HINT}")


_POSITIONS_OK: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def check_default_positions(model: nn.Module, tokens: Tensor) -> None:
    """(d) The engine passes `position_ids` = 0, 1, 2, … while the full-sequence forward lets the
    model choose; a model whose own default differs (RoBERTa-style embeddings count from
    padding_idx + 1) would be shifted. One short probe forward per model, with its own attention."""
    if model in _POSITIONS_OK:
        return
    ids = tokens[: min(8, len(tokens))].to(next(model.parameters()).device)[None]
    with torch.no_grad():
        try:
            own = model(input_ids=ids).logits
            given = model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=ids.device)[None]).logits
        except Exception:  # noqa: BLE001  (a model that cannot run this probe fails in the engine, named there)
            return
    if not torch.allclose(own, given, rtol=1e-5, atol=1e-5 * float(own.abs().max())):
        raise Unsupported(
            f"model: {type(model).__name__} does not number positions 0, 1, 2, … by default (its output changes when "
            "given position_ids = arange: RoBERTa-style embeddings count from padding_idx + 1), so the blocks, which "
            f"pass their absolute positions, would be shifted; {ENGINE_HINT}")
    _POSITIONS_OK.add(model)


def check_deterministic(model: nn.Module) -> None:
    """(e) A stochastic forward (dropout in training mode, the LoRA dropout included) cannot give the
    prefill's and the blocks' forwards the same values; gradient checkpointing in training mode
    turns the cache off."""
    active = []
    for name, mod in model.named_modules():
        if not mod.training:
            continue
        if getattr(mod, "gradient_checkpointing", False) is True:
            raise ModelContractError(
                "model: gradient checkpointing is on in training mode (model.gradient_checkpointing_enable()); "
                "transformers then runs without a cache, which the streamed backward needs. It already keeps one "
                "block's activations at a time: call model.gradient_checkpointing_disable() or model.eval()")
        if isinstance(mod, nn.modules.dropout._DropoutNd) and mod.p > 0:
            active.append(f"{name or type(mod).__name__} (p={mod.p})")
        for attr, val in vars(mod).items():
            if ("dropout" in attr or "pdrop" in attr) and isinstance(val, float) and val > 0:
                active.append(f"{name}.{attr}={val}")
    if active:
        shown = ", ".join(active[:4]) + (f" and {len(active) - 4} more" if len(active) > 4 else "")
        raise ModelContractError(
            f"model: dropout is active in training mode ({shown}): the forward is random, so the blocks and the "
            "prefill would not see the same values. Call model.eval() (the streamed backward needs no train mode) or "
            "set the dropout probabilities to 0 (LoRA: lora_dropout=0)")


def package_frame(exc: BaseException) -> bool:
    """Was `exc` raised by backstream's own code (innermost frame in this package)? A frame of a torch
    function mode of ours that only passes the call on (`miniature.keep_float64`) does not count."""
    here = os.path.dirname(os.path.abspath(__file__))
    tb, last = exc.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name != "__torch_function__" or os.path.dirname(os.path.abspath(code.co_filename)) != here:
            last = tb
        tb = tb.tb_next
    return last is not None and os.path.dirname(os.path.abspath(last.tb_frame.f_code.co_filename)) == here


# -- images: the decoder sees an image only as its input rows (docs/design.md §2c) -----------------

_IMAGE_ATTENTION_OK: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")


def check_image_attention(model: nn.Module) -> None:
    """With the token types its processor gives an image (`token_type_ids` / `mm_token_type_ids`: 1 at the
    image's placeholders), does a position still see only itself and the positions before it? Gemma 3
    builds a bidirectional mask over each image's tokens from them, which the engine's causal blocks (fed
    by token ids and rows of E, never the types) cannot compute. One probe per model: 4 forwards of 4
    random input rows [text, image, image, text], each row after the first perturbed once, no earlier
    output may move. A forward that cannot run the probe (it needs the image's grid) is left to the rest."""
    import inspect  # noqa: PLC0415

    from backstream.stream.hf import base_model  # noqa: PLC0415

    if model in _IMAGE_ATTENTION_OK:
        return
    base = base_model(model)
    takes = inspect.signature(base.forward).parameters
    keys = [k for k in _TOKEN_TYPE_KEYS if k in takes]
    emb = base.get_input_embeddings()
    if keys and emb is not None:
        p = next(base.parameters())
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, 4, emb.embedding_dim, generator=gen, dtype=torch.float64).to(p.device, p.dtype)
        types = torch.tensor([[0, 1, 1, 0]], device=p.device)
        # the earlier outputs of a causal model do not move at all; a leak moves them by O(1)
        tol = 1e-6 if p.dtype == torch.float64 else 1e-3 if p.dtype == torch.float32 else 5e-2
        was = base.training
        base.eval()
        try:
            with torch.no_grad():
                kw = {k: types for k in keys}
                ref = base(inputs_embeds=x, input_ids=None, **kw).logits
                for k in range(1, 4):
                    y = x.clone()
                    y[0, k] += 1.0
                    out = base(inputs_embeds=y, input_ids=None, **kw).logits
                    moved = (out[0, :k] - ref[0, :k]).abs().max()
                    if float(moved) > tol * max(float(ref.abs().max()), 1.0):
                        raise Unsupported(
                            f"model: {type(base).__name__}: with the token types its processor gives an image "
                            f"({'/'.join(keys)}), an earlier position sees position {k}: its image tokens attend to "
                            "each other both ways (a bidirectional mask over each image, as Gemma 3's), which the "
                            "engine's causal blocks cannot compute; the gradient would differ (docs/design.md §2c). "
                            "The reference backward feeds the decoder the same way; train this model on text only")
        except Unsupported:
            raise
        except Exception:  # noqa: BLE001  (a probe this forward cannot run: the other checks decide)
            return
        finally:
            base.train(was)
    _IMAGE_ATTENTION_OK.add(model)

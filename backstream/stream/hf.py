"""What every part of backstream asks of a Hugging Face causal LM, in one place: the transformers
model inside a PEFT wrapper, its text config, its expert count, its decoder layers, whether its
forward takes `logits_to_keep`. Importing this module changes nothing (no registration, no patch).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import socket
import sys
from urllib.parse import urlparse

from torch import nn

from backstream.checks import UserError

# The oldest transformers the engine and the sampler run on (the cache layer `DummyLayer` came in 5.23);
# pyproject.toml asks for the same. vLLM's own environment, which imports only the server's side of
# the package (rl/backends/vllm/worker_ext.py, rl/backends/vllm/weights/, quant/), may hold an older one.
MIN_TRANSFORMERS = (5, 23)
# The first transformers whose Cache API for layers with recurrent or convolution state the engine does not
# know: 5.25 gave those layers a token count, a history of states and `get_recurrent_states_to_keep`, which
# the engine's caches do not implement, so every hybrid model fails inside transformers there (refused by
# name, never streamed wrong); pyproject.toml asks for an older one.
STATE_API_UNKNOWN = (5, 25)


def state_api_hint() -> str:
    """What to say when a model with layer state fails inside this transformers: '' where the engine knows
    its Cache API, else the version to install."""
    import transformers  # noqa: PLC0415

    try:
        have = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    except ValueError:
        return ""
    if have < STATE_API_UNKNOWN:
        return ""
    return (f" transformers {transformers.__version__} changed the Cache API of layers with recurrent or convolution "
            f"state ({'.'.join(map(str, STATE_API_UNKNOWN))}); backstream streams them on transformers 5.23-5.24: "
            "pip install 'transformers>=5.23,<5.25'.")


def require_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than MIN_TRANSFORMERS, naming the fix: a source tree run beside an
    older install (a GPU machine's image, say) would otherwise fail deep inside an import or a forward."""
    if version is None:
        import transformers  # noqa: PLC0415

        version = transformers.__version__
    try:
        have = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return  # a version of another shape (a local build): the imports decide
    if have < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"backstream needs transformers >= {need}, this environment has {version}: "
                          f"pip install -U 'transformers>={need},<5.25' (no network: bring its wheel, as "
                          "bench/README.md 'The GPU check' does)")


# config keys that name an MoE's number of routed experts and the experts a token picks, by family
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts",
              "num_selected_experts")


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def text_config(model: nn.Module):
    """The config of the model's text decoder (the config itself for a plain causal LM), or None."""
    config = getattr(base_model(model), "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _int(config, key: str) -> int | None:
    try:  # heterogeneous configs raise on per-layer attributes read globally
        v = getattr(config, key, None)
    except Exception:  # noqa: BLE001
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def num_experts(config) -> int | None:
    """The number of routed experts an MoE config names (under any of `EXPERT_KEYS`), else None."""
    return next((v for v in (_int(config, k) for k in EXPERT_KEYS) if v is not None), None)


def experts_per_token(config) -> int | None:
    """How many experts a token is routed to (any of `TOP_K_KEYS`), else None."""
    return next((v for v in (_int(config, k) for k in TOP_K_KEYS) if v is not None), None)


def text_part(model: nn.Module) -> tuple[str, nn.Module] | None:
    """A vision-language model's text decoder, a child of its inner model, with that child's name
    (`language_model` in most families, Idefics3's `text_model`); None for a text model."""
    inner = getattr(base_model(model), "model", None)
    if not isinstance(inner, nn.Module):
        return None
    for name, child in inner.named_children():
        if name in ("language_model", "text_model"):
            return name, child
    return None


def image_path(model: nn.Module) -> set[int]:
    """The ids of a vision-language model's modules outside its text decoder (the vision tower, the
    projector: every child of the inner model but `text_part`'s), which the engine never runs
    (stream/vision.py gets their output); empty for a text model."""
    text = text_part(model)
    if text is None:
        return set()
    inner = base_model(model).model
    return {id(m) for name, child in inner.named_children() if name != text[0] for m in child.modules()}


def decoder_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The transformer blocks of `model` (a PEFT wrapper or not), by their names in
    `model.named_modules()`: the modules whose class is in the model's `_no_split_modules`, else the
    entries of its longest ModuleList. Empty when there is neither."""
    names = set(getattr(base_model(model), "_no_split_modules", None) or [])
    found = {n: m for n, m in model.named_modules() if type(m).__name__ in names}
    if found:
        return found
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return {}
    name, longest = max(lists, key=lambda nm: len(nm[1]))
    return {f"{name}.{i}": m for i, m in enumerate(longest)}


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Does the model's forward accept `logits_to_keep` (no [positions × vocab] logits beyond those)?"""
    return "logits_to_keep" in inspect.signature(base_model(model).forward).parameters


def takes_logits_mask(model: nn.Module) -> bool:
    """Does the model's forward take `logits_to_keep` as a boolean [B, Q] mask of the positions to keep
    (the engine's use: each row keeps its own)? transformers slices it with `slice_logits_to_keep`
    from 5.2x on; before (5.17: `hidden_states[:, logits_to_keep, :]`) a mask fails inside the model,
    and the engine takes the logits of the whole block instead and keeps its positions itself."""
    return takes_logits_to_keep(model) and _slices_by_mask(type(base_model(model)))


@functools.cache
def _slices_by_mask(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    return getattr(module, "slice_logits_to_keep", None) is not None


def cache_arg(model: nn.Module) -> str | None:
    """The keyword the model's forward takes its Cache under: `cache` (transformers 5.24 on),
    `past_key_values` (before, and families not yet renamed), or None when it takes neither."""
    return _cache_arg(type(base_model(model)))  # the class's forward, not a wrapper's


@functools.cache
def _cache_arg(cls: type) -> str | None:  # read once per class: the sampler asks at every token
    params = inspect.signature(cls.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def returned_cache(out):
    """The Cache a forward returned: `out.cache` from transformers 5.24 on, `out.past_key_values` before."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def locate(name: str, key: str, model_types: bool = False) -> str:
    """What a model name given as `key` is: "folder" (a local folder holding config.json), "type" (a
    transformers model_type, when `model_types`) or "hub" (a Hub id found in the local cache, or
    reachable). Anything else is a ValueError naming `key`, what was found and what to pass — at once:
    an unreachable Hub is not retried (the nearest model types are listed instead)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: PLC0415
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: PLC0415

    expected = ("a folder holding config.json, " + ("a transformers model_type (e.g. llama), " if model_types else "")
                + "or a Hub id (org/name)")
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise UserError(f"{key}: {name!r} is a folder but holds no config.json, so it is not a Hugging Face "
                             f"model folder (save_pretrained writes one); pass {expected}")
        return "folder"
    if model_types and name in CONFIG_MAPPING:
        return "type"
    if name.startswith((".", os.sep, "~")) or name.count("/") > 1 or os.path.splitext(name)[1]:
        raise UserError(f"{key}: {name!r} is no folder here; pass {expected} (a relative path starts at "
                         f"{os.getcwd()})")
    if _cached(name) or _hub_reachable():
        return "hub"
    near = difflib.get_close_matches(name.split("/")[-1].lower(), list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=5,
                                     cutoff=0.5)
    hint = f"; the nearest model types: {', '.join(near)}" if near and model_types else ""
    what = "a folder, a model_type" if model_types else "a folder"
    raise UserError(f"{key}: cannot load {name!r}: it is not {what} or a Hub id in the local cache, and the Hub "
                     f"cannot be reached (offline, or HF_HUB_OFFLINE=1){hint}; pass {expected}")


def _cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001  (not a valid repo id, no cache: not cached)
        return False


def _hub_reachable(timeout_s: float = 2.0) -> bool:
    """Can the Hub be reached now? One TCP connection with a short timeout (huggingface_hub itself would
    retry for tens of seconds before failing); False under HF_HUB_OFFLINE."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False

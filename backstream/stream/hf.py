"""What every part of backstream asks of a Hugging Face causal LM, in one place: the transformers
model inside a PEFT wrapper, its text config, its expert count, its decoder layers, whether its
forward takes `logits_to_keep`. Importing this module changes nothing (no registration, no patch).
"""

from __future__ import annotations

import inspect

from torch import nn

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

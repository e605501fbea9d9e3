"""Mamba 1's selective scan continued from a state (docs/design.md §2b).

transformers' Mamba 1 mixers (Mamba, Falcon-Mamba, Jamba) run a multi-token block with
`mamba_selective_scan`, which starts its state from zero: the recurrent state a cache holds is read on
one-token steps only (neither the torch path nor the mamba-ssm kernel takes an initial state). A block
that starts mid-sequence would be silently wrong. The scan is linear in its initial state h0; with
Δ_t = softplus(dt_t + bias) and the decay a_t = exp(A Σ_{s≤t} Δ_s),

    h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t B_t x_t       ⇒   h_t = h_t|0 + a_t ⊙ h0
    y_t = (C_t · h_t + D x_t) ⊙ silu(z_t)          ⇒   y_t = y_t|0 + (C_t · (a_t ⊙ h0)) ⊙ silu(z_t)

where ·|0 is the scan from zero. So the continued scan is the model's own scan from zero plus those two
terms, in plain torch: autograd gives dL/dh0, which the engine hands back to the block that produced
h0, as it does for every other state (backstream.stream.state).

`install(model)` puts `continued_scan` in front of the scan of the model's Mamba 1 mixers: a forward
pre-hook on each mixer notes the cache it runs with, and the module's `mamba_selective_scan` (looked up
by the mixer at call time) adds the two terms when that cache holds a state for the mixer's layer.
Every other call (no cache, a cache without a state: a sequence's first block, or a mixer of a model
not installed) is transformers' own scan, unchanged. The engine and the sampler both call `install`
(adapter.probe_layout); `selective_scan_reference` is the sequential recurrence from h0 the tests
compare it with.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SCAN = "mamba_selective_scan"  # the module-level function transformers' Mamba 1 mixers call
_current = threading.local()  # .stack: (cache, layer_idx) of the mixers in their forward, innermost last
_ORIGINAL: dict[str, object] = {}  # module name -> transformers' own scan


def is_mamba1_mixer(module: nn.Module) -> bool:
    """A mixer whose module's code scans with `mamba_selective_scan` (Mamba, Falcon-Mamba, Jamba)."""
    mod = sys.modules.get(type(module).__module__)
    return (mod is not None and callable(getattr(mod, SCAN, None)) and hasattr(module, "A_log")
            and isinstance(getattr(module, "layer_idx", None), int))


def continued_scan(original, h0: Tensor, hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                   D: Tensor | None = None, z: Tensor | None = None, delta_bias: Tensor | None = None,
                   delta_softplus: bool = False, return_last_state: bool = False, **kwargs):
    """`original`'s scan (transformers' `mamba_selective_scan`: x [B, I, L], dt [B, I, L], A [I, N],
    B and C [B, N, L]) continued from the state h0 [B, I, N] instead of zero (see the module docstring)."""
    out = original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                   return_last_state=return_last_state, **kwargs)
    y, last = out if return_last_state else (out, None)
    step = dt + delta_bias.to(dt.dtype)[..., None] if delta_bias is not None else dt
    if delta_softplus:
        step = F.softplus(step)
    decayed = torch.exp(A[None, :, None, :] * step.cumsum(-1)[..., None]) * h0[:, :, None, :].to(step.dtype)
    term = torch.einsum("bitn,bnt->bit", decayed, C.to(decayed.dtype)).to(y.dtype)  # [B, I, L]
    y = y + (term * F.silu(z) if z is not None else term)
    if not return_last_state:
        return y
    return y, last + decayed[:, :, -1].to(last.dtype)


def selective_scan_reference(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h0: Tensor | None,
                             D: Tensor | None = None, z: Tensor | None = None, delta_bias: Tensor | None = None,
                             delta_softplus: bool = False) -> tuple[Tensor, Tensor]:
    """The recurrence itself, one token at a time from h0 (zero if None): (y [B, I, L], h_L [B, I, N])."""
    step = dt + delta_bias[..., None] if delta_bias is not None else dt
    if delta_softplus:
        step = F.softplus(step)
    Bsz, inner, L = hidden_states.shape
    h = torch.zeros(Bsz, inner, A.shape[-1], dtype=step.dtype) if h0 is None else h0.to(step.dtype)
    ys = []
    for t in range(L):
        dt_t = step[:, :, t, None]
        h = torch.exp(dt_t * A[None]) * h + dt_t * B[:, None, :, t] * hidden_states[:, :, t, None]
        ys.append((h * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y, h


def transformers_scan(module_name: str):
    """transformers' own scan of a Mamba 1 modeling module (the one `install` put ours in front of)."""
    import importlib  # noqa: PLC0415

    return _ORIGINAL.get(module_name) or getattr(importlib.import_module(module_name), SCAN)


def _scan_for(module_name: str):
    original = _ORIGINAL[module_name]

    def mamba_selective_scan(hidden_states, dt, A, B, C, *args, **kwargs):
        stack = getattr(_current, "stack", None)
        cache, layer = stack[-1] if stack else (None, None)
        h0 = cache.get_recurrent_state(layer) if cache is not None else None
        if h0 is None:
            return original(hidden_states, dt, A, B, C, *args, **kwargs)
        return continued_scan(original, h0, hidden_states, dt, A, B, C, *args, **kwargs)

    mamba_selective_scan.continues_state = True
    return mamba_selective_scan


def _enter(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("cache_params", args[1] if len(args) > 1 else None))
    stack = getattr(_current, "stack", None)
    if stack is None:
        stack = _current.stack = []
    stack.append((cache, module.layer_idx))


def _exit(module, args, kwargs, output):
    _current.stack.pop()


def install(model: nn.Module) -> int:
    """Make `model`'s Mamba 1 mixers scan from the state their cache holds (once per model; the number
    of mixers). A mixer that raises leaves the stack as it was (`_exit` runs as an always-call hook)."""
    n = 0
    for m in model.modules():
        if not is_mamba1_mixer(m):
            continue
        n += 1
        if getattr(m, "_backstream_scan", False):
            continue
        name = type(m).__module__
        if name not in _ORIGINAL:
            _ORIGINAL[name] = getattr(sys.modules[name], SCAN)
            setattr(sys.modules[name], SCAN, _scan_for(name))
        m.register_forward_pre_hook(_enter, with_kwargs=True)
        m.register_forward_hook(_exit, with_kwargs=True, always_call=True)
        m._backstream_scan = True
    return n

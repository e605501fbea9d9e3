"""FSDP2 around the streamed backward (docs/design.md §6c): everything backstream knows of FSDP2, in one
leaf module that imports nothing of the engine.

Why the engine cannot let FSDP2 work as it does for one forward and one backward: ranks hold different
sequences, so they run different numbers of block forwards and backwards, and a block batch's graph
differs from rank to rank; and the streamed backward starts from each layer's K/V, where FSDP's
pre-backward all-gather does not fire. Hence, for one whole call (`stream_backward`, `logprobs`,
`reference_backward`: `run`), an `FSDPCall`:
- every unit is unsharded once at the start (model pre-order, the same on every rank) and kept
  gathered (reshard after forward/backward off), so that no forward or backward of the call
  communicates; gradients accumulate unreduced (gradient sync off);
- at the end of a backward call every rank runs one more backward, of a zero-weighted forward of one
  token through the whole model (`reduce`): the same graph on every rank, so FSDP's post-backward
  hooks reduce-scatter each unit once, in the same order everywhere, on a rank with no work (no
  sequence, every weight 0) too, and the zero gradient adds nothing. Reducing in the last block batch
  instead would make the set and order of collectives depend on that batch's graph, which differs
  by rank. Unused parameters are reduced as zeros (an MoE expert this rank never routed to);
- afterwards the user's settings are back and the units whose settings ask for it are resharded;
  after an exception the call's unreduced gradients are dropped and FSDP's `reset_iter_state` runs
  (a rank that raises leaves the others waiting in the reduction until the process group's timeout).
`gathered(model)` is the same protocol without a backward, for passes that run forwards only (the
sampler, a log-prob pass): ranks decode different numbers of tokens, and a per-forward all-gather
would make them wait on each other per token (or deadlock).

FSDP2 offers setters but no getters for its per-unit settings: they are saved from, and restored to,
the attributes those setters write (torch 2.13's FSDPParamGroup and FSDPState); `FSDPCall.check_supported`
refuses, when a model is sharded, a torch whose FSDP2 lacks any of them.

Sum or average over ranks and global loss normalisers are the caller's policy; `shard` sets the
trainer's (a SUM: its normalisers are global). Without a process group every function here is
trivial and costs one check.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backstream.checks import UserError
from backstream.stream.hf import decoder_layers


def active() -> bool:
    """Is a process group running (the only case where a model can hold FSDP units)?"""
    return dist.is_available() and dist.is_initialized()


def units(model: nn.Module) -> list:
    """The model's FSDP2 modules in pre-order (outer units first), [] without a process group."""
    if not active():
        return []  # the single-process path pays for nothing more than this check
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class FSDPCall:
    """Parameters gathered for the whole call, gradients accumulated unreduced, one reduction at the
    end (`reduce`, backward calls only); the units' own settings restored on exit, also after an
    exception. `reshard_all`: reshard every unit on exit (a forward-only pass: nothing gathered
    outlives it), else as FSDP leaves a unit after a backward, or after a forward without one."""

    GROUP = ("reduce_grads", "all_reduce_grads", "reshard_after_backward", "reduce_scatter_unused_params",
             "post_forward_mesh_info")
    SETTERS = ("set_reshard_after_forward", "set_reshard_after_backward", "set_requires_gradient_sync",
               "set_reduce_scatter_unused_params", "set_gradient_divide_factor", "set_force_sum_reduction_for_comms",
               "unshard", "reshard", "reset_iter_state")
    STATE = ("_is_root", "_lazy_init", "_fsdp_param_groups", "_auto_reshard_after_forward")

    @classmethod
    def check_supported(cls, units: list) -> None:
        """A clear error, at sharding time, when this torch's FSDP2 lacks what the engine relies on
        (the setters above and the internals they write), instead of an AttributeError mid-step; a
        UserError, so that the CLI names it (exit 2) rather than calling it a bug (torch 2.11 is such a
        torch: its FSDPState has no `_fsdp_param_groups`)."""
        missing = [f"{type(m).__name__}.{a}" for m in units[:1] for a in cls.SETTERS if not hasattr(m, a)]
        for m in units[:1]:
            state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
            missing += ["_get_fsdp_state"] if state is None else [f"FSDPState.{a}" for a in cls.STATE
                                                                   if not hasattr(state, a)]
            for g in getattr(state, "_fsdp_param_groups", None) or []:
                missing += [f"FSDPParamGroup.{a}" for a in cls.GROUP if not hasattr(g, a)]
        if missing:
            raise UserError(f"torchrun: this torch ({torch.__version__}) has an FSDP2 without "
                               f"{sorted(set(missing))}, which the streamed backward under FSDP relies on; "
                               "install the torch version backstream is tested with (2.13) or train in one process")

    def __init__(self, units: list, backward: bool, reshard_all: bool = False):
        self.units, self.backward, self.reshard_all = units, backward, reshard_all
        self.states = list({id(s): s for s in (m._get_fsdp_state() for m in units)}.values())

    def __enter__(self) -> FSDPCall:
        for state in self.states:
            if state._is_root is None:
                state._lazy_init()  # what FSDP does at the root's first forward; outer units come first
        self.groups = [g for state in self.states for g in state._fsdp_param_groups]
        self.saved = [{k: getattr(g, k) for k in self.GROUP} for g in self.groups]
        self.auto = [state._auto_reshard_after_forward for state in self.states]
        try:
            for m in self.units:
                m.set_reshard_after_forward(False, recurse=False)
                m.set_reshard_after_backward(False, recurse=False)
                m.set_requires_gradient_sync(False, recurse=False)
                # the reduction's set of parameters must not depend on what this rank's data used
                m.set_reduce_scatter_unused_params(True, recurse=False)
            for m in self.units:
                m.unshard()  # one all-gather per unit (none if gathered already), same order on every rank
        except BaseException as e:
            self.__exit__(type(e))
            raise
        return self

    def reduce(self, model: nn.Module) -> None:
        """The call's one gradient reduction: the user's sync settings back on, then the backward of
        a zero-weighted one-token forward (no collective in the forward: everything is gathered)."""
        for g, saved in zip(self.groups, self.saved):
            for k in ("reduce_grads", "all_reduce_grads", "reshard_after_backward"):
                setattr(g, k, saved[k])
        ids = torch.zeros((1, 1), dtype=torch.long, device=next(model.parameters()).device)
        with torch.enable_grad():
            logits = model(input_ids=ids, use_cache=False).logits
        if logits.requires_grad:
            torch.autograd.backward(logits, torch.zeros_like(logits))

    def __exit__(self, exc_type=None, *exc) -> None:
        for g, saved in zip(self.groups, self.saved):
            for k, v in saved.items():
                setattr(g, k, v)
        for state, auto in zip(self.states, self.auto):
            state._auto_reshard_after_forward = auto
        if exc_type is not None:
            # the call failed before its reduction: FSDP's own recovery, and the unreduced
            # gradients it holds (out of `model.zero_grad()`'s reach) would corrupt the next step
            for m in self.units:
                if m._get_fsdp_state()._is_root:
                    m.reset_iter_state()
            for g in self.groups:
                for p in g.fsdp_params:
                    p.unsharded_accumulated_grad = None
                    if hasattr(p, "_unsharded_param"):
                        p._unsharded_param.grad = None
        if self.reshard_all:
            for m in self.units:
                m.reshard()
            return
        for g, saved in zip(self.groups, self.saved):
            # as FSDP leaves a unit after a backward, or after a forward without one
            wanted = saved["reshard_after_backward"] if self.backward else saved["post_forward_mesh_info"] is not None
            if wanted:
                g.reshard()


def run(model: nn.Module, has_work: bool, backward: bool, local, idle):
    """One engine call: `local(across_ranks=False)` when the model is not sharded; else, inside one
    `FSDPCall`, `local(across_ranks=True)` on a rank with sequences or `idle()` on one without (its
    collectives must still match the others'), then the call's one reduction (backward calls)."""
    us = units(model)
    if not us:
        return local(across_ranks=False)
    with FSDPCall(us, backward) as call:
        result = local(across_ranks=True) if has_work else idle()
        if backward:
            call.reduce(model)
    return result


@contextlib.contextmanager
def gathered(model: nn.Module):
    """Every FSDP unit's parameters all-gathered once on entry (every rank must enter) and kept for
    the forwards inside, resharded on exit: forwards inside cost no collective, so ranks that run
    different numbers of them (decoding, skipped sequences) never wait on each other. No-op when
    the model is not sharded."""
    us = units(model)
    if not us:
        yield
        return
    with FSDPCall(us, backward=False, reshard_all=True):
        yield


def reshard(model: nn.Module) -> None:
    """Free every unit's gathered parameters (so that the next forward gathers the weights the
    optimizer just wrote, not a stale copy)."""
    for u in units(model):
        u.reshard()


def sum_over_ranks(t: Tensor) -> Tensor:
    """The element-wise sum of `t` over every rank (`t` itself without a process group), on t's
    device: the one collective on plain data the library runs itself (the MoE router's counts)."""
    if not active():
        return t
    on_nccl = dist.get_backend() == "nccl"
    out = t.to(torch.device("cuda", torch.cuda.current_device()) if on_nccl else "cpu").clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device)


def shard(model: nn.Module, device: torch.device, bf16: bool = False) -> nn.Module:
    """FSDP2 over every rank: `fully_shard` on each decoder layer, then on the root (after LoRA and
    quantization, so adapters and frozen base weights are sharded alike). Gradients are reduced as a
    SUM over ranks: the trainer's loss normalisers are global, so FSDP's default mean would divide the
    gradient by the world size a second time. `bf16`: parameters all-gathered and forwards run in
    bfloat16, gradients reduced in float32 (FSDP2's MixedPrecisionPolicy)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy())
    for layer in decoder_layers(model).values():
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)  # the root, as FSDP itself sets it
    FSDPCall.check_supported([m for m in model.modules() if isinstance(m, FSDPModule)])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM), no division
    return model


def versions(model: nn.Module) -> tuple[int, ...]:
    """The version counters of the trainable weights this rank holds: they change whenever an
    optimizer step (or any in-place write) touches one. Sharded, those of the shards: the gathered
    copies that `gathered` puts in the modules are refilled by all-gathers that leave their counters
    at 0, so they never show a step."""
    us = units(model)
    if not us:
        return tuple(p._version for p in model.parameters() if p.requires_grad)
    return tuple(p.sharded_param._version for u in us for g in u._get_fsdp_state()._fsdp_param_groups
                 for p in g.fsdp_params if p.sharded_param.requires_grad)


def full_state_dict(model: nn.Module, trainable_only: bool = False) -> dict[str, Tensor]:
    """The model's state dict with whole tensors (`trainable_only`: the parameters that require grad,
    a LoRA adapter). Sharded, a collective (every rank calls it; the shards are all-gathered one
    tensor at a time) whose result lands on rank 0's CPU, {} on the other ranks; inside `gathered` it
    leaves the units resharded (FSDP's state-dict hook), so no forward may follow it there. In one
    process, the model's own tensors (no copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415

    return get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=bool(units(model)), ignore_frozen_params=trainable_only))


def whole(t: Tensor) -> Tensor:
    """A parameter whole: a DTensor's shards all-gathered (a collective: every rank calls it, for the
    same parameters in the same order), any other tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def grad_norm(params: list[Tensor], max_norm: float) -> float:
    """The global gradient norm (over every rank's shards); clips to `max_norm` when > 0. Without
    DTensor parameters: torch's clip_grad_norm_ / the plain norm."""
    grads = [p.grad for p in params if p.grad is not None]
    if not (active() and any(hasattr(p, "to_local") for p in params)):
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        norms = [g.norm() for g in grads]
        return float(torch.norm(torch.stack(norms))) if norms else 0.0  # no gradient: every advantage was 0
    # DTensor gradients: the norm is a partial sum over shards; full_tensor() all-reduces it
    total = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros(())
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    gn = float(total)
    if max_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return gn

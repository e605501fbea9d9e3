"""What tests/distributed/test_dcp.py runs on each rank of a gloo group (tests/dist.py spawns the processes, so
these live at module level) and in the test process itself: a tiny float32 Llama, FSDP2-sharded on
two ranks, AdamW steps on rank-different data, checkpoints written and restored."""

import contextlib
import errno
import os
from unittest import mock

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from backstream import checkpoint
from backstream.default_model import build_tokenizer

LR = 1e-2


def build(lora: bool, layers: int = 2):
    """The same model on every rank and in every process: seeded."""
    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model, tok


def shard(model):
    """FSDP2 as the trainer does it: each decoder layer, then the root, on a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optimizer(model):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return opt, sched


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(1000 * step + rank))


def step(model, opt, sched, i: int, ranks: list[int]) -> None:
    """One optimizer step on the data of `ranks` (one rank under FSDP, whose mean over ranks is the
    mean of the per-rank losses; all of them in a single process)."""
    loss = sum(model(x, labels=x).loss for x in (batch(i, r) for r in ranks)) / len(ranks)
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def full(model, opt=None):
    """The gathered weights (and optimizer state, by parameter name) on rank 0; None on the others."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    w = get_model_state_dict(model, options=opts)
    o = get_optimizer_state_dict(model, opt, options=opts).get("state") if opt is not None else None
    if dist.get_rank() != 0:
        return None
    o = o and {k: {n: v.clone() for n, v in s.items()} for k, s in o.items()}  # `step` is the live tensor
    return w, o


def _same(a, b) -> bool | None:
    """Whether two sharded models hold the same weights (on rank 0; None on the others)."""
    wa, wb = full(a), full(b)
    return None if wa is None else wa[0].keys() == wb[0].keys() and all(torch.equal(wa[0][k], wb[0][k]) for k in wa[0])


def state(gen, opt, sched, i: int, rank: int) -> dict:
    return {"step": i, "optimizer": opt, "scheduler": sched.state_dict(), "rng": checkpoint.rng_state(),
            "data_position": 10 * rank + i}


def train_save_resume(root: str, single: str) -> dict:
    """On each rank, for full fine-tune and LoRA: 2 steps, save step-2, record, a third step, record;
    a full disk while saving step 3 (full: on rank 1 writing its shard; LoRA: on rank 0 writing the
    export); then, as a fresh process would, a new model and optimizer restored from step-2 take the
    third step; and the checkpoint one process wrote (`single`) restored into the sharded model."""
    rank = dist.get_rank()
    out = {}
    for lora, failing, target in ((False, 1, "torch.distributed.checkpoint.filesystem._write_item"),
                                  (True, 0, "save_pretrained")):
        run = os.path.join(root, "lora" if lora else "full")
        model, tok = build(lora)
        model = shard(model)
        opt, sched = optimizer(model)
        gen = torch.Generator()
        if not lora:  # a checkpoint before the first optimizer step leaves the optimizer, and restores it, unstepped
            fresh = checkpoint.save(os.path.join(root, "unstepped"), 0, model, tok, state(gen, opt, sched, 0, rank))
            other, _ = build(lora)
            other_opt, _ = optimizer(shard(other))
            checkpoint.restore(fresh, other, other_opt)
            out["unstepped"] = (not opt.state, not other_opt.state, _same(model, other))
        for i in (1, 2):
            step(model, opt, sched, i, [rank])
        torch.manual_seed(77 + rank)  # this rank's random state at the checkpoint
        r = out[lora] = {"path": checkpoint.save(run, 2, model, tok, state(gen, opt, sched, 2, rank), keep=2),
                         "at_save": full(model, opt)}
        step(model, opt, sched, 3, [rank])
        r["after"] = full(model)
        r["full_disk"] = _save_with_full_disk(run, model, tok, gen, opt, sched, failing, target)

        model, _ = build(lora)
        model = shard(model)
        opt, sched = optimizer(model)
        st = checkpoint.restore(checkpoint.latest_intact(run), model, opt, sched)
        torch.manual_seed(0)
        checkpoint.restore_rng(st["rng"])
        r["restored"] = {k: st[k] for k in ("step", "data_position", "world_size")}
        r["sampler"] = torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(77 + rank).get_state())
        r["lr"] = sched.get_last_lr()
        step(model, opt, sched, 3, [rank])
        r["after_resume"] = full(model)

        model, _ = build(lora)
        model = shard(model)
        opt, sched = optimizer(model)
        st = checkpoint.restore(os.path.join(single, "lora" if lora else "full", "checkpoints", "step-2"),
                                model, opt, sched)
        r["single"] = {"step": st["step"], "world_size": st["world_size"], "at_restore": full(model, opt)}
        step(model, opt, sched, 3, [rank])
        r["single"]["after"] = full(model)
    return out


def _save_with_full_disk(run, model, tok, gen, opt, sched, failing: int, target: str) -> dict:
    """`target`: a function of DCP's writer, or the tokenizer's method (rank 0 writes the export)."""
    rank = dist.get_rank()

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    patch = contextlib.nullcontext()
    if rank == failing:
        patch = mock.patch.object(tok, target, full_disk) if hasattr(tok, target) else mock.patch(target, full_disk)
    try:
        with patch:
            checkpoint.save(run, 3, model, tok, state(gen, opt, sched, 3, rank), keep=2)
        error = None
    except OSError as e:
        error = (e.errno, str(e))
    names = sorted(os.listdir(os.path.join(run, "checkpoints")))  # as this rank sees the folder
    dist.barrier()
    return {"error": error, "names": names, "latest": checkpoint.latest_intact(run)}

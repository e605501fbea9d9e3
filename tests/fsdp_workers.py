"""Worker functions for tests/distributed/test_fsdp_engine.py, run in 2 gloo processes by tests/dist.py (spawned
processes import them by module name, so they live here and not in the test file).

Each rank builds the same seeded float64 model, shards it with FSDP2 (every decoder layer, then the
whole model) and reduces by SUM (`set_gradient_divide_factor(1.0)`: the trainer's policy, not the
engine's), then runs the engine on its own share of a GRPO-like batch.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from dist import ALL_GATHER, REDUCE_SCATTER
from helpers import VOCAB, lora, make
from torch.distributed.fsdp import FSDPModule, fully_shard

from backstream import Objective, TokenWeights, logprobs, reference_backward, stream_backward
from backstream.rl.update.losses import PPOClipConfig, build_objective
from backstream.stream.fsdp import FSDPCall
from backstream.stream.hf import base_model

warnings.filterwarnings("ignore", category=FutureWarning)
CONFIGS = [(use_lora, reshard) for use_lora in (False, True) for reshard in (True, False)]
BLOCK = 3  # small blocks: many block batches, and a different number on each rank


# ---------------------------------------------------------------------------------------------
# Data: the same on every rank and in the test process.


def groups(n_groups: int = 5, seed: int = 0) -> list[tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]]:
    """GRPO-like groups: a prompt shared by 2 or 3 responses of unequal lengths; per group the
    sequences, their completion masks and the responses' advantages."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(n_groups):
        P = torch.randint(0, VOCAB, (int(torch.randint(4, 9, (1,), generator=gen)),), generator=gen)
        seqs, masks = [], []
        for _ in range(2 + g % 2):
            r = torch.randint(0, VOCAB, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen)
            seqs.append(torch.cat([P, r]))
            masks.append(torch.arange(len(seqs[-1])) >= len(P))
        out.append((seqs, masks, torch.randn(len(seqs), generator=gen, dtype=torch.float64)))
    return out


def share(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Rank 0 takes groups 0-2 (8 sequences), rank 1 groups 3-4 (5): different batch counts."""
    mine = groups()[:3] if rank == 0 else groups()[3:]
    return ([s for g in mine for s in g[0]], [m for g in mine for m in g[1]], torch.cat([g[2] for g in mine]))


def token_weights(rank: int, idle: bool = False) -> list[torch.Tensor]:
    """GRPO token weights A_i / (completion tokens of the GLOBAL batch): the global normaliser."""
    n_tok = sum(int(m.sum()) for r in (0, 1) for m in share(r)[1])
    seqs, masks, adv = share(rank)
    return [m.double() * (0.0 if idle else float(a)) / n_tok for m, a in zip(masks, adv)]


def ppo_objective(rank: int, idle: bool = False) -> Objective:
    seqs, masks, adv = share(rank)
    return build_objective(PPOClipConfig(), sequences=seqs, completion_mask=masks,
                           advantages=torch.zeros_like(adv) if idle else adv)


def objective(use_lora: bool, rank: int, idle: bool = False) -> Objective:
    """Token weights for full fine-tuning, the PPO-clip objective with LoRA."""
    return ppo_objective(rank, idle) if use_lora else TokenWeights(token_weights(rank, idle))


def model(use_lora: bool, dtype=torch.float64, family: str = "llama") -> torch.nn.Module:
    m = make(family, dtype)
    return lora(m) if use_lora else m


MOE_COEF = 0.7


def router_objective(rank: int, empty: bool = False) -> TokenWeights:
    """The token weights plus the MoE load-balancing loss (whose f_e and N span both ranks)."""
    return TokenWeights([] if empty else token_weights(rank), router_aux_coef=MOE_COEF)


def single_process_router() -> dict[str, tuple[dict[str, torch.Tensor], float]]:
    """The MoE model's gradients and load-balancing loss in one process: on both ranks' sequences
    ("both"), on rank 0's alone ("alone"), and the sum of the two ranks' calls each with its own
    counts ("per_rank": what a rank-local loss would give)."""
    m = model(False, family="qwen3-moe")
    out = {}
    for name, seqs, w in (("both", share(0)[0] + share(1)[0], token_weights(0) + token_weights(1)),
                          ("alone", share(0)[0], token_weights(0))):
        m.zero_grad(set_to_none=True)
        r = stream_backward(m, seqs, objective=TokenWeights(w, router_aux_coef=MOE_COEF), block_size=BLOCK)
        out[name] = ({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None},
                     r.stats.router_aux_loss)
    m.zero_grad(set_to_none=True)
    for rank in (0, 1):
        stream_backward(m, share(rank)[0], objective=router_objective(rank), block_size=BLOCK)
    out["per_rank"] = ({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, None)
    return out


def single_process_grads(use_lora: bool, dtype=torch.float64) -> tuple[dict[str, torch.Tensor],
                                                                       dict[str, torch.Tensor]]:
    """The plain model's gradients, in one process, of rank 0's objective alone and of the sum of
    both ranks' objectives (with token weights: one call on all the sequences)."""
    m = model(use_lora, dtype)
    grads = lambda: {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}  # noqa: E731
    stream_backward(m, share(0)[0], objective=objective(use_lora, 0), block_size=BLOCK)
    alone = grads()
    if use_lora:  # the sum of the two ranks' objectives
        stream_backward(m, share(1)[0], objective=objective(use_lora, 1), block_size=BLOCK)
    else:
        m.zero_grad(set_to_none=True)
        stream_backward(m, share(0)[0] + share(1)[0], token_weights(0) + token_weights(1))
    return alone, grads()


# ---------------------------------------------------------------------------------------------
# In the workers.


class Collectives:
    """Counts the collectives FSDP2 issues (it calls these two by name on every backend: tests/dist.py)."""

    def __init__(self):
        self.rs = self.ag = 0
        rs, ag = getattr(dist, REDUCE_SCATTER), getattr(dist, ALL_GATHER)

        def reduce_scatter(*a, **kw):
            self.rs += 1
            return rs(*a, **kw)

        def all_gather(*a, **kw):
            self.ag += 1
            return ag(*a, **kw)

        setattr(dist, REDUCE_SCATTER, reduce_scatter)
        setattr(dist, ALL_GATHER, all_gather)

    def take(self) -> tuple[int, int]:
        out = (self.rs, self.ag)
        self.rs = self.ag = 0
        return out


def sharded(use_lora: bool, reshard: bool, dtype=torch.float64, family: str = "llama") -> torch.nn.Module:
    m = model(use_lora, dtype, family)
    for layer in base_model(m).model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(m, reshard_after_forward=reshard)
    for unit in m.modules():  # neither setter recurses
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)  # the sum over ranks, not FSDP's average
            # factor 1 in float32/bf16 is a PREMUL_SUM, which gloo refuses: a plain SUM instead
            unit.set_force_sum_reduction_for_comms(True)
    return m


def settings(m) -> list:
    """Every unit's settings and sharded state, to check that a call leaves them as it found them."""
    out = []
    for unit in m.modules():
        if isinstance(unit, FSDPModule):
            for g in unit._get_fsdp_state()._fsdp_param_groups:
                out.append([getattr(g, k) is not None if k == "post_forward_mesh_info" else getattr(g, k)
                            for k in FSDPCall.GROUP] + [g._sharded_state.name])
    return out


def full_grads(m) -> dict[str, torch.Tensor]:
    """Each gradient gathered from its shards (a collective: every rank calls it)."""
    out = {n: p.grad.full_tensor() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return out


class Raises(Objective):
    """`inner`, failing in its second block: after one backward left unreduced gradients."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.needs_prefill_logprobs = inner.needs_prefill_logprobs

    def active(self, sequences):
        return self.inner.active(sequences)

    def reads(self, view):
        return self.inner.reads(view)

    def setup(self, logprobs):
        self.inner.setup(logprobs)

    def block_loss(self, view):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("objective failed")
        return self.inner.block_loss(view)


def run_all() -> dict:
    """Every check of the test file in one launch (spawning 2 processes is the expensive part).
    Per config: counts (reduce-scatters, all-gathers) of each call, rank 0's gathered gradients,
    this rank's log-probs, and the units' settings before and after each call."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a hang fails the test, slowly
    torch.manual_seed(0)
    rank = dist.get_rank()
    start = time.perf_counter()
    count = Collectives()
    seqs = share(rank)[0]
    out = {}
    for use_lora, reshard in CONFIGS:
        m = sharded(use_lora, reshard)
        res = out[use_lora, reshard] = {"counts": {}, "grads": {}, "settings": {}}

        def record(name, grads=True):
            res["counts"][name] = count.take()
            res["settings"][name] = settings(m)
            if grads:
                g = full_grads(m)
                if rank == 0:
                    res["grads"][name] = g
            count.take()  # full_tensor's own all-gathers are not the next call's

        res["settings"]["before"] = settings(m)

        # the first call fails on both ranks (before the reduction): nothing may stay changed, and its
        # unreduced gradients must not reach the next call's
        try:
            stream_backward(m, seqs, objective=Raises(objective(use_lora, rank)), block_size=BLOCK)
        except RuntimeError as e:
            res["raised"] = str(e)
        record("raised", grads=False)

        r = stream_backward(m, seqs, objective=objective(use_lora, rank), block_size=BLOCK)
        res["batches"] = r.stats.batches_run
        res["logprobs_backward"] = r.logprobs
        record("stream")

        reference_backward(m, seqs, objective=objective(use_lora, rank))
        record("reference")

        res["logprobs"] = logprobs(m, seqs, block_size=BLOCK)
        record("logprobs", grads=False)

        # rank 1 reads nothing (every advantage 0), then holds no sequence at all
        stream_backward(m, seqs, objective=objective(use_lora, rank, idle=rank == 1), block_size=BLOCK)
        record("idle")
        if rank == 1:
            res["logprobs_empty"] = logprobs(m, [])
            stream_backward(m, [], [], block_size=BLOCK)
            reference_backward(m, [], [])
        else:
            logprobs(m, seqs, block_size=BLOCK)
            stream_backward(m, seqs, objective=objective(use_lora, rank), block_size=BLOCK)
            reference_backward(m, seqs, objective=objective(use_lora, rank))
        record("empty")

    # the MoE router loss: routing counts and N summed over the ranks before any block runs, each
    # rank's gradient term over its own tokens; then rank 1 holds no sequence and still joins the sums
    m = sharded(False, True, family="qwen3-moe")
    for name, fn, kw in (("stream", stream_backward, {"block_size": BLOCK}), ("reference", reference_backward, {})):
        r = fn(m, seqs, objective=router_objective(rank), **kw)
        g = full_grads(m)
        out["moe", name] = (g if rank == 0 else None, r.stats.router_aux_loss)
        r = fn(m, [] if rank == 1 else seqs, objective=router_objective(rank, empty=rank == 1), **kw)
        g = full_grads(m)
        out["moe", name, "empty"] = (g if rank == 0 else None, r.stats.router_aux_loss)

    # float32: the divide-factor settings above work on gloo too
    m = sharded(False, True, torch.float32)
    stream_backward(m, seqs, [w.float() for w in token_weights(rank)], block_size=BLOCK)
    g = full_grads(m)
    out["float32"] = g if rank == 0 else None
    out["seconds"] = time.perf_counter() - start
    return out

"""The MoE router load-balancing loss (Switch Transformer eq. 4–6, as transformers computes it).

Over all router layers l and all input tokens t of all sequences (N = Σ_i len_i rows per layer):

    f_e = (1 / (L·N)) Σ_{l,t} #{e ∈ topk(p_{l,t})}      P_e = (1 / (L·N)) Σ_{l,t} p_{l,t,e}
    aux = E · Σ_e f_e · P_e,            p_{l,t} = softmax(router logits of token t at layer l)

f_e is a count: it has no gradient. So ∂aux = Σ_{l,t} Σ_e (E·f_e / (L·N)) ∂p_{l,t,e}: a per-token
term with coefficients fixed before any block runs (docs/design.md §3). The streamed engine takes f_e from
its prefill, where a token of a shared prefix stands for every sequence that contains it
(multiplicity m_t), exactly as the per-sequence computation counts it once per sequence.

`load_balancing_loss` is the naive reference: concatenate the rows, softmax, one-hot, mean.

Under torchrun (FSDP) the tokens of one minibatch are spread over the ranks, and f_e, P_e and N are
those of the whole minibatch: each rank sums its routing counts, probability mass and rows, one
all-reduce sums them over the ranks (`across_ranks`), and each rank's gradient term is
(E·f_e / (L·N)) Σ_{its l,t} ∂p_{l,t,e}. FSDP then sums the gradients over the ranks: the update of
one process on the whole minibatch. `load_balancing_sums` is that form for the naive reference.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from backstream.checks import UserError
from backstream.stream import fsdp
from backstream.stream.hf import base_model, experts_per_token, num_experts, text_config
from backstream.stream.objective import BlockView, Objective


def moe_spec(model: nn.Module, what: str = "router_aux_coef") -> tuple[int, int]:
    """(num_experts, top_k) of a transformers MoE causal LM, or a clear error."""
    base, cfg = base_model(model), text_config(model)
    experts, top_k = num_experts(cfg), experts_per_token(cfg)
    if not experts or top_k is None or not hasattr(cfg, "output_router_logits"):
        raise UserError(
            f"{what}: {type(base).__name__} is not a mixture-of-experts model with router logits "
            "(config needs num_experts, num_experts_per_tok and output_router_logits); set it to 0"
        )
    return experts, top_k


def load_balancing_loss(router_logits: tuple[Tensor, ...] | list[Tensor], num_experts: int, top_k: int) -> Tensor:
    """The textbook loss over router logits of shape [rows, E] per layer (all rows count)."""
    logits = torch.cat(list(router_logits), dim=0)
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    mask = torch.nn.functional.one_hot(chosen, num_experts).to(probs.dtype)  # [rows, k, E]
    tokens_per_expert = mask.mean(0)  # [k, E]
    prob_per_expert = probs.mean(0)  # [E]
    return num_experts * (tokens_per_expert * prob_per_expert[None]).sum()


def load_balancing_sums(router_logits, num_experts: int, top_k: int, coef: float) -> tuple[Tensor, float]:
    """The naive loss in its summed form, over every rank's rows (`fsdp.sum_over_ranks`; in
    one process, the textbook value): (coef · E · Σ_e f_e · Σ_{these rows} p_e / N, with gradient
    through p; the loss value over all ranks, E · Σ_e f_e P_e). Every rank must call it, also one
    without rows (pass an empty sequence)."""
    probs = [torch.softmax(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1) for x in router_logits]
    counts = torch.zeros(num_experts, dtype=torch.float64)
    prob_sum = torch.zeros(num_experts, dtype=torch.float64)
    for p in probs:
        counts += torch.bincount(torch.topk(p, top_k, dim=-1).indices.reshape(-1).cpu(), minlength=num_experts)
        prob_sum += p.detach().double().sum(0).cpu()
    f, n, value = _totals(counts, prob_sum, float(sum(len(p) for p in probs)), across_ranks=True)
    if not probs:
        return torch.zeros(()), value
    mass = torch.cat(probs).sum(0)  # [E], with gradient
    return coef * num_experts * (f.to(mass) * mass).sum() / n, value


def _totals(counts: Tensor, prob_sum: Tensor, rows: float, across_ranks: bool) -> tuple[Tensor, float, float]:
    """(f_e, N, the loss value E·Σ_e f_e·P_e) from routing counts, probability mass and rows;
    summed over every rank first with `across_ranks` (a collective)."""
    if across_ranks:
        t = fsdp.sum_over_ranks(torch.cat([counts, prob_sum, torch.tensor([rows], dtype=torch.float64)]))
        counts, prob_sum, rows = t[:len(counts)], t[len(counts):-1], float(t[-1])
    f = counts / rows
    return f, rows, float(len(counts) * (f * prob_sum / rows).sum())


class RouterAux(Objective):
    """The load-balancing loss as an objective term (streamed form). The prefill hook `observe`
    counts every view's routing (f_e, no gradient) and probability mass; `setup` fixes the
    per-expert coefficients (over every rank's tokens with `across_ranks`: a collective, which
    every rank must reach, also one without sequences); `block_loss` is the view's Σ_e c_e·p_e,
    each token weighed by the number of sequences that contain it."""

    needs_prefill_logprobs = False
    needs_router_logits = True

    def __init__(self, coef: float, num_experts: int, top_k: int, across_ranks: bool = False):
        self.coef, self.E, self.k, self.across_ranks = coef, num_experts, top_k, across_ranks
        self.counts = torch.zeros(num_experts, dtype=torch.float64)
        self.prob_sum = torch.zeros(num_experts, dtype=torch.float64)
        self.rows = 0.0  # Σ over layers of Σ m_t
        self.token_coef: Tensor | None = None
        self.value: float | None = None

    def active(self, sequences: list[Tensor]) -> list[Tensor]:
        return [torch.zeros(len(s), dtype=torch.bool) for s in sequences]  # no log-prob targets

    def reads(self, view: BlockView) -> bool:
        return view.mult_R is not None and view.mult_R.numel() > 0

    def _probs(self, logits: Tensor) -> Tensor:
        if logits.dim() != 2 or logits.shape[-1] != self.E:
            raise UserError(f"router_aux_coef: expected router logits of shape [tokens, {self.E}], "
                             f"got {tuple(logits.shape)}")
        return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def observe(self, view: BlockView) -> None:
        if not self.reads(view):
            return
        for logits in view.router_logits_LRE:
            p = self._probs(logits.detach())
            m = view.mult_R.to(p.device, torch.float64)
            chosen = torch.topk(p, self.k, dim=-1).indices  # [R, k]
            self.counts += torch.zeros(self.E, dtype=torch.float64, device=p.device).scatter_add_(
                0, chosen.reshape(-1), m.repeat_interleave(self.k)).cpu()
            self.prob_sum += (p.double() * m[:, None]).sum(0).cpu()
            self.rows += float(m.sum())

    def setup(self, logprobs) -> None:
        f, rows, self.value = _totals(self.counts, self.prob_sum, self.rows, self.across_ranks)
        self.token_coef = self.coef * self.E * f / rows

    def block_loss(self, view: BlockView) -> Tensor:
        out = None
        for logits in view.router_logits_LRE:
            p = self._probs(logits)
            w = view.mult_R.to(p.device, p.dtype)[:, None] * self.token_coef.to(p.device, p.dtype)[None]
            term = (p * w).sum()
            out = term if out is None else out + term
        return out


def router_term(model: nn.Module, objective: Objective, across_ranks: bool = False) -> RouterAux | None:
    """The router term an objective asks for with `router_aux_coef` (validated here, once, for the
    engine and the reference alike), or None when it is 0. `across_ranks`: the counts of the whole
    minibatch, summed over the ranks of an FSDP model."""
    coef = getattr(objective, "router_aux_coef", 0.0)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not math.isfinite(coef) or coef < 0:
        raise UserError(f"objective.router_aux_coef: expected a finite number >= 0, got {coef!r}")
    if coef == 0:
        return None
    return RouterAux(float(coef), *moe_spec(model, "objective.router_aux_coef"), across_ranks=across_ranks)

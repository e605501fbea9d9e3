"""The objective contract between an RL loss and the streamed backward (docs/design.md §3).

The engine never sees a whole sequence's logits. It hands an objective one *block view* at a
time: the logits of the positions in one block batch that predict a token the objective reads,
and for each (sequence, token) target the row that predicts it. The objective returns a scalar
whose gradient is that block's share of the total. This is exact for every objective that is a
sum over target tokens of a function of that token's logits and of *detached* statistics
(token counts, group sizes, sequence-level ratios, reference log-probs): those statistics are
computed once, before any block runs, from the prefill's log-probs (`Objective.setup`).

Sign convention: `stream_backward` adds to `p.grad` the gradient of the sum of the block terms.
An RL loss to *minimise* is therefore returned as is; `TokenWeights` returns Σ w·log π, so that
`p.grad += ∂/∂p Σ w·log π` as the engine's simplest contract states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class BlockView:
    """The targets whose predicting position lies in one block batch.

    logits_PV:  [P, V] float32 logits of the P distinct predicting positions (with grad in a
                backward block, without in the prefill).
    row_pos_N:  [N] long, the row of `logits_PV` that predicts target n.
    target_N:   [N] long, the token id of target n.
    seq_N:      [N] long, the sequence index i of target n.
    tok_N:      [N] long, the token index t of target n in sequence i (t ≥ 1).
    flat_N:     [N] long, offsets[i] + t: index into the concatenation of all sequences, the
                layout in which objectives keep per-token statistics (see `flat_offsets`).
    A position shared by several sequences (a shared prompt, a multi-turn prefix) appears once in
    `logits_PV` and once per sequence in the N targets.

    For an objective with `needs_router_logits` (the MoE load-balancing term), the view also
    carries every real token of the batch, targets or not (R rows):
    router_logits_LRE: per router layer [R, experts] logits;
    mult_R:            [R] float64, how many sequences contain each token (a shared prompt counts
                       once per sequence that contains it).
    """

    logits_PV: Tensor
    row_pos_N: Tensor
    target_N: Tensor
    seq_N: Tensor
    tok_N: Tensor
    flat_N: Tensor
    router_logits_LRE: list[Tensor] | None = None
    mult_R: Tensor | None = None
    _logp_P: Tensor | None = field(default=None, repr=False)

    def log_softmax(self) -> Tensor:
        """[P, V] log-probabilities, computed once per view."""
        if self._logp_P is None:
            # float32 at least (bf16 log-softmax is too coarse for ratios), float64 kept as is
            dtype = torch.promote_types(self.logits_PV.dtype, torch.float32)
            self._logp_P = torch.log_softmax(self.logits_PV.to(dtype), dim=-1)
        return self._logp_P

    def logprobs(self) -> Tensor:
        """[N] log π(target_n | history), in float32 or wider."""
        return self.log_softmax()[self.row_pos_N, self.target_N]

    def entropy(self) -> Tensor:
        """[N] entropy of the predicting distribution of each target (per row, gathered)."""
        logp = self.log_softmax()
        ent_P = -(logp.exp() * logp).sum(-1)
        return ent_P[self.row_pos_N]


def flat_offsets(lengths: list[int]) -> list[int]:
    """Start of each sequence in the flat per-token layout used by `BlockView.flat_N`."""
    out, acc = [], 0
    for n in lengths:
        out.append(acc)
        acc += n
    return out


class Objective:
    """Base class of the per-block objective hook.

    Subclasses implement `active` and `block_loss`; `setup` is optional. The total the engine
    differentiates is Σ over blocks of `block_loss(view)`, so `block_loss` must be additive over
    any partition of the targets: a sum (or a sum of per-target terms weighted by constants fixed
    in `setup`), never a mean over the view or any statistic that depends on which targets share
    the view.
    """

    def active(self, sequences: list[Tensor]) -> list[Tensor]:
        """Per sequence, a bool tensor of its length: True where the loss reads token t (t ≥ 1).

        Targets that are not active are never computed; a sequence with no active target costs
        nothing, and the blocks after the last active target of a path are never run.
        """
        raise NotImplementedError

    router_aux_coef: float = 0.0
    """Coefficient of the MoE router load-balancing loss (`backstream.stream.router`), added to the total
    over every input token of every sequence, a shared prefix counted once per sequence that
    contains it. 0 = off. When > 0 the model must be an MoE, every token is forwarded (the
    routing counts need them all) and the K/V cannot come from the caller."""

    needs_prefill_logprobs: bool = True
    """Whether `setup` reads the log-probs of every active target. When False, the prefill skips
    the chunks whose K/V no later block reads (a response's tail), and `setup` sees NaN there."""

    needs_router_logits: bool = False
    """Whether the views must carry the router logits of every token (`BlockView.router_logits_LRE`):
    every token is then forwarded, in the prefill too, and the K/V cannot come from the caller."""

    def reads(self, view: BlockView) -> bool:
        """Does this view hold anything this objective's `block_loss` reads?"""
        return view.target_N.numel() > 0

    def observe(self, view: BlockView) -> None:
        """The prefill hook: every prefill view (no grad), in forward order, before `setup`; for
        statistics over the whole batch that are not log-probs (e.g. routing counts)."""

    def setup(self, logprobs: list[Tensor] | None) -> None:
        """Called once before any block, with the log-probs at the current weights from the
        prefill (detached, float32 or wider, NaN where not active); None when the caller supplied the K/V
        and no prefill ran."""

    def block_loss(self, view: BlockView) -> Tensor:
        """Scalar term of this view; its gradient is accumulated into `.grad`."""
        raise NotImplementedError


class Terms(Objective):
    """The sum of several objectives (e.g. an RL loss and the MoE router term): the engine sees
    one objective; each term reads the views it `reads`."""

    def __init__(self, *terms: Objective):
        self.terms = terms
        self.needs_prefill_logprobs = any(t.needs_prefill_logprobs for t in terms)
        self.needs_router_logits = any(t.needs_router_logits for t in terms)

    def active(self, sequences: list[Tensor]) -> list[Tensor]:
        out = None
        for t in self.terms:
            a = t.active(sequences)
            out = a if out is None else [x | y for x, y in zip(out, a)]
        return out

    def reads(self, view: BlockView) -> bool:
        return any(t.reads(view) for t in self.terms)

    def observe(self, view: BlockView) -> None:
        for t in self.terms:
            t.observe(view)

    def setup(self, logprobs: list[Tensor] | None) -> None:
        for t in self.terms:
            t.setup(logprobs)

    def block_loss(self, view: BlockView) -> Tensor:
        losses = [t.block_loss(view) for t in self.terms if t.reads(view)]
        return sum(losses[1:], losses[0])


class TokenWeights(Objective):
    """The engine's simplest contract: Σ_i Σ_t weights[i][t] · log π(x_i[t] | x_i[:t])."""

    needs_prefill_logprobs = False

    def __init__(self, weights: list[Tensor], *, router_aux_coef: float = 0.0):
        self.weights = weights
        self.router_aux_coef = router_aux_coef
        self._flat = torch.cat([w.reshape(-1) for w in weights]).to(torch.float64) if weights else None

    def active(self, sequences: list[Tensor]) -> list[Tensor]:
        return [w != 0 for w in self.weights]

    def block_loss(self, view: BlockView) -> Tensor:
        logp_N = view.logprobs()
        w_N = self._flat.to(logp_N.device)[view.flat_N].to(logp_N.dtype)
        return (logp_N * w_N).sum()

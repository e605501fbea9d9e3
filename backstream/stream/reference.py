"""The naive reference: what every RL trainer does today.

One full-sequence forward per sequence, the logits from its first loss position on, one backward. It implements
the same contract as `stream_backward` (token weights, or an `Objective`'s block terms with the
whole sequence as one view) and is the baseline of the tests and the benchmarks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from backstream.stream import fsdp
from backstream.stream.engine import StreamResult, StreamStats, objective_from, validate_sequences, validate_weights
from backstream.stream.hf import takes_logits_to_keep
from backstream.stream.objective import BlockView, Objective, flat_offsets
from backstream.stream.router import load_balancing_loss, load_balancing_sums, router_term


def _sequence_view(logits_LV: Tensor, seq: Tensor, act: Tensor, i: int, offset: int) -> BlockView | None:
    """logits_LV holds the logits of the last L positions of the sequence."""
    ts = torch.nonzero(act).flatten().to(logits_LV.device)
    if len(ts) == 0:
        return None
    first = len(seq) - logits_LV.shape[0]
    return BlockView(
        logits_PV=logits_LV[ts - 1 - first], row_pos_N=torch.arange(len(ts), device=ts.device),
        target_N=seq.to(ts.device)[ts], seq_N=torch.full_like(ts, i), tok_N=ts, flat_N=ts + offset,
    )


def reference_backward(model: nn.Module, sequences: list[Tensor], weights: list[Tensor] | None = None, *,
                       objective=None, images=None) -> StreamResult:
    """p.grad += ∂/∂p Σ_i Σ_t weights[i][t] · log πθ(x_i[t] | x_i[:t]), computed the obvious way.

    With `objective`, its `setup` gets the log-probs of a no-grad pass first (as the streamed
    engine's prefill provides), then each sequence is one view. With `objective.router_aux_coef`
    > 0, every sequence is forwarded whole, the router logits of all of them are concatenated into
    the textbook load-balancing loss, and one backward runs over everything.
    Under FSDP2 the per-sequence backwards accumulate unreduced and every rank joins one reduction at
    the end, as in `stream_backward` (see backstream.stream.engine).
    With `images` (stream/vision.py), each sequence's forward takes its image rows of `images.embeds`
    with their graph, and each backward goes through the vision tower again (its graph retained), as
    a per-sample trainer does.
    """
    validate_sequences(model, sequences, allow_empty=bool(fsdp.units(model)))
    obj = objective_from(weights, objective)
    if weights is not None:
        validate_weights(sequences, weights)
    if images is not None:
        images.validate(sequences)

    def idle() -> StreamResult:  # nothing here; the router term's counts are still summed with the other ranks'
        result, term = StreamResult(logprobs=[]), router_term(model, obj)
        if term is not None:
            _, result.stats.router_aux_loss = load_balancing_sums((), term.E, term.k, term.coef)
        return result

    return fsdp.run(model, bool(sequences), True,
                    lambda across_ranks: _reference(model, sequences, obj, across_ranks=across_ranks, images=images),
                    idle)


def _reference(model, sequences, obj, across_ranks: bool = False, images=None) -> StreamResult:
    device = next(model.parameters()).device
    dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)
    active = [a.to("cpu", torch.bool) for a in obj.active(sequences)]
    offsets = flat_offsets([len(s) for s in sequences])
    logprobs = [torch.full((len(s),), math.nan, dtype=dtype) for s in sequences]

    keep_arg = takes_logits_to_keep(model)
    term = router_term(model, obj)  # validated as the engine validates it; computed the naive way below
    router = (term.E, term.k) if term is not None else None
    router_logits: list[tuple[Tensor, ...]] = []
    embed = images.embed_module(model) if images is not None else None
    retain = images is not None and images.embeds.requires_grad  # the tower's graph, for every sequence

    def forward(i: int, seq: Tensor, **kw):
        if images is None:
            return model(input_ids=seq.to(device)[None], use_cache=False, **kw)
        pos = images.position_ids(i, device)
        if pos is not None:
            kw["position_ids"] = pos
        with images.feeding(model):  # a deepstack family's second use of the image rows
            return model(inputs_embeds=images.sequence_embeds(embed, i, seq.to(device)), use_cache=False, **kw)

    def views(grad: bool):
        for i, (seq, act) in enumerate(zip(sequences, active)):
            if not act.any() and not (grad and router):
                continue
            # logits from the first predicting position on, as TRL's `logits_to_keep` does: the
            # prompt's [P × vocab] logits are not the cost this baseline should carry
            kw = {"logits_to_keep": len(seq) - int(torch.nonzero(act)[0]) + 1} if keep_arg and act.any() else {}
            if grad and router:
                kw["output_router_logits"] = True
            with torch.set_grad_enabled(grad):
                out = forward(i, seq, **kw)
            if grad and router:
                router_logits.append(tuple(out.router_logits))
            if act.any():
                yield i, _sequence_view(out.logits[0], seq, act, i, offsets[i])

    # an objective with batch statistics needs the log-probs of every sequence before any
    # backward: one more no-grad pass, as the streamed engine's prefill provides
    if type(obj).setup is not Objective.setup:
        for i, view in views(grad=False):
            logprobs[i][view.tok_N.cpu()] = view.logprobs().detach().cpu().to(dtype)
        obj.setup([x.clone() for x in logprobs])
    tokens, total = 0, []
    for i, view in views(grad=True):
        loss = obj.block_loss(view)
        logprobs[i][view.tok_N.cpu()] = view.logprobs().detach().cpu().to(dtype)
        if router:
            total.append(loss)  # one backward at the end: the router loss couples the sequences
        elif loss.requires_grad:
            loss.backward(retain_graph=retain)
        tokens += len(sequences[i])
    stats = StreamStats(sequences=len(sequences), input_tokens=tokens, backward_tokens=tokens)
    if router:
        per_layer = tuple(torch.cat(layer, dim=0) for layer in zip(*router_logits))
        if across_ranks:  # f_e and N of every rank's rows (the same loss, summed form: router.py)
            aux_term, stats.router_aux_loss = load_balancing_sums(per_layer, *router, term.coef)
        else:
            aux = load_balancing_loss(per_layer, *router)
            aux_term, stats.router_aux_loss = term.coef * aux, float(aux.detach())
        loss = aux_term + sum(total)
        if loss.requires_grad:
            loss.backward()
    return StreamResult(logprobs=logprobs, stats=stats)

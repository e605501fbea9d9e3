"""The in-process rollout engine: G sampled completions per prompt, with the sampler's log-probs and,
on request, the K/V the streamed backward can reuse (docs/design.md §1, §4).

Each prompt is prefilled once (prompts of one length as one batch); its cache is repeated over the G
rows of its group, and every row of the call then decodes as one batch (rl/backends/local/decode.py: rows of other
lengths left-padded; finished rows stay in the batch, fed and ignored, and leave it together each
time they are a quarter of it). The log-probs are taken under softmax(logits / T) before
top-k/top-p truncation, the learner's convention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from backstream.checks import UserError
from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local.decode import Rows, check_return_kv, decode
from backstream.rl.records import Completion, at_version
from backstream.stream import vision
from backstream.stream.hf import takes_logits_to_keep


@torch.no_grad()
def generate(
    model,
    prompts: list[Tensor],
    config: SamplingParams,
    *,
    group_size: int = 1,
    eos_token_id: int | list[int] | None,
    tokenizer=None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    return_kv: bool = False,
    progress=None,
    version: int = 0,
    pictures: list[list] | None = None,
) -> list[Completion]:
    """Sample `group_size` completions for every prompt (1-D token-id tensors), with `config`'s sampling
    parameters (`config.max_new_tokens` tokens at most).

    eos_token_id: the token(s) that end a completion (kept as its last token); None for none.
    tokenizer: anything with `decode(ids) -> str`; needed only for `config.stop`.
    generator: seeds the sampling, so that a seeded run is reproducible; or one generator per prompt
      (the same object may repeat). Every row of the call decodes in one batch; a row's samples
      depend only on its generator and its place among that generator's rows (rl/backends/local/decode.py `Draws`).
    progress: optional `progress(groups done, groups in all)`, called as each group finishes.
    return_kv: also return each sample's K/V (as the model's cache holds them, post-RoPE) for the
      streamed backward at the same weights (`stream_backward(..., kv=[c.kv for c in completions])`).
    version: the weight version every sampled token records (rl/records.py: the learner step that made
      the model's weights).
    pictures: per prompt, the images its placeholder tokens stand for (stream/vision.py `Picture`), for
      a vision-language model: each distinct image is encoded once (kept as its `embeds`), a group's
      prompt with it prefilled once, at the family's positions.
    Returns the completions, the G of prompt j at j*G .. j*G+G-1 (`Samples.of_groups` makes them a record).
    The model runs as it is: call `model.eval()` first if it has dropout.
    """
    if config.stop and tokenizer is None:
        raise UserError("tokenizer: required to detect SamplingParams.stop strings, got None")
    if not isinstance(prompts, (list, tuple)):
        raise UserError(f"prompts: expected a list of 1-D integer tensors, got {type(prompts).__name__}")
    gens = generator if isinstance(generator, (list, tuple)) else [generator] * len(prompts)
    if len(gens) != len(prompts):
        raise UserError(f"generator: got {len(gens)} generators for {len(prompts)} prompts; pass one per prompt "
                         "or a single one")
    for j, p in enumerate(prompts):
        if not isinstance(p, Tensor) or p.dim() != 1 or len(p) == 0 or p.is_floating_point():
            got = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
            raise UserError(f"prompts[{j}]: expected a non-empty 1-D integer tensor, got {got}")
    eos = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    keep_last = takes_logits_to_keep(model)

    G = group_size
    prompts = [p.detach().to("cpu", torch.long) for p in prompts]
    check_return_kv(model, return_kv)
    if not prompts:  # a rank's share of a round too small to reach it
        return []
    images = vision.images_for(model, prompts, pictures, grad=False) if pictures else None
    if images is None:
        return _generate(model, prompts, config, G, eos, tokenizer, gens, keep_last, return_kv, progress, version)
    # image positions as virtual tokens (their rows of the tower's output): two images never share a prefill
    virtual = [images.tree_inputs(i, p) for i, p in enumerate(prompts)]
    positions, shift = None, None
    if images.positions is not None:
        at = {tuple(v.tolist()): q for v, q in zip(virtual, images.positions)}
        positions = at.__getitem__
        shift = [int(q.max()) + 1 - len(p) for q, p in zip(images.positions, prompts)]
    with images.reading(model):
        return _generate(model, virtual, config, G, eos, tokenizer, gens, keep_last, return_kv, progress, version,
                         positions, shift)


def _generate(model, prompts, config, G, eos, tokenizer, gens, keep_last, return_kv, progress, version,
              positions=None, shift=None) -> list[Completion]:
    n = len(prompts) * G
    rows = Rows.of_prompts(model, [prompts[i // G].tolist() for i in range(n)], keep_last, config.max_new_tokens,
                           positions=positions)
    left = [G] * len(prompts)  # rows of each group still sampling

    def finished(i: int) -> None:
        left[i // G] -= 1
        if progress is not None and left[i // G] == 0:
            progress(sum(x == 0 for x in left), len(prompts))

    out = decode(model, rows, config, eos, tokenizer, [gens[i // G] for i in range(n)], keep_last,
                 [config.max_new_tokens] * n, keep_kv=return_kv, finished=finished,
                 shift=None if shift is None else [shift[i // G] for i in range(n)])
    kv = [c.as_kv() for c in out.caches] if return_kv else [None] * n
    return [at_version(ids, lp, version, reason, k)
            for ids, lp, reason, k in zip(out.tokens, out.logprobs, out.reasons, kv)]

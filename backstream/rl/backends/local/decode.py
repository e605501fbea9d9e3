"""The in-process decoder: rows of any lengths sampled as one batch (docs/design.md §1).

A batch row is a sequence with its cache: a prompt's copy for one of its G samples, or an episode's
history before its next turn. Rows of different lengths share one cache, each left-padded with
zeros to the longest; a 2-D mask hides the pads and every row runs at its own positions (the
HF `generate` convention). A row that finishes (EOS, a stop string, its token budget) has its K/V
copied out when asked for; finished rows leave the batch together once they are a quarter of it,
and columns that only they needed are cut.
A batch whose rows have one length needs no mask and computes exactly what one row alone would.

A model whose layers keep recurrent or convolution state (Qwen3.5's Gated DeltaNet, Mamba 2, LFM2's
short convolutions; `stream.adapter.probe_layout`) gets a cache whose layers fit it (`new_cache`):
transformers' own state layers beside the K/V ones, one state per row, never padded (a state has no
positions: a row's is what its own tokens left), and shared by a prompt's G rows as its K/V are.

Sampling draws one uniform number per row per step from the row's generator and inverts the CDF of
its probabilities (float64): a generator draws for every row it started with, finished or not, so a
row's samples never depend on when the others finished, nor on which other rows share the batch.
The log-prob of a sampled token is taken under softmax(logits / T) *before* top-k/top-p truncation:
that is what a learner dividing its logits by the same T computes, so sampler and learner agree
(temperature 0 samples greedily and reports log-probs at T = 1). One host sync per step reads the
new tokens: the EOS and stop-string checks need them.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import DynamicLayer

from backstream.checks import UserError
from backstream.rl.backends.local.prefix import SHARE_MIN, CannotShare, DecodeCache, DecodeLayer, Prefix, sharing
from backstream.stream.adapter import probe_layout
from backstream.stream.hf import base_model, cache_arg, text_config
from backstream.stream.kvstore import Pieces

KV = list[tuple[Tensor, Tensor]]  # per layer, (K, V) [Hkv, L, D] of one row
StateKey = tuple[str, int]  # ("conv" | "recurrent", state index) within a layer
# cuDNN's attention builds a graph per new key length, i.e. at every decode step: 2.3 ms of CPU per
# call on an H200 (61% of a Qwen3-0.6B-shaped rollout's time); the others take any length as it comes
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class NonFiniteLogits(UserError):
    """The policy's next-token logits hold NaN/inf: nothing can be sampled from them."""


def _filter(scaled_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    """Top-k then top-p: the dropped tokens' logits become -inf."""
    if 0 < top_k < scaled_BV.shape[-1]:
        kth_B1 = scaled_BV.topk(top_k, dim=-1).values[:, -1:]
        scaled_BV = scaled_BV.masked_fill(scaled_BV < kth_B1, -math.inf)
    if top_p < 1:
        sorted_BV, order_BV = scaled_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(-1)
        # drop a token once the tokens ranked above it already hold top_p; the first always stays
        drop_BV = probs_BV.cumsum(-1) - probs_BV >= top_p
        scaled_BV = scaled_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, -math.inf))
    return scaled_BV


class Draws:
    """Each row's uniform number for a step: row i draws from `generators[i]` (None: torch's global
    generator). A generator draws one number per row it was given at every step, finished or not, in
    row order, so a row's draws depend only on its generator and its place among that generator's
    rows."""

    def __init__(self, generators: list):
        self.gens: dict[int, tuple] = {}  # id(generator) -> (generator, its rows)
        for i, g in enumerate(generators):
            self.gens.setdefault(id(g), (g, []))[1].append(i)
        self.slot = {i: (id(g), k) for g, rows in self.gens.values() for k, i in enumerate(rows)}

    def step(self, live: list[int], device) -> Tensor:
        """The uniforms [len(live)] (float64) of the rows `live`, drawing for every generator that
        still has a live row."""
        wanted = {self.slot[i][0] for i in live}
        drawn = {}
        for key, (g, rows) in self.gens.items():
            if key in wanted:
                where = g.device if g is not None else "cpu"
                drawn[key] = torch.rand(len(rows), generator=g, dtype=torch.float64, device=where).tolist()
        return torch.tensor([drawn[self.slot[i][0]][self.slot[i][1]] for i in live], dtype=torch.float64,
                            device=device)


def sample_tokens(logits_BV: Tensor, temperature: float, top_k: int, top_p: float,
                  u_B: Tensor | None) -> tuple[Tensor, Tensor]:
    """The sampled tokens [B] and their log-probs [B] (before truncation); `u_B`: one uniform number
    per row (unused at temperature 0, which takes the argmax)."""
    logits_BV = logits_BV.to(torch.promote_types(logits_BV.dtype, torch.float32))  # bf16: softmax in float32
    scaled_BV = logits_BV / (temperature or 1.0)
    if temperature == 0:
        tok_B = logits_BV.argmax(-1)
    else:
        cdf_BV = _filter(scaled_BV, top_k, top_p).softmax(-1).double().cumsum(-1)
        # the first token whose cumulative mass exceeds u: a token of zero mass is never chosen
        tok_B = torch.searchsorted(cdf_BV, (u_B * cdf_BV[:, -1])[:, None], right=True).squeeze(-1)
        tok_B = tok_B.clamp_(max=logits_BV.shape[-1] - 1)
    logp_B = scaled_BV.log_softmax(-1).gather(-1, tok_B[:, None]).squeeze(-1)
    return tok_B, logp_B


# -- caches that fit the model -------------------------------------------------------------------


class StateLayer(cache_utils.LinearAttentionLayer):
    """A decode batch's recurrent and convolution states of one layer: transformers' own layer (the
    model's decode steps update it in place), with the batch operations the decoder uses."""

    def items(self) -> dict[StateKey, Tensor]:
        out = {}
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                out[("conv", i)] = self.conv_states[i]
            if self.is_recurrent_states_initialized[i]:
                out[("recurrent", i)] = self.recurrent_states[i]
        return out

    def load(self, states: dict[StateKey, Tensor]) -> None:
        """Continue from `states` ([B, ...] each): as if a prefill had left them."""
        for (kind, i), t in states.items():
            if kind == "conv":
                self.conv_states[i], self.conv_kernel_size[i] = t, t.shape[-1]
                self.is_conv_states_initialized[i] = True
            else:
                self.recurrent_states[i] = t
                self.is_recurrent_states_initialized[i] = True
            self.has_previous_state[i] = True
            self.device = self.device or t.device
            self.dtype = self.dtype or t.dtype

    def batch_select_indices(self, indices: Tensor) -> None:
        self.reorder_cache(indices)

    def drop_front(self, cut: int) -> None:
        pass  # a state has no positions


class HybridLayer(StateLayer, DynamicLayer):
    """A layer with both K/V and states (Falcon-H1, Zamba 2: attention and Mamba side by side)."""

    def __init__(self, number_of_states: int = 1):
        StateLayer.__init__(self, number_of_states=number_of_states)
        DynamicLayer.__init__(self)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if self.keys is None:  # the states' lazy initialisation set `is_initialized`, the flag both halves share
            DynamicLayer.lazy_initialization(self, key_states, value_states)
        return DynamicLayer.update(self, key_states, value_states, *args, **kwargs)

    def batch_select_indices(self, indices: Tensor) -> None:
        StateLayer.batch_select_indices(self, indices)
        DynamicLayer.batch_select_indices(self, indices)


def _states_per_layer(model) -> dict[int, int]:
    """Layer → how many states of a kind it keeps (state indices 0..n−1)."""
    out: dict[int, int] = {}
    for per_kind in probe_layout(model).states.values():
        for layer, i in per_kind:
            out[layer] = max(out.get(layer, 0), i + 1)
    return out


def new_cache(model) -> DynamicCache:
    """An empty cache for `model`: transformers' DynamicCache that grows a full-history K/V layer per
    layer (no config: a sliding-window layer would drop history, see row_kv), and in a model with
    recurrent or convolution state, the layers that fit each of its layers."""
    cache = DynamicCache()
    layout = probe_layout(model)
    if layout.states:
        n_states = _states_per_layer(model)
        layers = []
        for i in range(text_config(model).num_hidden_layers):
            if i in n_states:
                layers.append(HybridLayer(n_states[i]) if i in layout.kv_layers else StateLayer(n_states[i]))
            else:
                layers.append(DynamicLayer() if i in layout.kv_layers else cache_utils.DummyLayer())
        cache.layers = layers
    cache.fed = 0  # positions per row, pads included (the K/V's columns; a state-only model has none)
    return cache


def check_return_kv(model, return_kv: bool) -> None:
    """A rollout's K/V can stand in for the engine's prefill only in a model that keeps nothing else
    (`stream.adapter.probe_layout`): a recurrent or convolution state at each block boundary is not
    in them."""
    if return_kv and probe_layout(model).states:
        raise UserError(f"return_kv: {type(model).__name__} keeps recurrent or convolution state besides K/V, which "
                        "the streamed backward cannot take from a rollout (trainer: engine.reuse_rollout_kv = false)")


@dataclass
class RowCache:
    """One row's cache over its fed positions, what a later prefill continues (`prefill(history=)`):
    `prefix`, its prompt's K/V shared with the other rows of its group (rl/backends/local/prefix.py; None: none), then
    per layer the K and V [Hkv, L, D] of the positions after it (None for a layer without K/V) and, in a
    model whose layers keep recurrent or convolution state, those states [1, ...] by layer and (kind,
    index); `length`: every fed position, the prefix's included."""

    kv: list[tuple[Tensor, Tensor] | None]
    states: dict[int, dict[StateKey, Tensor]]
    length: int
    prefix: Prefix | None = None

    @property
    def dtype(self) -> torch.dtype:
        first = next((x[0] for x in self.kv if x is not None), None)
        return first.dtype if first is not None else next(iter(next(iter(self.states.values())).values())).dtype

    def as_kv(self) -> KV:
        """The K/V of every layer over every fed position, for `stream_backward(kv=)` (an attention-only
        model): a shared prefix stays one copy (`kvstore.Pieces`: the prefix, then the row's own)."""
        assert not self.states and all(x is not None for x in self.kv), "as_kv: a model with layer state"
        if self.prefix is None:
            return self.kv
        return [(Pieces([pk, k]), Pieces([pv, v])) for (pk, pv), (k, v) in
                zip((self.prefix.layer(i) for i in range(len(self.kv))), self.kv)]


def forward_last(model, ids_BL: Tensor, start: int | Tensor, cache: DynamicCache, keep_last: bool,
                 mask_BT: Tensor | None = None, positions: Tensor | None = None) -> Tensor:
    """Logits [B, V] of the last position of `ids_BL`, which sit at positions start.. (an int shared by
    every row, or one per row [B]), or at `positions` (a family's own, [n, B, L]: an image prompt's
    M-RoPE); `mask_BT`: the 2-D mask of the cache's positions and these (None: every position is
    real). A batch whose rows read shared prefixes attends through rl/backends/local/prefix.py."""
    L = ids_BL.shape[1]
    arange_L = torch.arange(L, device=ids_BL.device)
    pos = arange_L[None] + start if isinstance(start, int) else start[:, None] + arange_L
    if positions is not None:
        pos = positions.to(ids_BL.device)
    extra = {"logits_to_keep": 1} if keep_last else {}  # no [L, V] logits for a long prompt
    extra[cache_arg(model) or "past_key_values"] = cache
    if mask_BT is not None:
        extra["attention_mask"] = mask_BT
    with sdpa_kernel(SDPA_BACKENDS), sharing(model, cache):
        out = model(input_ids=ids_BL, position_ids=pos, use_cache=True, **extra)
    return out.logits[:, -1]


def prefill(model, ids: list[list[int]], device, keep_last: bool, history: RowCache | None = None,
            positions: Tensor | None = None):
    """The cache and next-token logits [n, V] of `ids` (sequences of one length, as one batch), after
    `history` (one row's cache; its one sequence then continues it, its prefix read where it is);
    `positions`: the family's own ([k, n, L]; None: 0..L-1)."""
    if history is None:
        cache = new_cache(model)
        logits = forward_last(model, torch.tensor(ids, dtype=torch.long, device=device), 0, cache, keep_last,
                              positions=positions)
        cache.fed = len(ids[0])
        return cache, logits
    assert len(ids) == 1, "prefill(history=): one sequence continues a row's cache"
    rows = stack([([0], history, None, None)], 1, len(ids[0]))
    logits = forward_last(model, torch.tensor(ids, dtype=torch.long, device=device), history.length, rows.cache,
                          keep_last, positions=positions)
    rows.cache.fed = history.length + len(ids[0])
    return rows.cache, logits


def row_cache(cache: DecodeCache, row: int, begin: int, end: int) -> RowCache:
    """Row `row` of a decode batch's cache over its fed positions, which are the batch's columns
    begin..end (begin: the row's first, after its padding): its prefix as it is (shared), the rest
    copied out."""
    kv = []
    for layer in cache.layers:
        own = layer.own(row, end) if isinstance(layer, DecodeLayer) else None
        kv.append(None if own is None else (own[0].clone(), own[1].clone()))
    states = {i: {k: t[row:row + 1].clone() for k, t in layer.items().items()}
              for i, layer in enumerate(cache.layers) if isinstance(layer, StateLayer)}
    return RowCache(kv, states, end - begin, cache.prefixes[row])


class HybridDecodeLayer(StateLayer, DecodeLayer):
    """A decode batch's layer with both K/V (its rows' prefixes and own buffers) and states."""

    def __init__(self, own_k: Tensor, own_v: Tensor, opad: Tensor, room: int, prefixes: list, layer: int,
                 width: int, states: dict[StateKey, Tensor]):
        StateLayer.__init__(self, number_of_states=1 + max(i for _, i in states))
        DecodeLayer.__init__(self, own_k, own_v, opad, room, prefixes, layer, width)
        self.load(states)

    def batch_select_indices(self, indices: Tensor) -> None:
        StateLayer.batch_select_indices(self, indices)
        DecodeLayer.batch_select_indices(self, indices)

    def drop_front(self, cut: int) -> None:
        DecodeLayer.drop_front(self, cut)


def _row_parts(cache, which: int, share: bool) -> tuple[Prefix | None, list, dict, int]:
    """What row `which` of a part's cache is made of: (its prefix, its own K/V per layer [Hkv, L, D]
    (None: a layer without K/V), its states per layer ([1, ...] by (kind, index)), its length). A fresh
    prefill's row (a prompt) is a prefix when `share`, else its own K/V; a decode cache's row and a
    `RowCache` keep their prefix and their own K/V."""
    if isinstance(cache, RowCache):
        return cache.prefix, cache.kv, cache.states, cache.length
    states = {i: {k: t[which:which + 1] for k, t in layer.items().items()}
              for i, layer in enumerate(cache.layers) if isinstance(layer, StateLayer)}
    if isinstance(cache, DecodeCache):
        own = [layer.own(which, cache.fed) if isinstance(layer, DecodeLayer) else None for layer in cache.layers]
        prefix = cache.prefixes[which]
        pad = next((x.C + int(x.opad[which]) - (prefix.length if prefix is not None else 0)
                    for x in cache.layers if isinstance(x, DecodeLayer)), 0)
        return prefix, own, states, cache.fed - pad
    kv = [(layer.keys, layer.values) if isinstance(layer, DynamicLayer) else None for layer in cache.layers]
    if share:
        empty = [None if x is None else (x[0][which, :, :0], x[1][which, :, :0]) for x in kv]
        return Prefix(kv, which, cache.fed), empty, states, cache.fed
    return None, [None if x is None else (x[0][which], x[1][which]) for x in kv], states, cache.fed


def stack(parts: list, n: int, room: int, share_min: float = math.inf) -> Rows:
    """`n` rows gathered from prefilled parts: (the rows it fills, its cache, its logits, `which`): a
    fresh prefill's cache (one batch row per distinct sequence, `which[k]` the one that row k of the
    part continues), a decode cache or a `RowCache` of one row per filled row (`which` None); logits
    None: none yet (`prefill(history=)` forwards next). A fresh prompt of `share_min` tokens or more is
    a shared prefix its rows read (rl/backends/local/prefix.py), a shorter one is copied into each row's own K/V. Own
    K/V are left-padded to the longest row; states are not (one per row, whatever its length)."""
    rows_of: list = [None] * n  # per row: (prefix, own K/V per layer, states per layer, length)
    logits = None
    for filled, cache, part_logits, which in parts:
        share = not isinstance(cache, (RowCache, DecodeCache)) and cache.fed >= share_min
        made: dict[int, tuple] = {}  # a fresh prompt's parts, one Prefix for all of its rows
        for k, r in enumerate(filled):
            j = which[k] if which is not None else k
            rows_of[r] = made[j] if share and j in made else _row_parts(cache, j, share)
            made[j] = rows_of[r]
        if part_logits is not None:
            if logits is None:
                logits = part_logits.new_empty((n, part_logits.shape[-1]))
            pick = torch.tensor(which if which is not None else range(len(filled)), device=part_logits.device)
            logits[torch.tensor(filled, device=logits.device)] = part_logits[pick]
    prefixes = [x[0] for x in rows_of]
    lengths = [x[3] for x in rows_of]
    own_len = [x[3] - (x[0].length if x[0] is not None else 0) for x in rows_of]
    width, n_own = max(lengths), max(own_len)
    some = next(t for x in rows_of[0][1] if x is not None for t in x) if any(rows_of[0][1]) else \
        next(t for per_layer in rows_of[0][2].values() for t in per_layer.values())
    opad = torch.tensor([n_own - o for o in own_len], device=some.device)
    layers = []
    for i in range(len(rows_of[0][1])):
        own = [x[1][i] for x in rows_of]
        padded = []
        if own[0] is not None:
            for j in (0, 1):  # K, V: their head sizes may differ (MLA)
                like = own[0][j]
                out = like.new_zeros((n, like.shape[0], n_own, like.shape[2]))
                for r, x in enumerate(own):
                    if own_len[r]:
                        out[r, :, n_own - own_len[r]:] = x[j]
                padded.append(out)
        states = {key: torch.cat([x[2][i][key] for x in rows_of]) for key in rows_of[0][2].get(i, {})}
        if padded and states:
            layers.append(HybridDecodeLayer(*padded, opad, room, prefixes, i, width, states))
        elif padded:
            layers.append(DecodeLayer(*padded, opad, room, prefixes, i, width))
        elif states:
            layers.append(StateLayer(number_of_states=1 + max(k for _, k in states)))
            layers[-1].load(states)
        else:
            layers.append(cache_utils.DummyLayer())
    # a model of states only has no K/V columns to pad (a pad mask would reach Mamba's mixer, which
    # multiplies its one-token input by the mask's [B, T] and silently broadcasts)
    pads = [width - x for x in lengths] if any(x is not None for x in rows_of[0][1]) else [0] * n
    return Rows(DecodeCache(layers, prefixes, width), lengths, pads, logits)


@dataclass
class Rows:
    """A decode batch: its cache (rl/backends/local/prefix.py `DecodeCache`: each row's prompt read from
    one shared copy, its own K/V left-padded to the longest row), each row's real length and pads, and each row's
    next-token logits [B, V]."""

    cache: DecodeCache
    lengths: list[int]
    pads: list[int]
    logits: Tensor

    @staticmethod
    def of_prompts(model, prompts: list[list[int]], keep_last: bool, room: int, share_min: float | None = None,
                   positions=None) -> Rows:
        """One row per prompt of `prompts`: one prefill per distinct prompt (a group's G rows share
        one), prompts of one length as one batch, each prompt's K/V then read by its rows from one copy
        (rl/backends/local/prefix.py); a prompt shorter than `share_min` tokens (default prefix.py's
        SHARE_MIN), or one of a model whose attention cannot read it so, is copied to its rows; `room`: the positions
        the decode will add; `positions(prompt)`: a prompt's own positions [k, L] (`prefilled`)."""
        if share_min is None:
            share_min = SHARE_MIN if shares(model) else math.inf
        return Rows.stack(Rows.prefilled(model, prompts, keep_last, positions=positions), len(prompts), room, share_min)

    @staticmethod
    def prefilled(model, prompts: list[list[int]], keep_last: bool, rows: list[int] | None = None,
                  positions=None) -> list:
        """`stack`'s parts for `prompts` (one prefill per distinct prompt, prompts of one length as one
        batch), prompt k filling row `rows[k]` (default k); `positions(prompt tuple)`: its rotary
        positions [k, L] where the family has its own (an image prompt's M-RoPE), None: 0..L-1."""
        device = next(model.parameters()).device
        rows = list(range(len(prompts))) if rows is None else rows
        rows_of: dict[tuple, list[int]] = {}
        for i, p in zip(rows, prompts):
            rows_of.setdefault(tuple(p), []).append(i)
        by_length: dict[int, list[tuple]] = {}
        for p in rows_of:
            by_length.setdefault(len(p), []).append(p)
        parts = []
        for same in by_length.values():
            pos = None if positions is None else torch.stack([positions(p) for p in same], 1)
            cache, logits = prefill(model, [list(p) for p in same], device, keep_last, positions=pos)
            parts.append(([i for p in same for i in rows_of[p]], cache, logits,
                          [k for k, p in enumerate(same) for _ in rows_of[p]]))
        return parts

    stack = staticmethod(stack)


def _stop_hit(tokenizer, ids: list[int], stop: list[str], window: int) -> bool:
    # Only the newest token can complete a stop string (an earlier completion would have stopped
    # the row already), so decoding the tail that could hold the longest one suffices.
    text = tokenizer.decode(ids[-window:])
    return any(s in text for s in stop)


@dataclass
class Decoded:
    """Per row: the sampled ids, their log-probs [n], how it ended ("eos", "stop" or "length"), and
    with `keep_kv` its cache over every fed position (its length, then all but its last sampled token)."""

    tokens: list[list[int]]
    logprobs: list[Tensor]
    reasons: list[str]
    caches: list[RowCache] | None


def decode(model, rows: Rows, config, eos: set[int], tokenizer, generators: list, keep_last: bool,
           budgets: list[int], keep_kv: bool = False, finished=None, choose=None, shift: list[int] | None = None
           ) -> Decoded:
    """Sample every row of `rows` until it ends: an EOS token, a stop string of `config.stop`, or
    `budgets[i]` tokens. Row i draws with `generators[i]`. `finished(i)` is called as row i ends.
    `choose`: what draws the tokens from the logits (default `sample_tokens`; a test's forces them).
    `shift[i]`: row i's first new position minus its length (an image prompt's M-RoPE: text after an
    image continues at the image's max + 1; default 0).

    A finished row stays in the batch (fed, its outputs ignored) until a quarter of the batch has
    finished; then they all leave at once. Dropping each row as it ends would copy the whole cache at
    almost every step of a long decode; this way a batch is copied O(log B) times."""
    B = len(rows.lengths)
    window = 4 * max((len(s) for s in config.stop), default=0) + 1  # a character may take up to 4 byte tokens
    draws = Draws(generators)
    cache, logits_BV, pads = rows.cache, rows.logits, list(rows.pads)
    device = logits_BV.device
    slots: list[int | None] = list(range(B))  # batch position -> its row, None once it finished
    pos_B = torch.tensor(rows.lengths, device=device)  # the next position of each batch row
    if shift is not None:
        pos_B = pos_B + torch.tensor(shift, device=device)
    mask_BT = None
    if any(pads):
        mask_BT = torch.ones((B, cache.fed), dtype=torch.long, device=device)
        for b, p in enumerate(pads):
            mask_BT[b, :p] = 0
    tokens: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    reasons: list[str] = [""] * B
    kept: list[RowCache] | None = [None] * B if keep_kv else None
    tok_B: Tensor | None = None
    for t in range(max(budgets)):
        if t > 0:
            if mask_BT is not None:
                mask_BT = torch.cat([mask_BT, mask_BT.new_ones((len(slots), 1))], 1)
            logits_BV = forward_last(model, tok_B[:, None], pos_B, cache, keep_last, mask_BT)
            pos_B = pos_B + 1
        live = [b for b, i in enumerate(slots) if i is not None]
        u_B = None
        if config.temperature:  # the live rows' draws; a finished row's token is fed and ignored
            u_B = torch.full((len(slots),), 0.5, dtype=torch.float64, device=device)
            u_B[live] = draws.step([slots[b] for b in live], device)
        tok_B, logp_B = (choose or sample_tokens)(logits_BV, config.temperature, config.top_k, config.top_p, u_B)
        new, new_lp = tok_B.tolist(), logp_B.tolist()  # the CPU-GPU sync of the step: the checks need the ids
        if any(math.isnan(new_lp[b]) for b in live):  # NaN/inf logits: the draw would be garbage
            raise NonFiniteLogits(f"model: its next-token logits hold NaN/inf (sampled token {t + 1} of "
                                  f"{sum(math.isnan(new_lp[b]) for b in live)} row(s)): its weights overflowed or "
                                  "hold NaN/inf; in a run, lower optim.lr or clip the gradient (optim.max_grad_norm)")
        for b in live:
            i = slots[b]
            tokens[i].append(new[b])
            logps[i].append(new_lp[b])
            if new[b] in eos:
                reasons[i] = "eos"
            elif config.stop and _stop_hit(tokenizer, tokens[i], config.stop, window):
                reasons[i] = "stop"
            elif len(tokens[i]) == budgets[i]:
                reasons[i] = "length"
            if reasons[i]:
                if keep_kv:  # the row's fed positions: its length, then t sampled tokens
                    kept[i] = row_cache(cache, b, pads[b], pads[b] + rows.lengths[i] + t)
                slots[b] = None
                if finished is not None:
                    finished(i)
        keep = [b for b, i in enumerate(slots) if i is not None]
        if not keep:
            break
        if 4 * (len(slots) - len(keep)) < len(slots):
            continue
        idx = torch.tensor(keep, device=device)
        cache.batch_select_indices(idx)
        slots, pads, tok_B, pos_B = [slots[b] for b in keep], [pads[b] for b in keep], tok_B[idx], pos_B[idx]
        if mask_BT is not None:
            mask_BT = mask_BT[idx]
            cut = min(pads)  # columns that only finished rows needed
            if cut:
                for layer in cache.layers:
                    if hasattr(layer, "drop_front"):
                        layer.drop_front(cut)
                mask_BT, pads = mask_BT[:, cut:], [p - cut for p in pads]
            if not any(pads):
                mask_BT = None  # every row real again: the unmasked path
    lp_dtype = torch.promote_types(logits_BV.dtype, torch.float32)
    return Decoded(tokens, [torch.tensor(lp, dtype=lp_dtype) for lp in logps], reasons, kept)


_SHARES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shares(model) -> bool:
    """Whether `model`'s attention can read shared prefixes through `attention`: a model that routes its
    attention through transformers' AttentionInterface, whose layers attend over the K/V their cache
    update returned, with no keyword `attention` does not implement (learnt once per model, on a
    3-token prefix continued by 2 tokens, and checked to give the logits of the model's own attention)."""
    base = base_model(model)
    known = _SHARES.get(base)
    if known is not None:
        return known
    # hybrids route their attention layers through the interface without declaring it (stream/adapter.py)
    ok = bool(getattr(base, "_supports_attention_backend", False) or getattr(base, "_is_stateful", False))
    if ok:
        try:
            ok = _probe(model)
        except CannotShare:
            ok = False
    _SHARES[base] = ok
    return ok


def _probe(model) -> bool:
    """A 3-token prefix continued by 2 tokens, read once as a shared prefix and once copied into its row:
    the same logits, to the dtype's rounding, or the model does not share."""
    param = next(model.parameters())
    device, out = param.device, []
    with torch.no_grad():
        for share_min in (1, math.inf):
            cache, logits = prefill(model, [[1, 2, 3]], device, False)
            rows = stack([([0], cache, logits, [0])], 1, 2, share_min=share_min)
            out.append(forward_last(model, torch.tensor([[4, 5]], device=device), 3, rows.cache, False).double())
    gap = float((out[0].log_softmax(-1) - out[1].log_softmax(-1)).abs().max())
    return gap <= {torch.float64: 1e-9, torch.float32: 1e-4}.get(param.dtype, 5e-2)

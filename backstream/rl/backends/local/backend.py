"""The in-process backend (rl/backends/base.py's protocol): the learner's own model samples, at its
current weights, in this process (rl/backends/local/decode.py: every row of a call in one batch).

- `complete`: each prompt prefilled once, its cache repeated over the G rows of its group, every row of
  the call decoded as one batch (rl/backends/local/generate.py); with `return_kv` each sample's K/V go to
  the engine, no prefill.
- `play`: episodes in rounds, every live episode's turn of a round decoded as one batch. The first
  round prefills each distinct prompt once; each episode then keeps its own K/V (and, in a hybrid
  model, its layer states), and a later turn prefills only its new tokens (the previous turn's last
  token, the inserted ones) after them before it joins the round's batch.
- `round` (an agent program's requests, from threads): a request that arrives while the model
  decodes waits; the requests that waited are then decoded together, so the episodes of a round
  batch. A request whose ids extend at least `reuse_min` tokens that an earlier request of the round
  was fed and sampled (an agent that appends to its conversation) prefills only its new tokens after
  that request's K/V, which it takes over; any other request is prefilled whole, requests of one
  length as one batch (a row prefilled after its own history is a forward of its own: for short
  histories the batched prefill is faster). Every request draws with its own seeded generator: its
  tokens depend on its seed, not on its batch-mates. Outside a `round` (a program still running
  after its episode ended) a request is refused: the model is being trained.

What it samples with is its `LocalWeights`' to say: `sync(model, step)` hands it the policy and the step
that made its weights (every token's version), which the backend asks for (`current`) at each call;
its forwards run with FSDP's parameters gathered once (`fsdp.gathered`), on the thread that calls it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from backstream.rl.backends.base import SamplingParams
from backstream.rl.backends.local.decode import Rows, check_return_kv, decode, prefill, shares
from backstream.rl.backends.local.gallery import Gallery
from backstream.rl.backends.local.generate import generate
from backstream.rl.backends.local.prefix import SHARE_MIN
from backstream.rl.records import Completion, Played, at_version
from backstream.stream import fsdp, vision
from backstream.stream.hf import takes_logits_to_keep

# how long a batch waits for the requests of episodes still playing: until every one has sent its
# request, no request came for GATHER_S, or GATHER_MAX_S in all
GATHER_S, GATHER_MAX_S = 0.02, 0.25
REUSE_MIN = 256  # the shortest history whose K/V a request continues instead of prefilling it


@dataclass
class _Request:
    ids: list[int]
    max_tokens: int
    seed: int
    answer: Completion | None = None
    error: BaseException | None = None


class LocalWeights:
    """The in-process backend's weights (rl/backends/base.py `Weights`): the learner's own model, at its
    weights as they are; `sync` says which model and the step that made them (every token's version)."""

    def __init__(self):
        self.model, self.version = None, 0

    def sync(self, model, step: int, progress=None) -> float:
        self.model, self.version = model, step
        return 0.0

    def current(self) -> tuple:
        """(the model, the step that made its weights); an error before the first `sync`."""
        if self.model is None:
            raise RuntimeError("the local backend samples nothing before its weights' first sync")
        return self.model, self.version


class LocalBackend:
    """The learner's model, sampling in this process (see the module docstring). `config`: the run's
    sampling settings (temperature, top-p/top-k, stop strings, rollout.max_new_tokens); `weights`: what
    it samples with (a new `LocalWeights` unless given)."""

    in_process = True

    def __init__(self, config: SamplingParams, eos: list[int], tokenizer, weights: LocalWeights | None = None):
        self.config, self.eos, self.tok = config, set(eos), tokenizer
        self.weights = weights if weights is not None else LocalWeights()
        self.cond = threading.Condition()
        self.queue: list[_Request] = []
        self.decoding = False
        self.open = False  # inside a `round`
        self.batches: list[int] = []  # requests per decode batch, this round
        self.live = 0  # episodes playing: each may send a request
        self.finished: set[str] = set()  # this round's sessions that are over
        self.prefixes: list[tuple[list[int], object]] = []  # this round's (ids fed, their K/V), each taken once
        self.reused = 0  # tokens of this round's requests not prefilled again
        self.reuse_min = REUSE_MIN
        self.gallery: Gallery | None = None  # this round's images (an agent's image parts), for a VLM

    # -- completions ----------------------------------------------------------------------------------
    def complete(self, prompts: list[Tensor], group_size: int, max_tokens: int, generators: list,
                 return_kv: bool = False, progress=None, pictures: list[list] | None = None) -> list[Completion]:
        model, version = self.weights.current()
        config = dataclasses.replace(self.config, max_new_tokens=max_tokens)
        with fsdp.gathered(model):
            return generate(model, prompts, config, group_size=group_size, eos_token_id=sorted(self.eos),
                            tokenizer=self.tok, return_kv=return_kv, generator=generators, progress=progress,
                            version=version, pictures=pictures)

    # -- episodes -------------------------------------------------------------------------------------
    def play(self, starts: list[list[int]], generators: list, turn, budget, max_turns: int,
             return_kv: bool = False, pictures: list[list] | None = None) -> list[Played]:
        model, version = self.weights.current()
        with fsdp.gathered(model):
            gallery = None if pictures is None else Gallery(model, len(starts))
            return self._play(model, version, starts, generators, turn, budget, return_kv, gallery, pictures)

    @torch.no_grad()
    def _play(self, model, version: int, starts: list[list[int]], generators: list, turn, budget,
              return_kv: bool, gallery: Gallery | None = None, pictures: list[list] | None = None) -> list[Played]:
        """Without `gallery`, text only; with it, `pictures[k]` are episode k's images in the order of its
        image placeholders: its prompt's at the start, and `turn` appends those of what it inserts (every
        placeholder of an inserted run is an image), fed as virtual ids (gallery.py)."""
        config = self.config
        keep_last = takes_logits_to_keep(model)
        check_return_kv(model, return_kv)
        played = [Played(fed=list(s)) for s in starts]
        if not starts:  # (a rank's share of a round can be empty)
            return played
        caches: list = [None] * len(starts)
        lengths = [len(s) for s in starts]
        feed: list[list[int]] = [[] for _ in starts]  # what each live episode feeds before its next turn
        reading, positions = contextlib.nullcontext(), None
        firsts = [list(s) for s in starts]
        if gallery is not None:
            by_ids = {}
            for k, s in enumerate(starts):
                image_at = [t == gallery.tid for t in s]
                firsts[k], pos = gallery.feed(k, list(s), list(pictures[k]), image_at, f"episode {k}'s prompt")
                by_ids[tuple(firsts[k])] = pos
            positions = by_ids.__getitem__ if gallery.mrope else None
            reading = gallery.reading()
        seen = [len(pictures[k]) if pictures else 0 for k in range(len(starts))]
        with reading:
            batch = Rows.of_prompts(model, firsts, keep_last, config.max_new_tokens, positions=positions)
            live = list(range(len(starts)))
            budgets = [budget(n) for n in lengths]
            while live:
                shift = None if gallery is None or not gallery.mrope else [gallery.shift_of(k) for k in live]
                out = self.decode_rows(model, batch, [generators[k] for k in live], keep_last, budgets, shift)
                still = []
                for r, k in enumerate(live):
                    tokens = out.tokens[r]
                    caches[k] = out.caches[r]
                    played[k].fed += tokens[:-1]
                    lengths[k] += len(tokens)
                    inserted = turn(k, at_version(tokens, out.logprobs[r], version, out.reasons[r]))
                    if inserted is not None:
                        feed[k] = tokens[-1:] + list(inserted)
                        lengths[k] += len(inserted)
                        still.append(k)
                    if gallery is not None:
                        gallery.sampled(k, tokens[:-1])
                del out, batch
                live = still
                if not live:
                    break
                # each live episode feeds its turn's last token and what was inserted, after its own K/V
                device = next(model.parameters()).device
                parts = []
                for r, k in enumerate(live):
                    ids, pos = feed[k], None
                    if gallery is not None:
                        new, seen[k] = pictures[k][seen[k]:], len(pictures[k])
                        image_at = [False] + [t == gallery.tid for t in feed[k][1:]]
                        ids, pos = gallery.feed(k, feed[k], new, image_at, f"episode {k}'s inserted tokens")
                        pos = None if pos is None else pos[:, None, :]
                    cache, logits = prefill(model, [ids], device, keep_last, history=caches[k], positions=pos)
                    caches[k] = None  # the batch's cache holds it now
                    played[k].fed += feed[k]
                    parts.append(([r], cache, logits, None))
                batch = Rows.stack(parts, len(live), config.max_new_tokens)
                del parts
                budgets = [budget(lengths[k]) for k in live]
        for k, p in enumerate(played):
            p.kv = caches[k].as_kv() if return_kv else None
        return played

    # -- requests (agent programs) --------------------------------------------------------------------
    @contextlib.contextmanager
    def round(self, episodes: int):
        """A round of `episodes` agent programs: requests are taken inside it (a program still running
        after it ended is refused: the model is being trained), batched while episodes still play
        (`_LocalRound.finish` says one is over), with the weights as they were when it opened."""
        model, version = self.weights.current()
        with self.cond:
            self.open, self.batches, self.prefixes, self.reused = True, [], [], 0
            self.live, self.finished = episodes, set()
            self.gallery = Gallery(model) if vision.holds_images(model) else None  # a VLM's requests' images
        try:
            with fsdp.gathered(model):
                yield _LocalRound(self, model, version)
        finally:
            with self.cond:
                while self.decoding:
                    self.cond.wait()
                self.open, self.live, self.prefixes, self.gallery = False, 0, [], None
                for r in self.queue:
                    r.error = RuntimeError("the episode's round is over")
                self.queue = []
                self.cond.notify_all()

    def _request(self, model, version: int, ids: list[int], max_tokens: int, seed: int) -> Completion:
        req = _Request(list(ids), max_tokens, seed)
        with self.cond:
            if not self.open:
                raise RuntimeError("no round is being sampled: this episode is over")
            self.queue.append(req)
            while req.answer is None and req.error is None:
                if self.decoding:
                    self.cond.wait()
                    continue
                self.decoding = True
                self._gather()
                batch, self.queue = self.queue, []
                self.cond.release()
                try:
                    self._answer(model, version, batch)
                except BaseException as e:  # noqa: BLE001  (each waiting request gets the error)
                    for r in batch:
                        r.error = r.error or e
                finally:
                    self.cond.acquire()
                    self.decoding = False
                    self.cond.notify_all()
        if req.error is not None:
            raise req.error
        return req.answer

    def _gather(self) -> None:
        """Before a batch: wait for the requests of the episodes still playing, while they keep coming
        (`GATHER_S` apart at most, `GATHER_MAX_S` in all): episodes whose previous answers came in one
        batch send their next requests together, and a batch of one is not decoded while the others'
        requests are on their way."""
        deadline = time.monotonic() + GATHER_MAX_S
        while len(self.queue) < self.live and time.monotonic() < deadline:
            n = len(self.queue)
            self.cond.wait(GATHER_S)
            if len(self.queue) == n:
                return

    def decode_rows(self, model, rows: Rows, generators: list, keep_last: bool, budgets: list[int],
                    shift: list[int] | None = None):
        """Every row of `rows` decoded as one batch, keeping each row's cache (rl/backends/local/decode.py
        `decode`; `shift`: an image episode's M-RoPE offsets): the one place the backend's episodes and
        requests draw their tokens."""
        return decode(model, rows, self.config, self.eos, self.tok, generators, keep_last, budgets, keep_kv=True,
                      shift=shift)

    @torch.no_grad()
    def _answer(self, model, version: int, batch: list[_Request]) -> None:
        self.batches.append(len(batch))
        gallery = self.gallery if self.gallery is not None and any(min(r.ids) < 0 for r in batch) else None
        if gallery is None:
            return self._answer_batch(model, version, batch, None)
        gallery.encode()  # the images its requests registered, in the thread that decodes
        with gallery.reading():
            return self._answer_batch(model, version, batch, gallery)

    def _answer_batch(self, model, version: int, batch: list[_Request], gallery: Gallery | None) -> None:
        """`batch` decoded; with `gallery`, requests whose ids hold images (virtual ids), at the
        family's positions."""
        keep_last = takes_logits_to_keep(model)
        device = next(model.parameters()).device
        mrope = gallery is not None and gallery.mrope
        parts, fresh = [], []
        for i, r in enumerate(batch):
            fed, kv = self._prefix(r.ids)
            if kv is None:
                fresh.append(i)
                continue
            self.reused += len(fed)
            pos = gallery.positions(r.ids)[:, None, len(fed):] if mrope else None
            cache, logits = prefill(model, [r.ids[len(fed):]], device, keep_last, history=kv, positions=pos)
            parts.append(([i], cache, logits, None))
        if fresh:
            positions = (lambda ids: gallery.positions(list(ids))) if mrope else None
            parts += Rows.prefilled(model, [batch[i].ids for i in fresh], keep_last, fresh, positions=positions)
        rows = Rows.stack(parts, len(batch), max(r.max_tokens for r in batch), SHARE_MIN if shares(model) else math.inf)
        del parts
        gens = [torch.Generator().manual_seed(r.seed) for r in batch]
        shift = [gallery.shift(r.ids) for r in batch] if mrope else None
        out = self.decode_rows(model, rows, gens, keep_last, [r.max_tokens for r in batch], shift)
        for r, ids, lp, reason, kv in zip(batch, out.tokens, out.logprobs, out.reasons, out.caches):
            r.answer = at_version(ids, lp, version, reason)
            with self.cond:
                self.prefixes.append((r.ids + ids[:-1], kv))

    def _prefix(self, ids: list[int]) -> tuple[list[int], object]:
        """The longest ids fed this round that `ids` extend by at least one token, and their K/V, taken
        (a branch that starts there later is prefilled whole); ([], None) if none."""
        with self.cond:
            best = max((k for k, (fed, _) in enumerate(self.prefixes) if self.reuse_min <= len(fed) < len(ids)
                        and ids[len(fed) - 1] == fed[-1] and ids[:len(fed)] == fed),
                       key=lambda k: len(self.prefixes[k][0]), default=None)
            return self.prefixes.pop(best) if best is not None else ([], None)


class _LocalRound:
    """A local round's requests (rl/backends/base.py `Requests`): each waits for its batch; `finish`
    when one of its episodes is over (fewer requests to wait for)."""

    def __init__(self, backend: LocalBackend, model, version: int):
        self.backend, self.model, self.version = backend, model, version

    def generate(self, ids: list[int], max_tokens: int, seed: int, key: str) -> Completion:
        return self.backend._request(self.model, self.version, ids, max_tokens, seed)

    @property
    def gallery(self) -> Gallery | None:
        """The round's images (a VLM's): what turns a request's image positions into virtual ids
        (`Gallery.virtual`) and back (`Gallery.real`); None for a text model."""
        return self.backend.gallery

    def finish(self, key: str) -> None:
        b = self.backend
        with b.cond:
            if key not in b.finished:
                b.finished.add(key)
                b.live -= 1
                b.cond.notify_all()

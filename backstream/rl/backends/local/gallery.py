"""Images in the in-process sampler's episodes (docs/vision.md, "Images in episodes"): an episode's
prompt may hold images, and a turn's inserted tokens may hold more (a tool's screenshot).

`Gallery` holds a round's images as the sampler feeds them: each distinct picture (by digest) encoded
once, its rows of E appended to one `Images` (stream/vision.py), whose `reading` hooks map a virtual
id -(row + 1) to its row. An episode feeds its image positions as those virtual ids, so its K/V at an
image are the image's, and two images behind the same placeholder ids never share a prefix. Per
episode it keeps the real ids fed so far, the pictures they hold and which positions are images, from
which the family's own positions (Qwen's M-RoPE, `vision.rope_positions`) of what it feeds next and
the decode's `shift` (the next position minus the length) follow.
"""

from __future__ import annotations

from typing import Any

import torch

from backstream.checks import UserError
from backstream.stream import vision


class Gallery:
    def __init__(self, model, episodes: int):
        self.model = model
        self.tid = vision.image_token(model)
        self.mrope = vision._rope_index(model) is not None
        from backstream.stream.hf import base_model  # noqa: PLC0415

        emb = base_model(model).get_input_embeddings()
        self.images = vision.Images(emb.weight.new_zeros(0, emb.embedding_dim), [])  # E grows as images come
        self.start: dict[str, int] = {}  # digest -> its first row of E
        self.ids: list[list[int]] = [[] for _ in range(episodes)]  # per episode: the real ids fed so far
        self.at: list[list[bool]] = [[] for _ in range(episodes)]  # ... which of them are images
        self.pictures: list[list] = [[] for _ in range(episodes)]  # ... the pictures they hold, in order
        self.shifts = [0] * episodes  # ... the next position minus the length (M-RoPE)

    def reading(self):
        """While open, the model's embedding reads the virtual ids (stream/vision.py `Images.reading`)."""
        return self.images.reading(self.model)

    def _add(self, pictures: list) -> None:
        new = [p for p in vision.unique([pictures]) if p.digest not in self.start]
        if not new:
            return
        vision.encode_pictures(self.model, [p for p in new if p.embeds is None], grad=False)
        at = self.images.embeds.shape[0]
        for p in new:
            self.start[p.digest] = at
            at += p.tokens
        deep = [p.deep for p in new] if new[0].deep is not None else None
        placed = vision.place([], self.tid, [p.embeds for p in new], [], deep=deep)
        self.images.embeds = torch.cat([self.images.embeds, placed.embeds.to(self.images.embeds.dtype)])
        if placed.deep:
            self.images.deep = [torch.cat([a, b]) for a, b in zip(self.images.deep, placed.deep)] \
                if self.images.deep else placed.deep

    def feed(self, k: int, ids: list[int], pictures: list, image_at: list[bool], where: str) -> tuple[list[int], Any]:
        """Episode k feeds `ids` next, whose positions `image_at` are the images `pictures` (in order):
        the ids as the model reads them (images as virtual ids) and their positions [n, len(ids)] (None
        for a family of 1-D positions). A count that does not match is an error naming `where`."""
        want = sum(p.tokens for p in pictures)
        have = sum(image_at)
        if have != want or any(a and t != self.tid for t, a in zip(ids, image_at)):
            raise UserError(f"{where}: {have} image placeholder tokens for {len(pictures)} image(s) that fill {want}; "
                            "the template or the text adds or drops placeholders (give images as image parts, "
                            "never as their token in text)")
        self._add(pictures)
        rows = [self.start[p.digest] + j for p in pictures for j in range(p.tokens)]
        out, r = [], iter(rows)
        for t, a in zip(ids, image_at):
            out.append(-(next(r) + 1) if a else t)
        self.ids[k] += ids
        self.at[k] += image_at
        self.pictures[k] += pictures
        if not self.mrope:
            return out, None
        seq = torch.tensor(self.ids[k])
        pos = vision.rope_positions(self.model, seq, self.pictures[k], self.tid, torch.tensor(self.at[k]))
        self.shifts[k] = int(pos.max()) + 1 - len(seq)
        return out, pos[:, -len(ids):]

    def sampled(self, k: int, ids: list[int]) -> None:
        """Episode k's model was fed `ids` it sampled (text: each at its length + its shift)."""
        self.ids[k] += ids
        self.at[k] += [False] * len(ids)

    def shift(self, k: int) -> int | None:
        """Episode k's next position minus its length (M-RoPE: text after an image continues at the
        image's max + 1); None for 1-D positions."""
        return self.shifts[k] if self.mrope else None

"""Images in the in-process sampler's episodes and agent requests (docs/vision.md, "Images in
episodes"): an episode's prompt may hold images, a turn's inserted tokens more (a tool's screenshot),
an agent program's request any (its `image_url` parts).

`Gallery` holds a round's images as the sampler feeds them: each distinct picture (by digest) gets
its rows of E in one `Images` (stream/vision.py), whose `reading` hooks map a virtual id -(row + 1) to
its row. Ids fed with their image positions as those virtual ids make the K/V at an image the
image's, and two images behind the same placeholder ids never share a prefix (the agent requests'
prefix reuse and transcript compare virtual ids). `register` assigns a picture its rows at once;
`encode` runs the tower over the pictures registered since, in the thread that decodes. From virtual
ids follow the family's own positions (Qwen's M-RoPE, `vision.rope_positions`), the decode's `shift`
(the next position minus the length) and, for the learner, the real ids with their pictures (`real`).
An episode played in rounds keeps its virtual ids so far here (`feed`).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from backstream.checks import UserError
from backstream.stream import vision


class Gallery:
    def __init__(self, model, episodes: int = 0):
        from backstream.stream.hf import base_model  # noqa: PLC0415

        self.model = model
        self.tid = vision.image_token(model)
        self.mrope = vision._rope_index(model) is not None
        emb = base_model(model).get_input_embeddings()
        self.images = vision.Images(emb.weight.new_zeros(0, emb.embedding_dim), [])  # E grows as images come
        self.start: dict[str, int] = {}  # digest -> its first row of E
        self.owner: list = []  # row -> its picture
        self.pending: list = []  # registered, not encoded yet
        self.lock = threading.Lock()
        self.fed: list[list[int]] = [[] for _ in range(episodes)]  # per played episode: its virtual ids so far
        self.shifts = [0] * episodes

    def reading(self):
        """While open, the model's embedding reads the virtual ids (stream/vision.py `Images.reading`)."""
        return self.images.reading(self.model)

    def register(self, pictures: list) -> list:
        """Rows for each picture not seen yet (by digest); returns the pictures as held (the first
        object of each digest, which `encode` fills)."""
        with self.lock:
            out = []
            for p in pictures:
                if p.digest not in self.start:
                    self.start[p.digest] = len(self.owner)
                    self.owner += [p] * p.tokens
                    self.pending.append(p)
                out.append(self.owner[self.start[p.digest]])
            return out

    def encode(self) -> None:
        """The tower over the pictures registered since the last call (one forward), their rows appended."""
        with self.lock:
            new, self.pending = self.pending, []
        if not new:
            return
        vision.encode_pictures(self.model, [p for p in new if p.embeds is None], grad=False)
        deep = [p.deep for p in new] if new[0].deep is not None else None
        placed = vision.place([], self.tid, [p.embeds for p in new], [], deep=deep)
        assert self.images.embeds.shape[0] == self.start[new[0].digest], "Gallery: rows out of order"
        self.images.embeds = torch.cat([self.images.embeds, placed.embeds.to(self.images.embeds.dtype)])
        if placed.deep:
            self.images.deep = [torch.cat([a, b]) for a, b in zip(self.images.deep, placed.deep)] \
                if self.images.deep else placed.deep

    def virtual(self, ids: list[int], pictures: list, image_at: list[bool], where: str) -> list[int]:
        """`ids` with their positions `image_at` (the images `pictures`, in order) as virtual ids,
        the pictures registered. A count that does not match is an error naming `where`."""
        want, have = sum(p.tokens for p in pictures), sum(image_at)
        if have != want or any(a and t != self.tid for t, a in zip(ids, image_at)):
            raise UserError(f"{where}: {have} image placeholder tokens for {len(pictures)} image(s) that fill {want}; "
                            "the template or the text adds or drops placeholders (give images as image parts, "
                            "never as their token in text)")
        held = self.register(pictures)
        rows = iter([self.start[p.digest] + j for p in held for j in range(p.tokens)])
        return [-(next(rows) + 1) if a else t for t, a in zip(ids, image_at)]

    def real(self, vids: list[int]) -> tuple[list[int], vision.Placed]:
        """Virtual ids as the learner takes them: the real ids, and their pictures in order with the
        mask of their image positions."""
        ids, at, pictures = [], [], []
        for v in vids:
            if v >= 0:
                ids.append(v)
                at.append(False)
                continue
            row = -v - 1
            p = self.owner[row]
            if row == self.start[p.digest]:  # an image's first row: the next picture
                pictures.append(p)
            ids.append(self.tid)
            at.append(True)
        return ids, vision.Placed(pictures, torch.tensor(at, dtype=torch.bool))

    def positions(self, vids: list[int]) -> Any:
        """The family's positions [n, len] of virtual ids (None for 1-D positions)."""
        if not self.mrope:
            return None
        ids, placed = self.real(vids)
        return vision.rope_positions(self.model, torch.tensor(ids), list(placed), self.tid, placed.at)

    def shift(self, vids: list[int]) -> int:
        """The next position after `vids` minus their length (M-RoPE: text after an image continues at
        the image's max + 1); 0 for 1-D positions."""
        pos = self.positions(vids)
        return 0 if pos is None else int(pos.max()) + 1 - len(vids)

    # -- an episode played in rounds -------------------------------------------------------------------
    def feed(self, k: int, ids: list[int], pictures: list, image_at: list[bool], where: str) -> tuple[list[int], Any]:
        """Episode k feeds `ids` next (`virtual`): the ids as the model reads them and their positions
        [n, len(ids)] (None for a family of 1-D positions); the tower runs over any new picture now."""
        out = self.virtual(ids, pictures, image_at, where)
        self.encode()
        self.fed[k] += out
        if not self.mrope:
            return out, None
        pos = self.positions(self.fed[k])
        self.shifts[k] = int(pos.max()) + 1 - len(self.fed[k])
        return out, pos[:, -len(ids):]

    def sampled(self, k: int, ids: list[int]) -> None:
        """Episode k's model was fed `ids` it sampled (text: each at its length + its shift)."""
        self.fed[k] += ids

    def shift_of(self, k: int) -> int | None:
        """Episode k's next position minus its length; None for 1-D positions."""
        return self.shifts[k] if self.mrope else None

"""Images on the token tree (docs/design.md §2c): a vision-language model's image rows as tree tokens.

A VLM's forward is `embed(ids)` with the rows at the image placeholders replaced by the vision tower's
output E (after its projector), then the same decoder. So an image is a run of prompt positions whose
input vector is a row of E instead of an embedding row; everything after the input layer is the text
engine's. `Images` says where:

    embeds     [R, H]: the rows of every unique image, once (the caller runs the tower once per image;
               requires grad when the tower trains, and is then the tower's output with its graph)
    rows[i]    [len_i] long: the row of `embeds` position t of sequence i reads, -1 for a token
    positions  None (the 1-D positions 0..len-1), or per sequence [n, len_i] long: the family's rotary
               positions (Qwen's M-RoPE: temporal, height and width rows, text continuing at the
               image's max + 1), as the model's own `get_rope_index` computes them

The tree sees an image position as the virtual token -(row + 1): two prompts share a node only where
they share the image rows, not merely the placeholder ids. A block batch's input is `inputs_embeds`:
the token embeddings with the image positions' rows of E as leaves (`block_embeds`); the gradient
reaching them is added into gE [R, H] (float32 or wider), and when every block has run one
`torch.autograd.backward(embeds, gE)` takes the tower's gradient: dL/dφ = Σ_b ∂L/∂E_b · ∂E/∂φ, the
sum the full forward takes, with the tower run and backpropagated once. With the tower frozen E is a
constant and gE is never made.

A family whose decoder reads the image again (Qwen3-VL's deepstack: the tower's intermediate features
D_d [R, H] added to the hidden states after decoder layer d at the image positions) holds them in
`deep`, indexed by the same rows: while `feeding` is open, each forward of the text model gets its
positions' rows of every D_d (as leaves whose gradient goes into gD_d, like E's), so a block adds them
where the full forward does, and the tower's one backward takes (gE, gD_1, ...) together.

`tower` and `place` build an `Images` from pixels with the model's own `get_image_features` and the
placeholder token; `sequence_embeds` is the naive reference's input (one sequence, E's graph kept).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from backstream.checks import UserError


@dataclass
class Images:
    embeds: Tensor
    rows: list[Tensor]
    positions: list[Tensor] | None = None
    deep: list[Tensor] = field(default_factory=list)  # deepstack levels, each [R, H] (Qwen3-VL), else empty
    gE: Tensor | None = field(default=None, repr=False)  # the engine's accumulators, while it runs
    gD: list[Tensor] | None = field(default=None, repr=False)
    _pending: tuple | None = field(default=None, repr=False)  # the next text-model forward's deepstack inputs

    def validate(self, sequences: list[Tensor]) -> None:
        """Shapes and ranges against the sequences; a clear error naming the argument otherwise."""
        if not isinstance(self.embeds, Tensor) or self.embeds.dim() != 2 or not self.embeds.dtype.is_floating_point:
            raise UserError(f"images.embeds: expected a floating [rows, hidden] tensor, got "
                            f"{getattr(self.embeds, 'shape', type(self.embeds).__name__)}")
        if not isinstance(self.rows, (list, tuple)) or len(self.rows) != len(sequences):
            raise UserError(f"images.rows: expected one tensor per sequence ({len(sequences)}), got "
                            f"{len(self.rows) if isinstance(self.rows, (list, tuple)) else type(self.rows).__name__}")
        R = self.embeds.shape[0]
        for d, D in enumerate(self.deep):
            if not isinstance(D, Tensor) or D.shape != self.embeds.shape:
                raise UserError(f"images.deep[{d}]: expected a tensor of images.embeds' shape "
                                f"{tuple(self.embeds.shape)}, got {getattr(D, 'shape', type(D).__name__)}")
        for i, (r, s) in enumerate(zip(self.rows, sequences)):
            if not isinstance(r, Tensor) or r.shape != s.shape or r.dtype.is_floating_point:
                raise UserError(f"images.rows[{i}]: expected an integer tensor of sequences[{i}]'s shape "
                                f"{tuple(s.shape)}, got {getattr(r, 'shape', type(r).__name__)}")
            if len(r) and (int(r.min()) < -1 or int(r.max()) >= R):
                raise UserError(f"images.rows[{i}]: a row outside [-1, {R}) (images.embeds has {R} rows)")
        if self.positions is not None:
            if len(self.positions) != len(sequences):
                raise UserError(f"images.positions: expected one tensor per sequence ({len(sequences)})")
            for i, (p, s) in enumerate(zip(self.positions, sequences)):
                if p.dim() != 2 or p.shape[1] != len(s):
                    raise UserError(f"images.positions[{i}]: expected [rows, {len(s)}], got {tuple(p.shape)}")

    def tree_inputs(self, i: int, seq: Tensor) -> Tensor:
        """Sequence i as the tree sees it: image positions as virtual tokens -(row + 1)."""
        r = self.rows[i].to("cpu", torch.long)
        return torch.where(r >= 0, -(r + 1), seq)

    def embed_module(self, model: nn.Module) -> nn.Module:
        from backstream.stream.hf import base_model  # noqa: PLC0415

        return base_model(model).get_input_embeddings()

    def block_embeds(self, embed: nn.Module, ids: Tensor, hooks: list) -> Tensor:
        """inputs_embeds [B, Q, H] of a block batch whose ids hold virtual image tokens: their rows of E
        as a leaf (when a gradient is taken and the tower trains) whose gradient goes into gE; the rows
        of each deepstack level likewise, for the text model's forward (`feeding`)."""
        img = ids < 0
        out = embed(ids.clamp_min(0))
        self._pending = None
        if not bool(img.any()):
            return out
        rows = (-ids[img] - 1).to(self.embeds.device)
        e = _leaf(self.embeds, rows, out.dtype, self.gE, hooks)
        if self.deep:
            gD = self.gD or [None] * len(self.deep)
            self._pending = (img, [_leaf(D, rows, out.dtype, g, hooks) for D, g in zip(self.deep, gD)])
        return out.masked_scatter(img[..., None].to(out.device), e.to(out.device))

    def start(self) -> None:
        """Before the backward: gE (and each gD_d) when the tower trains."""
        def zeros(t: Tensor) -> Tensor:
            return torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device)

        if self.embeds.requires_grad:
            self.gE = zeros(self.embeds)
            self.gD = [zeros(D) for D in self.deep]

    def finish(self) -> None:
        """After every block: the tower's backward, once, from E and every deepstack level together."""
        gE, gD, self.gE, self.gD = self.gE, self.gD or [], None, None
        outs = [(t, g) for t, g in zip([self.embeds, *self.deep], [gE, *gD]) if g is not None and t.requires_grad]
        outs = [(t, g) for t, g in outs if bool(g.any())]
        if outs:
            torch.autograd.backward([t for t, _ in outs], [g.to(t.dtype) for t, g in outs])

    def sequence_embeds(self, embed: nn.Module, i: int, seq: Tensor) -> Tensor:
        """The naive reference's inputs_embeds [1, L, H] of sequence i: E's rows with their graph."""
        r = self.rows[i].to(seq.device)
        out = embed(seq[None])
        img = r >= 0
        self._pending = None
        if not bool(img.any()):
            return out
        rows = r[img].to(self.embeds.device)
        if self.deep:
            self._pending = (img[None], [D[rows] for D in self.deep])
        return out.masked_scatter(img[None, :, None], self.embeds[rows].to(out.device, out.dtype))

    @contextlib.contextmanager
    def feeding(self, model: nn.Module):
        """While open, each forward of the text model takes the deepstack rows of the positions its input
        embeddings were just made for (`block_embeds`, `sequence_embeds`, `reading`) as its
        `visual_pos_masks` / `deepstack_visual_embeds` (levels added to `deep` while it is open count:
        an episode's images come as it goes); nothing for a family without them."""
        import inspect  # noqa: PLC0415

        from backstream.stream.family import Unsupported  # noqa: PLC0415
        from backstream.stream.hf import base_model, text_part  # noqa: PLC0415

        text = (text_part(model) or (None, None))[1]
        takes = inspect.signature(text.forward).parameters if isinstance(text, nn.Module) else {}
        if "deepstack_visual_embeds" not in takes:  # (a family without deepstack: nothing to feed)
            if not self.deep:
                yield self
                return
            raise Unsupported(f"model: {type(base_model(model)).__name__}'s tower gives deepstack features, but its "
                              "text model takes no deepstack_visual_embeds; the engine cannot place them")

        def before(module, args, kwargs):
            p, self._pending = self._pending, None
            if p is not None:
                h = kwargs.get("inputs_embeds")
                kwargs["visual_pos_masks"] = p[0].to(h.device if h is not None else p[0].device)
                kwargs["deepstack_visual_embeds"] = list(p[1])
            return args, kwargs

        hook = text.register_forward_pre_hook(before, with_kwargs=True)
        try:
            yield self
        finally:
            hook.remove()
            self._pending = None

    @contextlib.contextmanager
    def reading(self, model: nn.Module):
        """While open, the model's input embedding reads the image rows at virtual ids (`tree_inputs`):
        the sampler feeds a prompt with images as token ids, no graph (rl/backends/local/generate.py)."""
        embed, fed = self.embed_module(model), []

        def before(module, args):
            fed.append(args[0])
            return (args[0].clamp_min(0), *args[1:])

        def after(module, args, out):
            ids = fed.pop()
            img = ids < 0
            self._pending = None
            if not bool(img.any()):
                return out
            rows = (-ids[img] - 1).to(self.embeds.device)
            if self.deep:
                self._pending = (img, [D.detach()[rows] for D in self.deep])
            e = self.embeds.detach()[rows].to(out.device, out.dtype)
            return out.masked_scatter(img[..., None].to(out.device), e)

        hooks = [embed.register_forward_pre_hook(before), embed.register_forward_hook(after)]
        try:
            with self.feeding(model):
                yield self
        finally:
            for h in hooks:
                h.remove()

    def position_ids(self, i: int, device) -> Tensor | None:
        """Sequence i's rotary positions as the model takes them ([n, 1, L]), or None (the default)."""
        return None if self.positions is None else self.positions[i][:, None].to(device)


def _leaf(src: Tensor, rows: Tensor, dtype, acc: Tensor | None, hooks: list) -> Tensor:
    """`src`'s `rows` without their graph; a leaf whose gradient is added into `acc` at `rows` when
    `acc` is given and a gradient is taken."""
    e = src.detach()[rows].to(dtype)
    if acc is not None and torch.is_grad_enabled():
        e.requires_grad_(True)

        def deposit(x: Tensor) -> None:
            acc.index_add_(0, rows, x.grad.to(acc.dtype))
            x.grad = None

        hooks.append(e.register_post_accumulate_grad_hook(deposit))
    return e


def tower(model: nn.Module, pixel_values: Tensor, **kwargs) -> tuple[list[Tensor], list[Tensor] | None]:
    """The vision tower's output rows of each image ([n_k, H] per image, after the projector) and, for a
    deepstack family (Qwen3-VL), each image's deepstack features [levels, n_k, H] (else None): the
    model's own `get_image_features` (transformers' VLM API), run once."""
    from backstream.stream.family import check_image_attention  # noqa: PLC0415
    from backstream.stream.hf import base_model  # noqa: PLC0415

    check_image_attention(model)
    out = base_model(model).get_image_features(pixel_values=pixel_values, return_dict=True, **kwargs)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    feats = list(feats) if isinstance(feats, (list, tuple)) else list(feats.unbind(0))
    levels = getattr(out, "deepstack_features", None)
    if not levels:
        return feats, None
    # per level, the images' rows (a tuple per image, or one flat tensor split as the features are)
    sizes = [f.reshape(-1, f.shape[-1]).shape[0] for f in feats]
    per_level = [list(lv) if isinstance(lv, (list, tuple)) else list(lv.split(sizes)) for lv in levels]
    return feats, [torch.stack([lv[k].reshape(-1, lv[k].shape[-1]) for lv in per_level]) for k in range(len(feats))]


def encode(model: nn.Module, pixel_values: Tensor, **kwargs) -> list[Tensor]:
    """`tower`'s rows of each image, for a family without deepstack features (whose rows would be
    dropped here: `tower` and `place(deep=)` carry them)."""
    from backstream.stream.family import Unsupported  # noqa: PLC0415
    from backstream.stream.hf import base_model  # noqa: PLC0415

    feats, deep = tower(model, pixel_values, **kwargs)
    if deep is not None:
        raise Unsupported(f"model: {type(base_model(model)).__name__} adds the vision tower's deepstack features "
                          "to its first decoder layers; take them with vision.tower and pass place(deep=)")
    return feats


def place(sequences: list[Tensor], image_token_id: int, features: list[Tensor], images_of: list[list[int]],
          positions: list[Tensor] | None = None, deep: list[Tensor] | None = None,
          at: list[Tensor] | None = None) -> Images:
    """`Images` for sequences whose image placeholders (`image_token_id`) read the rows of
    `features` (one [n_k, H] per unique image) in order: `images_of[i]` are the images of sequence i,
    in the order its placeholders appear. Which placeholders are images: `at[i]` (a bool mask over
    sequence i: an episode's, where an image a tool returned comes after turns the policy sampled),
    else the first ones (a placeholder id the policy sampled after them is a token). An image used by
    several sequences (a group's prompt) is one set of rows. `deep`: each image's deepstack features
    [levels, n_k, H] (`tower`), for a family that has them."""
    if len(images_of) != len(sequences):
        raise UserError(f"images_of: expected one list per sequence ({len(sequences)}), got {len(images_of)}")
    starts, row = [], 0
    for f in features:
        starts.append(row)
        row += f.shape[0]
    rows = []
    for i, (s, ks) in enumerate(zip(sequences, images_of)):
        want = sum(features[k].shape[0] for k in ks)
        slots = image_slots(s, image_token_id, want, None if at is None else at[i])
        if len(slots) != want:
            raise UserError(f"sequences[{i}]: {len(slots)} image placeholder tokens, but its images "
                            f"{list(ks)} have {want} rows")
        r = torch.full(s.shape, -1, dtype=torch.long)
        if ks:
            r[slots.cpu()] = torch.cat([torch.arange(starts[k], starts[k] + features[k].shape[0]) for k in ks])
        rows.append(r)
    embeds = torch.cat(features) if features else torch.zeros(0, 1)
    levels = []
    if deep is not None and features:
        if len(deep) != len(features) or any(d.dim() != 3 or d.shape[1:] != f.shape for d, f in zip(deep, features)):
            raise UserError("deep: expected one [levels, n_k, H] tensor per image, matching its features")
        levels = list(torch.cat(deep, dim=1).unbind(0))
    return Images(embeds, rows, positions, deep=levels)


def image_slots(seq: Tensor, image_token_id: int, want: int, at: Tensor | None = None) -> Tensor:
    """The positions of `seq` that are images: its placeholders where `at` (a bool mask) says so, else
    the first `want` of them (the prompt's come first; one the policy sampled later is a token). An
    `at` that marks a position holding another id is an error, never a shifted image."""
    if at is None:
        return torch.nonzero(seq == image_token_id).flatten()[:want]
    at = at.to(seq.device, torch.bool)
    if at.shape != seq.shape or bool((seq[at] != image_token_id).any()):
        raise UserError("at: an image mask must have the sequence's shape and mark only its image placeholder "
                        f"tokens (id {image_token_id})")
    return torch.nonzero(at).flatten()


# -- pictures: images as a run holds them, encoded once per round -------------------------------------

@dataclass(eq=False)
class Picture:
    """One image of a prompt as the model's processor made it: `inputs`, what the vision tower takes for
    it alone (`pixel_values`, and a family's `image_grid_thw`, ...); `tokens`, the placeholder tokens it
    fills; `digest`, a hash of its inputs (two rows holding the same image share it, on the tree and in
    the tower). `embeds` is the tower's output [tokens, H] once a round encoded it without a graph (the
    frozen tower's, which the learner then reuses); `calls` counts the tower forwards it had."""

    digest: str
    inputs: dict
    tokens: int
    embeds: Tensor | None = field(default=None, repr=False)
    calls: int = 0
    deep: Tensor | None = field(default=None, repr=False)  # a deepstack family's [levels, tokens, H], with embeds
    # for a server that runs the processor itself (a vLLM server): the image (a PIL image), the token a
    # template renders for it, and the ids the processor expands that token into for this image alone
    source: object | None = field(default=None, repr=False)
    token: int | None = None
    span: tuple[int, ...] | None = field(default=None, repr=False)

    def fresh(self) -> Picture:
        """The same image with nothing encoded: what a round starts from (one round's embeddings are
        never another's: the tower may have trained in between)."""
        return Picture(self.digest, self.inputs, self.tokens, source=self.source, token=self.token, span=self.span)


class Placed(list):
    """A sequence's pictures (a list of `Picture`, in the order of its images) with `at`, the bool mask
    of its positions that are those images: what an episode's sampler knows, whose images a tool
    returned after turns in which the policy may have sampled a placeholder id (`place`)."""

    def __init__(self, pictures, at: Tensor):
        super().__init__(pictures)
        self.at = at


def unique(pictures_of: list[list[Picture]]) -> list[Picture]:
    """The distinct images of some sequences (by digest), in first-use order, each the first object
    seen with its digest."""
    seen: dict[str, Picture] = {}
    for ps in pictures_of:
        for p in ps:
            seen.setdefault(p.digest, p)
    return list(seen.values())


def tower_trains(model: nn.Module) -> bool:
    """Whether any parameter outside the text decoder (the vision tower, its projector) takes a gradient."""
    from backstream.stream.hf import base_model, image_path  # noqa: PLC0415

    outside = image_path(model)
    return any(p.requires_grad for m in base_model(model).modules() if id(m) in outside
               for p in m.parameters(recurse=False))


def encode_pictures(model: nn.Module, pictures: list[Picture], grad: bool) -> tuple[list[Tensor], list[Tensor] | None]:
    """The tower's output rows of each picture, one forward over all of them (their inputs concatenated
    along the first dimension, as a processor batches images), and their deepstack features where the
    family has them (`tower`): with the graph when `grad`, else without one and kept as
    `Picture.embeds` / `Picture.deep`. A picture whose rows do not match its placeholder count is an
    error naming the family's mismatch, never a shifted image."""
    if not pictures:
        return [], None
    keys = list(pictures[0].inputs)
    device = next(model.parameters()).device
    batch = {k: torch.cat([p.inputs[k] for p in pictures]).to(device) for k in keys}
    pv = batch.pop("pixel_values")
    if pv.is_floating_point():
        pv = pv.to(next(model.parameters()).dtype)
    with torch.set_grad_enabled(grad):
        feats, deep = tower(model, pv, **batch)
    from backstream.stream.hf import base_model  # noqa: PLC0415

    if len(feats) != len(pictures):  # a family whose features come flat: split by the placeholder counts
        sizes = [p.tokens for p in pictures]
        feats = list(torch.cat([f.reshape(-1, f.shape[-1]) for f in feats]).split(sizes))
        if deep is not None:
            deep = list(torch.cat(deep, dim=1).split(sizes, dim=1))
    width = base_model(model).get_input_embeddings().embedding_dim
    for p, f in zip(pictures, feats):
        p.calls += 1
        if f.shape[-1] != width:
            raise UserError(f"images: the vision tower gave rows of width {f.shape[-1]}, but the decoder's input "
                            f"embeddings are {width} wide; the model's vision config does not fit its text config")
        if f.shape[0] != p.tokens:
            raise UserError(f"images: the vision tower gave {f.shape[0]} rows for an image its processor expanded "
                            f"into {p.tokens} placeholder tokens; the processor and the model disagree (load both "
                            "from the same folder)")
    if not grad:
        for k, (p, f) in enumerate(zip(pictures, feats)):
            p.embeds, p.deep = f, None if deep is None else deep[k]
    return feats, deep


def holds_images(model: nn.Module) -> bool:
    """Whether `model` is a vision-language model this module feeds: its own `get_image_features`
    and an image token id in its config."""
    from backstream.stream.hf import base_model  # noqa: PLC0415

    base = base_model(model)
    cfg = base.config
    named = getattr(cfg, "image_token_id", None) is not None or getattr(cfg, "image_token_index", None) is not None
    return callable(getattr(base, "get_image_features", None)) and named


def image_token(model: nn.Module) -> int:
    """The placeholder token id of a vision-language model's images (its config's `image_token_id`)."""
    from backstream.stream.hf import base_model  # noqa: PLC0415

    cfg = base_model(model).config
    tid = getattr(cfg, "image_token_id", None)
    if tid is None:
        tid = getattr(cfg, "image_token_index", None)
    if tid is None:
        raise UserError(f"model: {type(base_model(model)).__name__}'s config names no image_token_id; it is not a "
                        "vision-language model backstream can feed images")
    return int(tid)


def _rope_index(model: nn.Module):
    """The family's M-RoPE position function (`get_rope_index`), or None (1-D positions)."""
    from backstream.stream.hf import base_model  # noqa: PLC0415

    base = base_model(model)
    for m in (getattr(base, "model", None), base):
        fn = getattr(m, "get_rope_index", None)
        if callable(fn):
            return fn
    return None


def rope_positions(model: nn.Module, seq: Tensor, pictures: list[Picture], image_token_id: int,
                   at: Tensor | None = None) -> Tensor | None:
    """Sequence `seq`'s rotary positions [n, len] as the model's own `get_rope_index` computes them from
    its placeholders (`image_slots`, `at`) and its pictures' grids (Qwen's M-RoPE); None for a family
    of 1-D positions."""
    fn = _rope_index(model)
    if fn is None:
        return None
    import inspect  # noqa: PLC0415

    takes = inspect.signature(fn).parameters
    kw = {}
    if pictures and "image_grid_thw" in pictures[0].inputs:
        kw["image_grid_thw"] = torch.cat([p.inputs["image_grid_thw"] for p in pictures]).to(seq.device)
    if "mm_token_type_ids" in takes:  # the images' placeholders: the first ones (a sampled one is text)
        kinds = torch.zeros(len(seq), dtype=torch.int)
        kinds[image_slots(seq.cpu(), image_token_id, sum(p.tokens for p in pictures), at)] = 1
        kw["mm_token_type_ids"] = kinds[None]
    pos = fn(seq[None].to("cpu", torch.long), **{k: v.cpu() for k, v in kw.items()})[0]
    return pos[:, 0].long()


def images_for(model: nn.Module, seqs: list[Tensor], pictures_of: list[list[Picture]], grad: bool,
               at: list[Tensor] | None = None) -> Images | None:
    """`Images` of sequences whose placeholders (`at`: `place`) read `pictures_of[i]` in order (None
    when no sequence holds an image): each distinct image encoded once, with its graph when `grad` (the
    tower trains), else its round's embeddings reused (`Picture.embeds`, encoded now where none are);
    positions the family's (`rope_positions`)."""
    if not any(pictures_of):
        return None
    tid = image_token(model)
    pics = unique(pictures_of)
    index = {p.digest: k for k, p in enumerate(pics)}
    if grad:
        feats, deep = encode_pictures(model, pics, grad=True)
    else:
        encode_pictures(model, [p for p in pics if p.embeds is None], grad=False)
        feats = [p.embeds for p in pics]
        deep = [p.deep for p in pics] if pics[0].deep is not None else None
    if at is None:
        at = [getattr(ps, "at", None) for ps in pictures_of]
    positions = None
    if _rope_index(model) is not None:
        positions = [rope_positions(model, s, ps, tid, at[i])
                     for i, (s, ps) in enumerate(zip(seqs, pictures_of))]
    return place(seqs, tid, feats, [[index[p.digest] for p in ps] for ps in pictures_of], positions, deep=deep,
                 at=at)


VISION_KEYS = ("vision/images", "vision/encoder_calls", "vision/image_tokens")


def vision_metrics(pictures_of: list[list[Picture]]) -> dict[str, float]:
    """A step's `vision/*`: its distinct images, the tower forwards they had (sampler's and learner's),
    and their placeholder tokens, each image counted once."""
    pics = {p.digest: p for ps in pictures_of for p in ps}
    calls: dict[str, int] = {}
    for ps in pictures_of:  # a digest may sit in several objects (rows of other rounds): count each once
        for p in ps:
            calls.setdefault(p.digest, 0)
    objs = {id(p): p for ps in pictures_of for p in ps}
    for p in objs.values():
        calls[p.digest] += p.calls
    return {"vision/images": float(len(pics)), "vision/encoder_calls": float(sum(calls.values())),
            "vision/image_tokens": float(sum(p.tokens for p in pics.values()))}

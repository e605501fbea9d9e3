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

`encode` and `place` build an `Images` from pixels with the model's own `get_image_features` and the
placeholder token; `sequence_embeds` is the naive reference's input (one sequence, E's graph kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from backstream.checks import UserError


@dataclass
class Images:
    embeds: Tensor
    rows: list[Tensor]
    positions: list[Tensor] | None = None
    gE: Tensor | None = field(default=None, repr=False)  # the engine's accumulator, while it runs

    def validate(self, sequences: list[Tensor]) -> None:
        """Shapes and ranges against the sequences; a clear error naming the argument otherwise."""
        if not isinstance(self.embeds, Tensor) or self.embeds.dim() != 2 or not self.embeds.dtype.is_floating_point:
            raise UserError(f"images.embeds: expected a floating [rows, hidden] tensor, got "
                            f"{getattr(self.embeds, 'shape', type(self.embeds).__name__)}")
        if not isinstance(self.rows, (list, tuple)) or len(self.rows) != len(sequences):
            raise UserError(f"images.rows: expected one tensor per sequence ({len(sequences)}), got "
                            f"{len(self.rows) if isinstance(self.rows, (list, tuple)) else type(self.rows).__name__}")
        R = self.embeds.shape[0]
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
        as a leaf (when a gradient is taken and the tower trains) whose gradient goes into gE."""
        img = ids < 0
        out = embed(ids.clamp_min(0))
        if not bool(img.any()):
            return out
        rows = (-ids[img] - 1).to(self.embeds.device)
        e = self.embeds.detach()[rows].to(out.dtype)
        if self.gE is not None and torch.is_grad_enabled():
            e.requires_grad_(True)
            gE = self.gE

            def deposit(x: Tensor) -> None:
                gE.index_add_(0, rows, x.grad.to(gE.dtype))
                x.grad = None

            hooks.append(e.register_post_accumulate_grad_hook(deposit))
        return out.masked_scatter(img[..., None].to(out.device), e.to(out.device))

    def start(self) -> None:
        """Before the backward: gE when the tower trains."""
        if self.embeds.requires_grad:
            self.gE = torch.zeros(self.embeds.shape, dtype=torch.promote_types(self.embeds.dtype, torch.float32),
                                  device=self.embeds.device)

    def finish(self) -> None:
        """After every block: the tower's backward, once."""
        gE, self.gE = self.gE, None
        if gE is not None and bool(gE.any()):
            torch.autograd.backward(self.embeds, gE.to(self.embeds.dtype))

    def sequence_embeds(self, embed: nn.Module, i: int, seq: Tensor) -> Tensor:
        """The naive reference's inputs_embeds [1, L, H] of sequence i: E's rows with their graph."""
        r = self.rows[i].to(seq.device)
        out = embed(seq[None])
        img = r >= 0
        if not bool(img.any()):
            return out
        e = self.embeds[r[img].to(self.embeds.device)].to(out.device, out.dtype)
        return out.masked_scatter(img[None, :, None], e)

    def position_ids(self, i: int, device) -> Tensor | None:
        """Sequence i's rotary positions as the model takes them ([n, 1, L]), or None (the default)."""
        return None if self.positions is None else self.positions[i][:, None].to(device)


def encode(model: nn.Module, pixel_values: Tensor, **kwargs) -> list[Tensor]:
    """The vision tower's output rows of each image ([n_k, H] per image, after the projector): the
    model's own `get_image_features` (transformers' VLM API), run once."""
    from backstream.stream.hf import base_model  # noqa: PLC0415

    base = base_model(model)
    out = base.get_image_features(pixel_values=pixel_values, return_dict=True, **kwargs)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    return list(feats) if isinstance(feats, (list, tuple)) else list(feats.unbind(0))


def place(sequences: list[Tensor], image_token_id: int, features: list[Tensor], images_of: list[list[int]],
          positions: list[Tensor] | None = None) -> Images:
    """`Images` for sequences whose image placeholders (`image_token_id`) read the rows of
    `features` (one [n_k, H] per unique image) in order: `images_of[i]` are the images of sequence i,
    in the order its placeholders appear. An image used by several sequences (a group's prompt) is
    one set of rows."""
    if len(images_of) != len(sequences):
        raise UserError(f"images_of: expected one list per sequence ({len(sequences)}), got {len(images_of)}")
    starts, at = [], 0
    for f in features:
        starts.append(at)
        at += f.shape[0]
    rows = []
    for i, (s, ks) in enumerate(zip(sequences, images_of)):
        slots = torch.nonzero(s == image_token_id).flatten()
        want = sum(features[k].shape[0] for k in ks)
        if len(slots) != want:
            raise UserError(f"sequences[{i}]: {len(slots)} image placeholder tokens, but its images "
                            f"{list(ks)} have {want} rows")
        r = torch.full(s.shape, -1, dtype=torch.long)
        if ks:
            r[slots.cpu()] = torch.cat([torch.arange(starts[k], starts[k] + features[k].shape[0]) for k in ks])
        rows.append(r)
    embeds = torch.cat(features) if features else torch.zeros(0, 1)
    return Images(embeds, rows, positions)

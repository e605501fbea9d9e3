"""How a streamed call gathers the parameters' gradients over its block batches (docs/design.md §5).

A streamed backward is many autograd calls, one per block batch, and each adds its share into the
parameters' gradients. Three things make that sum cheap and precise:
- `GradAccumulator`: a bfloat16/float16 parameter gathers its gradient in float32 and `.grad` is
  rounded once, at the end (one rounding instead of one per block batch);
- `SparseEmbeddingGrad`: the input embedding hands over the rows of each block's tokens, not a dense
  [vocab × hidden] table per block batch;
- `HeadGradInPlace`: the LM head's weight gradient is added into its accumulator by one in-place
  matrix product per block batch, not made whole first (a [vocab × hidden] tensor in flight).
With a 248,320-token vocabulary and hidden 1,024 (Qwen3.5's), each of the last two is 1 GiB of
float32 per block batch that is neither allocated nor written. `gathered_grads` puts them together.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backstream.stream import memory
from backstream.stream.hf import base_model


class GradAccumulator:
    """For the duration of a backward made of many autograd calls: every trainable parameter whose
    dtype is less precise than `dtype` gathers its gradient in a `dtype` buffer (a post-accumulate
    hook moves each block batch's `.grad` into it), and `.grad` receives the sum, rounded once, on
    exit (also after an exception: nothing accumulated is lost). A gradient already in `.grad`
    is the buffer's start, as plain accumulation would have it. No-op for dtype None."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None):
        self.params = [] if dtype is None else [
            p for p in model.parameters()
            if p.requires_grad and p.dtype.is_floating_point and torch.finfo(p.dtype).eps > torch.finfo(dtype).eps]
        self.managed = {id(p) for p in self.params}
        self.dtype, self.buf, self.handles = dtype, {}, []

    def _take(self, p: Tensor) -> None:
        g = p.grad
        if g is not None:
            b = self.buf.get(p)
            with memory.label("grad"):
                if b is None:  # dense from the start: a sparse embedding gradient adds its rows in place
                    b = torch.zeros(p.shape, dtype=self.dtype, device=p.device) if g.is_sparse else g.to(self.dtype)
                    if g.is_sparse:
                        b.add_(g)
                    self.buf[p] = b
                else:
                    b.add_(g)
            p.grad = None

    def target(self, p: Tensor) -> Tensor:
        """The dense tensor that `p`'s gradient is summed into: its buffer when this accumulator
        gathers it, else its `.grad` (zeros when it has none yet)."""
        if id(p) in self.managed:
            if p not in self.buf:
                with memory.label("grad"):
                    self.buf[p] = torch.zeros(p.shape, dtype=self.dtype, device=p.device)
            return self.buf[p]
        if p.grad is None:
            with memory.label("grad"):
                p.grad = torch.zeros_like(p)
            memory.tag(p.grad, "grad")
        return p.grad

    def __enter__(self) -> GradAccumulator:
        for p in self.params:
            self._take(p)
            self.handles.append(p.register_post_accumulate_grad_hook(self._take))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        while self.buf:  # each buffer goes as soon as its `.grad` is written: one at a time, not all
            p, b = self.buf.popitem()
            p.grad = b.to(p.dtype) if p.grad is None else p.grad + b.to(p.dtype)
            del b


class SparseEmbeddingGrad:
    """For the duration of a streamed call, the input embedding's backward hands over the rows of the
    block's tokens (`nn.Embedding.sparse`) instead of a dense [vocab × hidden] gradient per block
    batch: 1 GiB of zeros written and added at every block batch for a 248,320 × 1,024 float32 table
    (Qwen3.5's), where the rows are a few thousand. The table is read through a second leaf that shares
    its storage, so that with tied embeddings (the LM head's weight) the two gradients are not summed
    into one more dense [vocab × hidden] tensor per block batch either: the rows are added into the
    table's `.grad` once, on exit, which leaves it dense (optimizers take dense gradients). Not under
    FSDP (sharded tables), nor for an embedding that is not a plain `nn.Embedding` or takes no gradient."""

    def __init__(self, model: nn.Module, sharded: bool = False):
        base = base_model(model)
        emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
        ok = (type(emb) is nn.Embedding and emb.weight.requires_grad and not emb.sparse and not sharded
              and emb.max_norm is None and not emb.scale_grad_by_freq)
        self.emb = emb if ok else None

    def __enter__(self) -> SparseEmbeddingGrad:
        if self.emb is not None:
            self.table = self.emb.weight
            self.emb.weight = nn.Parameter(self.table.detach(), requires_grad=True)  # the same storage
            self.emb.sparse = True
        return self

    def __exit__(self, *exc) -> None:
        if self.emb is None:
            return
        rows, self.emb.weight, self.emb.sparse = self.emb.weight, self.table, False
        g = rows.grad
        if g is not None:
            with memory.label("grad"):
                g = g.to(self.table.dtype)
                if self.table.grad is None:
                    self.table.grad = g.to_dense() if g.is_sparse else g
                else:
                    self.table.grad.add_(g)  # in place, dense + sparse rows
            memory.tag(self.table.grad, "grad")


def head_in_place(model: nn.Module, sharded: bool = False) -> nn.Linear | None:
    """The LM head whose weight gradient `HeadGradInPlace` adds in place: a plain trainable
    `nn.Linear`, not under FSDP; else None (the planner counts the whole gradient then)."""
    base = base_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    ok = type(head) is nn.Linear and head.weight.requires_grad and not sharded
    return head if ok else None


class _HeadLinear(torch.autograd.Function):
    """`F.linear` whose backward adds the weight's gradient into `target(weight)` with one in-place
    product (addmm_) and hands autograd none for it; the input's and the bias's as usual."""

    @staticmethod
    def forward(ctx, x, weight, bias, target):
        ctx.save_for_backward(x)
        # the parameter itself, not a saved copy: saved tensors come back as other tensor objects
        # (saved-tensor hooks detach them), whose `.grad` is not the parameter's
        ctx.weight, ctx.target, ctx.bias = weight, target, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        (x,), weight = ctx.saved_tensors, ctx.weight
        acc = ctx.target(weight)
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        acc.addmm_(g2.t().to(acc.dtype), x2.to(acc.dtype))
        gx = (g2 @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gb = g2.sum(0) if ctx.bias and ctx.needs_input_grad[2] else None
        return gx, None, gb, None


class HeadGradInPlace:
    """For the duration of a streamed call, the LM head's weight gradient is summed in place into its
    accumulator (`GradAccumulator.target`: `.grad`, or the float32 buffer of a 16-bit model), one
    addmm_ per block batch, rather than made whole by autograd and added after: the [vocab × hidden]
    tensor in flight at every block batch (1 GiB at Qwen3.5's 248,320 × 1,024 in float32) is gone.
    The same sum of the same products; post-accumulate hooks do not see the head's weight (which is
    why this is not used under FSDP, whose reduction hooks on them)."""

    def __init__(self, model: nn.Module, accumulator: GradAccumulator, sharded: bool = False):
        self.head, self.acc = head_in_place(model, sharded), accumulator

    def __enter__(self) -> HeadGradInPlace:
        if self.head is not None:
            head, target = self.head, self.acc.target

            def forward(mod, x):
                return _HeadLinear.apply(x, mod.weight, mod.bias, target)

            self.saved = head.__dict__.get("forward")
            head.forward = types.MethodType(forward, head)
        return self

    def __exit__(self, *exc) -> None:
        if self.head is not None:
            if self.saved is None:
                del self.head.forward
            else:
                self.head.forward = self.saved


@contextlib.contextmanager
def gathered_grads(model: nn.Module, grad_dtype: torch.dtype | None, sharded: bool = False):
    """The three of the module docstring, for one streamed backward."""
    with SparseEmbeddingGrad(model, sharded) as emb, GradAccumulator(model, grad_dtype) as acc, \
            HeadGradInPlace(model, acc, sharded):
        yield emb

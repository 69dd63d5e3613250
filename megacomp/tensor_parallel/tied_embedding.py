"""One gradient buffer for a word embedding tied to the output layer: the lookup's backward adds into the output
layer's partial gradient instead of allocating its own.

A weight ``E`` ([V/tp, h] on each TP rank) used by the lookup ``x = E[ids]`` and by the output layer
``logits = h @ E^T`` gets two [V/tp, h] gradient contributions. Autograd's default: the output layer's
``dE_out = g^T h`` is computed at the start of backward and held in the weight's input buffer until the
lookup's backward, at the very end, allocates a second dense ``dE_emb`` (zeros, rows added per token); the two are
then summed. So two [V/tp, h] buffers are alive at once, which is what bounds LOMO's gradient memory from below
(benchmarks/results/memory). :class:`TiedEmbeddingGrad` keeps one:

  1. output layer: ``logits = F.linear(h, tied.output_weight(E))``. ``output_weight`` is an alias of ``E`` whose
     backward receives ``dE_out`` as autograd computed it, keeps a reference to it and passes it on to ``E``
     unchanged (so the engine holds it as ``E``'s first contribution, as in the default graph);
  2. lookup: ``x = tied.lookup(ids, E)`` (forward ``F.embedding(ids, E)``). Its backward sums the rows per distinct
     id into a small ``[U, h]`` tensor (``U`` distinct ids <= tokens; the same kernel as the default backward,
     ``aten.embedding_dense_backward``, over ids renumbered 0..U-1, so each row sums the same tokens in the same
     order), adds them into the kept ``dE_out`` in place (``index_add_`` with distinct rows: one addition per
     element) and returns no gradient for ``E``; the engine's buffer, which is that tensor, is now the full sum;
  3. a hook on ``E`` (before its accumulate-grad, before any post-accumulate hook such as LOMO's) checks that the
     gradient autograd hands to ``E`` is the tensor step 2 added into, and forgets the reference.

The backward order is fixed by the graph: the lookup's output feeds the layers that produce ``h``, so the output
layer's backward always runs before the lookup's. ``E``'s accumulate-grad and post-accumulate hooks run once, on
the complete gradient.

Precision: bit-identical to the default graph on CPU (tested, with repeated ids, TP 1 and 2): row ``k`` is
``dE_out[k] + (rows of the tokens with id k, summed in token order from 0)`` in both, an IEEE addition of the same
two numbers. The one difference: a ``-0.0`` element of ``dE_out`` in a row no token looks up stays ``-0.0`` here
(the default adds ``+0.0``), which compares equal and changes no update. On CUDA the same kernels run (not tested
here: no GPU in CI).

Memory: one [V/tp, h] buffer plus ``[U, h]`` row sums (no larger than the incoming [b, s, h] gradient).

Failure behaviour:
  - Another use of ``E`` in the same backward pass whose contribution reaches ``E`` between the two (an extra loss
    term on the embedding, two forwards summed into one loss) can make the engine sum out of place, so that the
    tensor step 2 added into is not ``E``'s gradient: the hook of step 3 raises RuntimeError (nothing is silently
    dropped; ``E`` then receives no gradient from that pass). One forward per backward pass is the supported use.
  - Without the output layer's contribution in the pass (logits not part of the loss) or with ``create_graph``,
    the lookup returns the default dense gradient and autograd sums as usual.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class _OutputWeight(torch.autograd.Function):
    """Alias of the tied weight for the output layer; backward keeps its gradient for the lookup (step 1)."""

    @staticmethod
    def forward(ctx, weight, tied):
        """``weight`` as a view (the output layer reads it unchanged)."""
        ctx.tied = tied
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        """Keep a reference to the output layer's partial gradient and pass it on unchanged."""
        ctx.tied.partial = grad
        return grad, None


class _Lookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds into the kept output-layer gradient (step 2)."""

    @staticmethod
    def forward(ctx, weight, ids, tied):
        """The rows of ``weight`` at ``ids``."""
        ctx.save_for_backward(ids)
        ctx.tied, ctx.num_weights = tied, weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        """Add the per-id row sums into the output layer's gradient in place (no gradient returned), or, without
        one, return the default dense gradient."""
        (ids,) = ctx.saved_tensors
        tied = ctx.tied
        partial, tied.partial = tied.partial, None
        if (partial is None or torch.is_grad_enabled() or partial.shape != (ctx.num_weights,) + grad.shape[-1:]
                or partial.dtype != grad.dtype or partial.device != grad.device or not partial.is_contiguous()):
            return torch.ops.aten.embedding_dense_backward(grad, ids, ctx.num_weights, -1, False), None, None
        rows, renumbered = torch.unique(ids, return_inverse=True)
        sums = torch.ops.aten.embedding_dense_backward(grad, renumbered, rows.numel(), -1, False)
        partial.index_add_(0, rows, sums)
        tied.merged = partial.data_ptr()
        return None, None, None


class TiedEmbeddingGrad:
    """The shared state of one tied weight (see the module docstring): the output layer's partial gradient of the
    current backward pass and the check of step 3. Build one per model, once; it registers a hook on ``weight``.

    Args:
        weight: the word embedding used by both the lookup and the output layer.
    """

    def __init__(self, weight: nn.Parameter) -> None:
        self.weight = weight
        self.partial: Optional[torch.Tensor] = None  # dE_out of this backward pass, until the lookup takes it
        self.merged: Optional[int] = None  # data_ptr of the tensor the lookup added into, until the hook checks it
        self._handle = weight.register_hook(self._check)

    def output_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The tied weight for the output layer (``F.linear(h, tied.output_weight(E))``)."""
        return _OutputWeight.apply(weight, self)

    def lookup(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, weight)``, with the backward of step 2."""
        return _Lookup.apply(weight, ids, self)

    def _check(self, grad: torch.Tensor) -> None:
        merged, self.merged, self.partial = self.merged, None, None
        if merged is not None and grad.data_ptr() != merged:
            raise RuntimeError(
                "tied word embedding: the lookup added its gradient into the output layer's partial gradient, but "
                "autograd summed that partial with another contribution out of place, so the lookup's part would be "
                "lost. The weight is used a third time in this backward pass (an extra loss term, or several forwards "
                "summed into one loss); run one forward per backward, or turn GPTConfig.tied_embedding_grad_in_place "
                "off")

    def remove(self) -> None:
        """Remove the hook on the weight (the model stops using this object)."""
        self._handle.remove()

"""Cross entropy over vocabulary-parallel logits, without gathering the logits.

Algorithm (per token, fp32): global max of the logits (all-reduce MAX) -> shift; then one all-reduce
SUM of [target logit, sum of exp, sum of logits] (each rank contributes its vocabulary slice) ->
``loss = log(sum_exp) - target_logit``; with label smoothing ``eps`` (as torch.nn.functional.cross_entropy
defines it) ``loss = (1 - eps) * loss + eps * (log(sum_exp) - mean_logit)``. Backward is local:
``softmax - (1 - eps) * onehot - eps / V``, written into the saved softmax (Megatron's memory saving: no
second logits-sized tensor) unless ``inplace_backward=False``, which keeps the graph valid for a second
backward (``retain_graph=True``, as LOMO's norm pass needs). The all-reduces carry 1-3 floats per token and stay
uncompressed (a codec cannot save anything there). Targets outside ``[0, V)`` raise ValueError.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group, inplace_backward):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        per_rank = logits.shape[-1]
        vocab = per_rank * world
        if target.shape != logits.shape[:-1]:
            raise ValueError(f"target shape {tuple(target.shape)} must equal the logits' leading dims "
                             f"{tuple(logits.shape[:-1])}")
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab):
            raise ValueError(f"targets must lie in [0, {vocab}), got [{int(target.min())}, {int(target.max())}]")
        x = logits.float()
        lmax = x.max(dim=-1).values
        comm.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group, tag="tp_cross_entropy")
        x = x - lmax.unsqueeze(-1)
        start = rank * per_rank
        outside = (target < start) | (target >= start + per_rank)
        local = (target - start).masked_fill(outside, 0)
        picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = x.exp()
        sums = torch.stack([picked, exp.sum(-1), x.sum(-1) if label_smoothing else torch.zeros_like(picked)])
        comm.all_reduce(sums, group=group, tag="tp_cross_entropy")
        picked, sum_exp, sum_logits = sums.unbind(0)
        log_z = sum_exp.log()
        loss = log_z - picked
        if label_smoothing:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sum_logits / vocab)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, outside)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits.dtype
        ctx.inplace_backward = inplace_backward
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        eps = ctx.label_smoothing
        g = softmax if ctx.inplace_backward else softmax.clone()
        hit = (~outside).to(g.dtype) * (1.0 - eps)
        g.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        if eps:
            g -= eps / ctx.vocab
        g.mul_(grad.unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, tp_group=None,
                                 inplace_backward: bool = True) -> torch.Tensor:
    """Per-token loss from logits split over the TP group along the last (vocabulary) dim.

    ``vocab_parallel_logits``: ``[..., V / tp]`` (rank r holds vocabulary entries ``r*V/tp ...``);
    ``target``: ``[...]`` global ids. Returns ``[...]`` fp32 losses (reduce them yourself).
    ``tp_group=None`` means the parallel_state façade's TP group; ``inplace_backward=False`` lets the graph be
    backpropagated twice (see the module docstring). Steps: see the module docstring. The two
    all-reduces are uncompressed, so the loss equals the gathered-logits cross entropy up to fp32 round-off.

    Raises:
        ValueError: ``label_smoothing`` outside ``[0, 1)``; ``target``'s shape differs from the logits'
            leading dims; a target outside ``[0, V)``.
        RuntimeError: ``tp_group=None`` and the parallel_state façade is not initialised.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if tp_group is None:
        from .. import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, tp_group,
                                            inplace_backward)

"""What every optimizer family of the loop builds its optimizer from: the weight-decay groups, the
model-parallel norm's group and per-parameter weights, and the parameters whose reduction waits for a
model-parallel sum (megacomp.optimizer.model_grads)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ...optimizer.model_grads import sequence_parallel_params, tied_embedding_weight


@dataclass
class OptimizerInputs:
    """The arguments the optimizer families share.

    Attributes:
        groups: torch param groups: matrices with the configured weight decay, vectors without.
        norm_group: the model-parallel group of the global gradient norm (None for TP = PP = 1).
        norm_weight: each parameter's weight in that norm (TP-replicated ones 1/TP, tied halves 1/2 each).
        deferred: parameters whose gradients are summed over another group before the DP reduction.
    """

    groups: list
    norm_group: Optional[object]
    norm_weight: Callable
    deferred: list


def optimizer_inputs(run) -> OptimizerInputs:
    """:class:`OptimizerInputs` of ``run``'s model, groups and config."""
    g, params = run.groups, list(run.model.parameters())
    tied = tied_embedding_weight(run.model, g)
    tp = g.tp_size

    def norm_weight(p) -> float:  # each parameter counts once in the model-parallel norm
        w = 1.0 if getattr(p, "tensor_model_parallel", False) else 1.0 / tp
        return w * (0.5 if p is tied else 1.0)

    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": run.cfg.training.weight_decay},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    deferred = ([tied] if tied is not None else []) + sequence_parallel_params(run.model, g,
                                                                               run.cfg.parallel.sequence_parallel)
    return OptimizerInputs(groups, g.mp if g.tp_size * g.pp_size > 1 else None, norm_weight, deferred)

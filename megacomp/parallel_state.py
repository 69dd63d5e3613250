"""Process groups for tensor (TP), pipeline (PP) and data (DP) parallelism.

Rank layout follows Megatron ("tp-dp-pp"): tensor-parallel ranks are adjacent, then data-parallel,
then pipeline stages:

    global_rank = tp_rank + tp_size * (dp_rank + dp_size * pp_rank)

so with 8 ranks, TP 2, PP 2 (DP 2): TP groups ``[0,1] [2,3] [4,5] [6,7]``; DP groups ``[0,2] [1,3] [4,6] [5,7]``;
PP groups ``[0,4] [1,5] [2,6] [3,7]``.

:class:`ProcessGroups` is the explicit object layers and optimizers take; the module-level functions
are a Megatron-style façade over one default instance for scripts that expect
``parallel_state.get_tensor_model_parallel_group()``. Layers never read the façade on their own when
given groups explicitly.

Every group built here takes a collective timeout: ``distributed_timeout_minutes`` when given (Megatron-core's
argument), else the default (world) group's (:func:`default_group_timeout`, which ``--distributed-timeout-minutes``
sets). torch's ``new_group`` without ``timeout=`` would fall back to its own 30-minute default, so a stalled rank
would keep the others waiting in a TP, DP or PP collective long after the world group had given up.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def rank_grid(world_size: int, tp: int, pp: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(tp_groups, dp_groups, pp_groups) as lists of global ranks for the layout above.

    Raises:
        ValueError: ``tp`` or ``pp`` < 1, or ``world_size`` not divisible by ``tp * pp``.
    """
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor/pipeline parallel sizes must be >= 1, got TP {tp}, PP {pp}")
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
                         f"pipeline_model_parallel_size ({pp}) = {tp * pp}; choose sizes whose product divides "
                         f"the number of ranks")
    dp = world_size // (tp * pp)
    rank = lambda t, d, p: t + tp * (d + dp * p)  # noqa: E731
    tp_groups = [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)]
    dp_groups = [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)]
    pp_groups = [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]
    return tp_groups, dp_groups, pp_groups


@dataclass
class ProcessGroups:
    """The groups this rank belongs to, with their sizes, ranks and members (global ranks)."""

    tp: Optional[dist.ProcessGroup]
    """Tensor-parallel group (adjacent ranks)."""
    dp: Optional[dist.ProcessGroup]
    """Data-parallel group (same TP rank and stage)."""
    pp: Optional[dist.ProcessGroup]
    """Pipeline group (same TP and DP rank, one rank per stage)."""
    tp_ranks: list[int] = field(default_factory=list)
    """Global ranks of this rank's TP group, in TP-rank order."""
    dp_ranks: list[int] = field(default_factory=list)
    """Global ranks of this rank's DP group."""
    pp_ranks: list[int] = field(default_factory=list)
    """Global ranks of this rank's pipeline, stage 0 first."""
    mp: Optional[dist.ProcessGroup] = None
    """Model-parallel group: every TP and PP rank holding one model replica (for the global grad norm)."""
    embedding: Optional[dist.ProcessGroup] = None
    """First and last stage of this rank's pipeline (tied embedding grads); None with one stage or when
    this rank is a middle stage."""

    @property
    def tp_size(self) -> int:
        """Ranks in the TP group (``len(tp_ranks)``)."""
        return len(self.tp_ranks)

    @property
    def dp_size(self) -> int:
        """Ranks in the DP group (``len(dp_ranks)``)."""
        return len(self.dp_ranks)

    @property
    def pp_size(self) -> int:
        """Pipeline stages (``len(pp_ranks)``)."""
        return len(self.pp_ranks)

    @property
    def tp_rank(self) -> int:
        """This process's position in ``tp_ranks``. Raises ValueError when it is not a member or
        torch.distributed is not initialised."""
        return self.tp_ranks.index(dist.get_rank())

    @property
    def dp_rank(self) -> int:
        """This process's position in ``dp_ranks``. Raises ValueError when it is not a member or
        torch.distributed is not initialised."""
        return self.dp_ranks.index(dist.get_rank())

    @property
    def pp_rank(self) -> int:
        """This process's stage, its position in ``pp_ranks``. Raises ValueError when it is not a member
        or torch.distributed is not initialised."""
        return self.pp_ranks.index(dist.get_rank())

    def destroy(self) -> None:
        """Destroy every group held here (a group held under two names only once) and set the group fields
        to None; the rank lists stay."""
        for g in {id(g): g for g in (self.tp, self.dp, self.pp, self.mp, self.embedding) if g is not None}.values():
            dist.destroy_process_group(g)
        self.tp = self.dp = self.pp = self.mp = self.embedding = None


def default_group_timeout() -> timedelta:
    """The collective timeout of the default (world) group: what ``init_process_group(timeout=...)`` (and so
    ``--distributed-timeout-minutes``) set. Read from the group's backend options; torch's default for the
    backend when the backend does not expose it.

    Raises:
        RuntimeError: torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: no default group to read the timeout of")
    group = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):  # no backend for this device, or no options
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return dist.distributed_c10d._get_default_timeout(dist.get_backend())


def group_timeout(distributed_timeout_minutes: Optional[float] = None) -> timedelta:
    """``distributed_timeout_minutes`` as a timedelta, or the default group's timeout when it is None.

    Raises:
        ValueError: a timeout that is not > 0.
    """
    if distributed_timeout_minutes is None:
        return default_group_timeout()
    if not distributed_timeout_minutes > 0:
        raise ValueError(f"distributed_timeout_minutes must be > 0, got {distributed_timeout_minutes}")
    return timedelta(minutes=distributed_timeout_minutes)


def build_process_groups(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                         distributed_timeout_minutes: Optional[float] = None) -> ProcessGroups:
    """Create every TP, DP and PP group (a collective call: all ranks must call it with the same sizes).

    Every rank creates every group in the same order (torch.distributed requires it) and keeps its own;
    also builds the model-parallel group and, with more than one stage, the first/last-stage embedding group.
    Every group gets the timeout of :func:`group_timeout` (``distributed_timeout_minutes``, else the world
    group's): a rank that stops answering makes the others' collectives fail after at most that long.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: sizes below 1, or a world size not divisible by TP x PP (see :func:`rank_grid`), or a
            timeout that is not > 0.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call megacomp.launch.init_distributed() (or "
                           "torch.distributed.init_process_group) before building model-parallel groups")
    timeout = group_timeout(distributed_timeout_minutes)
    world, me = dist.get_world_size(), dist.get_rank()
    grids = rank_grid(world, tensor_model_parallel_size, pipeline_model_parallel_size)
    mine = []
    for groups in grids:
        found = None
        for ranks in groups:  # every rank creates every group, in the same order
            g = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                found = (g, ranks)
        mine.append(found)
    (tp, tp_r), (dp, dp_r), (pp, pp_r) = mine
    mp = emb = None
    for ranks in model_parallel_groups(world, tensor_model_parallel_size, pipeline_model_parallel_size):
        g = dist.new_group(ranks, timeout=timeout)
        if me in ranks:
            mp = g
    for ranks in grids[2]:  # embedding groups: first and last stage of every pipeline
        if len(ranks) > 1:
            g = dist.new_group([ranks[0], ranks[-1]], timeout=timeout)
            if me in (ranks[0], ranks[-1]):
                emb = g
    return ProcessGroups(tp, dp, pp, tp_r, dp_r, pp_r, mp, emb)


def model_parallel_groups(world_size: int, tp: int, pp: int) -> list[list[int]]:
    """Ranks of each model replica (same DP rank), for the layout in the module docstring. The sizes are
    not validated here (:func:`rank_grid` does)."""
    dp = world_size // (tp * pp)
    return [[t + tp * (d + dp * p) for p in range(pp) for t in range(tp)] for d in range(dp)]


# -- Megatron-style façade -----------------------------------------------------------------------------
_GROUPS: Optional[ProcessGroups] = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              distributed_timeout_minutes: Optional[float] = None) -> ProcessGroups:
    """Build the groups and make them the default for the getters below; returns them. Every group takes
    ``distributed_timeout_minutes`` (None: the world group's timeout; see :func:`build_process_groups`).

    Raises:
        RuntimeError: the groups are already initialised (call destroy_model_parallel() first), or
            torch.distributed is not.
        ValueError: sizes that do not fit the world size (see :func:`rank_grid`), or a timeout that is not > 0.
    """
    global _GROUPS
    if _GROUPS is not None:
        raise RuntimeError("model parallel groups are already initialised; call destroy_model_parallel() first")
    _GROUPS = build_process_groups(tensor_model_parallel_size, pipeline_model_parallel_size,
                                   distributed_timeout_minutes)
    return _GROUPS


def model_parallel_is_initialized() -> bool:
    """Whether initialize_model_parallel() has run (and destroy_model_parallel() not since)."""
    return _GROUPS is not None


def get_process_groups() -> ProcessGroups:
    """The default groups set by initialize_model_parallel().

    Raises:
        RuntimeError: they are not initialised.
    """
    if _GROUPS is None:
        raise RuntimeError("model parallel groups are not initialised: call "
                           "megacomp.parallel_state.initialize_model_parallel(tp, pp), or pass groups explicitly")
    return _GROUPS


def destroy_model_parallel() -> None:
    """Destroy the default groups, if any, and clear the façade (a no-op when there are none)."""
    global _GROUPS
    if _GROUPS is not None:
        _GROUPS.destroy()
    _GROUPS = None


def get_tensor_model_parallel_group():
    """The default TP group. Raises RuntimeError when not initialised (see get_process_groups)."""
    return get_process_groups().tp


def get_tensor_model_parallel_rank() -> int:
    """This rank's TP rank. Raises RuntimeError when not initialised (see get_process_groups)."""
    return get_process_groups().tp_rank


def get_tensor_model_parallel_world_size() -> int:
    """The TP size. Raises RuntimeError when not initialised (see get_process_groups)."""
    return get_process_groups().tp_size


def get_data_parallel_group():
    """The default DP group. Raises RuntimeError when not initialised (see get_process_groups)."""
    return get_process_groups().dp


def get_data_parallel_rank() -> int:
    """This rank's DP rank. Raises RuntimeError when not initialised (see get_process_groups)."""
    return get_process_groups().dp_rank


def get_data_parallel_world_size() -> int:
    """The DP size. Raises RuntimeError when not initialised (see get_process_groups)."""
    return get_process_groups().dp_size


def get_pipeline_model_parallel_group():
    """The default pipeline group. Raises RuntimeError when not initialised (see get_process_groups)."""
    return get_process_groups().pp


def get_pipeline_model_parallel_rank() -> int:
    """This rank's pipeline stage. Raises RuntimeError when not initialised (see get_process_groups)."""
    return get_process_groups().pp_rank


def get_pipeline_model_parallel_world_size() -> int:
    """The number of pipeline stages. Raises RuntimeError when not initialised (see get_process_groups)."""
    return get_process_groups().pp_size

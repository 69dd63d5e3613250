"""Replica groups for local-step (outer-loop) training: the data-parallel ranks split into R replicas.

Megatron rank order (TP fastest, then DP, then PP) is kept; each data-parallel group of D ranks (equal TP
and PP rank) is cut into R replicas of D / R consecutive data-parallel ranks:

    inner group   the D / R ranks of one replica (the sharded optimizer's group inside the replica)
    outer group   the R ranks, one per replica, with the same position inside their replicas (the group
                  the pseudo-gradients cross: equal model-parallel and inner-DP ranks of every replica)

Every rank creates every group in the same order (torch.distributed.new_group is collective over the
world), so the call must be made on all ranks. Every group takes the world group's collective timeout
(megacomp.parallel_state.group_timeout), as the TP/DP/PP groups do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ..parallel_state import ProcessGroups, group_timeout, rank_grid


@dataclass
class ReplicaGroups:
    """This rank's replica, its inner data-parallel group and its outer group."""

    num_replicas: int
    """R: model replicas that synchronise every H steps."""
    replica: int
    """This rank's replica index in [0, R)."""
    inner: Optional[dist.ProcessGroup]
    """The data-parallel ranks of this replica (size D / R)."""
    outer: Optional[dist.ProcessGroup]
    """One rank per replica at this rank's position (size R)."""
    inner_ranks: list
    """Global ranks of ``inner``."""
    outer_ranks: list
    """Global ranks of ``outer`` (replica order)."""


def build_replica_groups(groups: ProcessGroups, num_replicas: int) -> ReplicaGroups:
    """Split the data-parallel dimension of ``groups`` into ``num_replicas`` replicas (see the module docstring).

    Raises:
        ValueError: ``num_replicas`` < 1, or not dividing the data-parallel size (the message names both and
            the world's layout)."""
    world, tp, pp, dp = dist.get_world_size(), groups.tp_size, groups.pp_size, groups.dp_size
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if dp % num_replicas:
        raise ValueError(f"num_replicas {num_replicas} does not divide the data-parallel size {dp} (world {world} = "
                         f"TP {tp} x PP {pp} x DP {dp}); use a divisor of {dp} or change the layout")
    per = dp // num_replicas
    me = dist.get_rank()
    _, dp_groups, _ = rank_grid(world, tp, pp)
    timeout = group_timeout()  # torch's own default for a new group would be 30 minutes
    out = {}
    for ranks in dp_groups:  # every rank creates every group, in the same order
        for r in range(num_replicas):
            members = ranks[r * per:(r + 1) * per]
            g = dist.new_group(members, timeout=timeout)
            if me in members:
                out["inner"], out["inner_ranks"], out["replica"] = g, members, r
        for j in range(per):
            members = [ranks[r * per + j] for r in range(num_replicas)]
            g = dist.new_group(members, timeout=timeout)
            if me in members:
                out["outer"], out["outer_ranks"] = g, members
    return ReplicaGroups(num_replicas, out["replica"], out["inner"], out["outer"], out["inner_ranks"],
                         out["outer_ranks"])

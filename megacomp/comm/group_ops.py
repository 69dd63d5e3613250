"""Who serves a process group's calls: torch.distributed, or the process-group object's own methods.

megacomp's collectives call the torch.distributed functions with ``group=``. That needs a group registered with
torch.distributed (``init_process_group``, ``new_group``). A process-group OBJECT that torch.distributed does not
know serves collectives only through its methods: torchft's reconfigurable ``ProcessGroupGloo`` (its members
change at every quorum, it is configured by torchft's ``Manager``, not by ``new_group``) is the case this exists
for. Handed to torch.distributed such a group fails (``No backend type associated with device type cpu``: its
flat all-gather is not one of the methods it serves; ``get_rank(group)``: the group is not registered).

The seam: :func:`get_rank`, :func:`get_world_size`, :func:`get_backend`, :func:`all_reduce`,
:func:`all_gather_into_tensor`, :func:`reduce_scatter_tensor` and :func:`all_to_all_single` take the group as
torch.distributed does. For a registered group (or None) they make exactly the torch.distributed call with the
same arguments, so nothing changes there (bit-identical: it is the same call). For an :class:`ObjectGroup` they
call the object's c10d methods (``allreduce``, ``allgather_into_tensor_coalesced``, ``alltoall_base``).
:func:`as_group` wraps an unregistered ``ProcessGroup`` object in an :class:`ObjectGroup`, so
``Channel(..., group=torchft_pg)`` works as written.

What an object group does not serve: point-to-point calls (megacomp's p2p and the duplex transport; the
collectives use the object's all-to-all instead) and the error probe's reference collective. Asking for them
raises ValueError naming the call.

Failure behaviour: an object group's collectives raise what its methods raise (torchft: an error after a peer
died or the group's timeout passed); nothing is retried here, the caller (megacomp.integrations.torchft) reports
the error to its quorum manager.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


class ObjectGroup:
    """A process group served by its own c10d methods (see the module docstring).

    Args:
        pg: a ``torch.distributed.ProcessGroup`` object (torchft's ``ProcessGroupGloo`` after its quorum), or any
            object with the same ``size()``, ``allreduce``, ``allgather_into_tensor_coalesced`` and ``alltoall_base``.

    The rank is read at every call, as the group may have been reconfigured since: torchft's wrappers answer
    ``rank()`` with 0 and keep the configured group as ``parent``, whose rank is the member's; other objects
    answer ``rank()`` themselves. Subclasses (megacomp.integrations.torchft.ReplicaGroup) may override
    :meth:`rank`, :meth:`size` and :meth:`wait`.
    """

    def __init__(self, pg) -> None:
        self.pg = pg

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pg!r})"

    def rank(self) -> int:
        """This member's rank in the group now."""
        parent = getattr(self.pg, "parent", None)  # torchft's ProcessGroupWrapper: the configured group
        return parent.rank() if parent is not None else self.pg.rank()

    def size(self) -> int:
        """The group's size now."""
        return self.pg.size()

    def backend(self) -> str:
        """The object's backend name (torchft: ``torchft-gloo``)."""
        return self.pg.getBackendName()

    def wait(self, work) -> None:
        """Wait for ``work`` of this group (raises what the backend raises)."""
        work.wait()


def as_group(group):
    """``group`` as the seam serves it: an unregistered ``ProcessGroup`` object wrapped in :class:`ObjectGroup`;
    None, a registered group or an ObjectGroup unchanged."""
    if group is None or isinstance(group, ObjectGroup):
        return group
    if isinstance(group, dist.ProcessGroup) and group not in c10d._world.pg_map:  # torch.distributed's registry
        return ObjectGroup(group)
    return group


def is_object_group(group) -> bool:
    """Whether ``group`` is served by its own methods (an :class:`ObjectGroup`)."""
    return isinstance(group, ObjectGroup)


def require_registered(group, what: str) -> None:
    """Raise ValueError when ``what`` (a point-to-point call, the probe) is asked of an object group."""
    if isinstance(group, ObjectGroup):
        raise ValueError(f"megacomp.comm.{what}: the group {group} is a process-group object (e.g. torchft's), which "
                         f"serves collectives only; use a torch.distributed group for {what}")


def get_world_size(group=None) -> int:
    """``torch.distributed.get_world_size(group)``."""
    return group.size() if isinstance(group, ObjectGroup) else dist.get_world_size(group)


def get_rank(group=None) -> int:
    """``torch.distributed.get_rank(group)``: the rank in the group."""
    return group.rank() if isinstance(group, ObjectGroup) else dist.get_rank(group)


def get_backend(group=None) -> str:
    """``torch.distributed.get_backend(group)``; an object group's backend name."""
    return group.backend() if isinstance(group, ObjectGroup) else dist.get_backend(group)


def member_ranks(group) -> list[int]:
    """Global rank of every member in group-rank order; an object group's members are named by their rank in it
    (torchft: the replica's rank in the quorum)."""
    if isinstance(group, ObjectGroup):
        return list(range(group.size()))
    return [dist.get_global_rank(group, r) if group is not None else r for r in range(dist.get_world_size(group))]


class _ObjectWork:
    """The work of an object group's collective, with a step to run after the wait (AVG's division)."""

    def __init__(self, group: ObjectGroup, work, then=None) -> None:
        self._group, self._work, self._then = group, work, then

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            work, self._work = self._work, None
            self._group.wait(work)
            if self._then is not None:
                self._then()
        return True

    def is_completed(self) -> bool:
        return self._work is None


def _finish(work: _ObjectWork, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """``torch.distributed.all_reduce``. On an object group AVG runs as SUM then a division by the group size
    (gloo has no AVG), as torchft's ``Manager.allreduce`` does."""
    if not isinstance(group, ObjectGroup):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    avg = op == dist.ReduceOp.AVG
    opts = c10d.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM if avg else op
    size = group.size()
    then = (lambda: tensor.div_(size)) if avg else None
    return _finish(_ObjectWork(group, group.pg.allreduce([tensor], opts), then), async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor`` (torch 2.13: ``all_gather_single``)."""
    if not isinstance(group, ObjectGroup):
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(output, input, group=group, async_op=async_op)
    work = group.pg.allgather_into_tensor_coalesced([output], [input], c10d.AllgatherOptions())
    return _finish(_ObjectWork(group, work), async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """``torch.distributed.reduce_scatter_tensor`` (torch 2.13: ``reduce_scatter_single``). On an object group
    (torchft's gloo serves no reduce-scatter) an all-reduce of a copy of the input, of which this rank keeps its
    chunk: the same sums, ``world`` times the bytes; the compressed reduce-scatter never takes this path (it moves
    encoded bytes by all-to-all)."""
    if not isinstance(group, ObjectGroup):
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return fn(output, input, op=op, group=group, async_op=async_op)
    full = input.detach().reshape(-1).clone()
    work = all_reduce(full, op, group, async_op=True)
    m, r = output.numel(), group.rank()
    return _finish(_ObjectWork(group, work, lambda: output.view(-1).copy_(full[r * m:(r + 1) * m])), async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[Sequence[int]] = None,
                      input_split_sizes: Optional[Sequence[int]] = None, group=None, async_op: bool = False):
    """``torch.distributed.all_to_all_single`` (split sizes count rows of dim 0)."""
    if not isinstance(group, ObjectGroup):
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)
    work = group.pg.alltoall_base(output, input, list(output_split_sizes or []), list(input_split_sizes or []),
                                  c10d.AllToAllOptions())
    return _finish(_ObjectWork(group, work), async_op)

"""Every rank's own state in a checkpoint that only one rank writes.

Error-feedback residuals differ per rank (each rank compresses its own gradients), but Lightning's DDP and
model-parallel strategies and Accelerate's ``save_state`` write the non-model part of a checkpoint from rank 0
only. :class:`PerRankState` wraps any object with ``state_dict`` / ``load_state_dict`` (megacomp's
``CompressedHookState``, ``FSDPCompression``): its ``state_dict`` gathers every rank's state to every rank
(a collective: call it on all ranks, as both frameworks do when they save), its ``load_state_dict`` hands each
rank its own entry back.

:class:`DDPHookRankState` is the same for megacomp's DDP hook state, plus what a resume into a fresh DDP needs:
DDP's first iteration buckets the gradients in its initial order (reverse parameter order) and only then
rebuilds its buckets in gradient-ready order, the layout the saved residuals belong to (their keys name the
bucket index and size, which both layouts can share); so after loading, the hook's ``start_iter`` moves to the
first resumed iteration, which averages uncompressed, and compression with the restored residuals continues
from the second. A resumed run therefore differs from an uninterrupted one by that one exact step.

Failure behaviour: loading with another world size raises ValueError (error-feedback residuals do not
reshard); the wrapped object's own checks (codec, units) raise as they do.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Union

import torch.distributed as dist


class PerRankState:
    """A stateful object's per-rank state, gathered for saving and split again for loading.

    Args:
        obj: the object, or a zero-argument callable returning it (for objects built later, e.g. in a
            LightningModule's ``configure_model``).
        group: the ranks whose states are kept (default: the world).
    """

    def __init__(self, obj: Union[Any, Callable[[], Any]], group=None) -> None:
        self._obj, self.group = obj, group

    @property
    def obj(self) -> Any:
        """The wrapped object (the callable's result when built from one)."""
        return self._obj() if callable(self._obj) and not hasattr(self._obj, "state_dict") else self._obj

    def state_dict(self) -> dict[str, Any]:
        """``{"world": n, "ranks": [state of rank 0, ..., state of rank n-1]}``, gathered on every rank."""
        mine = self.obj.state_dict()
        world = dist.get_world_size(self.group)
        states = [None] * world
        dist.all_gather_object(states, mine, group=self.group)
        return {"world": world, "ranks": states}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give the wrapped object this rank's entry. ValueError: saved with another world size."""
        world = dist.get_world_size(self.group)
        if state["world"] != world:
            raise ValueError(f"megacomp: this checkpoint holds error-feedback state of {state['world']} ranks, this "
                             f"run has {world}; resume with {state['world']} ranks (residuals do not reshard)")
        self.obj.load_state_dict(state["ranks"][dist.get_rank(self.group)])


class DDPHookRankState(PerRankState):
    """:class:`PerRankState` of a ``CompressedHookState`` (megacomp.optimizer.ddp_hook) that a fresh DDP resumes
    with (see the module docstring: the first resumed iteration is uncompressed)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's hook state, then keep the fresh DDP's first (initial-layout) iteration uncompressed."""
        super().load_state_dict(state)
        hook = self.obj
        hook.start_iter = max(hook.start_iter, hook.iteration + 1)

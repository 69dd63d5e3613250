"""Every rank's own state in a checkpoint that only one rank writes.

Error-feedback residuals differ per rank (each rank compresses its own gradients), but Lightning's DDP and
model-parallel strategies and Accelerate's ``save_state`` write the non-model part of a checkpoint from rank 0
only. :class:`PerRankState` wraps any object with ``state_dict`` / ``load_state_dict`` (megacomp's
``CompressedHookState``, ``FSDPCompression``): its ``state_dict`` gathers every rank's state to every rank
(a collective: call it on all ranks, as both frameworks do when they save), its ``load_state_dict`` hands each
rank its own entry back.

megacomp's DDP hook state needs nothing more: it keys each bucket's residuals by the bucket's parameters and reduces
a fresh DDP's first iteration in the saved bucket layout (megacomp.optimizer.ddp_hook), so a resumed run continues
bit for bit.

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


"""Overlapped parameter all-gather of the sharded optimizer (Megatron's ``--overlap-param-gather``).

Without it, ``step()`` ends by all-gathering every bucket's updated shards into the model (the next forward waits
for all of them). With :meth:`ParamGather.overlap_param_gather` (given the model):
  1. ``step()`` launches every bucket's all-gather asynchronously (``param_codec`` on compressed buckets: encoded at
     launch, decoded when finished) into a side buffer, in the order the model's forward first needs the buckets
     (by the position of their first parameter in ``model.parameters()``), and returns;
  2. a forward pre-hook on each module that owns parameters finishes, in launch order, the pending all-gathers up
     to the last bucket that module needs, and copies them into the parameters; so the wire time of later buckets
     overlaps the forward of earlier layers;
  3. anything else that reads the parameters first calls :meth:`ParamGather.wait_params` (``step()``,
     ``state_dict()``, ``load_state_dict()``, ``load_params_from_model()`` and ``sync_params()`` do).
Results and bytes are the synchronous all-gather's bit for bit (the same collectives on the same inputs, finished
in the same order on every rank). Assumption: a parameter's first use in a forward is inside a forward of the module
that owns it (true of megacomp's models; a root module's own parameters are waited for when the root's forward
starts). A parameter whose gradient arrives while its bucket is still pending was read stale: backward raises
RuntimeError naming this.

Mixin of DistributedOptimizer: reads ``buckets``, ``masters``, ``param_channel``, ``_param_plain``, ``group``,
``sharded``, ``hierarchy``, ``_validated``; DistributedOptimizer.__init__ sets ``_prefetch`` (False), ``_pending``
(bucket index -> (full buffer, work), in launch order) and ``_gather_order``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..comm.spans import span


class ParamGather:
    """The asynchronous parameter all-gather and the forward pre-hooks that wait for it (see the module docstring)."""

    def overlap_param_gather(self, model: nn.Module) -> None:
        """From now on, ``step()`` leaves the parameter all-gather in flight and ``model``'s forward waits for each
        bucket where it needs it. Raises ValueError for an unsharded or hierarchical optimizer, or when some managed
        parameter is not in ``model``."""
        if self._prefetch:
            raise ValueError("overlap_param_gather was already called on this optimizer (its hooks are in place)")
        if not self.sharded or self.hierarchy is not None:
            raise ValueError("overlap_param_gather needs the sharded, flat DistributedOptimizer (shard=True, no "
                             "hierarchy): there is nothing to all-gather otherwise, or it runs in two stages")
        order = {id(p): i for i, p in enumerate(model.parameters())}
        missing = sum(id(p) not in order for b in self.buckets for p in b.params)
        if missing:
            raise ValueError(f"overlap_param_gather: {missing} parameters of this optimizer are not in the model given; "
                             f"pass the module whose forward uses them")
        owner = {id(p): b.index for b in self.buckets for p in b.params}
        self._gather_order = sorted(self.buckets, key=lambda b: min(order[id(p)] for p in b.params))
        self._pending = {}
        self._prefetch_hooks = []
        for m in model.modules():
            own = {owner[id(p)] for p in m.parameters(recurse=False) if id(p) in owner}
            if own:
                self._prefetch_hooks.append(m.register_forward_pre_hook(self._make_prefetch_hook(own)))
        self._prefetch = True

    def _make_prefetch_hook(self, needed: set):
        def hook(module, args) -> None:
            if self._pending:
                self._finish_param_gathers(needed)
        return hook

    def _launch_param_gathers(self) -> None:
        """Start every bucket's all-gather (asynchronously, in forward order) into a side buffer."""
        for b in self._gather_order:
            master = self.masters[b.index]
            dtype = b.params[0].dtype
            full = torch.empty(b.padded, dtype=dtype, device=master.device)
            ch = self.param_channel if b.compressed else self._param_plain
            work = ch.all_gather_into_tensor(full, master.detach().to(dtype), group=self.group, async_op=True,
                                             validate=not self._validated)
            self._pending[b.index] = (full, work)

    def _finish_param_gathers(self, needed: Optional[set] = None) -> None:
        """Finish pending all-gathers in launch order, up to the last of ``needed`` (all when None), each copied into
        its parameters."""
        left = None if needed is None else {i for i in needed if i in self._pending}
        if left is not None and not left:
            return
        with span("param_all_gather"), torch.no_grad():
            for index in list(self._pending):
                full, work = self._pending.pop(index)
                if work is not None:  # a group of one rank: torch returns no handle
                    work.wait()
                b = self.buckets[index]
                for p, o in zip(b.params, b.offsets):
                    p.copy_(full[o:o + p.numel()].view_as(p))
                if left is not None:
                    left.discard(index)
                    if not left:
                        return

    def wait_params(self) -> None:
        """Finish every parameter all-gather in flight (the parameters then hold the last step's values)."""
        if self._pending:
            self._finish_param_gathers(None)

    def _check_not_pending(self, b) -> None:
        """Backward of a parameter whose bucket is still being gathered: its forward read stale values."""
        if self._pending and b.index in self._pending:
            raise RuntimeError("overlap_param_gather: a gradient arrived for a parameter whose all-gather had not been "
                               "waited for, so its forward read the previous step's values; a module used a parameter "
                               "it does not own before that owner's forward ran. Call optimizer.wait_params() before "
                               "such a forward, or do not overlap the parameter all-gather")

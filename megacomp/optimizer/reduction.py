"""The backward half of megacomp.optimizer.DistributedOptimizer: flat gradient buckets filled by hooks and reduced
over the data-parallel group.

Per backward, a post-accumulate-grad hook adds each ``param.grad`` (divided by the loss scale) into its bucket's
fp32 buffer and frees ``param.grad``. When a bucket is complete on the last micro-batch (outside
:meth:`GradientReduction.no_sync`), its reduction starts at once, asynchronously, so it overlaps the rest of
backward: a reduce-scatter into this rank's shard (``shard=True``; hierarchical or PowerSGD variants), or an
all-reduce of the whole bucket (``shard=False``). ``step()`` (in distributed_optimizer.py) launches the buckets
that got no gradient or are deferred, waits for every reduction and averages.

:class:`GradientReduction` is a mixin: it holds no state of its own and reads what
DistributedOptimizer.__init__ sets (``buckets``, ``group``, ``world``, ``sharded``, ``shard_index``, ``parts``,
``hierarchy``, ``grad_channel``, ``_grad_plain``, ``scaler``, ``step_count``, ``skipped_steps``,
``grad_codec_warmup_steps``, ``_accumulating``, ``_validated``). Subclasses change what a bucket's reduction is by
overriding ``_launch`` (the 1-bit family does).

Failure behaviour: a gradient arriving for a bucket already being reduced, or twice in one communicating backward,
raises RuntimeError (call ``step()`` after each backward or wrap the accumulation backwards in ``no_sync()``);
``main_grad`` of a parameter the optimizer does not manage raises KeyError.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..comm import AccordionChannel, Channel, LowRankChannel
from .buckets import Bucket


class GradientReduction:
    """Backward hooks, bucket reductions and buffer resets of the DistributedOptimizer (see the module docstring)."""

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 accumulated gradient of ``param`` (a view into its bucket), valid between backward and
        step. Reduce it over extra groups here only for ``deferred_params``."""
        for b in self.buckets:
            for p, o in zip(b.params, b.offsets):
                if p is param:
                    return b.grad[o:o + p.numel()].view(p.shape)
        raise KeyError("parameter is not managed by this DistributedOptimizer")


    # -- backward ---------------------------------------------------------------------------------
    def _make_hook(self, b: Bucket, i: int):
        p, o = b.params[i], b.offsets[i]

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            if b.work is not None or (not self._accumulating and i in b.ready):
                raise RuntimeError("DistributedOptimizer: a gradient arrived for a bucket that is already being "
                                   "reduced (or was already reported in this step); call step() after each "
                                   "backward, or wrap the accumulation backwards in optimizer.no_sync()")
            scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
            b.grad[o:o + p.numel()].add_(param.grad.reshape(-1).float(), alpha=scale)
            param.grad = None
            if self._accumulating:
                return
            b.ready.add(i)  # counted on the communicating backward only
            if len(b.ready) == len(b.params) and not b.deferred:
                self._launch(b)
        return hook

    def _launch(self, b: Bucket) -> None:
        # counted in attempted steps (skipped ones too), so every rank switches on the same step
        warm = self.step_count + self.skipped_steps < self.grad_codec_warmup_steps
        ch = self.grad_channel if b.compressed and not warm else self._grad_plain
        if isinstance(ch, AccordionChannel):
            ch = ch.channel_for(f"dp_gradient/b{b.index}")
        if not self.sharded:  # every rank reduces (and later updates) the whole bucket
            b.reduced = b.grad
            b.work = ch.all_reduce(b.grad, group=self.group, async_op=True, key=f"dp_gradient/b{b.index}",
                                   validate=not self._validated) or comm.CompressedWork(lambda: None)
            return
        b.reduced = torch.empty(b.padded // self.world, dtype=torch.float32, device=b.grad.device)
        if isinstance(ch, LowRankChannel):
            self._launch_low_rank(b, ch)
            return
        if self.hierarchy is not None:
            self._launch_hierarchical(b, ch)
            return
        b.work = ch.reduce_scatter_tensor(b.reduced, b.grad, group=self.group, async_op=True,
                                          key=f"dp_gradient/b{b.index}", validate=not self._validated)
        if b.work is None:  # a group of one rank: torch returns no handle
            b.work = comm.CompressedWork(lambda: None)

    def _launch_low_rank(self, b: Bucket, ch: LowRankChannel) -> None:
        """PowerSGD: all-reduce the bucket's matrices in low rank (in this thread, so it cannot race another
        bucket's collective on gloo), then keep this rank's shard."""
        views = [b.grad[o:o + p.numel()].view(p.shape) for p, o in zip(b.params, b.offsets)]
        ch.all_reduce_coalesced(views, group=self.group, key=f"dp_gradient/b{b.index}", validate=not self._validated)
        b.reduced.copy_(b.grad[slice(*b.shard_range(self.shard_index, self.parts))])
        b.work = comm.CompressedWork(lambda: None)

    def _launch_hierarchical(self, b: Bucket, ch: Channel) -> None:
        """Full precision inside a node (fast links), the codec across nodes (slow links): ZeRO++ qgZ/hpZ."""
        intra, inter = self.hierarchy
        partial = torch.empty(b.padded // dist.get_world_size(intra), dtype=torch.float32, device=b.grad.device)
        first = comm.reduce_scatter_tensor(partial, b.grad, group=intra, async_op=True, tag="dp_gradient_intra",
                                           validate=not self._validated)

        def finish() -> None:
            if first is not None:
                first.wait()
            ch.reduce_scatter_tensor(b.reduced, partial, group=inter, key=f"dp_gradient/b{b.index}",
                                     validate=not self._validated)
        b.work = comm.CompressedWork(finish)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients of the backwards inside without communicating (all but the last micro-batch)."""
        old, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = old

    # -- step -------------------------------------------------------------------------------------
    def _finish_reduction(self) -> list[torch.Tensor]:
        for b in self.buckets:  # buckets whose params got no gradient this step: launch in a fixed order
            if b.work is None:
                self._launch(b)
        shards = []
        for b in self.buckets:
            b.work.wait()
            b.work = None
            shard = b.reduced.mul_(1.0 / self.world)
            start, end = b.shard_range(self.shard_index, self.parts)
            if end > b.numel:  # padding carries no gradient (a sign codec would decode 0 as +scale)
                shard[max(b.numel - start, 0):].zero_()
            if self._accordion_active() and b.compressed:
                self.grad_channel.observe(f"dp_gradient/b{b.index}", shard, replicated=False)
            shards.append(shard)
        return shards

    def _accordion_active(self) -> bool:
        """Accordion counts the steps its codecs run (not the uncompressed warm-up)."""
        return (isinstance(self.grad_channel, AccordionChannel)
                and self.step_count + self.skipped_steps >= self.grad_codec_warmup_steps)


    def _reset(self) -> None:
        for b, m in zip(self.buckets, self.masters):
            b.grad.zero_()
            b.ready.clear()
            b.reduced = None
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (finishing any reduction already in flight, so ranks stay in step)."""
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            for p in b.params:
                p.grad = None
        self._reset()


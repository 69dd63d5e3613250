"""The backward half of megacomp.optimizer.DistributedOptimizer: flat gradient buckets filled by hooks and reduced
over the data-parallel group.

ZeRO-1 (``zero_stage=1``). Per backward, a post-accumulate-grad hook adds each ``param.grad`` (divided by the loss
scale) into its bucket's persistent fp32 buffer and frees ``param.grad``. When a bucket is complete on the last
micro-batch (outside :meth:`GradientReduction.no_sync`), its reduction starts at once, asynchronously, so it
overlaps the rest of backward: a reduce-scatter into this rank's shard (``shard=True``; hierarchical or PowerSGD
variants), or an all-reduce of the whole bucket (``shard=False``). ``step()`` (in distributed_optimizer.py)
launches the buckets that got no gradient or are deferred, waits for every reduction and averages.

ZeRO-2 (``zero_stage=2``), per backward (every micro-batch; ``no_sync`` changes nothing):
  1. the hook adds the gradient into the bucket's full-size fp32 buffer, allocated zeroed at the bucket's first
     gradient of this backward (after reaping a finished reduction, see 3);
  2. when the bucket's last parameter reported, its reduce-scatter is launched: first the reduction still in
     flight is waited for and added into its shard (at most one in flight), then this one starts into a fresh
     shard-sized output (the accumulated shard itself on the bucket's first reduction of the step, a temporary
     added into it later otherwise) and the bucket drops its buffer: a compressed reduce-scatter encodes on launch,
     so the buffer is freed now; torch's uncompressed one reads it until it finishes;
  3. before a new buffer is allocated, a reduction the backend reports finished is completed (no waiting);
  4. after the backward (an autograd-engine callback queued by the first hook), buckets that got only some of
     their gradients are launched as in 2, in bucket order;
  5. ``step()`` launches what is left (deferred buckets, buckets that got no gradient this step: zeros, as
     ZeRO-1), waits for everything, then proceeds as ZeRO-1 on the accumulated shards.
Deferred buckets keep their persistent buffer and are reduced once, in ``step()``, as under ZeRO-1. Error
feedback: the bucket's one key ``dp_gradient/b<i>/worker`` is updated by each reduction in turn (the residual of
micro-batch m is compensated in micro-batch m + 1), inside ``ErrorFeedback.deferred_count`` so that a step counts
once (LoCo's reset period stays in steps); ``step()`` counts them.

:class:`GradientReduction` is a mixin: it reads what DistributedOptimizer.__init__ sets (``buckets``, ``group``,
``world``, ``sharded``, ``shard_index``, ``parts``, ``hierarchy``, ``grad_channel``, ``_grad_plain``, ``scaler``,
``step_count``, ``skipped_steps``, ``grad_codec_warmup_steps``, ``zero_stage``, ``device``, ``_accumulating``,
``_validated``, ``_in_flight``, ``_end_queued``, ``_codec_stream``).

Side stream (``codec_stream``): each bucket's launch runs on megacomp.comm.codec_stream's side stream, after an
event marking its gradients complete, and its handle joins that stream (an event wait) before the result is read. Subclasses change what a bucket's reduction is by overriding
``_launch`` (the 1-bit family does, under ZeRO-1 only).

Failure behaviour: ZeRO-1: a gradient arriving for a bucket already being reduced, or twice in one communicating
backward, raises RuntimeError (call ``step()`` after each backward or wrap the accumulation backwards in
``no_sync()``). ZeRO-2: a gradient arriving twice for a parameter before its bucket was reduced (a backward that
ended without its callback, e.g. after an exception) raises RuntimeError asking for ``zero_grad()``; ``main_grad``
of a parameter that is not deferred raises RuntimeError. ``main_grad`` of a parameter the optimizer does not manage
raises KeyError. Every rank must give gradients to the same parameters in each backward (as under ZeRO-1), else the
ranks launch different collectives.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..comm import Channel
from ..comm.codec_stream import JoinedWork
from ..comm.spans import span
from .buckets import Bucket


class GradientReduction:
    """Backward hooks, bucket reductions and buffer resets of the DistributedOptimizer (see the module docstring)."""

    def main_grad(self, param: nn.Parameter) -> torch.Tensor:
        """The fp32 accumulated gradient of ``param`` (a view into its bucket), valid between backward and
        step. Reduce it over extra groups here only for ``deferred_params``.

        Raises:
            KeyError: ``param`` is not managed by this optimizer.
            RuntimeError: under ZeRO-2 for a parameter that is not deferred (its bucket's full-size gradient is
                freed once reduce-scattered; pass it in ``deferred_params`` to keep it until ``step()``)."""
        for b in self.buckets:
            for p, o in zip(b.params, b.offsets):
                if p is param:
                    if b.grad is None and self.zero_stage == 2 and not b.deferred:
                        raise RuntimeError("DistributedOptimizer(zero_stage=2) frees a bucket's full-size gradient "
                                           "once it is reduce-scattered, so only deferred_params have a main_grad "
                                           "between backward and step(); pass this parameter in deferred_params")
                    return b.grad[o:o + p.numel()].view(p.shape)
        raise KeyError("parameter is not managed by this DistributedOptimizer")

    # -- backward ---------------------------------------------------------------------------------
    def _make_hook(self, b: Bucket, i: int):
        p, o = b.params[i], b.offsets[i]
        stage2 = self.zero_stage == 2

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            if self._pending:  # overlap_param_gather: this parameter's forward must have waited for its bucket
                self._check_not_pending(b)
            scale = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
            if stage2 and not b.deferred:
                if i in b.ready:
                    raise RuntimeError("DistributedOptimizer(zero_stage=2): a parameter's gradient arrived twice "
                                       "before its bucket was reduced (a backward ended without its end-of-backward "
                                       "callback, e.g. after an exception); call zero_grad() before the next backward")
                if b.grad is None:  # this backward's full-size buffer, freed when its reduce-scatter starts/ends
                    self._reap()  # a finished reduction lets go of its buffer before this one is allocated
                    b.grad = self._grad_buffer(b)
                b.grad[o:o + p.numel()].add_(param.grad.reshape(-1).float(), alpha=scale)
                param.grad = None
                b.ready.add(i)
                self._queue_end_of_backward()
                if len(b.ready) == len(b.params):
                    self._launch(b)
                return
            if stage2:  # a deferred bucket: accumulated whole over the micro-batches, reduced in step()
                b.grad[o:o + p.numel()].add_(param.grad.reshape(-1).float(), alpha=scale)
                param.grad = None
                return
            if b.work is not None or (not self._accumulating and i in b.ready):
                raise RuntimeError("DistributedOptimizer: a gradient arrived for a bucket that is already being "
                                   "reduced (or was already reported in this step); call step() after each "
                                   "backward, or wrap the accumulation backwards in optimizer.no_sync()")
            b.grad[o:o + p.numel()].add_(param.grad.reshape(-1).float(), alpha=scale)
            param.grad = None
            if self._accumulating:
                return
            b.ready.add(i)  # counted on the communicating backward only
            if len(b.ready) == len(b.params) and not b.deferred:
                self._launch(b)
        return hook

    def _grad_buffer(self, b: Bucket) -> torch.Tensor:
        """A zeroed full-size fp32 gradient buffer for ``b`` (ZeRO-2 allocates one per backward that fills it)."""
        return torch.zeros(b.padded, dtype=torch.float32, device=self.device)

    def _queue_end_of_backward(self) -> None:
        # once per backward: the engine runs the callback after the last hook of this backward pass
        if not self._end_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True

    def _end_of_backward(self) -> None:
        """ZeRO-2, after each backward: reduce-scatter the buckets that got only some of their gradients (parameters
        unused by this micro-batch, or a model chunk of the interleaved schedule), in bucket order on every rank,
        so no full-size buffer outlives the backward that filled it."""
        self._end_queued = False
        for b in self.buckets:
            if b.ready and not b.deferred:
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        # counted in attempted steps (skipped ones too), so every rank switches on the same step
        warm = self.step_count + self.skipped_steps < self.grad_codec_warmup_steps
        ch = self.grad_channel if b.compressed and not warm else self._grad_plain
        ch = ch.level_for(f"dp_gradient/b{b.index}")  # Accordion: the level of this bucket's regime
        if b.compressed and not warm and self.grad_channel.adaptive:  # Accordion, norm_of local: the unreduced bucket
            self.grad_channel.observe_local(f"dp_gradient/b{b.index}", b.grad)
        if not self.sharded:  # every rank reduces (and later updates) the whole bucket
            b.reduced = b.grad
            with self._on_codec_stream(b):
                b.work = ch.all_reduce(b.grad, group=self.group, async_op=True, key=f"dp_gradient/b{b.index}",
                                       validate=not self._validated) or comm.CompressedWork(lambda: None)
            self._joined(b)
            return
        stage2 = self.zero_stage == 2
        if stage2:
            self._finish_in_flight()  # one reduction in flight at a time: its full-size buffer goes before this one
            if b.grad is None:  # no gradient this step (launched by step()): reduce zeros, as ZeRO-1 does
                b.grad = self._grad_buffer(b)
        out = torch.empty(b.padded // self.world, dtype=torch.float32, device=self.device)
        if stage2 and b.reduced is not None:  # a later micro-batch: into a temporary, added when it arrives
            b.pending = out
        else:
            b.reduced = out
        with self._counting_per_step(stage2), self._on_codec_stream(b):
            if ch.low_rank:
                self._launch_low_rank(b, ch, out)
            elif self.hierarchy is not None:
                self._launch_hierarchical(b, ch, out)
            else:
                b.work = ch.reduce_scatter_tensor(out, b.grad, group=self.group, async_op=True,
                                                  key=f"dp_gradient/b{b.index}", validate=not self._validated)
                if b.work is None:  # a group of one rank: torch returns no handle
                    b.work = comm.CompressedWork(lambda: None)
        self._joined(b)
        if stage2:
            self._hand_off(b, ch)

    def _on_codec_stream(self, b: Bucket):
        """The launch of ``b``'s reduction on the side stream (``codec_stream``; megacomp.comm.codec_stream): its
        codec kernels run beside the rest of backward, after the bucket's gradients (an event), never waiting on the
        host. The gradient buffer is kept from the allocator until the side stream is done (ZeRO-2 frees it now)."""
        if self._codec_stream is None:
            return contextlib.nullcontext()
        return self._codec_stream.launching(f"b{b.index}", keep=(b.grad,))

    def _joined(self, b: Bucket) -> None:
        """``b.work`` made to join the side stream first when waited for (before its result is read)."""
        if self._codec_stream is not None:
            b.work = JoinedWork(self._codec_stream, f"b{b.index}", b.work)

    def _hand_off(self, b: Bucket, ch) -> None:
        """ZeRO-2, after a bucket's reduce-scatter started: the bucket lets go of its full-size buffer (the next
        gradients start a fresh one) and the reduction's handle adds its output into the accumulated shard when
        it is waited for (:meth:`_finish_in_flight`). The buffer stays referenced until then only where the
        backend still reads it after the launch (torch's uncompressed reduce-scatter, the hierarchical intra-node
        stage); a compressed reduce-scatter has encoded it already, so it is freed now."""
        inner = b.work
        held = b.grad if self.hierarchy is not None or not ch.compresses(b.padded) else None
        if not b.deferred:
            b.grad = None
        b.ready.clear()

        def finish() -> None:
            nonlocal held
            with self._counting_per_step(True):  # the hierarchical inter-node stage encodes here
                inner.wait()
            held = None
            if b.pending is not None:
                b.reduced.add_(b.pending)
                b.pending = None
        b.work = comm.CompressedWork(finish)
        self._in_flight.append((b, inner))

    def _finish_in_flight(self) -> None:
        """Wait for the ZeRO-2 reductions in flight, in launch order (the same on every rank)."""
        for b, _ in self._in_flight:
            b.work.wait()
            b.work = None
        self._in_flight.clear()

    def _reap(self) -> None:
        """Finish the ZeRO-2 reduction in flight if the backend says it is done (no waiting): then its full-size
        buffer is freed before backward allocates the next one, and the peak is one buffer, not two, whenever the
        wire keeps up with backward. Only a backend handle (torch's uncompressed reduce-scatter) can report done
        early; finishing it is a local add, so ranks may reap at different moments without changing the order of
        their collectives (megacomp's compressed handles report done only once waited for)."""
        if self._in_flight and self._in_flight[0][1].is_completed():
            self._finish_in_flight()

    def _counting_per_step(self, stage2: bool):
        """ZeRO-2 reduces a bucket once per micro-batch: its error-feedback updates count as one update per optimizer
        step (step() counts them), so LoCo's periodic reset keeps its period in steps (ErrorFeedback.deferred_count)."""
        if stage2 and self.ef is not None:
            return self.ef.deferred_count()
        return contextlib.nullcontext()

    def _launch_low_rank(self, b: Bucket, ch, out: torch.Tensor) -> None:
        """PowerSGD: all-reduce the bucket's matrices in low rank (in this thread, so it cannot race another
        bucket's collective on gloo), then keep this rank's shard."""
        views = [b.grad[o:o + p.numel()].view(p.shape) for p, o in zip(b.params, b.offsets)]
        ch.all_reduce_coalesced(views, group=self.group, key=f"dp_gradient/b{b.index}", validate=not self._validated)
        out.copy_(b.grad[slice(*b.shard_range(self.shard_index, self.parts))])
        b.work = comm.CompressedWork(lambda: None)

    def _launch_hierarchical(self, b: Bucket, ch: Channel, out: torch.Tensor) -> None:
        """Full precision inside a node (fast links), the codec across nodes (slow links): ZeRO++ qgZ/hpZ."""
        intra, inter = self.hierarchy
        partial = torch.empty(b.padded // dist.get_world_size(intra), dtype=torch.float32, device=self.device)
        first = comm.reduce_scatter_tensor(partial, b.grad, group=intra, async_op=True, tag="dp_gradient_intra",
                                           validate=not self._validated)

        def finish() -> None:
            if first is not None:
                first.wait()
            ch.reduce_scatter_tensor(out, partial, group=inter, key=f"dp_gradient/b{b.index}",
                                     validate=not self._validated)
        b.work = comm.CompressedWork(finish)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients of the backwards inside without communicating (all but the last micro-batch).
        Under ZeRO-2 every backward reduce-scatters its buckets anyway (that is what frees them), so this only
        keeps code written for ZeRO-1 working."""
        old, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = old

    # -- step -------------------------------------------------------------------------------------
    def _finish_reduction(self) -> list[torch.Tensor]:
        """Every bucket's reduced shard for this step, averaged over the group (launching what backward did not)."""
        if self.zero_stage == 2:
            for b in self.buckets:  # a bucket backward left filled (its end-of-backward callback did not run)
                if b.grad is not None and not b.deferred:
                    self._launch(b)
            for b in self.buckets:  # deferred buckets, and buckets that got no gradient this step
                if b.reduced is None:
                    self._launch(b)
            with span("reduce_wait"):
                self._finish_in_flight()
            if self.ef is not None:
                self.ef.count_deferred()  # one error-feedback update per bucket and step (see _counting_per_step)
        else:
            for b in self.buckets:  # buckets whose params got no gradient this step: launch in a fixed order
                if b.work is None:
                    self._launch(b)
            with span("reduce_wait"):
                for b in self.buckets:
                    b.work.wait()
                    b.work = None
        shards = []
        for b in self.buckets:
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
        return (self.grad_channel.adaptive
                and self.step_count + self.skipped_steps >= self.grad_codec_warmup_steps)

    def _reset(self) -> None:
        for b, m in zip(self.buckets, self.masters):
            if self.zero_stage == 2 and not b.deferred:
                b.grad = None
            else:
                b.grad.zero_()
            b.ready.clear()
            b.reduced = b.pending = None
            m.grad = None
        self._in_flight.clear()
        self._end_queued = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (finishing any reduction already in flight, so ranks stay in step)."""
        self._finish_in_flight()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            for p in b.params:
                p.grad = None
        if self.ef is not None and self.zero_stage == 2:
            self.ef.count_deferred()  # the reductions that happened count, as they would under ZeRO-1
        self._reset()

"""The same gradient compression for plain torch DDP users, as a communication hook.

    from megacomp.optimizer import CompressedHookState, compressed_allreduce_hook
    ddp.register_comm_hook(CompressedHookState(codec="int4", error_feedback="loco"), compressed_allreduce_hook)

Each DDP bucket is averaged with megacomp's compressed all-reduce (encode -> all-to-all -> fp32 sum ->
re-encode -> all-gather, with a worker and a server error per bucket under error feedback; two ranks
exchange their whole encodings instead, one quantization and a worker error only). The hook
issues the collective and returns a future that a background thread completes (wait, decode), so the
transfer overlaps the rest of backward. That is safe where the completion issues no backend
collective: two ranks (one phase), or megacomp's tagged p2p transport on gloo (the second phase's
messages are matched by tag, whatever thread posts them). Otherwise (``overlap=False``, or NCCL with
more than two ranks) the hook finishes the all-reduce before returning: issuing a backend collective
from another thread would race the main thread's (the failure torch's own PowerSGD hook shows on gloo).
Buckets below ``min_compress_numel`` elements (the channel's small-tensor rule), and the first
``start_iter`` iterations (DDP rebuilds its buckets after iteration 1), use the plain all-reduce. The
state's ``channel`` (megacomp.comm.Channel, built from these fields) owns the error feedback, one key
per bucket.
``codec=None`` is bit-identical to DDP's default hook (divide by the world size, then all-reduce SUM).

PowerSGD (``codec={"name": "powersgd", "rank": 4}`` or a ``PowerSGD``): the state's channel is a
megacomp.comm.LowRankChannel; each bucket's parameters are read as matrices (views of the bucket buffer)
and reduced with PowerSGD (error feedback and warm-start Q per parameter, keys ``ddp_bucket<i>:<numel>/<j>``).
That exchange runs in the hook's own thread, so it works on gloo with any number of buckets (torch's
PowerSGD hook does not: its second all-reduce runs in a callback thread and races the next bucket's);
it does not overlap the rest of backward.

Accordion (``codec={"name": "accordion", "low": ..., "high": ...}``; megacomp.comm.AccordionChannel): each
bucket is reduced with the level its regime picks, completed in the hook (the policy reads the reduced
bucket), and the regimes are decided at the first bucket of every ``interval``-th compressed iteration (the
hook cannot see an optimizer's skipped steps; a GradScaler's inf bucket then enters that interval's norms).
"""
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm import make_channel, use_duplex
from ..compression import CodecLike, is_accordion, is_low_rank, make_low_rank

log = logging.getLogger("megacomp")


@dataclass
class CompressedHookState:
    """Settings and error-feedback state of :func:`compressed_allreduce_hook`."""

    codec: CodecLike = None
    """Codec of the gradient all-reduce (None: uncompressed), or PowerSGD settings (see the module docstring)."""
    error_feedback: Any = None
    """'ef', 'loco', an ErrorFeedbackConfig or an ErrorFeedback (one error per bucket)."""
    process_group: Optional[dist.ProcessGroup] = None
    """Group to average over (default: the world)."""
    min_compress_numel: int = 65536
    """Smaller buckets are averaged uncompressed."""
    start_iter: int = 2
    """Iterations run uncompressed first (DDP finalises its bucket layout after iteration 1)."""
    overlap: bool = True
    """Finish each compressed all-reduce (wait, decode, and for more than two ranks the second phase) in a
    background thread, so the transfer overlaps the rest of backward. Only where that finish issues no
    backend collective (megacomp's tagged p2p transport on gloo, or two ranks); otherwise, and with
    False, the hook completes the all-reduce before returning."""
    iteration: int = field(default=0, init=False)
    """Iterations seen (counted on bucket 0)."""

    def __post_init__(self) -> None:
        low_rank = make_low_rank(self.codec) if is_low_rank(self.codec) else None
        stateful = is_accordion(self.codec) or (low_rank is not None and (low_rank.error_feedback or low_rank.warm_start))
        if stateful and self.start_iter < 2:
            raise ValueError(f"powersgd/accordion keep state per bucket and parameter (residual, Q), and DDP rebuilds its "
                             f"buckets after iteration 1: start_iter must be >= 2, got {self.start_iter} (or turn off "
                             f"error_feedback and warm_start)")
        self.channel = make_channel("dp_gradient", self.codec, group=self.process_group,
                                    error_feedback=self.error_feedback, min_compress_numel=self.min_compress_numel,
                                    error_feedback_arg="the hook's error_feedback")
        self.codec, self.error_feedback = self.channel.codec, self.channel.error_feedback
        self.plain = self.channel.uncompressed()

    def state_dict(self) -> dict:
        """Iteration count, codec and error-feedback state (load with :meth:`load_state_dict`)."""
        out = {"iteration": self.iteration, "codec": self.codec.to_dict(),
               "error_feedback": self.error_feedback.state_dict() if self.error_feedback else None}
        if self.channel.reduces_whole_buckets:  # Q matrices, regimes (the residuals above)
            out["low_rank"] = self.channel.state_dict(error_feedback=False)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; raises ValueError when it was saved with another codec."""
        if state["codec"] != self.codec.to_dict():
            raise ValueError(f"hook state was saved with codec {state['codec']}, this hook uses {self.codec.to_dict()}")
        self.iteration = state["iteration"]
        if self.error_feedback is not None and state["error_feedback"] is not None:
            self.error_feedback.load_state_dict(state["error_feedback"])
        if self.channel.reduces_whole_buckets:
            self.channel.load_state_dict(state["low_rank"])


def compressed_allreduce_hook(state: CompressedHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket.buffer()`` over the group with ``state.codec``."""
    buf = bucket.buffer()
    if bucket.index() == 0:
        state.iteration += 1
        if state.channel.adaptive and state.iteration > state.start_iter + 1:
            state.channel.end_step(state.process_group)  # the previous iteration is complete on every rank
    world = dist.get_world_size(state.process_group)
    lossy = state.channel.compresses(buf.numel()) and state.iteration > state.start_iter
    buf.div_(world)  # divide first, as DDP's default hook does (no fp16 overflow in the sum)
    key = f"ddp_bucket{bucket.index()}:{buf.numel()}"
    validate = state.iteration == state.start_iter + 1
    if not lossy:
        work = state.plain.all_reduce(buf, validate=False, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    channel = state.channel.level_for(key)  # Accordion: the level of this bucket's regime
    fut = torch.futures.Future()
    if channel.low_rank:
        channel.all_reduce_coalesced(_param_views(bucket, buf), key=key, validate=validate)
        work = None
    else:
        work = channel.all_reduce(buf, key=key, validate=validate, async_op=True)
    if state.channel.adaptive:  # the policy reads the reduced bucket: finish here
        if work is not None:
            work.wait()
        state.channel.observe(key, buf, replicated=True)
    if work is None or state.channel.adaptive:
        fut.set_result(buf)
    elif state.overlap and (world == 2 or use_duplex(state.process_group, channel.options.duplex, buf.device)):
        threading.Thread(target=_finish, args=([work], buf, fut), daemon=True,
                         name=f"megacomp-ddp-bucket{bucket.index()}").start()
    else:
        _finish([work], buf, fut)
    return fut


def _param_views(bucket, buf: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's gradient as a view of the bucket buffer (DDP lays them out back to back, in
    ``bucket.parameters()`` order)."""
    views, pos = [], 0
    for p in bucket.parameters():
        views.append(buf[pos:pos + p.numel()].view(p.shape))
        pos += p.numel()
    if pos != buf.numel():
        raise RuntimeError(f"DDP bucket {bucket.index()} holds {buf.numel()} elements but its parameters {pos}; "
                           f"this torch version lays buckets out differently, so powersgd cannot read its matrices")
    return views


def _finish(box: list, buf: torch.Tensor, fut: torch.futures.Future) -> None:
    """Complete the compressed all-reduce held in ``box`` and hand the bucket to DDP (errors reach DDP through the
    future). The work is released before the future completes: once it does, DDP's backward, the step and maybe
    ``destroy_process_group`` go on in the main thread, and a backend work object freed later on this thread (the
    thread's arguments live until it ends) can outlive its process group and abort the process at exit."""
    work = box.pop()
    try:
        work.wait()
    except BaseException as e:  # DDP re-raises it from the future in finalize_backward
        del work
        fut.set_exception(e)
        return
    del work
    fut.set_result(buf)

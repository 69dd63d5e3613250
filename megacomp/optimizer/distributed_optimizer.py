"""ZeRO-1 / ZeRO-2 sharded optimizer with compressed gradient reduce-scatter and parameter all-gather.

Algorithm per step, over the data-parallel group of N ranks:
  1. backward (megacomp.optimizer.reduction): a post-accumulate-grad hook adds each ``param.grad`` (divided by
     the loss scale) into its bucket's fp32 buffer and frees ``param.grad``. When a bucket is complete on the
     last micro-batch (outside :meth:`no_sync`), its reduce-scatter starts at once, asynchronously (it overlaps
     the rest of backward): with ``grad_codec`` it is megacomp's compressed reduce-scatter (per-destination
     encode [+ error feedback per bucket] -> all-to-all -> fp32 sum), else torch's.
  2. ``step()``: waits for the reduce-scatters, averages (/N), checks inf/NaN across the group (skips the
     step on overflow, backs off the loss scale; error feedback drops non-finite residuals by itself),
     clips by the global gradient norm, steps ``optimizer_class`` on this rank's fp32 master shard, then
     all-gathers the updated parameters (with ``param_codec``, e.g. int8 blocks as in ZeRO++ qwZ) into
     the model parameters.

ZeRO-2 (``zero_stage=2``; megacomp.optimizer.reduction has the details): gradients are sharded as they are produced.
Every backward (micro-batch) fills a fresh full-size fp32 buffer per bucket; when a bucket is complete its
reduce-scatter starts and the buffer is released (at once when the reduce-scatter is compressed, which encodes it on
launch; when the reduction finishes otherwise), and the reduced shard is added into this rank's fp32 gradient shard,
the only gradient storage that persists between micro-batches. At most one reduction is in flight (the next bucket's
launch waits for it; a finished one is reaped before backward allocates a buffer), so the full-size buffers alive
are the buckets backward is filling plus at most one uncompressed reduce-scatter's input: with gradients arriving in
bucket order, one filling bucket per stream of buckets (a bucket holds one param group's parameters, and with a
codec only matrices or only 1-D parameters, so e.g. the small bias / norm bucket fills alongside the matrices' over
the whole backward). ``step()`` is then ZeRO-1's on the accumulated shards. Bytes on the wire per step: M
reduce-scatters per bucket for M micro-batches instead of one, i.e. (M - 1) x ZeRO-1's dp_gradient bytes more
(uncompressed: (M - 1) (N - 1) / N x 4 bytes per gradient element and rank); the parameter all-gather is unchanged.
Results: with one micro-batch per step bit-identical to ZeRO-1 (same reductions of the same buffers); with M > 1 the
sum over ranks and micro-batches is taken in another order (micro-batches of each rank first under ZeRO-1, ranks
first under ZeRO-2), so an element of the averaged gradient may differ by fp32 round-off: both are sums of the same
NM fp32 terms, each within gamma(NM - 1) x sum|g| of the exact sum (gamma(k) = k u / (1 - k u), u = 2^-24, any
summation tree), so they differ by at most 2 gamma(NM - 1) x sum|g| / N (plus one rounding of the 1 / N scaling when
N is not a power of two; checked in tests/test_optimizer_zero2.py; exact when the sums are, e.g. integer-valued
gradients). Error feedback keeps one residual per compressed bucket, updated by each micro-batch's reduction in
turn; it covers the whole bucket, as under ZeRO-1, and persists (fp32 by default: with error feedback ZeRO-2 saves
the gradient buffers' bytes but keeps residuals of the same size; bf16 or int8 error storage shrinks them); per step
the reduced shard then differs from the exact sum by (e_start - e_end) / (1 - beta) summed over the ranks (beta = 0:
classic EF; LoCo beta 0.8), each e bounded by the codec's error on what it encoded, and LoCo's reset counts
optimizer steps, not reductions. Deferred parameters (tied embeddings over PP, sequence-parallel norms) keep a whole
buffer until ``step()`` as under ZeRO-1, since their gradient is summed over another group first. A ZeRO-1
checkpoint loads into ZeRO-2 and back: the saved state (masters, optimizer state, error feedback, counters) is the
same, so the stage is not saved (a new key would also make torch.distributed.checkpoint refuse checkpoints written
without it).

Traffic: gradients travel on a ``dp_gradient`` channel and parameters on a ``dp_parameter`` channel
(megacomp.comm.Channel), either passed in (``grad_channel``/``param_channel``, as the trainer does) or
built here from ``grad_codec``/``param_codec``/``error_feedback``/``min_compress_numel``. The gradient
channel owns the error-feedback state (one key per bucket), saved in this optimizer's state_dict.
``grad_codec={"name": "powersgd", "rank": r}`` (or a megacomp.comm.LowRankChannel as ``grad_channel``)
all-reduces each compressed bucket's matrices with PowerSGD instead of reduce-scattering it, then keeps this
rank's shard; its residuals and warm-start Q matrices are saved in the state_dict too.
``grad_codec={"name": "accordion", ...}`` (megacomp.comm.AccordionChannel) picks each bucket's level per
interval from the reduced gradients' norms (one small all-reduce per interval, in ``step()``).

Checkpoints (this rank's shard, its checks on load, resharding): megacomp.optimizer.sharded_state.

Small-tensor rule (logged at construction): 1-D parameters (biases, norms) and buckets the channels would
not compress (under their ``min_compress_numel``) are reduced uncompressed. With no codecs the result equals
``optimizer_class`` on the averaged gradients up to fp32 round-off of the reduction.

Failure behaviour: parameters on several devices or dtypes, duplicates, an empty list, or parameters
that differ across the group (not replicated over ``process_group``) raise ValueError; a second
backward without ``step()`` or ``no_sync()`` raises RuntimeError (ZeRO-1); a checkpoint from another layout,
DP size or codec raises ValueError naming the difference; ``zero_stage=2`` with ``shard=False``, a PowerSGD or
Accordion gradient channel, or a 1-bit optimizer raises ValueError naming the fix.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..comm import AnyChannel, Channel, all_gather_base, make_channel
from ..comm.codec_stream import CodecStream
from ..comm.spans import span
from ..compression import CodecLike, make_codec
from .buckets import Bucket, build_buckets
from .loss_scaler import DynamicLossScaler
from .param_gather import ParamGather
from .params import default_optimizer_class, param_groups_of
from .reduction import GradientReduction
from .sharded_state import ShardedState

log = logging.getLogger("megacomp")


class DistributedOptimizer(GradientReduction, ParamGather, ShardedState):
    """Sharded optimizer over ``process_group`` (default: the world); see the module docstring.

    ``error_feedback``: None, 'ef', 'loco', an ErrorFeedbackConfig or ErrorFeedback (one error per
    bucket, checkpointed). ``loss_scaler``: a DynamicLossScaler (fp16) or None. ``defaults`` go to
    ``optimizer_class`` (e.g. lr, weight_decay, betas). ``grad_norm_group``: a further group (e.g. the
    model-parallel group) over which the gradient norm and the overflow check are reduced;
    ``grad_norm_weight(param)``: that parameter's share in the norm (1 / number of copies in the group).
    ``deferred_params``: reduced only in ``step()`` (see :meth:`main_grad`). ``hierarchy``: a pair
    (intra-node group, inter-node group) partitioning ``process_group``: gradients are reduce-scattered in
    full precision inside a node, then with ``grad_codec`` across nodes; parameters are all-gathered with
    ``param_codec`` across nodes, then in full precision inside (tags ``*_intra`` in comm.stats()).
    ``grad_codec_warmup_steps``: the first that many steps reduce gradients uncompressed (1-bit Adam's
    full-precision warm-up, e.g. with FrozenVarianceAdamW); error feedback starts with the codec.
    ``grad_channel`` / ``param_channel``: channels to use instead of building them from the codec
    arguments (then leave grad_codec/param_codec/error_feedback at None).
    ``shard=False``: every rank keeps the whole fp32 master and optimizer state (DDP + optimizer): gradients
    are all-reduced instead of reduce-scattered and there is no parameter all-gather (no ``param_codec``).
    ``zero_stage``: 1 (full-size gradient buckets for the whole step) or 2 (gradients sharded as they are
    produced; see the module docstring).
    ``codec_stream``: True launches each bucket's reduction (its codec kernels) on a side CUDA stream, ordered by
    events (megacomp.comm.codec_stream; inline on CPU); a ``CodecStream`` to use that one (tests record its steps).

    Raises:
        ValueError: error feedback without a lossy gradient codec; both a channel and codec arguments;
            bad bucket sizes or warm-up steps; parameters not replicated over the group; a ``zero_stage``
            other than 1 or 2, or 2 with ``shard=False`` or a PowerSGD / Accordion gradient channel.
    """

    def __init__(self, params: Iterable, optimizer_class=None, process_group=None,
                 grad_codec: CodecLike = None, param_codec: CodecLike = None, error_feedback=None, *,
                 bucket_size: int = 1 << 22, min_compress_numel: int = 65536, max_grad_norm: Optional[float] = None,
                 grad_norm_group=None, grad_norm_weight=None, deferred_params: Iterable = (), hierarchy=None,
                 loss_scaler: Optional[DynamicLossScaler] = None, check_replicated: bool = True,
                 grad_codec_warmup_steps: int = 0, grad_channel: Optional[AnyChannel] = None,
                 param_channel: Optional[Channel] = None, shard: bool = True, zero_stage: int = 1,
                 codec_stream=False, **defaults: Any) -> None:
        if zero_stage not in (1, 2) or isinstance(zero_stage, bool):
            raise ValueError(f"DistributedOptimizer: zero_stage must be 1 (sharded masters and optimizer state) or 2 "
                             f"(also sharded gradients), got {zero_stage!r}; shard=False is the unsharded optimizer")
        if zero_stage == 2 and not shard:
            raise ValueError("DistributedOptimizer(zero_stage=2) keeps only this rank's shard of the gradients, which "
                             "needs sharded masters: drop shard=False (pretraining: --no-shard-optimizer), or use "
                             "zero_stage=1")
        self.zero_stage = zero_stage
        self.group = process_group
        self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.hierarchy = hierarchy
        self.sharded = bool(shard)
        self.shard_index = self.rank if shard else 0
        self.parts = self.world if shard else 1  # shards of each bucket: one per rank, or one whole copy
        if not shard and (hierarchy is not None or not make_codec(param_codec).is_identity
                          or (param_channel is not None and param_channel.lossy)):
            raise ValueError("DistributedOptimizer(shard=False) keeps whole parameters on every rank: it has no "
                             "parameter all-gather (drop the parameter codec, dp_parameter) and no hierarchy")
        if hierarchy is not None:
            intra, inter = hierarchy
            n_local, n_nodes = dist.get_world_size(intra), dist.get_world_size(inter)
            if n_local * n_nodes != self.world:
                raise ValueError(f"hierarchy: intra-node group ({n_local} ranks) x inter-node group ({n_nodes} ranks) "
                                 f"must cover the {self.world} ranks of process_group")
            # after the intra-node reduce-scatter this rank holds chunk <local rank>; the inter-node one
            # splits that chunk over the nodes: this rank ends with sub-chunk <node> of it
            self.shard_index = dist.get_rank(intra) * n_nodes + dist.get_rank(inter)
        groups = param_groups_of(params)
        if grad_channel is not None and (grad_codec is not None or error_feedback is not None):
            raise ValueError("DistributedOptimizer: pass either grad_channel or grad_codec/error_feedback, not both")
        if param_channel is not None and param_codec is not None:
            raise ValueError("DistributedOptimizer: pass either param_channel or param_codec, not both")
        self.grad_channel = grad_channel if grad_channel is not None else make_channel(
            "dp_gradient", grad_codec, group=process_group, error_feedback=error_feedback,
            min_compress_numel=min_compress_numel)
        # parameters are gathered, never summed: only a value codec applies (Channel rejects PowerSGD settings)
        self.param_channel = param_channel if param_channel is not None else Channel(
            "dp_parameter", param_codec, group=process_group, min_compress_numel=min_compress_numel)
        self._grad_plain, self._param_plain = self.grad_channel.uncompressed(), self.param_channel.uncompressed()
        if self.grad_channel.reduces_whole_buckets and (hierarchy is not None or not shard):
            raise ValueError("DistributedOptimizer: a powersgd or accordion gradient channel does not combine with "
                             "hierarchy or shard=False; drop those or use a codec such as int4")
        if zero_stage == 2 and self.grad_channel.reduces_whole_buckets:
            raise ValueError("DistributedOptimizer(zero_stage=2) reduces every micro-batch's buckets as they fill; a "
                             "powersgd or accordion gradient channel all-reduces whole buckets (nothing saved) and "
                             "decides on whole-step gradients: use zero_stage=1, or a value codec such as int4")
        if not isinstance(grad_codec_warmup_steps, int) or grad_codec_warmup_steps < 0:
            raise ValueError(f"grad_codec_warmup_steps must be an int >= 0, got {grad_codec_warmup_steps!r}")
        self.grad_codec_warmup_steps = grad_codec_warmup_steps
        if self.grad_channel.adaptive and self.grad_channel.lr_source is None:  # Accordion's lr_trigger: this step's rate
            self.grad_channel.follow_lr(lambda: self.param_groups[0]["lr"])
        self.max_grad_norm, self.grad_norm_group, self.scaler = max_grad_norm, grad_norm_group, loss_scaler
        lossy = [ch for ch in (self.grad_channel, self.param_channel, *self._more_channels()) if ch.lossy]
        self.buckets: list[Bucket] = build_buckets([g["params"] for g in groups], self.world, bucket_size,
                                                   lambda n: any(ch.compresses(n) for ch in lossy),
                                                   frozenset(id(p) for p in deferred_params))
        self._describe_policy()
        self.device = groups[0]["params"][0].device
        for b in self.buckets:  # ZeRO-2 allocates a bucket's buffer per backward (deferred ones stay whole)
            if zero_stage == 1 or b.deferred:
                b.grad = torch.zeros(b.padded, dtype=torch.float32, device=self.device)
        if check_replicated:
            self._check_replicated()
        self.masters = [nn.Parameter(self._flat_params(b)[slice(*b.shard_range(self.shard_index, self.parts))].clone())
                        for b in self.buckets]
        inner_groups = []
        for gi, g in enumerate(groups):
            opts = {k: v for k, v in g.items() if k != "params"}
            inner_groups.append({"params": [m for m, b in zip(self.masters, self.buckets) if b.group == gi], **opts})
        self.optimizer = (optimizer_class or default_optimizer_class())(inner_groups, **defaults)
        self._norm_weights = self._build_norm_weights(grad_norm_weight)
        self.step_count, self.skipped_steps, self._last_grad_norm = 0, 0, None
        self._accumulating, self._validated = False, False
        self._in_flight: list = []  # ZeRO-2: (bucket, backend handle) of the reduce-scatter on the wire
        self._end_queued = False  # ZeRO-2: the end-of-backward callback is queued for the running backward
        self._prefetch, self._pending, self._gather_order = False, {}, []  # overlap_param_gather (param_gather.py)
        self._codec_stream = (codec_stream if isinstance(codec_stream, CodecStream)
                              else CodecStream(self.device) if codec_stream else None)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(b, i))
                       for b in self.buckets for i, p in enumerate(b.params)]

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global gradient norm of the last step that clipped (None before one). It is computed on the device;
        reading it here brings it to the host (a synchronisation, after the step: the trainer logs it)."""
        if torch.is_tensor(self._last_grad_norm):
            self._last_grad_norm = float(self._last_grad_norm)  # host sync: read by the caller after the step
        return self._last_grad_norm

    @last_grad_norm.setter
    def last_grad_norm(self, value) -> None:
        """Set it: a float, or a one-element tensor on the device (read back only when asked for)."""
        self._last_grad_norm = value

    @property
    def grad_codec(self):
        """The gradient codec, or None when gradients travel uncompressed."""
        return self.grad_channel.codec if self.grad_channel.lossy else None

    @property
    def param_codec(self):
        """The parameter codec, or None when parameters travel uncompressed."""
        return self.param_channel.codec if self.param_channel.lossy else None

    @property
    def ef(self):
        """The gradient channel's error-feedback state (one key per compressed bucket), or None."""
        return self.grad_channel.error_feedback

    # -- set-up helpers -------------------------------------------------------------------------------
    def _more_channels(self) -> tuple:
        """Further channels whose codecs mark buckets compressed (a subclass's momentum channel)."""
        return ()

    def _describe_policy(self) -> None:
        if self.grad_codec is None and self.param_codec is None:
            return
        plain = [b for b in self.buckets if not b.compressed]
        log.info("megacomp DistributedOptimizer: %d of %d buckets (%d of %d elements) stay uncompressed: 1-D "
                 "parameters and buckets under min_compress_numel=%d", len(plain), len(self.buckets),
                 sum(b.numel for b in plain), sum(b.numel for b in self.buckets),
                 self.grad_channel.min_compress_numel)

    def _flat_params(self, b: Bucket) -> torch.Tensor:
        flat = torch.zeros(b.padded, dtype=torch.float32, device=self.device)
        for p, o in zip(b.params, b.offsets):
            flat[o:o + p.numel()] = p.detach().reshape(-1).float()
        return flat

    def _build_norm_weights(self, weight_fn, whole: bool = False) -> list[Optional[torch.Tensor]]:
        """Per-shard (``whole``: per-bucket) element weights of the squared gradient norm (None = all ones): a
        parameter held by several ranks of the norm group (TP-replicated norms, a tied embedding's two copies)
        gets 1/copies."""
        out = []
        for b in self.buckets:
            if weight_fn is None or all(weight_fn(p) == 1.0 for p in b.params):
                out.append(None)
                continue
            w = torch.zeros(b.padded, dtype=torch.float64, device=self.device)
            for p, o in zip(b.params, b.offsets):
                w[o:o + p.numel()] = float(weight_fn(p))
            out.append(w if whole else w[slice(*b.shard_range(self.shard_index, self.parts))])
        return out

    def _check_replicated(self) -> None:
        # host sync: once, at construction (the parameters compared across the group)
        sums = torch.stack([torch.stack([f.double().sum(), f.double().square().sum()])
                            for f in (self._flat_params(b) for b in self.buckets)]).reshape(-1)
        table = torch.empty(self.world * sums.numel(), dtype=sums.dtype, device=sums.device)
        all_gather_base(table, sums, group=self.group)
        table = table.view(self.world, -1)
        bad = [r for r in range(self.world) if not torch.equal(table[r], table[0])]
        if bad:
            raise ValueError(f"DistributedOptimizer: parameters differ across the process group (group ranks {bad} "
                             f"differ from rank 0); the params must be replicated over process_group (pass the "
                             f"data-parallel group, and seed or broadcast the model identically on its ranks)")

    # -- step -------------------------------------------------------------------------------------
    def _all_reduce_max(self, value) -> float:
        """The maximum of ``value`` (a float, or a one-element tensor on this optimizer's device, which avoids a
        blocking host-to-device copy) over the group (and ``grad_norm_group``)."""
        if torch.is_tensor(value):
            t = value.to(torch.float64).reshape(1)
        else:
            t = torch.tensor([value], dtype=torch.float64, device=self.device)  # host sync: a host value (1-bit path)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if self.grad_norm_group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.grad_norm_group)
        # host sync: the one of a ZeRO step. Skipping the step on inf/NaN is Python control flow (an arbitrary inner
        # optimizer, the step counters, the loss scaler, the error-feedback reset), decided alike on every rank.
        return t.item()

    def _global_norm(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The global gradient norm over the group (and ``grad_norm_group``): a one-element fp64 tensor on the
        device, never read back here."""
        sq = torch.stack([(s.double().square() * w if w is not None else s.double().square()).sum()
                          for s, w in zip(shards, self._norm_weights)]).sum().reshape(1)
        if self.sharded:  # unsharded, every rank holds the whole averaged gradient: summing would count it N times
            dist.all_reduce(sq, group=self.group)
        if self.grad_norm_group is not None:
            dist.all_reduce(sq, group=self.grad_norm_group)
        return sq.sqrt()

    def step(self, closure=None) -> bool:
        """Reduce, update the local shard, all-gather parameters. Returns False when the step was skipped."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure")
        self.wait_params()  # a bucket whose parameters no forward used since the last step
        shards = self._finish_reduction()
        overflow = self._overflowed(shards)
        if self._accordion_active():  # decided on the reduced gradients, before clipping (every rank alike)
            if overflow:
                self.grad_channel.discard_step()
            self.grad_channel.end_step(self.group)
        if overflow:
            return self._skip_step()
        self._clip_and_update(shards)
        return self._finish_step()

    def _overflowed(self, shards: list[torch.Tensor]) -> bool:
        """Whether any rank's (or, with ``grad_norm_group``, any model-parallel rank's) averaged shards hold inf/NaN:
        this rank's flag is formed on the device, so the step's one host synchronisation is the reduced flag's."""
        if not shards:
            return bool(self._all_reduce_max(0.0))
        bad = torch.stack([torch.isfinite(s).all() for s in shards]).logical_not().any()
        return bool(self._all_reduce_max(bad))

    def _clip_and_update(self, shards: list[torch.Tensor]) -> None:
        """Clip ``shards`` by the global gradient norm (``max_grad_norm``) and step the inner optimizer on them."""
        if self.max_grad_norm is not None:
            norm = self._global_norm(shards)
            self.last_grad_norm = norm
            # min(max_norm / (norm + 1e-6), 1) on the device (as torch.nn.utils.clip_grad_norm_): the same fp64
            # coefficient as computed on the host, and a factor of 1 leaves the values unchanged, so no sync is needed
            coef = (self.max_grad_norm / (norm + 1e-6)).clamp_(max=1.0).reshape(())
            torch._foreach_mul_(shards, coef)
        for m, s in zip(self.masters, shards):
            m.grad = s
        with span("update"):
            self.optimizer.step()

    def _skip_step(self) -> bool:
        """An overflow step on every rank: count it, drop the residuals of the discarded gradient (they must not
        leak into later steps), back off the loss scale, clear the buffers. Returns False."""
        self.skipped_steps += 1
        if self.ef is not None:
            self.ef.reset()
        if self.scaler is not None:
            self.scaler.update(True)
        log.debug("megacomp DistributedOptimizer: inf/NaN gradients, step %d skipped (%d so far)%s",
                  self.step_count, self.skipped_steps,
                  f"; loss scale now {self.scaler.scale:g}" if self.scaler is not None else "")
        self._reset()
        return False

    def _finish_step(self) -> bool:
        """After the inner step: parameters into the model, loss scale, buffers cleared, the step counted."""
        if self._prefetch:  # left in flight: the next forward waits per bucket (param_gather.py)
            self._launch_param_gathers()
        else:
            with span("param_all_gather"):
                self.sync_params()
        if self.scaler is not None:
            self.scaler.update(False)
        self._reset()
        self.step_count += 1
        self._validated = True
        return True

    @torch.no_grad()
    def load_params_from_model(self) -> None:
        """Set this rank's fp32 master shards from the model parameters, after something other than this
        optimizer changed them (an outer step of megacomp.outer); the inner optimizer state is kept."""
        self.wait_params()
        for b, m in zip(self.buckets, self.masters):
            m.copy_(self._flat_params(b)[slice(*b.shard_range(self.shard_index, self.parts))])

    @torch.no_grad()
    def reload_params(self, params: Iterable[nn.Parameter], *, reset_state: bool = False) -> None:
        """These parameters were replaced in place by something other than this optimizer (LoQT's merge resets its
        factors): copy their slices of this rank's fp32 master shards from the model (only theirs, so the other
        parameters' masters are not replaced by a lossy all-gathered copy), and with ``reset_state`` zero their
        slices of every inner-optimizer state tensor shaped like the master (a step count, shared by the whole
        bucket, stays). Parameters this optimizer does not manage are ignored. Local: no communication."""
        ids = {id(p) for p in params}
        for b, master in zip(self.buckets, self.masters):
            start, end = b.shard_range(self.shard_index, self.parts)
            for p, off in zip(b.params, b.offsets):
                lo, hi = max(off, start), min(off + p.numel(), end)
                if id(p) not in ids or lo >= hi:  # not replaced, or not in this rank's shard
                    continue
                master[lo - start:hi - start].copy_(p.detach().reshape(-1)[lo - off:hi - off])
                state = self.optimizer.state.get(master, {}) if reset_state else {}
                for v in state.values():
                    if torch.is_tensor(v) and v.shape == master.shape:
                        v[lo - start:hi - start].zero_()

    def sync_params(self) -> None:
        """All-gather the master shards into the model parameters (``param_codec`` on compressed buckets)."""
        self.wait_params()  # collectives in flight go first, in the order every rank issued them
        for b, m in zip(self.buckets, self.masters):
            full = m.detach() if not self.sharded else self.gather_bucket(b, m)  # unsharded: the master is whole
            with torch.no_grad():
                for p, o in zip(b.params, b.offsets):
                    p.copy_(full[o:o + p.numel()].view_as(p))

    def gather_bucket(self, b: Bucket, master: torch.Tensor) -> torch.Tensor:
        """The whole bucket ``b`` (length ``b.padded``, the parameters' dtype) all-gathered from every rank's
        ``master`` shard over the group (``param_codec`` when the bucket is compressed), without touching the
        model (megacomp.optimizer.acco gathers into side buffers while the model computes)."""
        dtype = b.params[0].dtype
        full = torch.empty(b.padded, dtype=dtype, device=master.device)
        ch = self.param_channel if b.compressed else self._param_plain
        if self.hierarchy is None:
            ch.all_gather_into_tensor(full, master.detach().to(dtype), group=self.group, validate=not self._validated)
        else:  # across nodes with the codec, then full precision inside the node (qwZ + hpZ)
            intra, inter = self.hierarchy
            chunk = torch.empty(b.padded // dist.get_world_size(intra), dtype=dtype, device=master.device)
            ch.all_gather_into_tensor(chunk, master.detach().to(dtype), group=inter, validate=not self._validated)
            comm.all_gather_into_tensor(full, chunk, group=intra, tag="dp_parameter_intra",
                                        validate=not self._validated)
        return full

    @property
    def param_groups(self):
        """The inner optimizer's param groups (over the master shards): set ``lr`` here, as with torch optimizers."""
        return self.optimizer.param_groups

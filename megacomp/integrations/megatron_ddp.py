"""megatron-core's own data-parallel traffic on megacomp channels: DistributedDataParallel's gradient
reduce-scatter / all-reduce per bucket group and the DistributedOptimizer's parameter all-gather.

megatron-core's ``DistributedDataParallel`` keeps gradients in contiguous buffers cut into buckets, and a
``_ParamAndGradBucketGroup`` issues each group's collectives in two methods, which every DDP entry point
(``finish_grad_sync``, the overlap hooks, ``start_param_sync``, the forward pre-hook) calls through the
class. :func:`install` replaces those two methods on the class (``uninstall`` puts them back); the
replacements keep megatron-core's bookkeeping (first-batch handling, NaN checks, gradient scaling, the
handles ``finish_grad_sync`` / ``finish_param_sync`` wait on) and move only the collectives:

  ``start_grad_sync``   per bucket: reduce-scatter of ``grad_data`` into this rank's shard (distributed
                        optimizer) or all-reduce of ``grad_data`` (plain DDP, or ``force_all_reduce``),
                        on the ``dp_gradient`` channel with error feedback (EF / LoCo) keyed per bucket
  ``start_param_sync``  per bucket: all-gather of ``param_data`` from each rank's shard, on the
                        ``dp_parameter`` channel

The bucket's error-feedback key is ``megatron_ddp/<name of the bucket's first parameter>`` after
``MegatronCompression.register(ddp_model)``, else ``megatron_ddp/bucket<n>`` in the order buckets first
reduce (the bucket-group order, the same on every rank and every run of one model and bucket size). One
residual per bucket and rank: the bucket's layout is fixed, so it meets the same elements every step.

Error bounds (megacomp.comm.collectives): a compressed reduce-scatter's shard is within the sum over ranks
of the codec's bound on each rank's (error-compensated, scaled) chunk; an all-reduce adds the bound of the
second stage on the reduced chunk; the all-gather delivers every other rank's shard within the codec's
bound on that shard. The all-gather keeps this rank's own shard exact (it is restored after the gather):
with fp32 parameters the distributed optimizer's master weights are views of that shard, and decoding
them in place would quantize the master weights every step. So replicas differ by at most the codec's
bound on the shards they do not own.

With identity codecs every collective is the same ``torch.distributed`` call on the same tensors (one
call per bucket instead of megatron's coalesced group, which does not change values), so training is
bit-identical to stock megatron-core DDP (tested at DP 2 and 4, with and without the overlap flags).
Async handles: with ``overlap_grad_reduce`` / ``overlap_param_gather`` the collectives are started
asynchronously and their handle decodes (and restores the own shard) when megatron-core waits on it.

Not carried (megatron-core's own method runs when the path is uncompressed; a lossy codec raises
ValueError naming the setting): ``num_distributed_optimizer_instances > 1`` (partial distributed optimizer:
its inter-instance all-reduce), ``reduce_scatter_with_fp32_accumulation`` (megatron's own all-to-all
reduce-scatter), the 0.19 layer-wise optimizer's variable-size parameter gather (``overlap_param_gather``
without the distributed optimizer), and quantized (FP8 / MXFP8 / NVFP4) parameters.

Across nodes: the bucket reduce-scatter and parameter all-gather run flat over megatron-core's DP group, so a
node's data crosses its slow link once per rank of the group on the node (megacomp's own sharded optimizer,
DDP hook and FSDP2 integration run hop by hop instead: megacomp.comm.hierarchical).
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch
from torch.distributed import ReduceOp

_METHODS = (  # (name, parameter names in megatron-core 0.16 and 0.19), checked at install
    ("start_grad_sync", ("self", "force_all_reduce")),
    ("start_param_sync", ("self", "force_sync")),
)


def _bucket_group_class():
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    return _ParamAndGradBucketGroup


def check_signatures() -> None:
    """RuntimeError when the bucket group's methods are not the ones this module replaces."""
    cls = _bucket_group_class()
    for name, expected in _METHODS:
        names = tuple(inspect.signature(getattr(cls, name)).parameters)
        if names != expected:
            raise RuntimeError(f"megatron-core's _ParamAndGradBucketGroup.{name} has parameters {names}, megacomp "
                               f"expects {expected}: this megatron-core is not the one the integration was written for")


class _Handles:
    """The handle megatron-core stores and waits on: waits every started collective, then runs ``after``."""

    def __init__(self, works: list, after: Optional[Callable[[], None]] = None) -> None:
        self.works, self.after = works, after

    def wait(self) -> None:
        """Wait for (and decode) every collective of the bucket group; then restore what ``after`` restores."""
        works, self.works = self.works, []
        for work in works:
            if work is not None:
                work.wait()
        if self.after is not None:
            after, self.after = self.after, None
            after()


def _shard(bucket_group, idx: int, buffer: torch.Tensor, cache: list):
    """This rank's shard of a bucket buffer (megatron-core's shard_buffer, cached as it caches it)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    if cache[idx] is None:
        cache[idx] = shard_buffer(buffer, bucket_group.intra_distributed_optimizer_instance_size)
    return cache[idx][bucket_group.intra_distributed_optimizer_instance_rank]


def _quantized(bucket_group) -> bool:
    """Whether a bucket holds FP8 / FP4 parameters (Transformer Engine tensors: megatron post-processes them)."""
    from megatron.core import fp8_utils

    checks = [fp8_utils.is_float8tensor]
    try:
        from megatron.core import fp4_utils  # 0.19
        checks.append(fp4_utils.is_nvfp4tensor)
    except ImportError:
        pass
    return any(check(p) for b in bucket_group.buckets for p in b.params_list for check in checks)


def _wait_for_cuda_graph_gradients(bucket_group) -> None:
    """0.19: a CUDA-graph replay fills gradients asynchronously; wait for its events (none without graphs)."""
    events = {id(e): e for b in bucket_group.buckets for p in b.params_list
              if (e := getattr(p, "_cudagraph_wgrad_ready_event", None)) is not None}
    if events:
        stream = torch.cuda.current_stream()
        for event in events.values():
            stream.wait_event(event)


class DDPPatch:
    """The replacement methods of one ``MegatronCompression`` (built by :func:`install`)."""

    def __init__(self, owner) -> None:
        self.owner = owner  # the MegatronCompression: channels and bucket keys
        self.cls = _bucket_group_class()
        self.originals = {name: getattr(self.cls, name) for name, _ in _METHODS}

    # -- the seam ----------------------------------------------------------------------------------
    def install(self) -> None:
        """Replace the bucket group's methods on the class (every existing and future DDP sees them)."""
        patch = self

        def start_grad_sync(group_self, force_all_reduce: Optional[bool] = False):
            return patch.start_grad_sync(group_self, force_all_reduce)

        def start_param_sync(group_self, force_sync: bool = False):
            return patch.start_param_sync(group_self, force_sync)

        for fn in (start_grad_sync, start_param_sync):
            fn._megacomp = self
            fn.__doc__ = f"megacomp's replacement of megatron-core's {fn.__name__} (megacomp.integrations.megatron_ddp)"
            setattr(self.cls, fn.__name__, fn)

    def uninstall(self) -> None:
        """Put megatron-core's methods back."""
        for name, original in self.originals.items():
            if getattr(getattr(self.cls, name), "_megacomp", None) is self:
                setattr(self.cls, name, original)

    def _unsupported(self, what: str, fix: str, channel) -> None:
        if channel.lossy:
            raise ValueError(f"megatron integration: {what} is not compressed by megacomp (megatron-core would "
                             f"bypass the codec); {fix}, or set {channel.name} to none")

    # -- gradients ---------------------------------------------------------------------------------
    def start_grad_sync(self, g, force_all_reduce: Optional[bool] = False) -> None:
        """megatron-core's ``start_grad_sync`` with each bucket's collective on the dp_gradient channel."""
        cfg, channel = g.ddp_config, self.owner.channels.dp_gradient
        special = (("num_distributed_optimizer_instances > 1", "use one distributed-optimizer instance")
                   if cfg.num_distributed_optimizer_instances > 1 else
                   ("reduce_scatter_with_fp32_accumulation", "turn reduce_scatter_with_fp32_accumulation off")
                   if cfg.reduce_scatter_with_fp32_accumulation else None)
        if special is not None:
            self._unsupported(*special, channel)
            return self.originals["start_grad_sync"](g, force_all_reduce=force_all_reduce)
        if g.is_first_batch and g.grad_reduce_handle is not None:
            return None  # dispatched already in the first batch (megatron-core's rule)
        assert g.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        _wait_for_cuda_graph_gradients(g)
        for bucket in g.buckets:  # 0.19: gradients accumulated outside the buffer (higher-precision main_grad)
            for param in getattr(bucket, "params_with_extra_main_grads", ()):
                if getattr(param, "main_grad_copy_in_grad_buffer", None) is not None:
                    param.main_grad_copy_in_grad_buffer.copy_(param.main_grad)
        if cfg.check_for_nan_in_grad or cfg.check_for_large_grads:
            g.check_grads(check_for_nan_or_inf=cfg.check_for_nan_in_grad, check_for_large=cfg.check_for_large_grads)
        with torch.no_grad():  # already includes 1/dp when the collective sums (megatron-core's scaling)
            for bucket in g.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
        op = ReduceOp.AVG if cfg.average_in_collective else ReduceOp.SUM
        async_op = bool(cfg.overlap_grad_reduce)
        scatter = cfg.use_distributed_optimizer and not force_all_reduce
        group = g.intra_distributed_optimizer_instance_group if cfg.use_distributed_optimizer else g.data_parallel_group
        works = []
        for idx, bucket in enumerate(g.buckets):
            key = self.owner._bucket_key(bucket)
            if scatter:
                shard = _shard(g, idx, bucket.grad_data, g.cached_grad_buffer_shard_list)
                works.append(channel.reduce_scatter_tensor(shard, bucket.grad_data, op=op, group=group,
                                                           async_op=async_op, key=key, tag="dp_gradient"))
            else:
                works.append(channel.all_reduce(bucket.grad_data, op=op, group=group, async_op=async_op, key=key,
                                                tag="dp_gradient"))
        g.grad_reduce_handle = _Handles(works) if async_op else None
        return None

    # -- parameters --------------------------------------------------------------------------------
    def start_param_sync(self, g, force_sync: bool = False) -> None:
        """megatron-core's ``start_param_sync`` with each bucket's all-gather on the dp_parameter channel."""
        cfg, channel = g.ddp_config, self.owner.channels.dp_parameter
        post = getattr(g, "_post_param_sync", None)  # 0.19: quantized-parameter processing after a gather
        special = (("the layer-wise optimizer's parameter gather", "use the distributed optimizer")
                   if not cfg.use_distributed_optimizer else
                   ("FP8 / quantized parameters", "keep the parameters in a plain dtype")
                   if _quantized(g) else None)
        if special is not None:
            self._unsupported(*special, channel)
            return self.originals["start_param_sync"](g, force_sync=force_sync)
        if force_sync:
            if g.param_gather_handle is not None:
                g.param_gather_handle.wait()
                g.param_gather_handle = None
                if post is not None:
                    post()
                return None
        else:
            assert g.param_gather_handle is None
        async_op = bool(cfg.overlap_param_gather) and not force_sync
        group = g.intra_distributed_optimizer_instance_group
        works, own = [], []
        for idx, bucket in enumerate(g.buckets):
            shard = _shard(g, idx, bucket.param_data, g.cached_param_buffer_shard_list)
            if channel.compresses(bucket.param_data.numel()):
                exact = shard.clone()  # the gather writes the decoded own shard: keep the exact one (module doc)
                own.append((shard, exact))
                works.append(channel.all_gather_into_tensor(bucket.param_data, exact, group=group, async_op=async_op,
                                                            tag="dp_parameter"))
            else:
                works.append(channel.all_gather_into_tensor(bucket.param_data, shard, group=group, async_op=async_op,
                                                            tag="dp_parameter"))

        def restore() -> None:
            for shard, exact in own:
                shard.copy_(exact)

        if async_op:
            g.param_gather_handle = _Handles(works, restore)
        else:
            restore()
            g.param_gather_handle = None
        g.param_gather_dispatched = True
        if force_sync and cfg.overlap_param_gather and post is not None:
            post()
        return None


def install(owner) -> DDPPatch:
    """Check the signatures and replace the bucket group's methods for ``owner`` (a MegatronCompression)."""
    check_signatures()
    patch = DDPPatch(owner)
    patch.install()
    return patch


def bucket_names(ddp_model) -> dict:
    """``{bucket: name of its first parameter}`` for every bucket of a megatron-core DDP model (dense and
    expert buffers). ValueError: not a megatron-core DistributedDataParallel."""
    groups = getattr(ddp_model, "bucket_groups", None)
    if groups is None:
        raise ValueError(f"{type(ddp_model).__name__} has no bucket_groups: register(...) takes megatron-core's "
                         f"DistributedDataParallel (or any model, for the tensor-parallel keys only)")
    names = {id(p): n for n, p in ddp_model.named_parameters()}
    out = {}
    for g in list(ddp_model.bucket_groups) + list(getattr(ddp_model, "expert_parallel_bucket_groups", [])):
        for bucket in g.buckets:
            out[bucket] = names[id(bucket.params_list[0])]
    return out

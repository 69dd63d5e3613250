"""megacomp's codecs inside DTensor tensor parallelism: the collectives DTensor issues when a tensor changes
placement on the tensor-parallel mesh dimension (``redistribute``, explicit or inside an operator's
sharding propagation, forward and backward) travel on megacomp channels.

    from megacomp.integrations.dtensor_tp import DTensorTPCompression
    comp = DTensorTPCompression({"tp_forward": "int8", "sp_all_gather": "int8", "sp_reduce_scatter": "int8",
                                 "tp_backward": "int8"}, tp_mesh=world_mesh["tp"])
    with comp:                                 # or comp.install() ... comp.uninstall()
        loss = model(tokens).sum(); loss.backward()

Which code moves the bytes: DTensor (torch 2.13) turns every placement change into calls of three
placement methods, whatever called ``redistribute`` (``parallelize_module``'s ``ColwiseParallel`` /
``RowwiseParallel`` / ``SequenceParallel``, torchtitan's ``Module.parallelize`` wrappers, an operator's
implicit redistribution, or the backward of any of them). While installed, those three methods are
replaced on the placement classes (one binding each, restored by :meth:`uninstall`):

| placement change          | DTensor method                   | collective      | forward path        | backward path |
|---------------------------|----------------------------------|-----------------|---------------------|---------------|
| ``Partial`` -> ``Replicate`` | ``Partial._reduce_value``     | all-reduce      | ``tp_forward``      | ``tp_backward`` |
| ``Partial`` -> ``Shard(d)``  | ``Shard._reduce_shard_tensor`` | reduce-scatter | ``sp_reduce_scatter`` | ``tp_backward`` |
| ``Shard(d)`` -> ``Replicate`` | ``Shard._to_replicate_tensor`` | all-gather    | ``sp_all_gather``   | ``tp_backward`` |

Forward and backward are told apart by whether the autograd engine is running a backward pass on this
thread. Only calls on the tensor-parallel process group (``tp_mesh``'s group) are taken over; every
other mesh dimension (FSDP's, HSDP's) runs DTensor's own code. Along dimension ``d`` the tensor is moved
to dimension 0, reduced or gathered flat with megacomp's collective, and moved back.

Error bound: each collective's, per call, as megacomp.comm.collectives states it for the channel's codec
(all-reduce: the codec's bound on each rank's chunk, summed over ranks, plus the re-encoding of the sum;
reduce-scatter: the sum over ranks of the codec's bound on each chunk; all-gather: the codec's bound on
each shard). These collectives carry no per-call identity, so they travel without error feedback
(``*_error_feedback`` on a TP path raises ValueError).

Compression off: a path whose codec is the identity (or a message below ``min_compress_numel``) calls
DTensor's own method unchanged, so results are bit-identical to stock DTensor; the bytes are still counted
under the path in ``megacomp.comm.stats()`` (what the uncompressed collective sends, by the accounting
model of megacomp.comm.stats).

DTensor's own code also runs, counted as uncompressed, for what a codec cannot carry: reductions other
than sum/avg (max, min, product, bitwise), non-floating-point tensors, uneven shards (DTensor pads them)
and ``_MaskPartial`` (the vocab-parallel embedding's masked reduction); each kind is said once in the log.

Failure behaviour: installing while another DTensorTPCompression is installed raises RuntimeError; lossy
codecs on paths DTensor TP does not carry (pp_*, dp_*) and TP error feedback raise ValueError; an
unsupported torch (the placement methods missing or with other parameters) raises RuntimeError naming
what changed.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.tensor.placement_types import Partial, Shard

from ..config import TRAFFIC_PATHS, CommCompressionConfig

log = logging.getLogger("megacomp")

TP_PATHS = ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter")
"""The traffic paths DTensor tensor parallelism carries."""
_PATCHED = (  # (class, method, its parameters in torch 2.13), checked at install
    (Partial, "_reduce_value", ("self", "tensor", "mesh", "mesh_dim")),
    (Shard, "_reduce_shard_tensor", ("self", "tensor", "mesh", "reduce_op", "mesh_dim")),
    (Shard, "_to_replicate_tensor", ("self", "local_tensor", "mesh", "mesh_dim", "current_logical_shape")),
)
_SUM_OPS = ("sum", "avg")  # the reductions a codec's collective carries (ReduceOp.SUM / AVG)
_MARK = "__megacomp_dtensor_tp__"  # set on the replacement functions: tells an installed patch apart


def _op(name: str):
    return ReduceOp.SUM if name == "sum" else ReduceOp.AVG


def in_backward() -> bool:
    """Whether this thread is running an autograd backward pass (the engine sets a graph task id)."""
    return torch._C._current_graph_task_id() != -1


class DTensorTPCompression:
    """Compressed DTensor tensor-parallel collectives (see the module docstring).

    Args:
        config: a ``CommCompressionConfig`` or its mapping; ``tp_forward``, ``tp_backward``, ``sp_all_gather``,
            ``sp_reduce_scatter`` and ``min_compress_numel`` apply.
        tp_mesh: the 1-D tensor-parallel ``DeviceMesh`` (e.g. ``world_mesh["tp"]``, torchtitan's
            ``parallel_dims.get_mesh("tp")``); only collectives on its process group are compressed.

    Raises:
        ValueError: lossy codecs on paths other than the TP ones, error feedback on a TP path, a ``tp_mesh``
            that is not 1-D.
    """

    def __init__(self, config: Union[CommCompressionConfig, Mapping[str, Any], None], *, tp_mesh) -> None:
        if not isinstance(config, CommCompressionConfig):
            config = CommCompressionConfig.from_dict(config)
        other = [p for p in TRAFFIC_PATHS if p not in TP_PATHS and not getattr(config, p).is_identity]
        if other:
            raise ValueError(f"DTensor TP integration: {other} are not tensor-parallel traffic; set them to none "
                             f"(FSDP2's traffic: megacomp.integrations.fsdp)")
        ef = [p for p in TP_PATHS if getattr(config, p + "_error_feedback", None)]
        if ef:
            raise ValueError(f"DTensor TP integration: {[p + '_error_feedback' for p in ef]}: DTensor's collectives "
                             f"carry no per-call identity to key a residual by; set them to none")
        if tp_mesh.ndim != 1:
            raise ValueError(f"DTensor TP integration: tp_mesh must be the 1-D tensor-parallel mesh (e.g. "
                             f"world_mesh['tp']), got a {tp_mesh.ndim}-D mesh")
        self.config = config
        self.tp_mesh = tp_mesh
        self.group = tp_mesh.get_group()
        self.ranks = tuple(dist.get_process_group_ranks(self.group))
        self._known: dict = {}  # id(process group) -> whether it spans the TP ranks (a 2-D mesh has its own objects)
        ranked = config.for_rank(dist.get_rank()) if dist.is_initialized() else config
        self.channels = ranked.build_channels()
        self._originals: Optional[dict] = None
        self._said: set = set()

    # -- install / uninstall -----------------------------------------------------------------------
    def install(self) -> "DTensorTPCompression":
        """Replace the three placement methods (see the module docstring). RuntimeError: another
        DTensorTPCompression is installed, or this torch's methods differ from the ones this is written for."""
        if not hasattr(torch._C, "_current_graph_task_id"):
            raise RuntimeError(f"DTensor TP integration: this torch ({torch.__version__}) cannot tell a backward pass "
                               f"apart (no torch._C._current_graph_task_id); it is written for torch 2.13")
        for cls, name, params in _PATCHED:
            fn = getattr(cls, name, None)
            if fn is None:
                raise RuntimeError(f"DTensor TP integration: this torch ({torch.__version__}) has no "
                                   f"{cls.__name__}.{name}; it is written for torch 2.13's DTensor")
            if getattr(fn, _MARK, False):
                raise RuntimeError("DTensor TP integration: another DTensorTPCompression is installed; uninstall it "
                                   "first")
            got = tuple(inspect.signature(fn).parameters)
            if got != params:
                raise RuntimeError(f"DTensor TP integration: {cls.__name__}.{name} takes {got} in torch "
                                   f"{torch.__version__}, this integration expects {params} (torch 2.13)")
        self._originals = {(cls, name): getattr(cls, name) for cls, name, _ in _PATCHED}
        Partial._reduce_value = self._wrap(Partial, "_reduce_value", self._all_reduce)
        Shard._reduce_shard_tensor = self._wrap(Shard, "_reduce_shard_tensor", self._reduce_scatter)
        Shard._to_replicate_tensor = self._wrap(Shard, "_to_replicate_tensor", self._all_gather)
        return self

    def uninstall(self) -> None:
        """Put DTensor's methods back (a no-op when not installed)."""
        if self._originals is None:
            return
        for (cls, name), fn in self._originals.items():
            setattr(cls, name, fn)
        self._originals = None

    @property
    def installed(self) -> bool:
        """Whether this object's methods are in place."""
        return self._originals is not None

    def __enter__(self) -> "DTensorTPCompression":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _wrap(self, cls, name, impl):
        original = self._originals[(cls, name)]

        def method(placement, *args):
            return impl(original, placement, *args)

        method.__name__, method.__doc__ = name, f"megacomp's {cls.__name__}.{name} (DTensorTPCompression)"
        setattr(method, _MARK, True)
        return method

    # -- the three collectives ---------------------------------------------------------------------------
    def _channel(self, forward_path: str):
        return getattr(self.channels, "tp_backward" if in_backward() else forward_path)

    def _ours(self, mesh, mesh_dim: int) -> bool:
        group = mesh.get_group(mesh_dim)
        if id(group) not in self._known:
            self._known[id(group)] = (group, tuple(dist.get_process_group_ranks(group)) == self.ranks)
        return self._known[id(group)][1]

    def _plain(self, why: str, channel, original, *args):
        """DTensor's own code, counted under ``channel`` as uncompressed; ``why`` said once per kind."""
        if why not in self._said:
            self._said.add(why)
            log.info("megacomp: DTensor TP %s travel uncompressed (DTensor's own collective)", why)
        return original(*args)

    def _count(self, channel, kind: str, numel: int, dtype: torch.dtype) -> None:
        """Record an uncompressed collective under the channel's tag by megacomp.comm.stats' accounting model."""
        n, size = dist.get_world_size(self.group), torch.finfo(dtype).bits // 8 if dtype.is_floating_point else \
            torch.iinfo(dtype).bits // 8
        sent = {"all_reduce": 2 * (n - 1) * numel // n, "reduce_scatter": (n - 1) * numel // n,
                "all_gather": (n - 1) * numel}[kind] * size
        channel.stats.record(channel.name, sent, sent)

    def _all_reduce(self, original, placement, tensor, mesh, mesh_dim):
        if not self._ours(mesh, mesh_dim):
            return original(placement, tensor, mesh, mesh_dim)
        channel = self._channel("tp_forward")
        if type(placement) is not Partial or placement.reduce_op not in _SUM_OPS or not tensor.is_floating_point():
            self._count(channel, "all_reduce", tensor.numel(), tensor.dtype)
            return self._plain(f"{type(placement).__name__}({placement.reduce_op}) reductions of "
                               f"{tensor.dtype}", channel, original, placement, tensor, mesh, mesh_dim)
        if not channel.compresses(tensor.numel()):
            self._count(channel, "all_reduce", tensor.numel(), tensor.dtype)
            return original(placement, tensor, mesh, mesh_dim)
        out = tensor.contiguous().clone()
        channel.all_reduce(out, op=_op(placement.reduce_op), group=self.group)
        return out

    def _reduce_scatter(self, original, shard, tensor, mesh, reduce_op, mesh_dim):
        if not self._ours(mesh, mesh_dim):
            return original(shard, tensor, mesh, reduce_op, mesh_dim)
        channel = self._channel("sp_reduce_scatter")
        n, d = mesh.size(mesh_dim), shard.dim % tensor.dim()
        if reduce_op not in _SUM_OPS or not tensor.is_floating_point() or tensor.size(d) % n:
            self._count(channel, "reduce_scatter", tensor.numel(), tensor.dtype)
            return self._plain(f"reduce-scatters ({reduce_op}, {tensor.dtype}, uneven shards)", channel, original,
                               shard, tensor, mesh, reduce_op, mesh_dim)
        if not channel.compresses(tensor.numel()):
            self._count(channel, "reduce_scatter", tensor.numel(), tensor.dtype)
            return original(shard, tensor, mesh, reduce_op, mesh_dim)
        flat = tensor.movedim(d, 0).contiguous()
        out = flat.new_empty((flat.size(0) // n,) + tuple(flat.shape[1:]))
        channel.reduce_scatter_tensor(out, flat, op=_op(reduce_op), group=self.group)
        return out.movedim(0, d).contiguous()

    def _all_gather(self, original, shard, local, mesh, mesh_dim, logical_shape):
        if not self._ours(mesh, mesh_dim):
            return original(shard, local, mesh, mesh_dim, logical_shape)
        channel = self._channel("sp_all_gather")
        n, d = mesh.size(mesh_dim), shard.dim % local.dim()
        if not local.is_floating_point() or logical_shape[d] % n:
            self._count(channel, "all_gather", local.numel(), local.dtype)
            return self._plain(f"all-gathers ({local.dtype}, uneven shards)", channel, original, shard, local, mesh,
                               mesh_dim, logical_shape)
        if not channel.compresses(local.numel() * n):
            self._count(channel, "all_gather", local.numel(), local.dtype)
            return original(shard, local, mesh, mesh_dim, logical_shape)
        flat = local.movedim(d, 0).contiguous()
        out = flat.new_empty((flat.size(0) * n,) + tuple(flat.shape[1:]))
        channel.all_gather_into_tensor(out, flat, group=self.group)
        return out.movedim(0, d).contiguous()

    def __repr__(self) -> str:
        return "DTensorTPCompression(" + ", ".join(f"{p}={getattr(self.channels, p).codec}" for p in TP_PATHS) + ")"

"""megacomp's codecs inside PyTorch FSDP2 (``fully_shard``): compressed gradient reduce-scatter and
parameter all-gather, with error feedback per FSDP unit.

    from torch.distributed.fsdp import fully_shard
    from megacomp.integrations.fsdp import FSDPCompression
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    comp = FSDPCompression({"dp_gradient": "int4", "dp_gradient_error_feedback": "loco",
                            "dp_parameter": "int8"}).apply(model)
    ...                                                  # train as usual
    dcp.save({"model": ..., "optim": ..., "megacomp": comp}, checkpoint_id=path)   # comp is a Stateful

How: FSDP2 (torch 2.13) lets a module replace its collectives (``FSDPModule.set_custom_reduce_scatter`` /
``set_custom_all_gather`` taking a ``ReduceScatter`` / ``AllGather`` from
``torch.distributed.fsdp._fully_shard._fsdp_api``). :meth:`FSDPCompression.apply` gives every FSDP unit
under the model (each module ``fully_shard`` was called on) its own :class:`CompressedReduceScatter` on
the ``dp_gradient`` channel and :class:`CompressedAllGather` on the ``dp_parameter`` channel:

- reduce-scatter: FSDP's flat, padded gradient buffer of the unit goes through megacomp's compressed
  reduce-scatter (encode each destination chunk, all-to-all, fp32 sum of the decoded chunks; ``op`` AVG
  or SUM as FSDP asks); error feedback (EF or LoCo) keyed by the unit's module name, one residual of the
  whole buffer per rank (the buffer's layout is fixed for a unit, so the residual meets the same
  elements every step). Error bound per element: the sum over ranks of the codec's bound on each rank's
  compensated chunk (megacomp.comm.collectives).
- all-gather: each rank's flat parameter shard is encoded once and every rank decodes all shards, so the
  unsharded parameters used in forward/backward are the codec's reconstruction (bound: the codec's, per
  shard); the sharded fp32 parameters the optimizer updates stay exact (the qwZ idea of ZeRO++).
- Messages below ``min_compress_numel`` and identity codecs call exactly the torch.distributed functions
  FSDP's defaults call, so with compression off training is bit-identical to stock FSDP2 (tested).
- A lossy all-gather completes inside the call (FSDP only waits on a ``dist.Work``), so it does not
  overlap the previous unit's compute; an uncompressed one keeps FSDP's async behaviour.

Traffic is counted under ``dp_gradient`` and ``dp_parameter`` in ``megacomp.comm.stats()``.

Checkpointing: an ``FSDPCompression`` is a DCP ``Stateful``; its state (each rank's error-feedback
residuals and stochastic-rounding streams) is one entry per rank (``rank<r>``), so DCP keeps every rank's
own copy, and resuming continues bit for bit (tested). Loading refuses another world size or codec.

Not covered: HSDP's replicate-dim all-reduce (FSDP issues it with ``dist.all_reduce`` directly; a lossy
``dp_gradient`` on an HSDP unit raises ValueError), FSDP units with several parameter groups
(``shard_placement_fn`` with per-parameter meshes: torch refuses custom comms there; re-raised as
ValueError naming the unit), and ``ReduceOp.PREMUL_SUM`` (``set_gradient_divide_factor``) under a lossy codec.
"""
from __future__ import annotations

import io
from typing import Any, Mapping, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

from ..comm import Channel
from ..compression import Codec
from ..config import TRAFFIC_PATHS, CommCompressionConfig

_DP_PATHS = ("dp_gradient", "dp_parameter")


class _PlainAlloc:
    """FSDP's ``Comm.allocate`` as its default: a plain temporary buffer per call."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain temporary buffer (as FSDP's default)."""
        return torch.empty(*size, dtype=dtype, device=device)


class CompressedReduceScatter(_PlainAlloc, ReduceScatter):
    """FSDP2's gradient reduce-scatter on a megacomp channel; error feedback under key ``key``."""

    def __init__(self, channel: Channel, key: str) -> None:
        self.channel, self.key = channel, key

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        return self.channel.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op,
                                                  key=self.key, tag="dp_gradient")


class CompressedAllGather(_PlainAlloc, AllGather):
    """FSDP2's parameter all-gather on a megacomp channel (no error feedback: nothing is summed)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        # FSDP waits only on a dist.Work: a compressed gather (whose handle decodes on wait) finishes here
        async_op = async_op and not self.channel.compresses(output_tensor.numel())
        return self.channel.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op,
                                                   tag="dp_parameter")


def _is_hsdp(module: FSDPModule) -> bool:
    state = module._get_fsdp_state()
    # HSDP / replicate units carry a DDPMeshInfo (HSDPMeshInfo subclasses it): FSDP all-reduces their shards
    return any(isinstance(g.mesh_info, DDPMeshInfo) for g in state._fsdp_param_groups)


class FSDPCompression:
    """Compressed FSDP2 communication from a ``CommCompressionConfig`` (see the module docstring).

    Args:
        config: a ``CommCompressionConfig`` or its mapping; ``dp_gradient`` (+ ``dp_gradient_error_feedback``),
            ``dp_parameter`` and ``min_compress_numel`` apply (PowerSGD/Accordion are not FSDP codecs).

    Raises:
        ValueError: lossy codecs on TP/PP paths (FSDP has none), PowerSGD or Accordion settings, or
            ``dp_gradient_warmup_steps`` (FSDP has no step counter to switch on).
    """

    def __init__(self, config: Union[CommCompressionConfig, Mapping[str, Any], None] = None) -> None:
        if not isinstance(config, CommCompressionConfig):
            config = CommCompressionConfig.from_dict(config)
        other = [p for p in TRAFFIC_PATHS if p not in _DP_PATHS and not getattr(config, p).is_identity]
        if other:
            raise ValueError(f"FSDP integration: {other} are not FSDP traffic (FSDP has a gradient reduce-scatter "
                             f"and a parameter all-gather); set them to none")
        if not isinstance(config.dp_gradient, Codec):
            raise ValueError("FSDP integration: dp_gradient must be an element-wise codec (PowerSGD and Accordion "
                             "work in megacomp's DDP hook and sharded optimizer, not in FSDP's flat buffers)")
        if config.dp_gradient_warmup_steps:
            raise ValueError("FSDP integration: dp_gradient_warmup_steps is not supported (FSDP has no step "
                             "counter); set it to 0")
        self.config = config
        ranked = config.for_rank(dist.get_rank()) if dist.is_initialized() else config
        self.channels = ranked.build_channels()
        self.units: dict[str, FSDPModule] = {}

    def apply(self, model: torch.nn.Module) -> "FSDPCompression":
        """Install the compressed collectives on every FSDP unit of ``model`` (including ``model`` itself).

        Raises:
            ValueError: no FSDP unit (call ``fully_shard`` first), a unit with several parameter groups, or a
                lossy dp_gradient on an HSDP unit.
        """
        grad, param = self.channels.dp_gradient, self.channels.dp_parameter
        for name, module in model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            name = name or "<root>"
            if grad.lossy and _is_hsdp(module):
                raise ValueError(f"FSDP unit {name!r} is HSDP: its replicate-dim all-reduce is not compressible "
                                 f"here; use 1-D FSDP or set dp_gradient to none")
            try:
                module.set_custom_reduce_scatter(CompressedReduceScatter(grad, f"fsdp/{name}"))
                module.set_custom_all_gather(CompressedAllGather(param))
            except ValueError as e:
                raise ValueError(f"FSDP unit {name!r}: torch refuses custom collectives here ({e}); megacomp's "
                                 f"FSDP compression needs one parameter group per unit (no per-parameter "
                                 f"meshes from shard_placement_fn)") from e
            self.units[name] = module
        if not self.units:
            raise ValueError("FSDPCompression.apply: the model has no FSDP unit; call fully_shard on its blocks and "
                             "on the model first")
        return self

    # -- checkpointing (DCP Stateful) ------------------------------------------------------------------
    def _mine(self) -> dict[str, Any]:
        return {"world": dist.get_world_size(), "units": sorted(self.units),
                "channels": {p: getattr(self.channels, p).state_dict() for p in _DP_PATHS}}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as one opaque entry ``rank<r>`` (DCP would deduplicate a plain tensor entry that
        every rank holds under the same name, keeping one rank's residuals only)."""
        buf = io.BytesIO()
        torch.save(self._mine(), buf)
        return {f"rank{dist.get_rank()}": buf.getvalue()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's entry. ValueError: no entry for this rank, another world size, other FSDP
        units or another codec."""
        key = f"rank{dist.get_rank()}"
        if key not in state:
            raise ValueError(f"FSDPCompression: the checkpoint has no state for {key} (saved with another world size?)")
        blob = state[key]
        saved = torch.load(io.BytesIO(blob), weights_only=True) if isinstance(blob, (bytes, bytearray)) else blob
        if saved["world"] != dist.get_world_size():
            raise ValueError(f"FSDPCompression: saved with {saved['world']} ranks, running with "
                             f"{dist.get_world_size()}; error-feedback residuals do not reshard")
        if saved["units"] != sorted(self.units):
            raise ValueError(f"FSDPCompression: saved for FSDP units {saved['units']}, this model has "
                             f"{sorted(self.units)}; call apply(model) on the same model before loading")
        for p in _DP_PATHS:
            getattr(self.channels, p).load_state_dict(saved["channels"][p])

    def __repr__(self) -> str:
        return (f"FSDPCompression(dp_gradient={self.channels.dp_gradient.codec}, "
                f"dp_parameter={self.channels.dp_parameter.codec}, units={len(self.units)})")


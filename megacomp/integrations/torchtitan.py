"""megacomp compression inside a torchtitan training job: FSDP2's gradient reduce-scatter and parameter
all-gather (megacomp.integrations.fsdp) and DTensor tensor parallelism's activations and gradients
(megacomp.integrations.dtensor_tp), from one ``CommCompressionConfig``.

    from megacomp.integrations.torchtitan import TorchTitanCompression
    model = model_spec.parallelize_fn(model, parallel_dims=parallel_dims, ...)   # torchtitan's TP + FSDP2
    comp = TorchTitanCompression({"tp_forward": "int8", "sp_all_gather": "int8", "sp_reduce_scatter": "int8",
                                  "tp_backward": "int8", "dp_gradient": "int4",
                                  "dp_gradient_error_feedback": "loco", "dp_parameter": "int8"},
                                 parallel_dims).apply(model)
    with comp:                                  # the TP collectives are megacomp's while inside
        ...                                     # torchtitan's forward / backward / optimizer step
    checkpointer states: {"megacomp": comp}     # a DCP Stateful: each rank's FSDP error-feedback residuals

What it takes from torchtitan: its ``ParallelDims`` (the ``tp`` mesh for the TP collectives; FSDP units are
found on the model) and the DTensor backend of its model-parallel axes: ``parallelism.spmd_backend =
"partial_dtensor"`` (torchtitan 0.3.0's ``Module.parallelize`` redistributes DTensors there, which is
where megacomp's TP seam sits). torchtitan's default backend in 0.3.0, ``"spmd_types"``, keeps activations
as plain tensors and issues its collectives through the ``spmd_types`` package instead of DTensor; a lossy
TP path with that backend raises ValueError saying to set ``partial_dtensor``.

FSDP2 on gloo: torchtitan sets every FSDP unit's gradient divide factor to 1 (it scales by the global token
count itself), which FSDP issues as ``ReduceOp.PREMUL_SUM``; gloo has no PREMUL_SUM and megacomp's lossy
reduce-scatter sums, so :meth:`TorchTitanCompression.apply` calls ``set_force_sum_reduction_for_comms(True)``
on every unit (FSDP then sums and multiplies by the factor, 1, locally). Do the same on a stock run you
compare against (``force_sum_reduction``).

Error bounds and compression off: those of the two integrations (each path's codec per collective; with
every path uncompressed the run is bit-identical to stock torchtitan, tested on the debug model).
Traffic is counted under its path (``tp_forward``, ``tp_backward``, ``sp_all_gather``, ``sp_reduce_scatter``,
``dp_gradient``, ``dp_parameter``) in ``megacomp.comm.stats()``.

Failure behaviour: a torchtitan other than 0.3 raises RuntimeError naming the supported version; lossy TP
paths without a ``tp`` mesh dimension > 1 or under the ``spmd_types`` backend, and lossy DP paths without
FSDP units, raise ValueError; the two integrations' own errors pass through.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional, Union

import torch

from ..config import TRAFFIC_PATHS, CommCompressionConfig
from .dtensor_tp import TP_PATHS, DTensorTPCompression
from .fsdp import FSDPCompression

SUPPORTED_TORCHTITAN = (0, 3)
"""The torchtitan release (major, minor) this integration is written and tested for (CI pins 0.3.0)."""
_DP_PATHS = ("dp_gradient", "dp_parameter")


def check_torchtitan_version() -> str:
    """torchtitan's version string; RuntimeError when it is not the supported release."""
    import torchtitan

    version = getattr(torchtitan, "__version__", "0.0.0")
    if tuple(int(p) for p in version.split(".")[:2]) != SUPPORTED_TORCHTITAN:
        raise RuntimeError(f"megacomp's torchtitan integration supports torchtitan "
                           f"{'.'.join(map(str, SUPPORTED_TORCHTITAN))}.x (tested 0.3.0), found {version}; "
                           f"install torchtitan==0.3.0")
    return version


def force_sum_reduction(model: torch.nn.Module) -> int:
    """Make every FSDP unit of ``model`` reduce with SUM and divide locally instead of ``PREMUL_SUM`` (what gloo
    and megacomp's reduce-scatter support); returns the number of units."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_force_sum_reduction_for_comms(True)
    return len(units)


class TorchTitanCompression:
    """FSDP2 and DTensor-TP compression of a torchtitan model (see the module docstring).

    Args:
        config: a ``CommCompressionConfig`` or its mapping (TP and DP paths; PP paths must stay none).
        parallel_dims: torchtitan's ``ParallelDims`` of the job (its meshes built).

    Raises:
        RuntimeError: unsupported torchtitan version.
        ValueError: lossy PP paths; lossy TP paths without TP or under the ``spmd_types`` backend.
    """

    def __init__(self, config: Union[CommCompressionConfig, Mapping[str, Any], None], parallel_dims) -> None:
        check_torchtitan_version()
        if not isinstance(config, CommCompressionConfig):
            config = CommCompressionConfig.from_dict(config)
        pp = [p for p in TRAFFIC_PATHS if p.startswith("pp_") and not getattr(config, p).is_identity]
        if pp:
            raise ValueError(f"torchtitan integration: {pp} are not covered (torchtitan's pipeline schedules send "
                             f"with torch.distributed directly); set them to none")
        lossy_tp = [p for p in TP_PATHS if not getattr(config, p).is_identity]
        if lossy_tp and not parallel_dims.tp_enabled:
            raise ValueError(f"torchtitan integration: {lossy_tp} are lossy but the job has no tensor parallelism "
                             f"(parallelism.tensor_parallel_degree = 1); set them to none")
        if lossy_tp and parallel_dims.spmd_backend == "spmd_types":
            raise ValueError("torchtitan integration: compressed TP needs parallelism.spmd_backend = "
                             "'partial_dtensor' (the 'spmd_types' backend issues its collectives outside DTensor)")
        self.config, self.parallel_dims = config, parallel_dims
        none = {p: None for p in TRAFFIC_PATHS}
        self.tp: Optional[DTensorTPCompression] = None
        if parallel_dims.tp_enabled:
            self.tp = DTensorTPCompression(replace(config, **{**none, **{p: getattr(config, p) for p in TP_PATHS}},
                                                   **{p + "_error_feedback": None for p in _DP_PATHS[:1]}),
                                           tp_mesh=parallel_dims.get_mesh("tp"))
        self.fsdp = FSDPCompression(replace(config, **{**none, **{p: getattr(config, p) for p in _DP_PATHS}}))
        self.model: Optional[torch.nn.Module] = None

    def apply(self, model: torch.nn.Module) -> "TorchTitanCompression":
        """Install the compressed collectives on the FSDP units of ``model`` (forcing SUM reductions, see the module
        docstring); the TP seam is installed by entering this object (``with comp:``) or :meth:`install`.
        ValueError: lossy DP paths and no FSDP unit."""
        lossy_dp = any(not getattr(self.config, p).is_identity for p in _DP_PATHS)
        if force_sum_reduction(model) or lossy_dp:
            self.fsdp.apply(model)
        self.model = model
        return self

    def install(self) -> "TorchTitanCompression":
        """Install the TP seam (DTensorTPCompression.install); a no-op without tensor parallelism."""
        if self.tp is not None:
            self.tp.install()
        return self

    def uninstall(self) -> None:
        """Remove the TP seam."""
        if self.tp is not None:
            self.tp.uninstall()

    def __enter__(self) -> "TorchTitanCompression":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # -- checkpointing (DCP Stateful, as torchtitan's CheckpointManager takes in ``states``) ----------------
    def state_dict(self) -> dict[str, Any]:
        """The FSDP integration's state (each rank's error-feedback residuals; TP keeps none)."""
        return self.fsdp.state_dict() if self.fsdp.units else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (ValueError as FSDPCompression.load_state_dict)."""
        if self.fsdp.units:
            self.fsdp.load_state_dict(state)

    def __repr__(self) -> str:
        return f"TorchTitanCompression(tp={self.tp!r}, fsdp={self.fsdp!r})"

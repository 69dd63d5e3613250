"""Compressed collectives and p2p on torch.distributed, with wire statistics.

Same names and arguments as torch.distributed plus keyword-only ``codec=`` (and ``error_feedback=`` for
the reducing collectives); ``codec=None`` is bit-identical to torch.distributed.
"""
from torch.distributed import ReduceOp

from ._common import CompressedWork, comm_device, error_feedback_states, set_validation
from .collectives import all_gather_into_tensor, all_reduce, all_to_all_single, reduce_scatter_tensor
from .p2p import irecv, isend, recv, send
from .stats import WireStats, reset_stats, stats
from .transport import set_duplex, set_pipeline_numel

__all__ = [
    "CompressedWork", "ReduceOp", "WireStats", "comm_device", "all_gather_into_tensor", "all_reduce", "all_to_all_single",
    "error_feedback_states", "irecv", "isend", "recv", "reduce_scatter_tensor", "reset_stats", "send",
    "set_duplex", "set_pipeline_numel", "set_validation", "stats",
]

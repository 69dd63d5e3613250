"""Pipeline parallelism: compressed stage-to-stage traffic, the 1F1B schedule and its interleaved form."""
from .interleaved import check_interleaving, forward_backward_pipelining_with_interleaving
from .communicator import PipelineCommunicator
from .schedules import forward_backward_pipelining_without_interleaving

__all__ = ["PipelineCommunicator", "check_interleaving", "forward_backward_pipelining_with_interleaving",
           "forward_backward_pipelining_without_interleaving"]

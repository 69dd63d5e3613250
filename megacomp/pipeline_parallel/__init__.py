"""Pipeline parallelism: compressed stage-to-stage traffic and the 1F1B schedule."""
from .p2p import PipelineCommunicator
from .schedules import forward_backward_pipelining_without_interleaving

__all__ = ["PipelineCommunicator", "forward_backward_pipelining_without_interleaving"]

"""Sharded optimizer with compressed gradients/parameters, loss scaling, the DDP comm hook, and DeMo."""
from .demo import DeMo
from .ddp_hook import CompressedHookState, compressed_allreduce_hook
from .distributed_optimizer import DistributedOptimizer, default_optimizer_class
from .frozen_adam import FrozenVarianceAdamW
from .loss_scaler import DynamicLossScaler
from .multi_timescale_adam import MultiTimescaleAdamW

__all__ = ["CompressedHookState", "DeMo", "DistributedOptimizer", "DynamicLossScaler", "FrozenVarianceAdamW",
           "MultiTimescaleAdamW", "compressed_allreduce_hook", "default_optimizer_class"]

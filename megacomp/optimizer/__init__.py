"""Sharded optimizer with compressed gradients/parameters, loss scaling, the DDP comm hook, DeMo and the 1-bit family."""
from .demo import DeMo
from .ddp_hook import CompressedHookState, compressed_allreduce_hook
from .distributed_optimizer import DistributedOptimizer, default_optimizer_class
from .frozen_adam import FrozenVarianceAdamW
from .loss_scaler import DynamicLossScaler
from .multi_timescale_adam import MultiTimescaleAdamW
from .onebit import OneBitAdam, OneBitLamb, OneBitOptimizer, ZeroOneAdam

__all__ = ["CompressedHookState", "DeMo", "DistributedOptimizer", "DynamicLossScaler", "FrozenVarianceAdamW",
           "MultiTimescaleAdamW", "OneBitAdam", "OneBitLamb", "OneBitOptimizer", "ZeroOneAdam",
           "compressed_allreduce_hook", "default_optimizer_class"]

"""Sharded optimizer with compressed gradients/parameters, loss scaling, the DDP comm hook, DeMo, the 1-bit family, LOMO and AdaLomo."""
from .demo import DeMo
from .ddp_hook import CompressedHookState, compressed_allreduce_hook
from .distributed_optimizer import DistributedOptimizer, default_optimizer_class
from .frozen_adam import FrozenVarianceAdamW
from .lomo import AdaLomo, Lomo
from .loss_scaler import DynamicLossScaler
from .multi_timescale_adam import MultiTimescaleAdamW
from .onebit import OneBitAdam, OneBitLamb, OneBitOptimizer, ZeroOneAdam

__all__ = ["AdaLomo", "CompressedHookState", "DeMo", "DistributedOptimizer", "DynamicLossScaler", "FrozenVarianceAdamW",
           "Lomo", "MultiTimescaleAdamW", "OneBitAdam", "OneBitLamb", "OneBitOptimizer", "ZeroOneAdam",
           "compressed_allreduce_hook", "default_optimizer_class"]

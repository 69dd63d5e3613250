"""The 1-bit optimizer family on the data-parallel optimizer: 1-bit Adam, 0/1 Adam and 1-bit LAMB.

``OneBitAdam``, ``ZeroOneAdam`` and ``OneBitLamb`` take DeepSpeed's hyperparameter names and defaults plus the
data-parallel group, the momentum codec (default: signs with one scale per chunk) or a ready momentum channel
(``momentum_channel``) and ``shard``; see
megacomp.optimizer.onebit.optimizer for the exchange, the bytes per step and the failure behaviour, and
megacomp.optimizer.onebit.momentum_path for the momentum codec's checks and channel.

Across nodes: the momentum and warm-up exchanges run flat over the DP group (each rank's signs cross the slow link
once per rank of the group on its node); hop-by-hop exchanges (megacomp.comm.hierarchical) are not wired here.
"""
from .momentum_path import DEFAULT_MOMENTUM_CODEC, resolve_momentum_setting
from .optimizer import OneBitAdam, OneBitLamb, OneBitOptimizer, ZeroOneAdam
from .rules import OneBitAdamRule, OneBitLambRule, ZeroOneAdamRule
from .schedule import FreezeSchedule, ZeroOneSchedule

__all__ = ["DEFAULT_MOMENTUM_CODEC", "FreezeSchedule", "OneBitAdam", "OneBitAdamRule", "OneBitLamb", "OneBitLambRule",
           "OneBitOptimizer", "ZeroOneAdam", "ZeroOneAdamRule", "ZeroOneSchedule", "resolve_momentum_setting"]

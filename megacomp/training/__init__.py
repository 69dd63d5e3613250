"""Pretraining: configuration, loop, checkpoints, metrics, divergence policy, exit signals."""
from .arguments import PretrainConfig, load_compression, parse_args
from .guard import DivergenceGuard, TrainingDiverged
from .trainer import Trainer, learning_rate

__all__ = ["DivergenceGuard", "PretrainConfig", "Trainer", "TrainingDiverged", "learning_rate", "load_compression",
           "parse_args"]

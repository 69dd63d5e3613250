"""Pretraining: configuration, loop, checkpoints, metrics."""
from .arguments import PretrainConfig, load_compression, parse_args
from .trainer import Trainer, learning_rate

__all__ = ["PretrainConfig", "Trainer", "learning_rate", "load_compression", "parse_args"]

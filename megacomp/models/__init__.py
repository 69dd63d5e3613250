"""Models built from the tensor-parallel layers."""
from .transformer import ParallelAttention, ParallelMLP, TransformerBlock, TransformerConfig

__all__ = ["ParallelAttention", "ParallelMLP", "TransformerBlock", "TransformerConfig"]

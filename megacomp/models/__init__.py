"""Models built from the tensor-parallel layers."""
from .llama import LLAMA_OPTIONS, llama_config
from .transformer import ParallelAttention, ParallelMLP, RMSNorm, TransformerBlock, TransformerConfig

__all__ = ["LLAMA_OPTIONS", "ParallelAttention", "ParallelMLP", "RMSNorm", "TransformerBlock", "TransformerConfig",
           "llama_config"]

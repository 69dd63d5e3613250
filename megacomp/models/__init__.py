"""Models built from the tensor-parallel layers."""
from .llama import LLAMA_OPTIONS, fc1_from_megatron, llama_config
from .transformer import ParallelAttention, ParallelMLP, RMSNorm, TransformerBlock, TransformerConfig

__all__ = ["LLAMA_OPTIONS", "ParallelAttention", "ParallelMLP", "RMSNorm", "TransformerBlock", "TransformerConfig",
           "fc1_from_megatron", "llama_config"]

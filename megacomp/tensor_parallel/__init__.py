"""Tensor parallelism with compressible communication: Megatron-core names, signatures and return values."""
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .loqt import LoQT, LoQTLinear, LoQTSchedule, convert_to_loqt, sync_optimizer
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region)
from .utils import allreduce_sequence_parallel_gradients, init_method_normal, scaled_init_method_normal

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "allreduce_sequence_parallel_gradients",
    "LoQT", "LoQTLinear", "LoQTSchedule", "convert_to_loqt", "sync_optimizer",
    "copy_to_tensor_model_parallel_region", "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region", "init_method_normal", "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "scaled_init_method_normal", "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region", "vocab_parallel_cross_entropy",
]

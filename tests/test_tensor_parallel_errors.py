"""Bad input to the tensor-parallel layers raises clear errors (megacomp.tensor_parallel)."""
import pytest
import torch

from distributed import run_ranks
from megacomp import parallel_state
from megacomp.config import ModelParallelConfig
from megacomp.models import TransformerConfig
from megacomp.models.transformer import ParallelAttention
from megacomp.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      vocab_parallel_cross_entropy)


def _errors_body(rank, world):
    parallel_state.initialize_model_parallel(2)
    cfg = ModelParallelConfig(tensor_model_parallel_size=2)
    sp = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear output_size \(7\) is not divisible by the tensor-parallel size \(2\)"):
        ColumnParallelLinear(4, 7, config=cfg)
    with pytest.raises(ValueError, match=r"RowParallelLinear input_size \(5\)"):
        RowParallelLinear(5, 4, config=cfg)
    with pytest.raises(ValueError, match=r"VocabParallelEmbedding num_embeddings \(33\)"):
        VocabParallelEmbedding(33, 4, config=cfg)
    with pytest.raises(ValueError, match="sequence_parallel requires input_is_parallel=True"):
        RowParallelLinear(8, 4, config=sp, input_is_parallel=False)
    with pytest.raises(ValueError, match="gather_output=True is incompatible with sequence_parallel"):
        ColumnParallelLinear(8, 4, config=sp, gather_output=True)
    with pytest.raises(ValueError, match=r"num_attention_heads \(3\) is not divisible"):
        ParallelAttention(TransformerConfig(hidden_size=12, num_attention_heads=3), cfg)
    col = ColumnParallelLinear(8, 4, config=cfg)
    with pytest.raises(ValueError, match=r"expects the input's last dim to be input_size=8, got shape \(2, 3, 6\)"):
        col(torch.randn(2, 3, 6))
    row = RowParallelLinear(8, 4, config=cfg)
    with pytest.raises(ValueError, match=r"input_size / tp = 4, got shape \(2, 3, 8\)"):
        row(torch.randn(2, 3, 8))  # the full input given where the shard is expected
    row_sp = RowParallelLinear(8, 4, config=sp)
    with pytest.raises(ValueError, match="sequence .* dim 3 is not divisible by the tensor-parallel size 2"):
        row_sp(torch.randn(3, 2, 4))
    emb = VocabParallelEmbedding(8, 4, config=cfg)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 8\)"):
        emb(torch.tensor([[1, 9]]))
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 8\)"):
        vocab_parallel_cross_entropy(torch.randn(2, 4), torch.tensor([1, 8]))
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_cross_entropy(torch.randn(2, 4), torch.tensor([1, 2, 3]))
    # the group is still healthy
    out, _ = col(torch.randn(2, 3, 8))
    assert out.shape == (2, 3, 2)
    parallel_state.destroy_model_parallel()
    return True


def test_bad_shapes_and_options_raise_clear_errors():
    assert all(run_ranks(_errors_body, 2))

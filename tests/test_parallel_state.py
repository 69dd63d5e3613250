"""Process-group layout (Megatron order: TP adjacent, then DP, then PP), façade and errors
(megacomp.parallel_state), and the configuration dataclasses (megacomp.config)."""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import parallel_state
from megacomp.config import CommCompressionConfig, ModelParallelConfig


def test_rank_grid_megatron_order():
    tp, dp, pp = parallel_state.rank_grid(8, 2, 2)
    assert tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tensor_model_parallel_size \(4\)"):
        parallel_state.rank_grid(6, 4, 1)


def _facade_body(rank, world):
    assert not parallel_state.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        parallel_state.get_tensor_model_parallel_group()
    g = parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert (g.tp_size, g.dp_size, g.pp_size) == (2, 1, 2)
    assert parallel_state.get_tensor_model_parallel_rank() == rank % 2
    assert parallel_state.get_pipeline_model_parallel_rank() == rank // 2
    assert parallel_state.get_data_parallel_world_size() == 1
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
    assert t.item() == (0 + 1 if rank < 2 else 2 + 3)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
    assert t.item() == (rank % 2) * 2 + 2
    with pytest.raises(RuntimeError, match="already initialised"):
        parallel_state.initialize_model_parallel(2)
    parallel_state.destroy_model_parallel()
    with pytest.raises(ValueError, match="not divisible"):
        parallel_state.initialize_model_parallel(3)
    g = parallel_state.initialize_model_parallel(1, 1)
    assert g.dp_size == 4
    # a config whose TP size disagrees with the group is refused by the layers
    with pytest.raises(ValueError, match="tensor-parallel group has 1 ranks but config.tensor_model_parallel_size is 2"):
        ModelParallelConfig(tensor_model_parallel_size=2).tp_group()
    parallel_state.destroy_model_parallel()
    return True


def test_facade_groups_and_errors():
    assert all(run_ranks(_facade_body, 4))


def test_compression_config():
    c = CommCompressionConfig.from_dict({"tp_forward": "int8", "dp_gradient": {"name": "int4", "block_size": 64},
                                         "dp_gradient_error_feedback": "loco", "pp_activation": "none"})
    assert c.tp_forward.name == "int8" and c.dp_gradient.block_size == 64 and c.pp_activation.is_identity
    assert c.dp_gradient_error_feedback.beta == 0.8
    ch = c.build_channels()  # one channel per path, each normalised once: a Codec, never None
    assert ch.tp_forward.codec_for(10).is_identity  # below min_compress_numel: uncompressed, by policy
    assert ch.tp_forward.codec_for(1 << 20).name == "int8"
    assert ch.tp_backward.codec_for(1 << 20).is_identity and ch.pp_activation.codec.is_identity
    assert ch.dp_gradient.error_feedback is not None and ch.tp_forward.error_feedback is None
    assert c.to_dict()["pp_activation"] is None
    assert CommCompressionConfig.from_dict(c.to_dict()).to_dict() == c.to_dict()
    with pytest.raises(ValueError, match=r"unknown CommCompressionConfig key\(s\) \['tp_fwd'\]"):
        CommCompressionConfig.from_dict({"tp_fwd": "int8"})
    with pytest.raises(ValueError, match="error feedback needs a lossy codec"):
        CommCompressionConfig(dp_gradient_error_feedback="loco")
    m = ModelParallelConfig.from_dict({"tensor_model_parallel_size": 2, "params_dtype": "bf16",
                                       "compression": {"tp_forward": "fp8_e4m3"}})
    assert m.params_dtype == torch.bfloat16 and m.compression.tp_forward.name == "fp8_e4m3"
    with pytest.raises(ValueError, match="unknown ModelParallelConfig key"):
        ModelParallelConfig.from_dict({"tensor_parallel": 2})


def test_compression_config_for_rank_gives_each_rank_its_own_stochastic_seed():
    """A YAML seed is the same on every rank; for_rank offsets it so that the ranks' stochastic-rounding
    draws differ (rank 0 keeps it), leaves unseeded codecs and the rest of the config as they are."""
    import torch

    c = CommCompressionConfig.from_dict({"dp_gradient": {"name": "int2", "rounding": "stochastic", "seed": 7},
                                         "tp_forward": "int8", "dp_gradient_error_feedback": "loco"})
    per_rank = [c.for_rank(r) for r in range(3)]
    assert per_rank[0].to_dict() == c.to_dict()
    assert len({p.dp_gradient.seed for p in per_rank}) == 3
    assert all(p.tp_forward is c.tp_forward and p.dp_gradient_error_feedback == c.dp_gradient_error_feedback
               for p in per_rank)
    x = torch.randn(4096)
    assert not torch.equal(per_rank[1].dp_gradient.encode_flat(x), per_rank[2].dp_gradient.encode_flat(x))
    assert c.dp_gradient.seed == 7  # the original is unchanged


def _stalled_peer_body(rank, world, minutes):
    """Rank 1 does not join rank 0's DP all-reduce: rank 0's collective must fail after the group's timeout, not
    torch's 30-minute default for a new group."""
    import time
    groups = parallel_state.build_process_groups(1, 1, distributed_timeout_minutes=minutes)
    waited = None
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1), group=groups.dp)
        waited = time.monotonic() - start
    else:
        time.sleep(minutes * 60 * 4)  # stalled well past the timeout, then gone
    return waited


def test_every_group_takes_the_configured_timeout():
    """The DP group of 2 ranks with a 1.2 s timeout: the all-reduce rank 1 never joins fails on rank 0 after about
    1.2 s (gloo measures it from the call; the bound allows a loaded machine 3 s more)."""
    waited, _ = run_ranks(_stalled_peer_body, 2, 0.02)
    assert 0.02 * 60 <= waited < 0.02 * 60 + 3.0, waited


def _inherited_timeout_body(rank, world):
    groups = parallel_state.build_process_groups(2, 1)
    own = parallel_state.build_process_groups(2, 1, distributed_timeout_minutes=0.5)
    with pytest.raises(ValueError, match="distributed_timeout_minutes must be > 0"):
        parallel_state.build_process_groups(2, 1, distributed_timeout_minutes=0)
    return parallel_state.default_group_timeout(), parallel_state.group_timeout(), groups.tp_size, own.tp_size


def test_groups_inherit_the_world_groups_timeout():
    """Without distributed_timeout_minutes every group takes the world group's timeout (run_ranks sets 60 s),
    the one --distributed-timeout-minutes sets."""
    from datetime import timedelta
    for world_timeout, inherited, tp, tp_own in run_ranks(_inherited_timeout_body, 2):
        assert world_timeout == inherited == timedelta(seconds=60) and tp == tp_own == 2

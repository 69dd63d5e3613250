"""megacomp.integrations.fsdp on real FSDP2 (torch's fully_shard, gloo, CPU).

- Compression off: parameters after AdamW steps bit-identical to stock FSDP2 at DP 2 and 4 (tiny GPT).
- Compression on: the reduce-scatter and the all-gather of FSDP's flat buffers within the codec's bound;
  LoCo int4 gradients + int8 parameters train and count their bytes; resume through DCP bit-identical.
- Bad input: non-FSDP paths, PowerSGD, no FSDP unit, several parameter groups per unit, another world
  size or codec on load.
"""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from codec_bounds import elementwise_bound, reduce_scatter_bound
from distributed import run_ranks
from megacomp import comm, parallel_state
from megacomp.compression import make_codec
from megacomp.config import ModelParallelConfig
from megacomp.integrations.fsdp import CompressedAllGather, CompressedReduceScatter, FSDPCompression
from megacomp.models.gpt import GPTConfig, GPTModel

V, L = 64, 16
LOSSY = {"dp_gradient": {"name": "int4", "block_size": 64}, "dp_gradient_error_feedback": "loco",
         "dp_parameter": {"name": "int8", "block_size": 64}, "min_compress_numel": 0}


def _gpt():
    groups = parallel_state.initialize_model_parallel(1, 1)
    cfg = GPTConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_layers=2, vocab_size=V,
                    max_seq_length=L, seed=7)
    model = GPTModel(cfg, ModelParallelConfig(process_groups=groups))
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def _steps(model, opt, first, count):
    losses = []
    for it in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * it + dist.get_rank())
        ids = torch.randint(0, V, (2, L), generator=g)
        loss = model(ids, torch.roll(ids, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _params(model):
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def _off_body(rank, world):
    out = {}
    for mode in ("stock", "megacomp"):
        model = _gpt()
        if mode == "megacomp":
            comp = FSDPCompression(None).apply(model)
            assert set(comp.units) == {"<root>", "layers.0", "layers.1"}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        comm.reset_stats()
        _steps(model, opt, 0, 3)
        out[mode] = _params(model)
        counted = comm.stats()
        parallel_state.destroy_model_parallel()
    differ = [n for n in out["stock"] if not torch.equal(out["stock"][n], out["megacomp"][n])]
    assert not differ, differ
    return sorted(counted)


@pytest.mark.parametrize("world", [2, 4])
def test_compression_off_is_bit_identical_to_stock_fsdp2(world):
    for paths in run_ranks(_off_body, world, timeout=240):
        assert {"dp_gradient", "dp_parameter"} <= set(paths)  # the traffic went through megacomp's channels


def _bound_body(rank, world, spec):
    codec = make_codec(spec)
    comp = FSDPCompression({"dp_gradient": spec, "dp_parameter": spec, "min_compress_numel": 0})
    g = torch.Generator().manual_seed(rank)
    n = 4096
    full = torch.randn(world * n, generator=g) * torch.logspace(-3, 1, world * n)  # mixed magnitudes
    out = torch.empty(n)
    CompressedReduceScatter(comp.channels.dp_gradient, "k")(out, full.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    parts = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(parts, full)
    chunks = [p[rank * n:(rank + 1) * n] for p in parts]
    exact = sum(c.double() for c in chunks) / world
    ok_rs = ((out.double() - exact).abs() <= reduce_scatter_bound(codec, chunks) / world * (1 + 2 ** -20)).all().item()
    shards = [p[r * n:(r + 1) * n] for r, p in enumerate(parts)]  # rank r's shard: its own chunk r
    gathered = torch.empty(world * n)
    CompressedAllGather(comp.channels.dp_parameter)(gathered, shards[rank].clone(), dist.group.WORLD, async_op=True)
    ok_ag = all(((gathered[r * n:(r + 1) * n].double() - shards[r].double()).abs()
                 <= elementwise_bound(codec, shards[r])).all().item() for r in range(world))
    return ok_rs, ok_ag, not torch.equal(gathered[:n], shards[0])


@pytest.mark.parametrize("spec", [dict(name="int8", block_size=64), dict(name="int4", block_size=32)],
                         ids=["int8", "int4"])
def test_compressed_fsdp_collectives_are_within_the_codec_bound(spec):
    for ok_rs, ok_ag, lossy in run_ranks(_bound_body, 2, spec):
        assert ok_rs and ok_ag and lossy


def _resume_body(rank, world, path):
    def build():
        model = _gpt()
        comp = FSDPCompression(LOSSY).apply(model)
        return model, comp, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, comp, opt = build()
    comm.reset_stats()
    _steps(model, opt, 0, 3)
    wire = comm.stats()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "megacomp": comp}, checkpoint_id=path)
    keys = sorted(comp.channels.dp_gradient.error_feedback.keys())
    straight = _steps(model, opt, 3, 2), _params(model)
    parallel_state.destroy_model_parallel()

    model, comp, opt = build()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "megacomp": comp}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = _steps(model, opt, 3, 2), _params(model)
    parallel_state.destroy_model_parallel()
    assert straight[0] == resumed[0]
    differ = [n for n in straight[1] if not torch.equal(straight[1][n], resumed[1][n])]
    assert not differ, differ
    grad = wire["dp_gradient"]
    return keys, grad.wire_bytes / grad.uncompressed_bytes, wire["dp_parameter"].ratio


def test_lossy_training_counts_its_bytes_and_resumes_bit_for_bit_through_dcp(tmp_path):
    for keys, grad_ratio, param_ratio in run_ranks(_resume_body, 2, str(tmp_path / "ckpt"), timeout=240):
        assert keys == ["fsdp/<root>/worker", "fsdp/layers.0/worker", "fsdp/layers.1/worker"]
        # int4 + one fp32 scale per 64 values: (4 + 32/64) / 32 of fp32; int8 + scale: (8 + 0.5) / 32
        assert grad_ratio == pytest.approx(4.5 / 32, rel=0.02) and param_ratio == pytest.approx(8.5 / 32, rel=0.02)


def _bad_body(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    with pytest.raises(ValueError, match="no FSDP unit"):
        FSDPCompression(None).apply(torch.nn.Linear(4, 4))
    # two meshes (process groups) in one unit: torch makes two parameter groups and refuses custom collectives
    other = FSDPMeshInfo(mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))["a"], shard_mesh_dim=0)
    two = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(two, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p is two[1].weight else None)
    with pytest.raises(ValueError, match="one parameter group per unit"):
        FSDPCompression(None).apply(two)
    model = _gpt()
    comp = FSDPCompression(LOSSY).apply(model)
    state = comp.state_dict()
    with pytest.raises(ValueError, match="codec"):
        FSDPCompression(dict(LOSSY, dp_parameter="int4")).apply(model).load_state_dict(state)
    with pytest.raises(ValueError, match="no state for rank"):
        comp.load_state_dict({"rank9": b""})
    parallel_state.destroy_model_parallel()
    return True


def test_bad_input_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not FSDP traffic"):
        FSDPCompression({"tp_forward": "int8"})
    with pytest.raises(ValueError, match="element-wise codec"):
        FSDPCompression({"dp_gradient": {"name": "powersgd", "rank": 2}})
    with pytest.raises(ValueError, match="warmup"):
        FSDPCompression({"dp_gradient": "int4", "dp_gradient_warmup_steps": 3})
    assert all(run_ranks(_bad_body, 4, str(tmp_path), timeout=240))  # 4: a 2-rank mesh is another group

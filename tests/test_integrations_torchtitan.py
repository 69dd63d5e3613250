"""megacomp.integrations.dtensor_tp and .torchtitan on real DTensor tensor parallelism (gloo, CPU).

- Compression off: a ColwiseParallel -> RowwiseParallel MLP (with and without sequence parallelism) gives outputs,
  input gradients and weight gradients bit-identical to stock DTensor, and its collectives are counted under
  tp_forward / tp_backward / sp_all_gather / sp_reduce_scatter.
- Compression on: each placement change (Partial -> Replicate, Partial -> Shard, Shard -> Replicate) within its
  codec's bound against the exact collective.
- Bad input: lossy non-TP paths, TP error feedback, a second install, torchtitan's spmd_types backend.

The torchtitan example (examples/torchtitan_llama3.py: TP 2 x FSDP 2 on 4 ranks, compression off equal to stock
torchtitan loss by loss, TP bytes counted) runs in CI through scripts/run_examples.sh, not here (about 3 minutes).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from codec_bounds import all_reduce_bound, elementwise_bound, reduce_scatter_bound
from distributed import run_ranks
from megacomp import comm
from megacomp.compression import make_codec
from megacomp.integrations.dtensor_tp import DTensorTPCompression

INT8 = {"name": "int8", "block_size": 32}
LOSSY = {"tp_forward": INT8, "tp_backward": INT8, "sp_all_gather": INT8, "sp_reduce_scatter": INT8,
         "min_compress_numel": 0}


def _mlp_run(mesh, sp: bool, comp):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    plan = ({"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))} if sp
            else {"0": ColwiseParallel(), "2": RowwiseParallel()})
    parallelize_module(mlp, mesh, plan)
    g = torch.Generator().manual_seed(1)  # the same full input on both ranks; SP ranks take their sequence shard
    x = torch.randn(2, 8, 16, generator=g)
    if sp:
        x = x.chunk(mesh.size(), dim=1)[mesh.get_local_rank()].contiguous()
    x.requires_grad_(True)
    with comp if comp is not None else _Nothing():
        y = mlp(x)
        (y * torch.arange(y.numel()).view_as(y).float().sin()).sum().backward()
    return {"y": y.detach().clone(), "dx": x.grad.clone(),
            **{n: p.grad.to_local().clone() for n, p in mlp.named_parameters()}}


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _off_body(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for sp in (False, True):
        stock = _mlp_run(mesh, sp, None)
        comm.reset_stats()
        ours = _mlp_run(mesh, sp, DTensorTPCompression({}, tp_mesh=mesh))
        differ = [k for k in stock if not torch.equal(stock[k], ours[k])]
        assert not differ, f"sp={sp}: {differ} differ from stock DTensor"
        out[sp] = sorted(p for p, s in comm.stats().items() if s.calls)
    return out


@pytest.mark.slow
def test_compression_off_is_bit_identical_to_stock_dtensor_tp():
    for paths in run_ranks(_off_body, 2, timeout=120):
        assert {"tp_forward", "tp_backward"} <= set(paths[False])  # RowwiseParallel's all-reduce, dgrad all-reduce
        assert {"sp_all_gather", "sp_reduce_scatter", "tp_backward"} <= set(paths[True])


def _lossy_body(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    codec = make_codec(INT8)
    g = torch.Generator().manual_seed(10 + rank)
    partial = torch.randn(4, 6, 32, generator=g)
    parts = [torch.empty_like(partial) for _ in range(world)]
    dist.all_gather(parts, partial)
    exact = sum(p.double() for p in parts)
    comp = DTensorTPCompression(LOSSY, tp_mesh=mesh)
    comm.reset_stats()
    with comp:
        full = DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
        shard = DTensor.from_local(partial, mesh, [Partial()]).redistribute(mesh, [Shard(1)]).to_local()
        gathered = DTensor.from_local(partial, mesh, [Shard(1)]).redistribute(mesh, [Replicate()]).to_local()
    assert ((full.double() - exact).abs() <= all_reduce_bound(codec, parts)).all()
    # reduce-scatter along dim 1: this rank's slice of dim 1, each rank's chunk encoded on its own
    mine = [p.chunk(world, 1)[rank] for p in parts]
    bound = reduce_scatter_bound(codec, [m.movedim(1, 0).contiguous() for m in mine]).view(
        mine[0].movedim(1, 0).shape).movedim(0, 1)
    assert ((shard.double() - exact.chunk(world, 1)[rank]).abs() <= bound).all()
    for r in range(world):  # all-gather along dim 1: each shard within the codec's bound on that shard
        flat = parts[r].movedim(1, 0).contiguous()
        b = elementwise_bound(codec, flat).view(flat.shape).movedim(0, 1)
        got = gathered[:, r * 6:(r + 1) * 6]
        assert ((got.double() - parts[r].double()).abs() <= b).all()
    s = comm.stats()
    assert all(s[p].wire_bytes < s[p].uncompressed_bytes for p in ("tp_forward", "sp_reduce_scatter", "sp_all_gather"))

    # bad input
    with pytest.raises(ValueError, match="not tensor-parallel traffic"):
        DTensorTPCompression({"dp_gradient": "int4"}, tp_mesh=mesh)
    with pytest.raises(ValueError, match="no per-call identity"):
        DTensorTPCompression({"tp_backward": "int4", "tp_backward_error_feedback": "ef"}, tp_mesh=mesh)
    with comp, pytest.raises(RuntimeError, match="another DTensorTPCompression is installed"):
        DTensorTPCompression({}, tp_mesh=mesh).install()
    assert not comp.installed and not getattr(Partial._reduce_value, "__megacomp_dtensor_tp__", False)
    return True


def test_lossy_placement_changes_within_codec_bound_and_bad_input():
    assert all(run_ranks(_lossy_body, 2, timeout=120))


def test_torchtitan_integration_refuses_what_it_cannot_compress():
    pytest.importorskip("torchtitan")
    from torchtitan.distributed import ParallelDims

    from megacomp.integrations.torchtitan import TorchTitanCompression, check_torchtitan_version

    assert check_torchtitan_version().startswith("0.3")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2, spmd_backend="spmd_types")
    with pytest.raises(ValueError, match="partial_dtensor"):
        TorchTitanCompression({"tp_forward": "int8"}, dims)
    with pytest.raises(ValueError, match="pipeline"):
        TorchTitanCompression({"pp_activation": "int8"}, dims)
    no_tp = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=2,
                         spmd_backend="partial_dtensor")
    with pytest.raises(ValueError, match="no tensor parallelism"):
        TorchTitanCompression({"sp_all_gather": "int8"}, no_tp)

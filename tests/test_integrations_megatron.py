"""megacomp.integrations.megatron against unpatched megatron-core (0.16.1, CPU, gloo).

- Compression off: forward outputs and every gradient bit-identical to unpatched megatron-core at TP 2 and 4
  (embedding, column, frozen column, row), and again after uninstall.
- Sequence parallelism (megatron-core's own path asserts CUDA on CPU): with the integration, compression
  off equals the non-sequence-parallel run bit for bit at TP 2.
- Compression on: the row layer's forward all-reduce and the column layer's input-gradient all-reduce within
  the codec's propagated bound (tests/codec_bounds.py), error feedback keyed per weight and checkpointed.
- Bad input: unsupported version, changed signature, installing twice, lossy non-TP paths, uneven splits and
  gradient-accumulation fusion under a lossy codec.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

from codec_bounds import all_reduce_bound
from distributed import run_ranks

pytest.importorskip("megatron.core", reason="CI installs megatron-core==0.16.1 (scripts/install.sh test)")
warnings.filterwarnings("ignore", module="megatron")

from megacomp.integrations.megatron import MegatronCompression, check_megatron_version  # noqa: E402

S, B, H, F, V = 8, 2, 16, 32, 24


def _init(std=0.02):
    return lambda w: torch.nn.init.normal_(w, std=std)


def _build(sp=False):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer import TransformerConfig

    from megatron.core import parallel_state as ps

    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(), sequence_parallel=sp)
    torch.manual_seed(0)
    mods = torch.nn.ModuleDict(dict(
        emb=VocabParallelEmbedding(V, H, init_method=_init(1.0), config=cfg),
        col=ColumnParallelLinear(H, F, config=cfg, init_method=_init(), bias=True, gather_output=False),
        frozen=ColumnParallelLinear(H, F, config=cfg, init_method=_init(), bias=False, gather_output=False),
        row=RowParallelLinear(F, H, config=cfg, init_method=_init(), bias=True, input_is_parallel=True,
                              skip_bias_add=False)))
    mods["frozen"].weight.requires_grad_(False)
    return mods


def _run(mods, sp=False):
    """tokens [b, s] -> embedding -> [s, b, h] -> col (+ frozen col) -> row; returns output and all gradients."""
    torch.manual_seed(1)
    tokens = torch.randint(0, V, (B, S))
    x = mods["emb"](tokens).transpose(0, 1).contiguous()  # [s, b, h], as megatron's embedding module does
    torch.manual_seed(2)
    grad = torch.randn(S, B, H)
    if sp:  # each TP rank holds its sequence slice of the activations and of their gradients
        from megatron.core import parallel_state as ps
        tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        x, grad = x.chunk(tp, dim=0)[r].contiguous(), grad.chunk(tp, dim=0)[r].contiguous()
    x = x.detach().requires_grad_()
    h = mods["col"](x)[0] + mods["frozen"](x)[0]
    out = mods["row"](torch.nn.functional.gelu(h))[0]
    out.backward(grad)
    grads = {n: p.grad.clone() for n, p in mods.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


def _equal(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "output or input gradient differs"
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2]), \
        [k for k in a[2] if not torch.equal(a[2][k], b[2].get(k, torch.empty(0)))]


def _off_body(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers, mappings
    from megacomp import comm

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    stock = _run(_build())
    originals = (mappings.copy_to_tensor_model_parallel_region, layers.linear_with_grad_accumulation_and_async_allreduce)
    comm.reset_stats()
    with MegatronCompression(None) as comp:
        assert comp.installed and layers.reduce_from_tensor_model_parallel_region.__self__ is comp
        patched = _run(_build())
    counted = comm.stats()
    assert (mappings.copy_to_tensor_model_parallel_region, layers.linear_with_grad_accumulation_and_async_allreduce) \
        == originals and not comp.installed
    after = _run(_build())
    _equal(stock, patched)
    _equal(stock, after)
    ps.destroy_model_parallel()
    return sorted(counted)


@pytest.mark.parametrize("world", [2, 4])
def test_compression_off_is_bit_identical_to_megatron_core_and_uninstall_restores_it(world):
    for paths in run_ranks(_off_body, world, timeout=240):
        assert {"tp_forward", "tp_backward"} <= set(paths), paths  # the traffic went through megacomp's channels


def _sp_body(rank, world):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    with MegatronCompression(None):
        dense = _run(_build())
        seq = _run(_build(sp=True), sp=True)
    ps.destroy_model_parallel()
    rows = slice(rank * S // world, (rank + 1) * S // world)
    assert torch.equal(seq[0], dense[0][rows]) and torch.equal(seq[1], dense[1][rows])
    # the row bias is added to each rank's sequence slice, so its gradient is partial (megatron marks it
    # sequence_parallel and its finalize_model_grads all-reduces it over TP): the sum of the partial sums
    # differs from the one sum only by fp32 summation order, at most (S*B) ulps of sum |dY| per element
    bias = seq[2].pop("row.bias")
    dist.all_reduce(bias)
    torch.manual_seed(2)
    order = S * B * 2.0 ** -24 * torch.randn(S, B, H).abs().sum((0, 1))
    assert ((bias - dense[2].pop("row.bias")).abs() <= order).all()
    differ = [k for k in dense[2] if not torch.equal(seq[2][k], dense[2][k])]
    assert not differ, differ
    return True


def test_sequence_parallel_runs_on_cpu_and_matches_the_dense_layout():
    assert all(run_ranks(_sp_body, 2, timeout=240))


def _gathered(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def _bound_body(rank, world, codec):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megacomp.compression import make_codec

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True)
    torch.manual_seed(0)
    col = ColumnParallelLinear(H, F, config=cfg, init_method=_init(), bias=False, gather_output=False)
    row = RowParallelLinear(F, H, config=cfg, init_method=_init(), bias=False, input_is_parallel=True, skip_bias_add=False)
    torch.manual_seed(1)
    x, y_in, g = torch.randn(S, B, H), torch.randn(S, B, F // world), torch.randn(S, B, F // world)
    comp = MegatronCompression({"tp_forward": codec, "tp_backward": codec, "min_compress_numel": 0})
    with comp:
        out = row(y_in)[0]
        xr = x.clone().requires_grad_()
        col(xr)[0].backward(g)
    # the exact values and each rank's partial, in fp64
    partial_out = (y_in.double() @ row.weight.double().t()).float()
    partial_dx = (g.double() @ col.weight.double()).float()
    exact_out, exact_dx = sum(p.double() for p in _gathered(partial_out)), sum(p.double() for p in _gathered(partial_dx))
    c = make_codec(codec)
    err_out, err_dx = (out.double() - exact_out).abs(), (xr.grad.double() - exact_dx).abs()
    ok_out = (err_out <= all_reduce_bound(c, _gathered(partial_out))).all().item()
    ok_dx = (err_dx <= all_reduce_bound(c, _gathered(partial_dx))).all().item()
    ps.destroy_model_parallel()
    return ok_out, ok_dx, err_out.max().item() > 0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("codec", [dict(name="int8", block_size=32), dict(name="int4", block_size=16)],
                         ids=["int8", "int4"])
def test_compressed_tp_traffic_is_within_the_codec_bound(world, codec):
    for ok_out, ok_dx, lossy in run_ranks(_bound_body, world, codec, timeout=240):
        assert ok_out and ok_dx and lossy


def _ef_body(rank, world):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    spec = {"tp_backward": {"name": "int4", "block_size": 16}, "tp_backward_error_feedback": "ef",
            "min_compress_numel": 0}
    mods = _build()
    comp = MegatronCompression(spec).register(mods)
    with comp:
        _run(mods)
    keys = sorted(comp.channels.tp_backward.error_feedback.keys())
    fresh = MegatronCompression(spec)
    fresh.load_state_dict(comp.state_dict())
    same = all(torch.equal(fresh.channels.tp_backward.error_feedback.error(k), comp.channels.tp_backward.error_feedback.error(k))
               for k in keys)
    with pytest.raises(ValueError, match="codec"):
        MegatronCompression({"tp_backward": "int8", "tp_backward_error_feedback": "ef"}).load_state_dict(comp.state_dict())
    ps.destroy_model_parallel()
    return keys, same


def test_error_feedback_is_keyed_per_weight_and_checkpointed():
    keys, same = run_ranks(_ef_body, 2, timeout=240)[0]
    # the dgrad all-reduce of each trainable and frozen column layer; the row layer's input grad needs none
    assert keys == ["megatron/col.weight/worker", "megatron/frozen.weight/worker"] and same


def test_bad_input_is_refused_with_a_clear_error(monkeypatch):
    import megatron.core as mcore
    from megatron.core.tensor_parallel import mappings

    assert check_megatron_version() == "0.16.1"
    with pytest.raises(ValueError, match="not tensor-parallel paths"):
        MegatronCompression({"dp_gradient": "int4"})
    first = MegatronCompression(None).install()
    try:
        with pytest.raises(RuntimeError, match="already installed"):
            MegatronCompression(None).install()
    finally:
        first.uninstall()
    first.uninstall()  # idempotent
    lossy = MegatronCompression({"sp_all_gather": "int8", "tp_backward": "int8"})
    with pytest.raises(ValueError, match="uneven splits"):
        lossy._gather_from_sequence_parallel_region(torch.zeros(3, 2), output_split_sizes=[1, 2])
    with pytest.raises(ValueError, match="gradient_accumulation_fusion"):
        lossy._linear_with_grad_accumulation_and_async_allreduce(torch.zeros(2, 4), torch.zeros(3, 4), None, True,
                                                                 False, False)
    monkeypatch.setattr(mcore, "__version__", "0.15.2")
    with pytest.raises(RuntimeError, match="0.15.2 is not supported.*0.16.1"):
        MegatronCompression(None).install()
    monkeypatch.setattr(mcore, "__version__", "0.16.1")
    monkeypatch.setattr(mappings, "copy_to_tensor_model_parallel_region", lambda x, group=None, extra=1: x)
    with pytest.raises(RuntimeError, match="copy_to_tensor_model_parallel_region has parameters"):
        MegatronCompression(None).install()
    assert not hasattr(mappings, "_megacomp_installed")

"""megacomp.integrations.megatron against unpatched megatron-core (0.16.1 on Python 3.11, 0.19.2 on 3.12; CPU, gloo).

- Compression off: forward outputs and every gradient bit-identical to unpatched megatron-core at TP 2 and 4
  (embedding, column, frozen column, row), and again after uninstall.
- Sequence parallelism (megatron-core's own path asserts CUDA on CPU): with the integration, compression
  off equals the non-sequence-parallel run bit for bit at TP 2.
- On a GPU (skipped without CUDA): stock megatron-core's sequence-parallel path against the integration,
  compression off bit for bit (TP 2, two spawned gloo ranks sharing the GPU; TP 1 without sequence
  parallelism, which megatron-core refuses there), and int8 on the sequence-parallel all-gather,
  reduce-scatter and input-gradient reduce-scatter within the codec's bound.
- Compression on: the row layer's forward all-reduce and the column layer's input-gradient all-reduce within
  the codec's propagated bound (tests/codec_bounds.py), error feedback keyed per weight and checkpointed.
- Bad input: unsupported versions (the refusal lists the supported ones), changed signature, installing twice, lossy non-TP paths, uneven splits and
  gradient-accumulation fusion under a lossy codec.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

from codec_bounds import all_reduce_bound
from distributed import run_ranks

pytest.importorskip("megatron.core", reason="CI installs megatron-core==0.16.1 (scripts/install.sh test; "
                                              "0.19.2 in scripts/ci_py312.sh)")
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


def _run(mods, sp=False, device="cpu"):
    """tokens [b, s] -> embedding -> [s, b, h] -> col (+ frozen col) -> row; returns output and all gradients.
    Inputs are drawn on the CPU and moved to ``device`` (the same values on any device)."""
    torch.manual_seed(1)
    tokens = torch.randint(0, V, (B, S)).to(device)
    x = mods["emb"](tokens).transpose(0, 1).contiguous()  # [s, b, h], as megatron's embedding module does
    torch.manual_seed(2)
    grad = torch.randn(S, B, H).to(device)
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

    assert check_megatron_version() == mcore.__version__  # 0.16.1 (Python 3.11) or 0.19.2 (the Python 3.12 leg)
    with pytest.raises(ValueError, match="not tensor- or data-parallel paths"):
        MegatronCompression({"pp_activation": "int4"})
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
    for other in ("0.15.2", "0.17.1", "0.20.0"):  # untested releases, before, between and after
        monkeypatch.setattr(mcore, "__version__", other)
        with pytest.raises(RuntimeError, match=f"{other} is not supported.*supported: 0.16.x, 0.19.x"):
            MegatronCompression(None).install()
    for tested in ("0.16.1", "0.19.2"):
        monkeypatch.setattr(mcore, "__version__", tested)
        assert check_megatron_version() == tested
    monkeypatch.setattr(mappings, "copy_to_tensor_model_parallel_region", lambda x, group=None, extra=1: x)
    with pytest.raises(RuntimeError, match="copy_to_tensor_model_parallel_region has parameters"):
        MegatronCompression(None).install()
    assert not hasattr(mappings, "_megacomp_installed")


# -- sequence parallelism against megatron-core's own path, on a GPU --------------------------------------------
# megatron-core's sequence-parallel code allocates its buffers with device=torch.cuda.current_device(), which
# asserts on a CPU-only torch, so stock megatron-core runs sequence parallelism only where there is a GPU.
# The ranks are spawned, not forked (a forked child cannot use CUDA once the parent touched it, as pytest's
# process may have), and talk over gloo: NCCL refuses two ranks on one GPU, and gloo carries CUDA tensors
# (its all-reduce and all-gather stage them through host memory; its reduce-scatter is a cloned all-reduce).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="megatron-core's sequence-parallel path allocates on CUDA: needs a GPU")


def _spawned_worker(fn, rank, world, init_file, args, queue):
    import os
    import traceback
    from datetime import timedelta

    try:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # what megatron-core asks for under sequence parallelism
        torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU: every rank shares device 0
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        queue.put((rank, True, fn(rank, world, "cuda", *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_spawned(fn, world, *args, timeout=300.0):
    """``fn(rank, world, "cuda", *args)`` on ``world`` spawned gloo ranks with CUDA; their (picklable) results."""
    import multiprocessing as mp
    import os
    import queue as queue_mod
    import tempfile
    import time

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="megacomp-pg-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_spawned_worker, args=(fn, r, world, init_file, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            try:
                rank, ok, value = queue.get(timeout=0.5)
                (results if ok else errors)[rank] = value
            except queue_mod.Empty:
                pass
            for r, p in enumerate(procs):  # a rank that died without reporting (a crash inside a collective)
                if r not in results and r not in errors and not p.is_alive() and queue.empty():
                    errors[r] = f"rank {r} exited with code {p.exitcode} without reporting"
            if errors:  # the others may wait in a collective for the failed rank: a short grace period
                deadline = min(deadline, time.monotonic() + 10.0)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(results) - set(errors))
                errors.update({r: f"rank {r} did not finish in time (hang?)" for r in missing})
                break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    assert not errors, "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
    return [results[r] for r in range(world)]


def _sp_stock_body(rank, world, device):
    """Stock megatron-core, then the same layers with MegatronCompression installed (every path uncompressed),
    then stock again after uninstall: outputs, the input gradient and every parameter gradient equal bit for bit.
    Sequence parallel at TP > 1 (megatron-core refuses it at TP 1, where the layers run without it)."""
    from megatron.core import parallel_state as ps
    from megacomp import comm

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    sp = world > 1
    stock = _run(_build(sp).to(device), sp, device)
    comm.reset_stats()
    with MegatronCompression(None):
        patched = _run(_build(sp).to(device), sp, device)
    counted = sorted(comm.stats())
    after = _run(_build(sp).to(device), sp, device)
    ps.destroy_model_parallel()
    assert stock[0].device.type == patched[0].device.type == torch.device(device).type
    assert stock[0].shape[0] == S // world  # each rank's sequence slice under sequence parallelism
    _equal(stock, patched)
    _equal(stock, after)
    return counted


@needs_cuda
@pytest.mark.parametrize("world", [1, 2, 4], ids=["tp1", "tp2_sp", "tp4_sp"])
def test_cuda_compression_off_is_bit_identical_to_megatron_core_with_sequence_parallel(world):
    if world == 1:  # why TP 1 has no sequence-parallel case: megatron-core's config refuses it
        from megatron.core.transformer import TransformerConfig

        with pytest.raises(ValueError, match="sequence parallelism without tensor parallelism"):
            TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, sequence_parallel=True)
    for paths in _run_spawned(_sp_stock_body, world):
        # the traffic went through megacomp's channels (at TP 1 there is none: every mapping returns its input)
        want = {"sp_all_gather", "sp_reduce_scatter", "tp_backward", "tp_forward"} if world > 1 else set()
        assert want <= set(paths), paths


def _sp_bound_body(rank, world, device, codec):
    """Column then row layer under sequence parallelism with ``codec`` on sp_all_gather, sp_reduce_scatter and
    tp_backward, against fp64 values: the row's forward reduce-scatter and the column's input-gradient
    reduce-scatter within the sum of each rank's codec bound on its chunk, the column's output within the
    all-gathered input's codec bound carried through |W| (plus the fp32 dot products' round-off)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megacomp.compression import make_codec

    from codec_bounds import FP32_ULP, elementwise_bound, reduce_scatter_bound

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=world, sequence_parallel=True)
    torch.manual_seed(0)
    col = ColumnParallelLinear(H, F, config=cfg, init_method=_init(), bias=False, gather_output=False).to(device)
    row = RowParallelLinear(F, H, config=cfg, init_method=_init(), bias=False, input_is_parallel=True,
                            skip_bias_add=False).to(device)
    torch.manual_seed(1)
    x_full = torch.randn(S, B, H)  # the same on every rank; each holds its sequence slice
    torch.manual_seed(2 + rank)
    y_in, g = torch.randn(S, B, F // world), torch.randn(S, B, F // world)  # TP-sharded activations
    # duplex off: the encoded bytes travel by gloo's all-to-all / all-gather, which stage CUDA tensors through
    # host memory; gloo's point-to-point sends (megacomp's default transport on gloo) take CPU tensors only
    comp = MegatronCompression({"sp_all_gather": codec, "sp_reduce_scatter": codec, "tp_backward": codec,
                                "min_compress_numel": 0, "duplex": False})
    with comp:
        out_row = row(y_in.to(device))[0]
        xr = x_full.chunk(world)[rank].contiguous().to(device).requires_grad_()
        out_col = col(xr)[0]
        out_col.backward(g.to(device))
    c = make_codec(codec)
    wr, wc = row.weight.detach().cpu().double(), col.weight.detach().cpu().double()  # [H, F/tp], [F/tp, H]
    m = S * B * H // world  # a reduce-scatter's chunk: this rank's sequence slice, flat
    mine = slice(rank * m, (rank + 1) * m)

    def reduce_scattered(partial, absprod, k):
        """exact fp64 sum of this rank's chunk of every rank's partial, and the bound: the codec's on each
        rank's chunk plus the round-off of the fp32 dot products of length k that made the partials."""
        parts, mags = _gathered(partial), _gathered(absprod)
        chunks = [p.reshape(-1)[mine] for p in parts]
        exact = sum(ch.double() for ch in chunks)
        bound = reduce_scatter_bound(c, chunks) + sum(2 * k * FP32_ULP * a.reshape(-1)[mine] for a in mags)
        return exact, bound

    exact, bound = reduce_scattered((y_in.double() @ wr.t()).float(), y_in.double().abs() @ wr.abs().t(), F // world)
    err_row = (out_row.detach().cpu().double().reshape(-1) - exact).abs()
    exact, bound_dx = reduce_scattered((g.double() @ wc).float(), g.double().abs() @ wc.abs(), F // world)
    err_dx = (xr.grad.cpu().double().reshape(-1) - exact).abs()
    # every rank's slice is encoded on its own, then X W^T over the gathered, decoded X
    b_in = torch.cat([elementwise_bound(c, s.contiguous()).view(s.shape) for s in x_full.chunk(world)])
    bound_col = b_in @ wc.abs().t() + 2 * H * FP32_ULP * ((x_full.double().abs() + b_in) @ wc.abs().t())
    err_col = (out_col.detach().cpu().double() - x_full.double() @ wc.t()).abs()
    ps.destroy_model_parallel()
    return [((err <= b).all().item(), err.max().item() > 0, (err / b).max().item())
            for err, b in ((err_row, bound), (err_col, bound_col), (err_dx, bound_dx))]


@needs_cuda
@pytest.mark.parametrize("codec", [dict(name="int8", block_size=32), "int8"], ids=["int8_b32", "int8"])
def test_cuda_sequence_parallel_compressed_is_within_the_codec_bound(codec):
    for checks in _run_spawned(_sp_bound_body, 2, codec):
        # row forward reduce-scatter, column forward all-gather (carried through W), column dgrad reduce-scatter
        assert all(ok and lossy for ok, lossy, _ in checks), checks

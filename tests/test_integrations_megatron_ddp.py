"""megatron-core's own DistributedDataParallel and DistributedOptimizer with megacomp on their DP traffic.

Stock megatron-core runs on CPU here through megacomp.integrations.megatron_ddp_cpu.megatron_on_cpu (its
buffers' device, its 'cuda' scalars and its CUDA type-name check; nothing else), with megatron-core's
GPTModel (local layer spec, core attention TorchSDPA) on gloo ranks.

- Compression off: every gradient after backward (``main_grad``, reduced by megatron's buckets), every loss
  and every parameter after 3 optimizer steps bit-identical to stock megatron-core, at DP 2 and 4, plain DDP
  and the distributed optimizer, with and without overlap_grad_reduce / overlap_param_gather; uninstall
  puts megatron-core's methods back.
- Compression on: each bucket's reduce-scatter (int8; int4 + LoCo over two steps, the second with the
  residuals of the first) and all-reduce within the propagated codec bound, the parameter all-gather (int8)
  within the codec's bound with the own shard exact; error feedback keyed per bucket by parameter name and
  checkpointed.
- Bad input: PowerSGD, warm-up steps, a changed method signature, unsupported flags under a lossy codec.
"""
import warnings

import pytest
import torch
import torch.distributed as dist

from codec_bounds import FP32_ULP, all_reduce_bound, elementwise_bound, reduce_scatter_bound
from distributed import run_ranks

pytest.importorskip("megatron.core", reason="CI installs megatron-core (scripts/install.sh test)")
warnings.filterwarnings("ignore", module="megatron")

# imported here, before the ranks fork, so that each rank does not import them again
import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401

from megacomp import comm  # noqa: E402
from megacomp.compression import make_codec  # noqa: E402
from megacomp.integrations.megatron import MegatronCompression  # noqa: E402
from megacomp.integrations.megatron_ddp_cpu import TorchSDPA, megatron_on_cpu  # noqa: E402

V, L, B = 64, 16, 2
BUCKET = 4000  # elements: several buckets (each bucket group reduces on its own) when overlap_grad_reduce is on


def _gpt():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = TorchSDPA
    torch.manual_seed(0)
    return cfg, GPTModel(cfg, spec, vocab_size=V, max_sequence_length=L)


def _ddp(distopt, overlap, lr=1e-2):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg, model = _gpt()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=distopt, overlap_grad_reduce=overlap, overlap_param_gather=overlap and distopt,
        bucket_size=BUCKET), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, use_distributed_optimizer=distopt,
                                                 clip_grad=1.0), [ddp])
    return ddp, opt


def _loss(ddp, step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())  # each DP rank its own batch
    ids = torch.randint(0, V, (B, L), generator=g)
    pos = torch.arange(L).unsqueeze(0).expand(B, -1)
    return ddp(ids, pos, None, labels=torch.roll(ids, -1, 1)).mean()


def _train(distopt, overlap, steps=3):
    """megatron-core's training step (zero the buffers, forward, backward, finish_grad_sync, optimizer step);
    returns the losses, every main_grad after the first backward and the parameters after ``steps``."""
    ddp, opt = _ddp(distopt, overlap)
    losses, grads = [], None
    for step in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = _loss(ddp, step)
        loss.backward()
        ddp.finish_grad_sync()
        if grads is None:
            grads = {n: p.main_grad.clone() for n, p in ddp.named_parameters()}
        ok, _, _ = opt.step()
        assert ok
        losses.append(loss.item())
    if overlap and distopt:  # the last step's all-gather is dispatched by the next forward: finish it now
        ddp.start_param_sync(force_sync=True)
    params = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    return losses, grads, params, len(ddp.bucket_groups)


def _off_body(rank, world, distopt, overlap):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as Group

    originals = (Group.start_grad_sync, Group.start_param_sync)
    with megatron_on_cpu():
        ps.initialize_model_parallel()
        stock = _train(distopt, overlap)
        comm.reset_stats()
        with MegatronCompression(None) as comp:
            assert Group.start_grad_sync._megacomp is comp._ddp
            ours = _train(distopt, overlap)
        counted = comm.stats()
        assert (Group.start_grad_sync, Group.start_param_sync) == originals
        ps.destroy_model_parallel()
    assert stock[0] == ours[0], (stock[0], ours[0])
    for what, a, b in (("main_grad", stock[1], ours[1]), ("parameter", stock[2], ours[2])):
        differ = [n for n in a if not torch.equal(a[n], b[n])]
        assert not differ, (what, differ)
    return sorted(counted), stock[3]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: 3-5 s each
@pytest.mark.parametrize("distopt", [False, True], ids=["ddp", "distopt"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_compression_off_is_bit_identical_to_stock_megatron_ddp(world, distopt, overlap):
    for paths, groups in run_ranks(_off_body, world, distopt, overlap, timeout=400):
        want = {"dp_gradient", "dp_parameter"} if distopt else {"dp_gradient"}
        assert want <= set(paths), paths  # the traffic went through megacomp's channels
        assert groups > 1 if overlap else groups == 1  # several bucket groups with overlap (BUCKET)


def _compensated(snap, world, residual):
    """Every rank's compensated buffer (scaled by 1/world as megatron scales it, plus this rank's residual)."""
    x = snap * (1.0 / world)
    x = x + residual if residual is not None else x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return parts


def _bound_body(rank, world, distopt, spec, steps):
    """Gradients as megatron accumulates them (backward under no_sync), then its finish_grad_sync with a lossy
    dp_gradient; the reduced buffer against the exact sum of every rank's compensated buffer."""
    from megatron.core import parallel_state as ps

    codec = make_codec(spec["dp_gradient"])
    checks = []
    with megatron_on_cpu():
        ps.initialize_model_parallel()
        ddp, opt = _ddp(distopt, overlap=False)
        comp = MegatronCompression(dict(spec, min_compress_numel=0)).register(ddp)
        ef = comp.channels.dp_gradient.error_feedback
        with comp:
            for step in range(steps):
                ddp.zero_grad_buffer()
                with ddp.no_sync():  # accumulate only: the collective runs in finish_grad_sync below
                    _loss(ddp, step).backward()
                (bucket,) = ddp.bucket_groups[0].buckets
                key = f"megatron_ddp/{_first_name(ddp)}/worker"
                residual = ef.error(key).clone() if ef is not None and ef.error(key) is not None else None
                snap = bucket.grad_data.clone()
                ddp.finish_grad_sync()
                parts = _compensated(snap, world, residual)
                if distopt:
                    m = snap.numel() // world
                    chunks = [p[rank * m:(rank + 1) * m] for p in parts]
                    got = bucket.grad_data[rank * m:(rank + 1) * m]
                    bound = reduce_scatter_bound(codec, chunks)
                else:  # a plain all-reduce: first-stage residuals are keyed '/worker', the second '/server'
                    chunks, got, bound = parts, bucket.grad_data, all_reduce_bound(codec, parts).reshape(-1)
                exact = sum(c.double() for c in chunks)
                # + the fp32 sum of `world` decoded values: at most world ulps of the sum of their magnitudes
                bound = bound + world * FP32_ULP * (sum(c.double().abs() for c in chunks) + bound)
                err = (got.double() - exact).abs()
                checks.append(((err <= bound).all().item(), err.max().item() > 0))
                opt.step()
        keys = sorted(ef.keys()) if ef is not None else []
        ps.destroy_model_parallel()
    return checks, keys


def _first_name(ddp):
    names = {id(p): n for n, p in ddp.named_parameters()}
    return names[id(ddp.bucket_groups[0].buckets[0].params_list[0])]


_FIRST = "module.output_layer.weight"  # megatron fills its buckets from the last parameter backwards
LOCO4 = {"dp_gradient": {"name": "int4", "block_size": 32}, "dp_gradient_error_feedback": "loco"}
INT8 = {"dp_gradient": {"name": "int8", "block_size": 64}}


@pytest.mark.parametrize("distopt", [False, True], ids=["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("spec", [INT8, LOCO4], ids=["int8", "int4_loco"])
def test_compressed_gradient_buckets_are_within_the_codec_bound(distopt, spec):
    # LoCo over two steps on the reduce-scatter (the second compensated by the first's residual); the
    # all-reduce's second stage also adds its own residual to the output, so it is bounded on the first step
    steps = 2 if "dp_gradient_error_feedback" in spec and distopt else 1
    for checks, keys in run_ranks(_bound_body, 2, distopt, spec, steps, timeout=400):
        assert len(checks) == steps and all(ok and lossy for ok, lossy in checks), checks
        if "dp_gradient_error_feedback" in spec:  # one residual per bucket, keyed by its first parameter's name
            assert keys == [f"megatron_ddp/{_FIRST}/worker"], keys


def _gather_body(rank, world, spec):
    """The distributed optimizer's parameter all-gather with a lossy dp_parameter: every other rank's shard
    within the codec's bound of that shard, this rank's own shard exact (the optimizer's updated values)."""
    from megatron.core import parallel_state as ps

    codec = make_codec(spec)
    with megatron_on_cpu():
        ps.initialize_model_parallel()
        ddp, opt = _ddp(True, overlap=False)
        with MegatronCompression({"dp_parameter": spec, "min_compress_numel": 0}):
            ddp.zero_grad_buffer()
            _loss(ddp, 0).backward()
            ddp.finish_grad_sync()
            (bucket,) = ddp.bucket_groups[0].buckets
            # what the optimizer writes into this rank's shard: run the step with the gather intercepted
            group = ddp.bucket_groups[0]
            m = bucket.param_data.numel() // world
            shards = {}
            original = type(group).start_param_sync

            def spy(g, force_sync=False):
                shards["mine"] = g.buckets[0].param_data[rank * m:(rank + 1) * m].clone()
                return original(g, force_sync)

            type(group).start_param_sync = spy
            try:
                opt.step()
            finally:
                type(group).start_param_sync = original
        ps.destroy_model_parallel()
    exact = [torch.empty_like(shards["mine"]) for _ in range(world)]
    dist.all_gather(exact, shards["mine"])
    got = bucket.param_data.view(world, m)
    own_exact = torch.equal(got[rank], exact[rank])
    others = [((got[r].double() - exact[r].double()).abs() <= elementwise_bound(codec, exact[r])).all().item()
              for r in range(world) if r != rank]
    lossy = any(not torch.equal(got[r], exact[r]) for r in range(world) if r != rank)
    return own_exact, all(others), lossy


def test_compressed_parameter_all_gather_is_within_the_codec_bound_and_keeps_the_own_shard_exact():
    for own_exact, within, lossy in run_ranks(_gather_body, 2, {"name": "int8", "block_size": 64}, timeout=400):
        assert own_exact and within and lossy


def _checkpoint_body(rank, world):
    from megatron.core import parallel_state as ps

    spec = dict(LOCO4, min_compress_numel=0)
    with megatron_on_cpu():
        ps.initialize_model_parallel()
        ddp, opt = _ddp(True, overlap=True)
        comp = MegatronCompression(spec).register(ddp)
        with comp:
            ddp.zero_grad_buffer()
            _loss(ddp, 0).backward()
            ddp.finish_grad_sync()
        ef = comp.channels.dp_gradient.error_feedback
        keys = sorted(ef.keys())
        fresh = MegatronCompression(spec)
        fresh.load_state_dict(comp.state_dict())
        same = all(torch.equal(fresh.channels.dp_gradient.error_feedback.error(k), ef.error(k)) for k in keys)
        with pytest.raises(ValueError, match="codec"):
            MegatronCompression({"dp_gradient": "int8", "dp_gradient_error_feedback": "ef"}).load_state_dict(
                comp.state_dict())
        ps.destroy_model_parallel()
    return keys, same, len(ddp.bucket_groups)


def test_error_feedback_is_keyed_per_bucket_by_parameter_name_and_checkpointed():
    keys, same, groups = run_ranks(_checkpoint_body, 2, timeout=400)[0]
    assert len(keys) == groups > 1 and same, keys
    assert all(k.startswith("megatron_ddp/module.") and k.endswith("/worker") for k in keys), keys


def test_bad_input_is_refused_with_a_clear_error(monkeypatch):
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as Group

    with pytest.raises(ValueError, match="element-wise codec"):
        MegatronCompression({"dp_gradient": {"name": "powersgd", "rank": 2}})
    with pytest.raises(ValueError, match="dp_gradient_warmup_steps"):
        MegatronCompression({"dp_gradient": "int8", "dp_gradient_warmup_steps": 3})
    with pytest.raises(ValueError, match="not tensor- or data-parallel paths"):
        MegatronCompression({"pp_activation": "int8"})
    with pytest.raises(ValueError, match="bucket_groups"):
        from megacomp.integrations.megatron_ddp import bucket_names
        bucket_names(torch.nn.Linear(2, 2))
    monkeypatch.setattr(Group, "start_grad_sync", lambda self, force_all_reduce=False, extra=None: None)
    with pytest.raises(RuntimeError, match="start_grad_sync has parameters"):
        MegatronCompression(None).install()
    from megatron.core.tensor_parallel import mappings
    assert not hasattr(mappings, "_megacomp_installed")


def _unsupported_body(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with megatron_on_cpu():
        ps.initialize_model_parallel()
        cfg, model = _gpt()
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            use_distributed_optimizer=True, reduce_scatter_with_fp32_accumulation=True), model)
        with MegatronCompression({"dp_gradient": "int8"}):
            _loss(ddp, 0).backward()
            with pytest.raises(ValueError, match="reduce_scatter_with_fp32_accumulation"):
                ddp.finish_grad_sync()
        ps.destroy_model_parallel()
    return True


@pytest.mark.slow
def test_unsupported_megatron_flags_under_a_lossy_codec_are_refused():
    assert all(run_ranks(_unsupported_body, 2, timeout=400))

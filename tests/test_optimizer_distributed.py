"""DistributedOptimizer on real gloo groups (megacomp.optimizer.distributed_optimizer).

- Uncompressed: parameters after several steps equal single-process torch.optim.AdamW on the averaged
  gradients (DP 2, 3, 4; sizes that do not divide evenly; several buckets; gradient accumulation;
  clipping) to fp32 round-off.
- Resume: save after k steps, load into a fresh optimizer, continue: bit-identical to the uninterrupted
  run, error feedback included (state_dict and torch.distributed.checkpoint).
- Bad input: mixed dtypes, unreplicated params, double backward, non-finite gradients.
"""
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import RankFailure, run_ranks
from megacomp import comm
from megacomp.optimizer import DistributedOptimizer, DynamicLossScaler


class RecordingAdamW(torch.optim.AdamW):
    """torch AdamW that keeps a copy of the gradients each step is given (the averaged, clipped shards; under ACCO the
    estimate's, then the update's)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def batch(rank, step, micro=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(6, 7, generator=g).to(dtype), torch.randn(6, 3, generator=g).to(dtype)


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference_run(world, steps, micro_batches=1, max_norm=None, **adam):
    """Single process: AdamW on the gradient averaged over ranks (and micro-batches)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), **adam)
    history = []
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(world):
            for m in range(micro_batches):
                model.zero_grad()
                (loss_fn(model, *batch(r, step, m)) / micro_batches).backward()
                for a, p in zip(grads, model.parameters()):
                    a += p.grad
        for a, p in zip(grads, model.parameters()):
            p.grad = a / world
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def _equality_body(rank, world, micro_batches, max_norm):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size=50, lr=1e-2, weight_decay=0.1,
                               max_grad_norm=max_norm)
    assert len(opt.buckets) > 1
    history = []
    for step in range(4):
        for m in range(micro_batches):
            ctx = opt.no_sync() if m < micro_batches - 1 else torch.enable_grad()
            with ctx:
                (loss_fn(model, *batch(rank, step, m)) / micro_batches).backward()
        assert opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


@pytest.mark.parametrize("world,micro,max_norm", [(2, 1, None), (3, 2, None), (4, 1, 0.05)],
                         ids=["dp2", "dp3-accum2", "dp4-clip"])
def test_uncompressed_equals_single_process_adamw(world, micro, max_norm):
    ref = reference_run(world, 4, micro, max_norm, lr=1e-2, weight_decay=0.1)
    for hist in run_ranks(_equality_body, world, micro, max_norm):
        for step, (got, want) in enumerate(zip(hist, ref)):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")


def _resume_body(rank, world, ckpt_dir):
    kw = dict(grad_codec="int4", param_codec="int8", error_feedback="loco", bucket_size=60, min_compress_numel=0,
              lr=1e-2)

    def train(model, opt, steps, start):
        for step in range(start, start + steps):
            loss_fn(model, *batch(rank, step)).backward()
            opt.step()

    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    train(model, opt, 3, 0)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": opt.state_dict()}
    import torch.distributed.checkpoint as dcp
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=ckpt_dir)
    train(model, opt, 3, 3)
    full = [p.detach().clone() for p in model.parameters()]

    results = []
    for via_dcp in (False, True):
        fresh = make_model(seed=123)  # different init: everything must come from the checkpoint
        fresh.load_state_dict(saved["model"])
        opt2 = DistributedOptimizer(fresh.parameters(), torch.optim.AdamW, check_replicated=False, **kw)
        if via_dcp:
            opt2.init_state()
            template = {"optim": opt2.state_dict()}
            dcp.load(template, checkpoint_id=ckpt_dir)
            opt2.load_state_dict(template["optim"])
        else:
            opt2.load_state_dict(saved["optim"])
        train(fresh, opt2, 3, 3)
        results.append(all(torch.equal(a, b) for a, b in zip(full, fresh.parameters())))
    assert opt.ef is not None and len(opt.ef.keys()) > 0
    wire = comm.stats()["dp_gradient"]
    return results, wire.wire_bytes / wire.uncompressed_bytes


def test_resume_is_bit_identical_with_error_feedback():
    with tempfile.TemporaryDirectory() as d:
        for results, ratio in run_ranks(_resume_body, 2, d):
            assert results == [True, True]
            assert ratio < 0.5  # int4 on the matrices; the 1-D params stay uncompressed by rule


def _errors_body(rank, world):
    msgs = {}
    mixed = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="cannot share one flat buffer"):
        DistributedOptimizer(mixed, torch.optim.AdamW)
    with pytest.raises(ValueError, match="empty parameter list"):
        DistributedOptimizer([], torch.optim.AdamW)
    with pytest.raises(ValueError, match="error feedback needs a lossy codec"):
        DistributedOptimizer(make_model().parameters(), torch.optim.AdamW, error_feedback="loco")
    try:
        DistributedOptimizer(make_model(seed=rank).parameters(), torch.optim.AdamW)
    except ValueError as e:
        msgs["replicated"] = str(e)
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    loss_fn(model, *batch(rank, 0)).backward()
    with pytest.raises(RuntimeError, match="already being reduced"):
        loss_fn(model, *batch(rank, 1)).backward()
    opt.zero_grad()
    # non-finite gradient on one rank: every rank skips the step, weights untouched
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batch(rank, 2)
    if rank == 1:
        x[0, 0] = float("nan")
    loss_fn(model, x, y).backward()
    assert opt.step() is False and opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    loss_fn(model, *batch(rank, 3)).backward()
    assert opt.step() is True
    # fp16-style loss scaling: an overflow backs the scale off, EF and weights survive
    scaler = DynamicLossScaler(scale=2.0 ** 10, growth_interval=2)
    model2 = make_model()
    opt2 = DistributedOptimizer(model2.parameters(), torch.optim.AdamW, loss_scaler=scaler, grad_codec="int8",
                                error_feedback="ef", min_compress_numel=0, lr=0.1)
    (loss_fn(model2, *batch(rank, 0)) * scaler.scale).backward()
    assert opt2.step()
    (loss_fn(model2, *batch(rank, 1)) * float("inf")).backward()
    assert not opt2.step() and scaler.scale == 2.0 ** 9
    assert all(opt2.ef.error(k) is None for k in opt2.ef.keys()) and not list(opt2.ef.keys())  # EF dropped
    assert all(torch.isfinite(p).all() for p in model2.parameters())
    (loss_fn(model2, *batch(rank, 2)) * scaler.scale).backward()
    assert opt2.step()
    return msgs


def test_bad_input_is_refused_or_skipped():
    for msgs in run_ranks(_errors_body, 2):
        assert "parameters differ across the process group (group ranks [1]" in msgs["replicated"]


def _bf16_body(rank, world):
    model = make_model(dtype=torch.bfloat16)
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, grad_codec="int8",
                               param_codec="int8", min_compress_numel=0)
    losses = []
    for step in range(30):
        x, y = batch(rank, 0, dtype=torch.bfloat16)  # the same batch: the loss must fall
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in opt.masters)
    return losses


def test_bf16_params_with_fp32_masters_train():
    for losses in run_ranks(_bf16_body, 2):
        assert losses[-1] < 0.7 * losses[0]


def _hier_body(rank, world, codec):
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size=50, lr=1e-2, weight_decay=0.1,
                               hierarchy=(intra, inter), grad_codec=codec, min_compress_numel=0)
    comm.reset_stats()
    history = []
    for step in range(4):
        loss_fn(model, *batch(rank, step)).backward()
        assert opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    stats = comm.stats()
    return history, {k: (v.wire_bytes, v.uncompressed_bytes) for k, v in stats.items()}


def test_hierarchical_mode_equals_flat_and_compresses_only_across_nodes():
    ref = reference_run(4, 4, 1, None, lr=1e-2, weight_decay=0.1)
    for hist, stats in run_ranks(_hier_body, 4, None):
        for got, want in zip(hist, ref):
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for hist, stats in run_ranks(_hier_body, 4, "int8"):
        intra, inter = stats["dp_gradient_intra"], stats["dp_gradient"]
        assert intra[0] == intra[1]          # full precision inside the node
        assert inter[0] < 0.4 * inter[1]     # int8 (+ scales) across nodes, 1-D params excepted


def _ef_telescoping_body(rank, world, ef, steps):
    """SGD (lr 1) on rank-constant gradients c_r through an int2 DistributedOptimizer."""
    p = nn.Parameter(torch.zeros(30, 100))  # 2-D: 1-D params stay uncompressed by policy
    c = (torch.randn(3000, generator=torch.Generator().manual_seed(rank)) * (1 + torch.arange(3000) % 7)).view(30, 100)
    opt = DistributedOptimizer([p], torch.optim.SGD, grad_codec={"name": "int2", "block_size": 128},
                               error_feedback=ef, min_compress_numel=0, lr=1.0)
    for _ in range(steps):
        (p * c).sum().backward()
        assert opt.step()
    errors = {k: opt.ef.error(k).clone() for k in opt.ef.keys()} if ef else {}
    return p.detach().clone(), c, errors


@pytest.mark.parametrize("world", [2, 3])
def test_error_feedback_telescopes_through_the_optimizer(world):
    """Classic EF: after T steps of SGD, p_T = -T * mean_r(c_r) + (mean of the ranks' final errors in the
    shard each rank owns), so the drift from the exact trajectory stays one quantization error however
    long it runs; without EF the int2 bias grows with T."""
    steps = 20
    res = run_ranks(_ef_telescoping_body, world, "ef", steps)
    exact = -steps * torch.stack([r[1] for r in res]).mean(0)
    assert res[0][2], "the gradient bucket must be compressed with error feedback"
    p_ef = res[0][0]
    drift = (p_ef - exact).abs().max().item()
    worst_error = max(e.abs().max().item() for r in res for e in r[2].values())
    assert drift <= worst_error * 1.001 + 1e-3 * steps * exact.abs().max().item() * 2 ** -20
    plain = run_ranks(_ef_telescoping_body, world, None, steps)[0][0]
    assert (plain - exact).abs().max().item() > 5 * drift  # no EF: the bias accumulates


def _warmup_body(rank, world, codec, warmup):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, grad_codec=codec,
                               error_feedback="loco" if codec else None, grad_codec_warmup_steps=warmup,
                               min_compress_numel=0, bucket_size=50, lr=1e-2)
    history, ef_keys = [], []
    for step in range(4):
        loss_fn(model, *batch(rank, step)).backward()
        assert opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
        ef_keys.append(len(list(opt.ef.keys())) if opt.ef is not None else 0)
    return history, ef_keys


def test_grad_codec_warmup_steps_are_uncompressed():
    """1-bit Adam's full-precision warm-up: the first steps are bit-identical to the uncompressed
    optimizer and leave no error-feedback state; the codec (and EF) start after them."""
    plain = run_ranks(_warmup_body, 2, None, 0)[0][0]
    hist, keys = run_ranks(_warmup_body, 2, "int4", 2)[0]
    for step in range(2):
        assert all(torch.equal(a, b) for a, b in zip(hist[step], plain[step]))
    assert keys[:2] == [0, 0] and keys[2] > 0
    assert not all(torch.equal(a, b) for a, b in zip(hist[3], plain[3]))
    with pytest.raises(RankFailure, match="grad_codec_warmup_steps must be an int >= 0"):
        run_ranks(_warmup_body, 1, "int4", -1)


def _resumes_bit_for_bit(rank, kw, before, after, ways=("state_dict", "dcp")):
    """Train ``before`` steps with ``DistributedOptimizer(**kw)``, save (state_dict and
    torch.distributed.checkpoint), train ``after`` more; then for each of ``ways`` a fresh optimizer loaded
    from the save trains the same ``after`` steps. Returns (one bool per way: same parameters, the optimizer)."""
    import torch.distributed.checkpoint as dcp

    def train(model, opt, steps):
        for step in steps:
            loss_fn(model, *batch(rank, step)).backward()
            opt.step()

    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    train(model, opt, range(before))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    holder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(holder)
    dcp.save({"optim": saved}, checkpoint_id=holder[0])
    train(model, opt, range(before, before + after))
    same = []
    for way in ways:
        fresh = make_model(seed=5)  # a different init: everything must come from the save
        fresh.load_state_dict(saved_model)
        opt2 = DistributedOptimizer(fresh.parameters(), torch.optim.AdamW, check_replicated=False, **kw)
        if way == "dcp":
            opt2.init_state()
            template = {"optim": opt2.state_dict()}
            dcp.load(template, checkpoint_id=holder[0])
            opt2.load_state_dict(template["optim"])
        else:
            opt2.load_state_dict(saved)
        train(fresh, opt2, range(before, before + after))
        same.append(all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters())))
    return same, opt


def _powersgd_body(rank, world):
    from megacomp.compression import PowerSGD

    out = {}
    for name, codec in (("plain", None), ("full", PowerSGD(rank=16, min_compression_rate=0, error_feedback=False))):
        model = make_model()
        opt = DistributedOptimizer(model.parameters(), torch.optim.SGD, grad_codec=codec, bucket_size=50,
                                   min_compress_numel=0, lr=0.1)
        for step in range(4):
            loss_fn(model, *batch(rank, step)).backward()
            assert opt.step()
        out[name] = [p.detach().clone() for p in model.parameters()]
    # rank 1 with error feedback and warm start: resume from state_dict and from torch.distributed.checkpoint
    kw = dict(grad_codec={"name": "powersgd", "rank": 1, "min_compression_rate": 0}, bucket_size=50,
              min_compress_numel=0, lr=1e-2)
    same, opt = _resumes_bit_for_bit(rank, kw, 3, 3)
    out["resumed"] = same
    out["q_keys"] = len(opt.grad_channel.q)
    return out


def test_powersgd_gradients_full_rank_equal_uncompressed_and_resume_bit_for_bit():
    """PowerSGD on the sharded optimizer: at full rank (SGD, so the update is linear in the gradient) the
    parameters equal the uncompressed optimizer's up to fp32 round-off; rank 1 with error feedback resumes
    bit for bit, its residuals and warm-start Q matrices restored."""
    for res in run_ranks(_powersgd_body, 3):
        for a, b in zip(res["plain"], res["full"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert res["resumed"] == [True, True]
        assert res["q_keys"] == 3  # the three weight matrices


def _powersgd_errors(rank, world):
    model = make_model()
    singles = [dist.new_group([r]) for r in range(world)]
    with pytest.raises(ValueError, match="does not combine with hierarchy"):
        DistributedOptimizer(model.parameters(), grad_codec="powersgd", hierarchy=(dist.group.WORLD, singles[rank]))
    with pytest.raises(ValueError, match="keeps its own error feedback"):
        DistributedOptimizer(model.parameters(), grad_codec="powersgd", error_feedback="loco")
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        DistributedOptimizer(model.parameters(), grad_codec={"name": "powersgd", "rank": 0})
    return True


def test_powersgd_bad_settings_are_refused():
    assert all(run_ranks(_powersgd_errors, 2))


def _accordion_body(rank, world):
    # eta 100: every interval after the first is calm, so the bucket switches to rank 1 after step 4
    acc = {"name": "accordion", "low": {"name": "powersgd", "rank": 2, "min_compression_rate": 0},
           "high": {"name": "powersgd", "rank": 1, "min_compression_rate": 0}, "eta": 100.0, "interval": 2}
    kw = dict(grad_codec=acc, bucket_size=50, min_compress_numel=0, lr=1e-2)
    same, opt = _resumes_bit_for_bit(rank, kw, 5, 4, ways=("dcp",))
    return same[0], opt.grad_channel.switches


def test_accordion_switches_powersgd_ranks_and_resumes_bit_for_bit():
    results = run_ranks(_accordion_body, 2)
    for same, switches in results:
        assert same
        assert [(s, level) for s, _, level, _ in switches][:1] == [(4, "high")]  # rank 1 after interval 2
    assert results[0][1] == results[1][1]  # the same decisions on every rank


def _cold_start_dcp_body(rank, world):
    kw = dict(grad_codec={"name": "powersgd", "rank": 1, "min_compression_rate": 0, "warm_start": False},
              bucket_size=50, min_compress_numel=0, lr=1e-2)
    return _resumes_bit_for_bit(rank, kw, 2, 2, ways=("dcp",))[0][0]


def test_powersgd_without_warm_start_resumes_through_dcp():
    """A fresh start matrix per step: the draw counters are in the template, so the resumed run draws what the
    uninterrupted one drew."""
    assert all(run_ranks(_cold_start_dcp_body, 2))


def _reload_body(rank, world):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size=1 << 20, lr=1e-2)
    x, y = batch(rank, 0)
    loss_fn(model, x, y).backward()
    assert opt.step()
    replaced, kept = model[2].weight, model[0].weight  # one bucket: the two share its masters and state
    masters = [m.detach().clone() for m in opt.masters]
    moments = [opt.optimizer.state[m]["exp_avg"].clone() for m in opt.masters]
    with torch.no_grad():  # both change in the model; only `replaced` is reported
        replaced.fill_(0.25)
        kept.add_(1.0)
    opt.reload_params([replaced], reset_state=True)
    b, master = opt.buckets[0], opt.masters[0]
    start, end = b.shard_range(opt.shard_index, opt.parts)
    inside = torch.zeros(b.padded, dtype=torch.bool)
    for p, off in zip(b.params, b.offsets):
        if p is replaced:
            inside[off:off + p.numel()] = True
    mine = inside[start:end]
    exp_avg = opt.optimizer.state[master]["exp_avg"]
    assert len(opt.buckets) == 1
    return int(mine.sum()), (bool((master[mine] == 0.25).all()), torch.equal(master[~mine], masters[0][~mine]),
                             bool((exp_avg[mine] == 0).all()), torch.equal(exp_avg[~mine], moments[0][~mine]))


def test_reload_params_reloads_only_the_replaced_masters_and_resets_their_state():
    """What LoQT's merge asks (megacomp.tensor_parallel.loqt.sync_optimizer): the replaced parameter's slice of the
    fp32 masters is copied from the model and its optimizer-state slice zeroed; the rest stays."""
    results = run_ranks(_reload_body, 2)
    assert sum(n for n, _ in results) == 65  # the 13 x 5 weight, split over the two shards
    for _, checks in results:
        assert all(checks), checks

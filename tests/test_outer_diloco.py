"""megacomp.outer: DiLoCo's outer loop on real gloo ranks.

- Replica groups split the data-parallel dimension as the module says (inner and outer members).
- Each outer step equals an independent fp64 restatement of the paper's rule (pseudo-gradient mean,
  SGD with Nesterov momentum) within the fp32 rounding of the operations it performs (bound derived below).
- H = 1, lr 1, no momentum, no compression is parameter averaging after every step, bit for bit (asserted
  against torch's average_parameters).
- A lossy outer codec with error feedback is counted under the ``outer`` tag and sends fewer bytes.
- state_dict / load_state_dict resume bit-identically; bad settings raise naming the fix.
"""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import comm, parallel_state
from megacomp.outer import DiLoCo, DiLoCoConfig, build_replica_groups

EPS32 = 2.0 ** -24  # unit roundoff of fp32


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(37, 5, generator=g)), torch.nn.Parameter(torch.randn(11, generator=g)),
            torch.nn.Parameter(torch.randn(4, 3, generator=g))]


def inner_step(params, rank, step):
    """A stand-in for H inner optimizer steps: a deterministic, rank-dependent update."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g), alpha=0.05 * (rank + 1))


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])


def _rule_body(rank, world, lr, momentum, nesterov, h, outer_steps):
    params = make_params()
    outer = DiLoCo(params, None, DiLoCoConfig(outer_steps=h, outer_lr=lr, outer_momentum=momentum, nesterov=nesterov))
    checks = []
    for t in range(outer_steps * h):
        before = outer.outer[0].detach().double().clone()
        buf = outer.optimizers[0].state.get(outer.outer[0], {}).get("momentum_buffer")
        m_before = buf.double().clone() if buf is not None else None
        inner_step(params, rank, t)
        local = flat(params).double()
        locals_ = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(locals_, local)
        synced = outer.step()
        if not synced:
            continue
        # fp64 restatement of the paper's outer step from the same fp32 state
        delta = torch.stack([before - x for x in locals_]).mean(0)
        m = delta.clone() if m_before is None or momentum == 0 else momentum * m_before + delta
        step = delta + momentum * m if (nesterov and momentum) else (m if momentum else delta)
        want = before - lr * step
        got = flat(params).double()
        scale = before.abs() + torch.stack(locals_).abs().max(0).values + m.abs() + delta.abs()
        bound = (world + 8) * EPS32 * scale * (1 + lr)  # one rounding per fp32 operation on these magnitudes
        checks.append((((got - want).abs() <= bound).all().item(), (got - want).abs().max().item(),
                       torch.equal(got.float(), outer.outer[0].detach())))
    return checks


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.9, False), (0.0, False)])
def test_outer_step_equals_the_papers_rule_in_fp64(world, momentum, nesterov):
    for checks in run_ranks(_rule_body, world, 0.7, momentum, nesterov, 3, 3):
        assert len(checks) == 3
        for ok, err, same in checks:
            assert ok, err
            assert same  # the model's parameters are theta_t


def _averaging_body(rank, world, steps):
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    params = make_params()
    ref = make_params()
    outer = DiLoCo(params, None, DiLoCoConfig(outer_steps=1, outer_lr=1.0, outer_momentum=0.0))
    identical = []
    for t in range(steps):
        inner_step(params, rank, t)
        inner_step(ref, rank, t)
        outer.step()
        average_parameters(iter(ref), None)  # torch's synchronous parameter averaging (PeriodicModelAverager's)
        identical.append(torch.equal(flat(params), flat(ref)))
    return identical


@pytest.mark.parametrize("world", [2, 3])
def test_h1_lr1_without_momentum_is_parameter_averaging_bit_for_bit(world):
    """The acceptance check: H = 1, outer SGD lr 1, no momentum, no compression equals synchronous
    parameter averaging after every inner step, bit for bit (the reference: torch's average_parameters)."""
    for identical in run_ranks(_averaging_body, world, 5):
        assert identical == [True] * 5


def _codec_body(rank, world):
    params = make_params()
    cfg = DiLoCoConfig(outer_steps=2, codec={"name": "int8", "block_size": 64}, error_feedback="ef")
    outer = DiLoCo(params, None, cfg)
    comm.reset_stats()
    for t in range(4):
        inner_step(params, rank, t)
        outer.step()
    st = comm.stats()["outer"]
    keys = sorted(outer.channel.error_feedback.keys())
    return st.calls, st.wire_bytes, st.uncompressed_bytes, keys, bool(torch.isfinite(flat(params)).all())


def test_lossy_outer_codec_is_counted_and_keeps_its_residual():
    for calls, wire, raw, keys, finite in run_ranks(_codec_body, 2):
        assert calls == 2 and 0 < wire < 0.3 * raw and finite
        assert keys == ["pseudo_gradient/worker"]


def _channel_body(rank, world):
    """A channel from megacomp.comm.make_channel (as a config's ``outer`` path gives) runs the same exchange as the
    one DiLoCo builds from its config, bit for bit; mismatching settings are refused."""
    from megacomp.comm import make_channel

    spec = {"name": "int8", "block_size": 64}
    a, b = make_params(), make_params()
    built = DiLoCo(a, None, DiLoCoConfig(outer_steps=2, codec=spec, error_feedback="ef"))
    given = DiLoCo(b, None, DiLoCoConfig(outer_steps=2, codec=spec, error_feedback="ef"),
                   channel=make_channel("outer", spec, error_feedback="ef"))
    also = DiLoCo(make_params(), None, DiLoCoConfig(outer_steps=2),
                  channel=make_channel("outer", spec))  # a config without codec: the channel decides
    for t in range(4):
        for params, outer in ((a, built), (b, given)):
            inner_step(params, rank, t)
            outer.step()
    with pytest.raises(ValueError, match="differs from the channel's"):
        DiLoCo(make_params(), None, DiLoCoConfig(codec="int4"), channel=make_channel("outer", spec))
    with pytest.raises(ValueError, match="error feedback .* differs"):
        DiLoCo(make_params(), None, DiLoCoConfig(codec=spec, error_feedback="loco"),
               channel=make_channel("outer", spec, error_feedback="ef"))
    with pytest.raises(ValueError, match="compresses by structure"):
        DiLoCo(make_params(), None, DiLoCoConfig(), channel=make_channel("outer", "powersgd"))
    return torch.equal(flat(a), flat(b)) and not also.averaging


def test_a_ready_outer_channel_equals_the_config_codec_bit_for_bit():
    assert all(run_ranks(_channel_body, 2))
    from megacomp.compression import make_codec
    from megacomp.outer import sparseloco

    assert DiLoCoConfig(codec="{name: int8, block_size: 64}").codec == make_codec("int8", block_size=64)
    assert sparseloco.DEFAULT_CODEC == make_codec("int2", k=64, chunk=4096)  # what an unset outer path means there


def run_and_resume(rank, cfg, stop, end):
    """Steps 1..end straight, and steps 1..stop then a fresh DiLoCo loaded from the state at ``stop`` for the
    rest: (whether both end bit-identical, the fragments in flight at ``stop``, the saved state)."""
    params = make_params()
    outer = DiLoCo(params, None, cfg)
    for t in range(1, stop + 1):
        inner_step(params, rank, t)
        outer.step()
    in_flight = sorted(outer.pending)
    saved, saved_params = outer.state_dict(), [p.detach().clone() for p in params]
    params2 = [torch.nn.Parameter(p.clone()) for p in saved_params]
    outer2 = DiLoCo(params2, None, cfg)
    outer2.load_state_dict(saved)
    for t in range(stop + 1, end + 1):
        for ps, o in ((params, outer), (params2, outer2)):
            inner_step(ps, rank, t)
            o.step()
    outer.finish()
    outer2.finish()
    return torch.equal(flat(params), flat(params2)), in_flight, saved


def _resume_body(rank, world):
    cfg = DiLoCoConfig(outer_steps=2, codec={"name": "int4", "block_size": 32}, error_feedback="loco")
    same, _, saved = run_and_resume(rank, cfg, 5, 9)  # mid-cycle: 2 syncs and one step of the third cycle
    other = DiLoCo(make_params(), None, DiLoCoConfig(outer_steps=3))
    try:
        other.load_state_dict(saved)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return same, refused


def test_state_dict_resumes_bit_identically_and_refuses_another_configuration():
    for same, refused in run_ranks(_resume_body, 2):
        assert same
        assert "saved with" in refused and "same outer configuration" in refused


def _groups_body(rank, world, tp, replicas):
    groups = parallel_state.initialize_model_parallel(tp)
    try:
        rg = build_replica_groups(groups, replicas)
        return rg.replica, rg.inner_ranks, rg.outer_ranks, dist.get_world_size(rg.outer)
    except ValueError as e:
        return str(e)
    finally:
        parallel_state.destroy_model_parallel()


def test_replica_groups_and_bad_settings():
    # world 4, TP 2: DP 2 -> 2 replicas of one DP rank; outer groups join equal TP ranks
    res = run_ranks(_groups_body, 4, 2, 2)
    assert res[0] == (0, [0], [0, 2], 2) and res[1] == (0, [1], [1, 3], 2)
    assert res[2] == (1, [2], [0, 2], 2) and res[3] == (1, [3], [1, 3], 2)
    for msg in run_ranks(_groups_body, 2, 1, 3):
        assert "num_replicas 3 does not divide the data-parallel size 2" in msg
    with pytest.raises(ValueError, match="outer_steps"):
        DiLoCoConfig(outer_steps=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        DiLoCoConfig(outer_momentum=1.0)
    with pytest.raises(ValueError, match="error feedback needs a lossy codec"):
        DiLoCoConfig(error_feedback="ef")


# -- pretraining with DiLoCo ------------------------------------------------------------------------
def _pretrain_body(rank, world, cfg):
    from megacomp.training import Trainer

    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return [(h["loss"], h["traffic"]) for h in history]


def test_pretraining_with_diloco_over_two_tp2_replicas_logs_outer_traffic_and_resumes(tiny_config, tmp_path):
    from dataclasses import replace

    cfg = replace(tiny_config, train_iters=6, tensor_model_parallel_size=2, outer_algorithm="diloco", num_replicas=2,
                  outer_steps=2, outer_codec="int4", outer_error_feedback="ef")
    full = run_ranks(_pretrain_body, 4, cfg)[0]
    losses = [loss for loss, _ in full]
    assert losses[-1] < losses[0]
    outer = [t.get("outer", [0, 0]) for _, t in full]
    assert [w > 0 for w, _ in outer] == [False, True] * 3  # one exchange every 2 steps
    assert all(w < 0.3 * u for w, u in outer if u)
    assert all(t.get("dp_gradient", [0, 0]) == [0, 0] for _, t in full)  # one DP rank per replica: no inner DP bytes
    ck = str(tmp_path / "ck")
    first = run_ranks(_pretrain_body, 4, replace(cfg, save=ck, exit_interval=3))[0]  # mid-cycle
    rest = run_ranks(_pretrain_body, 4, replace(cfg, load=ck))[0]
    assert [loss for loss, _ in first + rest] == losses
    with pytest.raises(AssertionError, match="saved with"):
        run_ranks(_pretrain_body, 4, replace(cfg, load=ck, outer_steps=3))


def test_pretraining_flags_for_the_outer_loop_are_checked():
    from megacomp.training import PretrainConfig
    from megacomp.training.arguments import check

    base = PretrainConfig(tensor_model_parallel_size=2, global_batch_size=16, micro_batch_size=4)
    check(PretrainConfig(**{**base.to_dict(), "outer_algorithm": "diloco", "num_replicas": 2}), world_size=4)
    cases = [({"outer_algorithm": "diloco", "num_replicas": 2, "outer_steps": 0}, "outer_steps"),
             ({"outer_algorithm": "diloco", "num_replicas": 1}, "needs num_replicas >= 2"),
             ({"outer_algorithm": "diloco", "num_replicas": 3}, "num_replicas 3 does not divide the data-parallel size 2"),
             ({"num_replicas": 2}, "needs an outer algorithm"),
             ({"outer_algorithm": "gossip", "num_replicas": 2}, "must be one of none, diloco"),
             ({"outer_algorithm": "diloco", "num_replicas": 2, "outer_error_feedback": "ef"}, "needs a lossy codec"),
             ({"outer_algorithm": "streaming_diloco", "num_replicas": 2, "outer_steps": 6, "outer_fragments": 4,
               "outer_schedule": "torchft"}, "divisible by fragments")]
    check(PretrainConfig(**{**base.to_dict(), "outer_algorithm": "streaming_diloco", "num_replicas": 2,
                            "outer_steps": 6, "outer_fragments": 2, "outer_delay": 2, "outer_schedule": "torchft"}),
          world_size=4)
    for extra, words in cases:
        with pytest.raises(ValueError, match=words):
            check(PretrainConfig(**{**base.to_dict(), **extra}), world_size=4)


# -- Streaming DiLoCo ---------------------------------------------------------------------------------
def _streaming_body(rank, world, cfg_kw, steps):
    """The implementation on this rank, and an fp64 simulation of every replica under the same schedule."""
    cfg = DiLoCoConfig(**cfg_kw)
    params = make_params()
    outer = DiLoCo(params, None, cfg)
    frag_sizes = [sum(p.numel() for p in f) for f in outer.fragments]
    bounds = [0]
    for n in frag_sizes:
        bounds.append(bounds[-1] + n)
    # fp64 simulation: replicas' weights, outer weights and momenta per fragment, pending exchanges
    sim = [flat(make_params()).double() for _ in range(world)]
    sim_outer = [sim[0][bounds[f]:bounds[f + 1]].clone() for f in range(cfg.fragments)]
    sim_m = [None] * cfg.fragments
    pending = {}
    H, P, tau, alpha, lr, mu = cfg.outer_steps, cfg.fragments, cfg.delay, cfg.mixing, cfg.outer_lr, cfg.outer_momentum
    calls = 0
    for t in range(1, steps + 1):
        inner_step(params, rank, t)
        for r in range(world):  # the same perturbation as inner_step, applied in fp64
            g = torch.Generator().manual_seed(1000 * r + t)
            d = torch.cat([torch.randn(p.shape, generator=g).reshape(-1) for p in make_params()]).double()
            sim[r] += 0.05 * (r + 1) * d
        outer.step()

        def apply(f):
            delta = pending.pop(f)[1]
            m = delta.clone() if sim_m[f] is None or mu == 0 else mu * sim_m[f] + delta
            sim_m[f] = m
            step = delta + mu * m if (cfg.nesterov and mu) else (m if mu else delta)
            sim_outer[f] = sim_outer[f] - lr * step
            for r in range(world):
                seg = sim[r][bounds[f]:bounds[f + 1]]
                seg.copy_(sim_outer[f] + alpha * (seg - sim_outer[f]))
        for f in sorted(pending):
            if pending[f][0] == t:
                apply(f)
        for f in range(P):
            if (t + f * H // P) % H == 0:
                calls += 1
                delta = torch.stack([sim_outer[f] - s[bounds[f]:bounds[f + 1]] for s in sim]).mean(0)
                pending[f] = (t + tau, delta)
                if tau == 0:
                    apply(f)
    outer.finish()
    got = flat(params).double()
    scale = max(s.abs().max().item() for s in sim)
    bound = steps * (world + 8) * EPS32 * scale * (1 + lr) * 4  # fp32 rounding per operation, accumulated
    return (got - sim[rank]).abs().max().item(), bound, calls, outer.syncs


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("cfg_kw", [dict(outer_steps=4, fragments=2, delay=1, mixing=0.5),
                                    dict(outer_steps=6, fragments=3, delay=2, mixing=0.0, outer_momentum=0.0),
                                    dict(outer_steps=4, fragments=1, delay=3, mixing=0.25)],
                         ids=["P2-tau1-a.5", "P3-tau2-plainSGD", "P1-tau3-a.25"])
def test_streaming_diloco_equals_an_fp64_simulation_of_its_schedule(world, cfg_kw):
    for err, bound, calls, syncs in run_ranks(_streaming_body, world, cfg_kw, 13):
        assert err <= bound, (err, bound)
        assert calls >= 3 and syncs <= calls  # exchanges still in flight at the end are not applied


def _streaming_resume_body(rank, world):
    cfg = DiLoCoConfig(outer_steps=4, fragments=2, delay=2, mixing=0.5, codec={"name": "int4", "block_size": 32},
                       error_feedback="loco")
    # fragment 1 started at step 2 applies at 4; fragment 0 starts at 4 and is in flight when the state is taken
    same, in_flight, _ = run_and_resume(rank, cfg, 4, 11)
    return in_flight, same


def test_streaming_diloco_resumes_bit_identically_with_an_exchange_in_flight():
    for in_flight, same in run_ranks(_streaming_resume_body, 2):
        assert in_flight == [0] and same


def _torchft_body(rank, world, cfg_kw, steps):
    """This rank's parameters under schedule='torchft', and a plain-torch restatement of torchft 0.2.0's DiLoCo
    (local_sgd.py: pseudo-gradient original - local when a fragment is prepared, all-reduce SUM then / R, restore
    the original weights, the outer SGD steps the model's own parameters, save them, lerp towards the local weights
    saved at the sync) run for every replica in this process."""
    cfg = DiLoCoConfig(schedule="torchft", **cfg_kw)
    params = make_params()
    outer = DiLoCo(params, None, cfg)
    frags = [[next(i for i, q in enumerate(params) if q is p) for p in f] for f in outer.fragments]
    H, P, tau, alpha = cfg.outer_steps, cfg.fragments, cfg.delay, cfg.mixing
    reps = [[p.detach().clone() for p in make_params()] for _ in range(world)]
    original = [p.detach().clone() for p in make_params()]
    model = [torch.nn.Parameter(p.clone()) for p in original]  # what torchft's outer optimizer steps
    opt = torch.optim.SGD(model, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                          nesterov=cfg.nesterov and cfg.outer_momentum > 0)
    local_step, manager_step, grads, syncs = 0, 0, {}, 0
    for t in range(1, steps + 1):
        inner_step(params, rank, t)
        outer.step()
        for r in range(world):
            inner_step(reps[r], r, t)
        local_step += 1
        if local_step == H // P - tau:  # prepare_sync of fragment manager_step % P
            f = manager_step % P
            grads[f] = {i: sum(original[i] - reps[r][i] for r in range(world)) / world for i in frags[f]}
        if local_step == H // P:  # perform_sync
            f = manager_step % P
            for i in frags[f]:
                model[i].data.copy_(original[i])
                model[i].grad = grads[f][i]
            opt.step()
            opt.zero_grad()
            for i in frags[f]:
                original[i] = model[i].detach().clone()
                for r in range(world):
                    reps[r][i] = model[i].detach().clone().lerp_(reps[r][i], alpha)
            manager_step, local_step, syncs = manager_step + 1, 0, syncs + 1
    outer.finish()
    return [p.detach().clone() for p in params], reps[rank], outer.syncs, syncs


@pytest.mark.parametrize("cfg_kw", [dict(outer_steps=3), dict(outer_steps=4, fragments=2, delay=1, mixing=0.5),
                                    dict(outer_steps=6, fragments=3, delay=1, mixing=0.25, outer_momentum=0.0),
                                    dict(outer_steps=4, fragments=1, delay=3, mixing=0.5)],
                         ids=["DiLoCo-H3", "P2-tau1-a.5", "P3-tau1-plainSGD", "P1-tau3-a.5"])
def test_torchft_schedule_equals_a_restatement_of_torchfts_diloco_bit_for_bit(cfg_kw):
    # two replicas: torchft's (a + b) / 2 and megacomp's a / 2 + b / 2 round alike, so the match is exact
    for got, want, syncs, want_syncs in run_ranks(_torchft_body, 2, cfg_kw, 13):
        assert syncs == want_syncs >= 3
        for p, q in zip(got, want):
            assert torch.equal(p, q), (p - q).abs().max()


def test_streaming_settings_are_checked():
    with pytest.raises(ValueError, match="delay"):
        DiLoCoConfig(outer_steps=4, delay=4)
    with pytest.raises(ValueError, match="mixing"):
        DiLoCoConfig(mixing=1.0)
    with pytest.raises(ValueError, match="fragments"):
        DiLoCoConfig(fragments=0)
    with pytest.raises(ValueError, match="divisible by fragments"):
        DiLoCoConfig(outer_steps=6, fragments=4, schedule="torchft")
    with pytest.raises(ValueError, match="delay"):
        DiLoCoConfig(outer_steps=4, fragments=2, delay=2, schedule="torchft")
    with pytest.raises(ValueError, match="schedule"):
        DiLoCoConfig(schedule="paper")


def test_pretraining_with_streaming_diloco_resumes_with_an_exchange_in_flight(tiny_config, tmp_path):
    from dataclasses import replace

    cfg = replace(tiny_config, train_iters=8, outer_algorithm="streaming_diloco", num_replicas=2, outer_steps=4,
                  outer_fragments=2, outer_delay=1, outer_mixing=0.5, outer_codec="int4")
    full = run_ranks(_pretrain_body, 2, cfg)[0]
    losses = [loss for loss, _ in full]
    outer = [t.get("outer", [0, 0])[0] > 0 for _, t in full]
    assert outer == [False, True, False, True] * 2  # fragment 1 starts at steps 2, 6; fragment 0 at 4, 8
    ck = str(tmp_path / "ck")
    first = run_ranks(_pretrain_body, 2, replace(cfg, save=ck, exit_interval=4))[0]  # fragment 0 in flight
    rest = run_ranks(_pretrain_body, 2, replace(cfg, load=ck))[0]
    assert [loss for loss, _ in first + rest] == losses
    with pytest.raises(ValueError, match="streaming_diloco"):
        from megacomp.training.arguments import check
        check(replace(cfg, outer_algorithm="diloco"), world_size=2)
    with pytest.raises(ValueError, match="larger than the 2 layers"):
        check(replace(cfg, outer_fragments=3), world_size=2)


def _lossy_bound_body(rank, world, spec):
    from codec_bounds import all_reduce_bound
    from megacomp.compression import make_codec

    lr, mu = 0.7, 0.9
    exact_p, lossy_p = make_params(), make_params()
    exact = DiLoCo(exact_p, None, DiLoCoConfig(outer_steps=1, outer_lr=lr, outer_momentum=mu))
    lossy = DiLoCo(lossy_p, None, DiLoCoConfig(outer_steps=1, outer_lr=lr, outer_momentum=mu, codec=spec))
    start = flat(exact_p).clone()
    inner_step(exact_p, rank, 1)
    inner_step(lossy_p, rank, 1)
    scaled = ((start - flat(exact_p)) / world)  # what each rank hands to the all-reduce: Delta_r / R
    parts = [torch.empty_like(scaled) for _ in range(world)]
    dist.all_gather(parts, scaled)
    exact.step()
    lossy.step()
    # first outer step: theta = theta0 - lr * (1 + mu) * mean(Delta) (Nesterov, fresh momentum), so the codec's
    # all-reduce error enters scaled by lr * (1 + mu); plus fp32 rounding of the outer update on both sides
    codec_err = all_reduce_bound(make_codec(spec), parts).reshape(-1)
    scale = start.abs().double() + flat(exact_p).abs().double()
    bound = lr * (1 + mu) * codec_err + 2 * (world + 8) * EPS32 * scale * (1 + lr)
    diff = (flat(lossy_p).double() - flat(exact_p).double()).abs()
    return bool((diff <= bound).all()), diff.max().item(), bool((diff > 0).any())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("spec", [{"name": "int8", "block_size": 64}, {"name": "int4", "block_size": 32}],
                         ids=["int8", "int4"])
def test_lossy_outer_codec_error_is_within_the_codec_bound(world, spec):
    for ok, worst, changed in run_ranks(_lossy_bound_body, world, spec):
        assert ok, worst
        assert changed  # the codec really quantized

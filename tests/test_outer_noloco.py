"""megacomp.outer.noloco (NoLoCo through the DiLoCo engine, algorithm='noloco') on real gloo ranks.

- The gossip groups partition the replicas, are the same on every rank, and change between outer steps.
- Each outer step equals an fp64 restatement of the reference rule (groups drawn independently here),
  within the fp32 rounding of the operations the engine performs (bound derived in the test).
- Groups of all R replicas with beta 0 and alpha 1 are DiLoCo's parameter averaging (same bound).
- Only point-to-point traffic, counted under ``outer``: (n_g - 1) x (codec(Delta) + fp32 phi) per replica.
- Resume is bit-identical, with and without an exchange in flight; bad settings raise naming the fix.
"""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import comm
from megacomp.outer import DiLoCo, DiLoCoConfig
from megacomp.outer.noloco import gossip_groups
from test_outer_diloco import EPS32, flat, inner_step, make_params, run_and_resume


def test_gossip_groups_partition_the_replicas_and_change_every_step():
    seen = set()
    for step in range(20):
        groups = gossip_groups(8, 2, seed=3, step=step)
        assert sorted(r for g in groups for r in g) == list(range(8)) and all(len(g) == 2 for g in groups)
        assert groups == gossip_groups(8, 2, seed=3, step=step)  # a pure function of (seed, step)
        seen.add(tuple(map(tuple, groups)))
    assert len(seen) > 10
    assert [len(g) for g in gossip_groups(6, 3, 0, 0)] == [3, 3]
    with pytest.raises(ValueError, match="group size 4 must be >= 2 and divide the replica count 6"):
        gossip_groups(6, 4, 0, 0)


def _rule_body(rank, world, cfg_kw, h, outer_steps):
    params = make_params()
    cfg = DiLoCoConfig(outer_steps=h, algorithm="noloco", **cfg_kw)
    outer = DiLoCo(params, None, cfg)
    worst = 0.0
    momentum = torch.zeros(flat(params).numel(), dtype=torch.float64)
    n = 0
    for t in range(outer_steps * h):
        inner_step(params, rank, t)
        phi, theta = outer.outer[0].detach().double().clone(), flat(params).double()
        gathered = [torch.empty(2, theta.numel(), dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, torch.stack([phi, theta]))
        m_before = momentum.clone()
        if not outer.step():
            continue
        # fp64 restatement: m <- beta m - alpha mean(Delta) + alpha (mean(phi) - phi_i); phi_i <- phi_i + m
        [group] = [g for g in gossip_groups(world, cfg.group_size, cfg.seed, n) if rank in g]
        n += 1
        phis = torch.stack([gathered[j][0] for j in group])
        deltas = torch.stack([gathered[j][0] - gathered[j][1] for j in group])
        a, b = cfg.outer_lr, cfg.outer_momentum
        momentum = b * m_before - a * deltas.mean(0) + a * (phis.mean(0) - phi)
        want = phi + momentum
        got = flat(params).double()
        assert torch.equal(got, outer.outer[0].double())
        # fp32 roundings on the engine's path, each at most EPS32 times a magnitude bounded by S below:
        # Delta_j (1 per member, n_g), the two means (n_g - 1 adds and one division each), mean(phi) - phi,
        # beta m, - alpha mean(Delta), + alpha (...), phi + m: 2 n_g + 6 in all
        k = 2 * len(group) + 6
        s = (phi.abs() + b * m_before.abs() + a * deltas.abs().mean(0) + a * phis.abs().mean(0) + a * phi.abs()
             + momentum.abs() + want.abs())
        excess = ((got - want).abs() - k * EPS32 * s).max().item()
        worst = max(worst, excess)
    return worst, n


@pytest.mark.parametrize("world,cfg_kw", [
    (2, dict()),
    (4, dict(outer_momentum=0.5, outer_lr=0.7, seed=5)),
    (4, dict(outer_momentum=0.0, outer_lr=1.0, group_size=4)),
    (3, dict(outer_momentum=0.3, outer_lr=0.9, group_size=3)),
])
def test_outer_step_equals_the_reference_rule_in_fp64(world, cfg_kw):
    for worst, syncs in run_ranks(_rule_body, world, cfg_kw, 2, 4):
        assert syncs == 4 and worst <= 0, f"error exceeds the fp32 bound by {worst}"


def _reference_code_body(rank, world, steps):
    """The engine with NoLoCo's defaults against the reference code's gossip step (gensyn-ai/noloco @a1b4a42,
    src/noloco/sparse_optimizer_c.py: outer_step), restated in fp32 in its order of operations for a group of 2:
    mean = (phi_root + phi_other) / 2, mean_g = ((theta - phi)_root + (theta - phi)_other) / 2,
    m += (beta - 1) m + alpha mean_g + alpha (mean - phi), phi += m, theta = phi."""
    params = make_params()
    cfg = DiLoCoConfig(outer_steps=1, algorithm="noloco")
    outer = DiLoCo(params, None, cfg)
    m = torch.zeros(flat(params).numel())
    worst = 0.0
    for t in range(steps):
        inner_step(params, rank, t)
        phi, theta = outer.outer[0].detach().clone(), flat(params).clone()
        gathered = [torch.empty(2, theta.numel()) for _ in range(world)]
        dist.all_gather(gathered, torch.stack([phi, theta]))
        assert outer.step()
        root, other = gathered  # a group of two: both replicas, the root first as in the reference
        mean = (root[0] + other[0]) * (1.0 / 2)
        mean_g = ((root[1] - root[0]) + (other[1] - other[0])) * (1.0 / 2)
        m = m + ((cfg.outer_momentum - 1.0) * m + cfg.outer_lr * mean_g + cfg.outer_lr * (mean - phi))
        want = phi + m
        got = flat(params)
        # both orders of operations round each of ~10 fp32 operations once, on magnitudes up to s
        s = phi.abs() + theta.abs() + m.abs() + want.abs() + max(x.abs().max() for x in gathered)
        worst = max(worst, ((got - want).abs() - 20 * EPS32 * s).max().item())
    return (cfg.outer_lr, cfg.outer_momentum, cfg.group_size), worst


def test_defaults_and_step_are_the_reference_codes():
    """DiLoCoConfig(algorithm='noloco') left unset is the reference's every gossip configuration (alpha 0.7, beta
    0.5, groups of 2), and the engine's step is the reference code's within fp32 rounding, over 3 outer steps."""
    for defaults, worst in run_ranks(_reference_code_body, 2, 3):
        assert defaults == (0.7, 0.5, 2)
        assert worst <= 0, f"error exceeds the fp32 bound by {worst}"


def _averaging_body(rank, world):
    params = make_params()
    outer = DiLoCo(params, None, DiLoCoConfig(outer_steps=1, outer_lr=1.0, outer_momentum=0.0, algorithm="noloco",
                                              group_size=world))
    inner_step(params, rank, 0)
    theta = flat(params).double()
    gathered = [torch.empty_like(theta) for _ in range(world)]
    dist.all_gather(gathered, theta)
    outer.step()
    want = torch.stack(gathered).mean(0)
    got = flat(params).double()
    # phi + (mean(phi) - phi - mean(Delta)): 2 world + 6 roundings of magnitudes up to 4 max|x|
    bound = (2 * world + 6) * EPS32 * 4 * torch.stack(gathered).abs().max(0).values.clamp_min(1.0)
    return bool(((got - want).abs() <= bound).all()), torch.equal(got, want)


@pytest.mark.parametrize("world", [2, 4])
def test_whole_group_alpha1_beta0_is_parameter_averaging(world):
    for within, _ in run_ranks(_averaging_body, world):
        assert within


def _traffic_body(rank, world, codec, error_feedback):
    params = make_params()
    numel = flat(params).numel()
    cfg = DiLoCoConfig(outer_steps=2, algorithm="noloco", codec=codec, error_feedback=error_feedback)
    outer = DiLoCo(params, None, cfg)
    comm.reset_stats()
    for t in range(4):
        inner_step(params, rank, t)
        outer.step()
    stats = comm.stats()
    kinds = {k for k, v in stats.items() if v.calls}
    wire, raw = stats["outer"].wire_bytes, stats["outer"].uncompressed_bytes
    return kinds, wire, raw, numel, outer.channel.state_dict()


@pytest.mark.parametrize("codec,error_feedback", [(None, None), ({"name": "int8", "block_size": 64}, "ef")])
def test_only_point_to_point_traffic_counted_under_outer(codec, error_feedback):
    for kinds, wire, raw, numel, state in run_ranks(_traffic_body, 4, codec, error_feedback):
        assert kinds == {"outer", "outer_recv"}  # sends, and their receive-side mirror (not summed in metrics)
        assert raw == 2 * 2 * numel * 4  # 2 syncs x (Delta + phi) x one peer, fp32 sizes
        if codec is None:
            assert wire == raw
        else:  # phi stays fp32; Delta is one int8 per element plus one fp32 scale per 64
            assert wire == 2 * (numel * 4 + numel + 4 * -(-numel // 64))
            assert state["error_feedback"]  # the residual is kept


def _resume_body(rank, world, cfg_kw, stop):
    cfg = DiLoCoConfig(algorithm="noloco", outer_momentum=0.5, **cfg_kw)
    same, in_flight, saved = run_and_resume(rank, cfg, stop, 13)
    other = DiLoCo(make_params(), None, DiLoCoConfig(outer_steps=cfg.outer_steps, outer_momentum=0.5))
    try:
        other.load_state_dict(saved)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return same, in_flight, refused


@pytest.mark.parametrize("cfg_kw,stop,in_flight", [
    (dict(outer_steps=3, codec={"name": "int4", "block_size": 32}, error_feedback="loco"), 7, []),
    (dict(outer_steps=4, fragments=2, delay=1, mixing=0.5), 4, [0]),  # fragment 0 starts at step 4
])
def test_resume_is_bit_identical_and_refuses_diloco_state(cfg_kw, stop, in_flight):
    for same, flight, refused in run_ranks(_resume_body, 4, cfg_kw, stop):
        assert same and flight == in_flight
        assert "saved with" in refused and "noloco" in refused


def _bad_group_body(rank, world):
    try:
        DiLoCo(make_params(), None, DiLoCoConfig(algorithm="noloco", group_size=3))
    except ValueError as e:
        return str(e)
    return ""


def test_bad_settings():
    with pytest.raises(ValueError, match="outer algorithm must be 'diloco', 'noloco', .* got 'gossip'"):
        DiLoCoConfig(algorithm="gossip")
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        DiLoCoConfig(algorithm="noloco", group_size=1)
    with pytest.raises(ValueError, match="needs groups of 2"):
        DiLoCoConfig(algorithm="noloco", group_size=4, codec="int8", error_feedback="ef")
    for message in run_ranks(_bad_group_body, 4):
        assert "group_size 3 does not divide the replica count 4" in message


def test_pretraining_with_noloco_over_four_replicas_logs_outer_traffic_and_resumes(tiny_config, tmp_path):
    from dataclasses import replace

    from test_outer_diloco import _pretrain_body

    cfg = replace(tiny_config, train_iters=6, outer_algorithm="noloco", num_replicas=4, outer_steps=2,
                  outer_codec="int8", outer_error_feedback="ef")
    full = run_ranks(_pretrain_body, 4, cfg)[0]
    losses = [loss for loss, _ in full]
    assert losses[-1] < losses[0]
    outer = [t.get("outer", [0, 0]) for _, t in full]
    assert [w > 0 for w, _ in outer] == [False, True] * 3  # one gossip round every 2 steps
    assert all(0.3 * u < w < 0.7 * u for w, u in outer if u)  # int8 Delta (about 1/4) + fp32 phi (1/2 of the raw)
    assert all("outer_recv" not in t for _, t in full)  # receive mirrors are not summed twice
    ck = str(tmp_path / "ck")
    first = run_ranks(_pretrain_body, 4, replace(cfg, save=ck, exit_interval=3))[0]  # mid-cycle
    rest = run_ranks(_pretrain_body, 4, replace(cfg, load=ck))[0]
    assert [loss for loss, _ in first + rest] == losses
    with pytest.raises(AssertionError, match="saved with"):
        run_ranks(_pretrain_body, 4, replace(cfg, load=ck, outer_algorithm="diloco"))


def test_pretraining_flags_for_noloco_are_checked():
    from megacomp.training import PretrainConfig
    from megacomp.training.arguments import check

    with pytest.raises(ValueError, match="outer_group_size 3 does not divide num_replicas 4"):
        check(PretrainConfig(outer_algorithm="noloco", num_replicas=4, outer_group_size=3))
    with pytest.raises(ValueError, match="needs groups of 2"):
        check(PretrainConfig(outer_algorithm="noloco", num_replicas=4, outer_group_size=4, outer_codec="int8",
                             outer_error_feedback="ef"))


def test_run_summary_splits_bytes_per_token_into_inner_and_outer():
    from megacomp.training.report import RunTotals

    totals = RunTotals()
    for it, outer in ((1, 0), (2, 4000)):
        totals.add({"iteration": it, "iteration_time_s": 1.0, "loss": 3.0, "skipped": False,
                    "traffic": {"dp_gradient": [1000, 4000], "outer": [outer, outer]}}, tokens=100)
    text = totals.summary(2)
    assert "per token" in text and "30.0 bytes (inner 10.0, outer 20.0)" in text

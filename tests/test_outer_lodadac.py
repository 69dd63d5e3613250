"""megacomp.outer.lodadac (LoDAdaC's Algorithm 1: LoDAdaCAdam's local update + LoDAdaC's compressed gossip) and
megacomp.outer.topology.

- Topologies: ring, torus, exponential and random_peer give symmetric, doubly stochastic mixing matrices with the
  documented neighbours and rho = ||W - J||_2; a topology that does not fit the replica count raises one line naming
  the fix; so do bad local-update settings.
- Algorithm 1, ring of 4: every iteration equals an fp64 restatement written here (m, the previous u, xh, y and the
  gossip step per agent, with W) within the fp32 rounding of the operations performed: compression off with K = 1
  and K = 3, and int4 / top-k (the restatement applying the same deterministic Q) with K = 3. Replicas started
  from different weights begin at replica 0's (line 2).
- Table 2's AMSGrad / AdaGrad rules and the bias-correction / weight-decay options equal their fp64 restatements.
- Consensus: after the replicas drift apart, compressed gossip rounds shrink the consensus distance and keep the
  sum of the replicas' weights (to fp32 rounding).
- xh tracking: xh_i - x^0 is exactly the fp32 sum of the messages Q[x^{t+1/2} - xh^t] (recomputed here), and
  y_i = sum_j W_ji xh_j to fp32 rounding; bytes: one encoding per neighbour per exchange, under ``outer``.
- Resume is bit-identical (ring and random_peer, int4).
- Pretraining with --outer-algorithm lodadac trains, logs outer traffic every K steps and resumes. Slow.
"""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp.outer.lodadac import LoDAdaC, LoDAdaCAdam, LoDAdaCConfig
from megacomp.outer.topology import check_topology, mixing_matrix, mixing_rho, neighbours

EPS32 = 2.0 ** -24


@pytest.mark.parametrize("topology,replicas,expected,rho", [
    ("ring", 4, [1, 3], 1 / 3), ("ring", 2, [1], 0.0), ("torus", 9, [1, 2, 3, 6], 0.4), ("torus", 6, [1, 2, 3], None),
    ("exponential", 8, [1, 2, 4, 6, 7], 1 / 3), ("exponential", 4, [1, 2, 3], 0.0)])
def test_neighbours_and_doubly_stochastic_symmetric_mixing(topology, replicas, expected, rho):
    assert neighbours(topology, replicas, 0) == expected
    w = torch.tensor(mixing_matrix(topology, replicas), dtype=torch.float64)
    assert torch.equal(w, w.T)
    one = torch.ones(replicas, dtype=torch.float64)
    assert torch.allclose(w.sum(0), one) and torch.allclose(w.sum(1), one)
    assert mixing_rho(topology, replicas) < 1
    if rho is not None:  # eigenvalues of circulant / product graphs, by hand
        assert abs(mixing_rho(topology, replicas) - rho) < 1e-12


def test_random_peer_is_a_perfect_matching_that_changes():
    draws = []
    for n in range(6):
        pairs = {i: neighbours("random_peer", 8, i, seed=5, exchange=n) for i in range(8)}
        assert all(len(p) == 1 and pairs[p[0]] == [i] for i, p in pairs.items())
        draws.append(tuple(pairs[i][0] for i in range(8)))
    assert len(set(draws)) > 1
    assert abs(mixing_rho("random_peer", 8) - 1) < 1e-12  # one matching is disconnected: outside Assumption 2


def test_topology_that_does_not_fit_raises_one_line_naming_the_fix():
    with pytest.raises(ValueError, match="torus needs a replica count that factors as rows x cols.*got 5; use ring"):
        check_topology("torus", 5)
    with pytest.raises(ValueError, match="random_peer .* needs an even replica count, got 3; use ring"):
        check_topology("random_peer", 3)
    with pytest.raises(ValueError, match="must be one of ring, torus, exponential, random_peer"):
        check_topology("star", 4)
    with pytest.raises(ValueError, match="gossip step .* must be in"):
        LoDAdaCConfig(gossip_lr=1.5)
    x = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="delta .* must be > 0"):
        LoDAdaCAdam(x, eps=0.0)
    with pytest.raises(ValueError, match="rule must be one of adam, amsgrad, adagrad"):
        LoDAdaCAdam(x, rule="lion")


N = 64
ALPHA, DELTA, B1, B2 = 0.05, 0.1, 0.9, 0.95


def _target(rank, t):
    return torch.randn(N, generator=torch.Generator().manual_seed(31 * rank + t), dtype=torch.float64)


def _restated_q(codec, v64):
    """The restatement's Q: the same deterministic codec applied to its own (fp64) argument."""
    v = v64.float()
    return codec.decode_flat(codec.encode_flat(v), v.numel(), torch.float32).double()


def _algorithm1_body(rank, world, steps, k, codec, gamma):
    x = torch.nn.Parameter(torch.randn(N, generator=torch.Generator().manual_seed(7 + rank)))  # differ: line 2
    opt = LoDAdaCAdam([x], lr=ALPHA, betas=(B1, B2), eps=DELTA)
    engine = LoDAdaC([x], None, LoDAdaCConfig(outer_steps=k, topology="ring", codec=codec, gossip_lr=gamma))
    q = engine.codec
    w = torch.tensor(mixing_matrix("ring", world), dtype=torch.float64)
    x0 = torch.randn(N, generator=torch.Generator().manual_seed(7)).double()  # replica 0's
    X = torch.stack([x0] * world)
    XH, M, U = X.clone(), torch.zeros_like(X), torch.zeros_like(X)  # xh^0 = x^0, m^{-1} = u^{-1} = 0
    worst = 0.0
    for t in range(steps):
        x.grad = (x.detach().double() - _target(rank, t)).float()  # grad of 0.5 ||x - target_rank(t)||^2
        opt.step()
        engine.step()
        G = X - torch.stack([_target(j, t) for j in range(world)])
        M = B1 * M + (1 - B1) * G
        half = X - ALPHA * M / (U.sqrt() + DELTA)  # the previous u
        U = B2 * U + (1 - B2) * G * G
        if (t + 1) % k == 0:
            XH = XH + torch.stack([_restated_q(q, half[i] - XH[i]) for i in range(world)])
            X = half + gamma * (w.T @ XH - XH)  # row i: sum_j W_ji xh_j - xh_i
        else:
            X = half
        scale = max(float(X.abs().max()), 1.0)
        worst = max(worst, float((x.detach().double() - X[rank]).abs().max()) / scale)
    return worst


@pytest.mark.parametrize("k,codec,gamma", [(1, None, 1.0), (3, None, 0.6), (3, "int4", 0.5),
                                           (3, {"name": "none", "k": 16, "chunk": 32}, 0.5)])
def test_ring_of_four_is_algorithm_1(k, codec, gamma):
    # torch.optim's first step imports torch._dynamo: once, here, not in each forked rank
    warm = torch.nn.Parameter(torch.zeros(1))
    warm.grad = torch.zeros(1)
    LoDAdaCAdam([warm]).step()
    steps = 7
    for worst in run_ranks(_algorithm1_body, 4, steps, k, codec, gamma):
        # per iteration the fp32 path rounds <= 16 times on values of the weights' scale (the Adam step ~10, the
        # gossip <= 6: the difference, xh, three additions into y, the final step), and an error already in x comes
        # back through the gradient (1-Lipschitz here) scaled by at most alpha / delta: it grows by (1 + alpha / delta)
        # per iteration. Q is the same function on both sides; at its rounding thresholds it would differ by a whole
        # level, which these seeds do not meet (the bound would fail loudly, not pass by luck).
        growth = sum((1 + ALPHA / DELTA) ** s for s in range(steps))
        assert worst <= 16 * EPS32 * growth, worst


def test_table_2_rules_and_the_adamw_options_match_their_restatement():
    g_seq = [torch.randn(9, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in range(6)]
    for rule, bias, decay in [("amsgrad", False, False), ("adagrad", False, False), ("adam", True, True)]:
        x = torch.nn.Parameter(torch.ones(9))
        opt = LoDAdaCAdam([{"params": [x], "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.99), eps=1e-3, rule=rule,
                          bias_correction=bias, apply_weight_decay=decay)
        ref, m, u, ue, s = torch.ones(9, dtype=torch.float64), 0.0, 0.0, 0.0, 0.0
        for t, g in enumerate(g_seq):
            x.grad = g.float()
            opt.step()
            g = g.float().double()
            if decay:
                ref = ref * (1 - 0.01 * 0.1)
            m = 0.9 * m + 0.1 * g
            prev = u / (1 - 0.99 ** t) if bias and t else u
            denom = (prev.sqrt() if torch.is_tensor(prev) else 0.0) + 1e-3
            ref = ref - 0.01 * (m / (1 - 0.9 ** (t + 1)) if bias else m) / denom
            if rule == "adam":
                u = 0.99 * u + 0.01 * g * g
            elif rule == "amsgrad":
                ue = 0.99 * ue + 0.01 * g * g
                u = torch.maximum(torch.as_tensor(u, dtype=torch.float64), ue)
            else:
                s = s + g * g
                u = s / (t + 1)
        # ~10 fp32 roundings per step on O(1) values, amplified by lr / delta = 10 through the division
        assert float((x.detach().double() - ref).abs().max()) <= len(g_seq) * 10 * EPS32 * 10, rule


def _consensus_body(rank, world, drift_rounds, rounds, codec, gamma):
    from megacomp import comm

    comm.reset_stats()
    x = torch.nn.Parameter(torch.zeros(500), requires_grad=False)
    engine = LoDAdaC([x], None, LoDAdaCConfig(outer_steps=1, topology="ring", codec=codec, gossip_lr=gamma))

    def distance_and_sum():
        total = x.detach().double().clone()
        dist.all_reduce(total)
        mean = total / world
        d = (x.detach().double() - mean).pow(2).sum()
        dist.all_reduce(d)
        return float(d), total

    for t in range(drift_rounds):  # local steps that differ per replica, with gossip after each
        with torch.no_grad():
            x.add_(torch.randn(500, generator=torch.Generator().manual_seed(100 * rank + t)), alpha=rank + 1)
        engine.step()
    dists, (d0, s0) = [], distance_and_sum()
    for _ in range(rounds):  # gossip only: x^{t+1/2} = x^t
        engine.step()
        dists.append(distance_and_sum()[0])
    s1 = distance_and_sum()[1]
    scale = float(x.abs().max())
    wire = comm.stats()["outer"].wire_bytes
    return d0, dists, float((s1 - s0).abs().max()), scale, wire, engine.codec.wire_bytes(500)


def test_compressed_gossip_shrinks_consensus_distance_and_keeps_the_sum():
    drift, rounds = 3, 40
    for d0, dists, drift_sum, scale, wire, nbytes in run_ranks(_consensus_body, 4, drift, rounds, "int4", 0.5):
        assert d0 > 0 and dists[-1] < 1e-2 * d0
        assert all(later < earlier for earlier, later in zip(dists[::10], dists[10::10]))
        # the gossip step adds gamma (y_i - xh_i); summed over i it is gamma (sum_i y_i - sum_i xh_i) = 0 in exact
        # arithmetic (W doubly stochastic): per round each replica rounds ~6 times on values of the weights' scale
        assert drift_sum <= rounds * 4 * 6 * EPS32 * 4 * scale
        assert wire == (drift + rounds) * 2 * nbytes  # one encoding to each of the 2 ring neighbours per exchange


def _tracking_body(rank, world, rounds, codec):
    x = torch.nn.Parameter(torch.randn(300, generator=torch.Generator().manual_seed(rank)), requires_grad=False)
    engine = LoDAdaC([x], None, LoDAdaCConfig(outer_steps=1, topology="ring", codec=codec, gossip_lr=0.5))
    q = engine.codec
    x0 = x.detach().clone()
    sent32, sent64 = x0.clone(), torch.zeros(300, dtype=torch.float64)
    for t in range(rounds):
        with torch.no_grad():
            x.add_(torch.randn(300, generator=torch.Generator().manual_seed(100 * rank + t)), alpha=0.3)
        msg = q.decode_flat(q.encode_flat(x.detach() - engine.xhat), 300, torch.float32)  # Q[x^{t+1/2} - xh^t]
        sent32.add_(msg)
        sent64 += msg.double()
        engine.step()
    return x0, engine.xhat.clone(), engine.y.clone(), sent32, sent64


def test_xhat_is_the_sum_of_the_sent_messages_and_y_tracks_w_xhat():
    rounds = 10
    results = run_ranks(_tracking_body, 4, rounds, "int4")
    w = torch.tensor(mixing_matrix("ring", 4), dtype=torch.float64)
    assert all(torch.equal(r[0], results[0][0]) for r in results)  # line 2: every replica starts at x^0
    for i, (x0, xhat, y, sent32, sent64) in enumerate(results):
        assert torch.equal(xhat, sent32)  # xh_i^t = x^0 + the messages, added in the same order: bit for bit
        # in fp64 the telescoping sum differs only by the rounding of the rounds' fp32 additions
        assert float((xhat.double() - x0.double() - sent64).abs().max()) <= rounds * EPS32 * float(xhat.abs().max())
        wxhat = sum(w[j, i] * results[j][1].double() for j in range(4))
        # y_i adds 3 messages per round (3 roundings each of at most |y|)
        assert float((y.double() - wxhat).abs().max()) <= rounds * 3 * 2 * EPS32 * float(y.abs().max())


def _resume_body(rank, world, stop, end, topology):
    def fresh():
        x = torch.nn.Parameter(torch.randn(120, generator=torch.Generator().manual_seed(rank)), requires_grad=False)
        return x, LoDAdaC([x], None, LoDAdaCConfig(outer_steps=2, topology=topology, codec="int4", seed=1))

    def local(x, t):
        with torch.no_grad():
            x.add_(torch.randn(120, generator=torch.Generator().manual_seed(50 * rank + t)), alpha=0.2)

    x, e = fresh()
    for t in range(end):
        local(x, t)
        e.step()
    straight = x.detach().clone()
    x2, e2 = fresh()
    for t in range(stop):
        local(x2, t)
        e2.step()
    state, saved = e2.state_dict(), x2.detach().clone()
    x3, e3 = fresh()
    with torch.no_grad():
        x3.copy_(saved)
    e3.load_state_dict(state)
    for t in range(stop, end):
        local(x3, t)
        e3.step()
    return torch.equal(straight, x3.detach())


@pytest.mark.parametrize("topology", ["ring", "random_peer"])
def test_resume_is_bit_identical(topology):
    assert all(run_ranks(_resume_body, 4, 5, 12, topology))


def _bad_topology_body(rank, world):
    x = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
    try:
        LoDAdaC([x], None, LoDAdaCConfig(topology="random_peer"))
    except ValueError as e:
        return str(e)
    return ""


def test_topology_refused_for_the_replica_count_at_build_and_in_flags():
    for message in run_ranks(_bad_topology_body, 3):
        assert "needs an even replica count, got 3" in message
    from megacomp.training import PretrainConfig
    from megacomp.training.arguments import check

    with pytest.raises(ValueError, match="torus needs a replica count that factors"):
        check(PretrainConfig(outer_algorithm="lodadac", num_replicas=5, outer_topology="torus"), world_size=5)
    with pytest.raises(ValueError, match="gossip copies are its error feedback"):
        check(PretrainConfig(outer_algorithm="lodadac", num_replicas=4, outer_codec="int4", outer_error_feedback="ef"),
              world_size=4)


def test_training_uses_algorithm_1s_local_update_and_checks_its_flags():
    from megacomp.training import PretrainConfig
    from megacomp.training.arguments import check
    from megacomp.training.features.outer_loop import lodadac_optimizer

    made = lodadac_optimizer(PretrainConfig(outer_algorithm="lodadac", num_replicas=4))
    assert made.func is LoDAdaCAdam  # the paper's defaults: no bias correction, no weight decay
    assert made.keywords == {"eps": 1e-4, "rule": "adam", "bias_correction": False, "apply_weight_decay": False}
    base = {"outer_algorithm": "lodadac", "num_replicas": 4}
    for extra, words in [({"lodadac_delta": 0.0}, "lodadac_delta must be > 0"),
                         ({"lodadac_rule": "lion"}, "lodadac_rule must be one of adam, amsgrad, adagrad"),
                         ({"adam_freeze_variance_step": 5}, "both replace the inner optimizer")]:
        with pytest.raises(ValueError, match=words):
            check(PretrainConfig(**base, **extra), world_size=4)


@pytest.mark.slow
def test_pretraining_with_lodadac_over_four_replicas_logs_outer_traffic_and_resumes(tiny_config, tmp_path):
    from dataclasses import replace

    from test_outer_diloco import _pretrain_body

    cfg = replace(tiny_config, train_iters=6, outer_algorithm="lodadac", num_replicas=4, outer_steps=2,
                  outer_codec="int4")
    full = run_ranks(_pretrain_body, 4, cfg)[0]
    losses = [loss for loss, _ in full]
    assert losses[-1] < losses[0]
    outer = [t.get("outer", [0, 0]) for _, t in full]
    assert [w > 0 for w, _ in outer] == [False, True] * 3
    assert all(0.1 * u < w < 0.2 * u for w, u in outer if u)  # int4 with a 4-byte scale per 128: ~0.16 of fp32
    ck = str(tmp_path / "ck")
    first = run_ranks(_pretrain_body, 4, replace(cfg, save=ck, exit_interval=3))[0]
    rest = run_ranks(_pretrain_body, 4, replace(cfg, load=ck))[0]
    assert [loss for loss, _ in first + rest] == losses


def test_lodadac_runs_unclipped_unless_clip_grad_is_typed():
    from megacomp.training import PretrainConfig
    from megacomp.training.arguments import resolve

    cfg = PretrainConfig(outer_algorithm="lodadac", num_replicas=4)  # clip_grad not given: the trainer's 1.0
    lines = resolve(cfg, 4)
    assert cfg.training.clip_grad == 0 and any("no gradient clipping" in line for line in lines)
    typed = PretrainConfig(outer_algorithm="lodadac", num_replicas=4, clip_grad=0.5)
    resolve(typed, 4)
    assert typed.training.clip_grad == 0.5  # a typed --clip-grad is the user's: kept (the banner names it)
    other = PretrainConfig(outer_algorithm="diloco", num_replicas=4)
    resolve(other, 4)
    assert other.training.clip_grad == 1.0


# The authors' release (github.com/HavenCook/LoDAdaC-release, commit b3fbfed, src/Optimizer.py, optim_name
# "DistributedAdam", restated here, not copied): per parameter, with beta1 0.9, beta2 0.999, eps 1e-8,
#     m = b1 m + (1 - b1) g;  v_prev = v;  v = b2 v + (1 - b2) g * g;  u_prev = u;  u = u - v_prev + v
#     x -= lr m / sqrt(u_prev + eps)
# followed by the neighbour step; with one agent (nprocs 1) every neighbour_reduce returns at once, so this is the
# whole local update. u is gossiped only when "u" is in comm_set (the experiments' sets are ['x'] and
# ['x_bar', 'g_bar']), so u = v: Algorithm 1's u with the previous u in the denominator. The release clips nothing.
# Uncompressed, its neighbour step replaces x by the mean of x and the neighbours' x: W x with 1 / (d + 1) weights.
RELEASE_LR, RELEASE_B1, RELEASE_B2, RELEASE_EPS = 1e-3, 0.9, 0.999, 1e-8


def _release_local_steps(x, grads):
    """The release's iterate after ``grads``, and the signed shift that moving delta outside the root makes: the
    gradients are given, so m and u are the same sequences on both sides and only the denominators differ."""
    m, v, u = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x)
    out, shift = x.clone(), torch.zeros_like(x)
    for g in grads:
        m = RELEASE_B1 * m + (1 - RELEASE_B1) * g
        v_prev, v = v, RELEASE_B2 * v + (1 - RELEASE_B2) * g * g
        u_prev, u = u, u - v_prev + v
        out = out - RELEASE_LR * m / torch.sqrt(u_prev + RELEASE_EPS)
        # megacomp: 1 / (sqrt(u) + 1e-4) (Algorithm 1's delta) where the release has 1 / sqrt(u + 1e-8); equal at u = 0
        shift += RELEASE_LR * m * (1 / torch.sqrt(u_prev + RELEASE_EPS) - 1 / (u_prev.sqrt() + 1e-4))
    return out, shift


def test_local_update_is_the_releases_distributed_adam_up_to_where_delta_sits():
    grads = [torch.randn(33, generator=torch.Generator().manual_seed(40 + s), dtype=torch.float64) for s in range(8)]
    x0 = torch.randn(33, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for steps in (1, len(grads)):
        x = torch.nn.Parameter(x0.float())
        opt = LoDAdaCAdam([x], lr=RELEASE_LR, betas=(RELEASE_B1, RELEASE_B2), eps=1e-4)  # the release's defaults
        for g in grads[:steps]:
            x.grad = g.float()
            opt.step()
        ref, shift = _release_local_steps(x0.float().double(), [g.float().double() for g in grads[:steps]])
        # ~10 fp32 roundings per step, each relative to the iterate or the step (the first step, lr m / delta, is
        # of the gradients' size; later ones are smaller): the scale of the values
        rounding = steps * 10 * EPS32 * max(float(ref.abs().max()), float(grads[0].abs().max()), 1.0)
        assert float((x.detach().double() - (ref + shift)).abs().max()) <= rounding
        if steps == 1:
            assert float(shift.abs().max()) == 0  # the first step is the release's (sqrt(0 + 1e-8) = 1e-4)
        else:  # after it the delta placement is the whole difference, far above the rounding
            assert float(shift.abs().max()) > 100 * rounding

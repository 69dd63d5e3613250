"""megacomp.outer.lodadac (LoDAdaC-style local AdamW + CHOCO compressed gossip) and megacomp.outer.topology.

- Topologies: ring, torus, exponential and random_peer give symmetric, doubly stochastic mixing matrices with the
  documented neighbours; a topology that does not fit the replica count raises one line naming the fix.
- Ring of 4, compression off, one local step: every exchange equals an fp64 restatement of decentralised Adam
  (AdamW written out per replica, then X <- W X) within the fp32 rounding of the operations performed.
- Compressed gossip (int4, gamma 0.5) without local steps: the consensus distance shrinks and the sum of the
  replicas' weights is preserved (to fp32 rounding).
- Error feedback: the copy of x_i a neighbour holds is bit-identical to the sender's own (the same bytes), and the
  delivered messages plus the residual x_i - xh_i telescope to x_i (to fp32 rounding); also per pair under
  random_peer.
- Bytes: one encoding per neighbour per exchange, counted under ``outer``; resume is bit-identical.
- Pretraining with --outer-algorithm lodadac trains, logs outer traffic every H steps and resumes. Slow.
"""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp.outer.lodadac import LoDAdaC, LoDAdaCConfig
from megacomp.outer.topology import check_topology, mixing_matrix, neighbours

EPS32 = 2.0 ** -24


@pytest.mark.parametrize("topology,replicas,expected", [
    ("ring", 4, [1, 3]), ("ring", 2, [1]), ("torus", 9, [1, 2, 3, 6]), ("torus", 6, [1, 2, 3]),
    ("exponential", 8, [1, 2, 4, 6, 7]), ("exponential", 4, [1, 2, 3])])
def test_neighbours_and_doubly_stochastic_symmetric_mixing(topology, replicas, expected):
    assert neighbours(topology, replicas, 0) == expected
    w = torch.tensor(mixing_matrix(topology, replicas), dtype=torch.float64)
    assert torch.equal(w, w.T)
    one = torch.ones(replicas, dtype=torch.float64)
    assert torch.allclose(w.sum(0), one) and torch.allclose(w.sum(1), one)


def test_random_peer_is_a_perfect_matching_that_changes():
    draws = []
    for n in range(6):
        pairs = {i: neighbours("random_peer", 8, i, seed=5, exchange=n) for i in range(8)}
        assert all(len(p) == 1 and pairs[p[0]] == [i] for i, p in pairs.items())
        draws.append(tuple(pairs[i][0] for i in range(8)))
    assert len(set(draws)) > 1


def test_topology_that_does_not_fit_raises_one_line_naming_the_fix():
    with pytest.raises(ValueError, match="torus needs a replica count that factors as rows x cols.*got 5; use ring"):
        check_topology("torus", 5)
    with pytest.raises(ValueError, match="random_peer .* needs an even replica count, got 3; use ring"):
        check_topology("random_peer", 3)
    with pytest.raises(ValueError, match="must be one of ring, torus, exponential, random_peer"):
        check_topology("star", 4)
    with pytest.raises(ValueError, match="gossip step .* must be in"):
        LoDAdaCConfig(gossip_lr=1.5)


def _target(rank, t, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(31 * rank + t), dtype=torch.float64)


def _adam_body(rank, world, steps, lr, wd):
    n = 23
    x0 = torch.randn(n, generator=torch.Generator().manual_seed(7))
    x = torch.nn.Parameter(x0.clone())
    opt = torch.optim.AdamW([x], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    engine = LoDAdaC([x], None, LoDAdaCConfig(outer_steps=1, topology="ring"))
    w = torch.tensor(mixing_matrix("ring", world), dtype=torch.float64)
    X = torch.stack([x0.double()] * world)  # decentralised Adam, restated: local moments, then X <- W X
    M, V = torch.zeros_like(X), torch.zeros_like(X)
    worst = 0.0
    for t in range(steps):
        x.grad = (x.detach().double() - _target(rank, t, n)).float()  # grad of 0.5 ||x - target_rank(t)||^2
        opt.step()
        engine.step()
        G = X - torch.stack([_target(j, t, n) for j in range(world)])
        M, V = 0.9 * M + 0.1 * G, 0.95 * V + 0.05 * G * G
        mhat, vhat = M / (1 - 0.9 ** (t + 1)), V / (1 - 0.95 ** (t + 1))
        X = X * (1 - lr * wd) - lr * mhat / (vhat.sqrt() + 1e-8)
        X = w @ X
        scale = max(float(X.abs().max()), 1.0)
        worst = max(worst, float((x.detach().double() - X[rank]).abs().max()) / scale)
    return worst


@pytest.mark.slow  # torch.optim's first use imports torch._dynamo (~15 s on a loaded CPU)
def test_ring_of_four_compression_off_one_local_step_is_decentralised_adam():
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # that import once, here, not in each forked rank
    steps = 5
    for worst in run_ranks(_adam_body, 4, steps, 0.05, 0.1):
        # per step: the Adam update (~10 fp32 operations, the division amplifying the moments' rounding by at most
        # lr / sqrt(vhat) ~ lr on these O(1) gradients) and the 3-term weighted sum (3 roundings)
        assert worst <= steps * 16 * EPS32, worst


def _consensus_body(rank, world, rounds, codec, gamma):
    from megacomp import comm

    comm.reset_stats()
    x = torch.nn.Parameter(torch.randn(500, generator=torch.Generator().manual_seed(rank)) * (rank + 1),
                           requires_grad=False)
    engine = LoDAdaC([x], None, LoDAdaCConfig(outer_steps=1, topology="ring", codec=codec, gossip_lr=gamma))

    def distance_and_sum():
        total = x.detach().double().clone()
        dist.all_reduce(total)
        mean = total / world
        d = (x.detach().double() - mean).pow(2).sum()
        dist.all_reduce(d)
        return float(d), total

    dists, (d0, s0) = [], distance_and_sum()
    for _ in range(rounds):
        engine.sync()
        dists.append(distance_and_sum()[0])
    s1 = distance_and_sum()[1]
    scale = float(x.abs().max())
    return d0, dists, float((s1 - s0).abs().max()), scale, comm.stats()["outer"].wire_bytes, engine.codec.wire_bytes(500)


def test_compressed_gossip_shrinks_consensus_distance_and_keeps_the_sum():
    rounds = 30
    for d0, dists, drift, scale, wire, nbytes in run_ranks(_consensus_body, 4, rounds, "int4", 0.5):
        assert dists[-1] < 1e-2 * d0
        assert all(later < earlier for earlier, later in zip(dists[::10], dists[10::10]))
        # sum_i x_i changes only by fp32 rounding: per round, each replica's update rounds ~4 operations on values
        # of at most the weights' magnitude
        assert drift <= rounds * 4 * 4 * EPS32 * 4 * scale
        assert wire == rounds * 2 * nbytes  # one encoding to each of the 2 ring neighbours per exchange


def _telescope_body(rank, world, topology, rounds):
    x = torch.nn.Parameter(torch.randn(300, generator=torch.Generator().manual_seed(rank)), requires_grad=False)
    engine = LoDAdaC([x], None, LoDAdaCConfig(outer_steps=1, topology=topology, codec="int4", gossip_lr=0.5, seed=4))
    delivered = {}  # peer -> sum of the messages this rank received from it (captured per exchange)
    for t in range(rounds):
        with torch.no_grad():
            x.add_(torch.randn(300, generator=torch.Generator().manual_seed(100 * rank + t)), alpha=0.3)
        before = {k: v.clone() for k, v in engine.copies.items()}
        engine.sync()
        for k, v in engine.copies.items():
            if k.startswith("peer/"):
                q = v - before.get(k, torch.zeros_like(v))
                delivered[k] = delivered.get(k, torch.zeros_like(v)) + q
    mine = {k: v for k, v in engine.copies.items() if k.startswith("mine/")}
    theirs = {k: v for k, v in engine.copies.items() if k.startswith("peer/")}
    return rank, x.detach().clone(), mine, theirs, delivered


@pytest.mark.parametrize("topology", ["ring", "random_peer"])
def test_error_feedback_copies_agree_bitwise_and_telescope(topology):
    rounds = 8
    results = run_ranks(_telescope_body, 4, topology, rounds)
    by_rank = {r[0]: r for r in results}
    for rank, x, mine, theirs, delivered in results:
        for key, copy in theirs.items():
            peer = int(key.split("/")[1])
            peer_mine = by_rank[peer][2]
            own = peer_mine["mine/all"] if "mine/all" in peer_mine else peer_mine[f"mine/{rank}"]
            assert torch.equal(copy, own)  # the peer's copy of what it sent = what we decoded, bit for bit
            # messages delivered + what the peer has not sent yet = the peer's weights: the residual carries the rest
            residual = by_rank[peer][1] - own
            total = delivered[key] + residual
            assert (total - by_rank[peer][1]).abs().max() <= rounds * 2 * EPS32 * by_rank[peer][1].abs().max() * 4


def _resume_body(rank, world, stop, end):
    def fresh():
        x = torch.nn.Parameter(torch.randn(120, generator=torch.Generator().manual_seed(rank)), requires_grad=False)
        return x, LoDAdaC([x], None, LoDAdaCConfig(outer_steps=2, topology="random_peer", codec="int4", seed=1))

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


def test_resume_is_bit_identical():
    assert all(run_ranks(_resume_body, 4, 5, 12))


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

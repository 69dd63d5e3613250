"""The DDP communication hook (megacomp.optimizer.ddp_hook): with codec=None it is bit-identical to plain
DDP; with int4 + LoCo it trains like plain DDP on a small regression task. Hop by hop (a topology set by hand,
4 ranks as 2 nodes x 2 ranks): compression off is plain DDP bit for bit; int4 + LoCo trains, counts the fast hop under
dp_gradient@intra_node and the slow hop at exactly the bytes the algorithm sends (a third of the flat hook's); the
per-hop residuals resume bit for bit; bad settings and a bucket layout change are refused in one line each."""
import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from megacomp import comm
from megacomp.comm.common import split_sizes
from megacomp.comm.transport import pipeline_segments
from megacomp.compression import make_codec
from megacomp.optimizer import CompressedHookState, compressed_allreduce_hook
from megacomp.optimizer.ddp_residuals import _hop_slots
from megacomp.placement import Topology


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))


def train(rank, hook_state, steps):
    ddp = DDP(model(), bucket_cap_mb=0.1)
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, compressed_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    w_true = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        loss = ((ddp(x) - torch.tanh(x @ w_true)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in ddp.parameters()], losses


def _body(rank, world):
    plain, plain_losses = train(rank, None, 6)
    hooked, _ = train(rank, CompressedHookState(codec=None), 6)
    identical = all(torch.equal(a, b) for a, b in zip(plain, hooked))
    comm.reset_stats()
    _, base = train(rank, None, 150)
    _, loco = train(rank, CompressedHookState(codec="int4", error_feedback="loco", min_compress_numel=1000), 150)
    stats = comm.stats()["dp_gradient"]
    return identical, base, loco, stats.wire_bytes / stats.uncompressed_bytes


def test_hook_matches_plain_ddp_and_converges():
    for identical, base, loco, ratio in run_ranks(_body, 2):
        assert identical
        tail = lambda ls: sum(ls[-20:]) / 20  # noqa: E731
        assert tail(loco) < 0.5 * tail(base[:20])  # it trains
        assert abs(tail(loco) - tail(base)) <= 0.05 * tail(base) + 1e-3, (tail(loco), tail(base))
        assert ratio < 0.3  # int4 on the large buckets after the 2 uncompressed warm-up iterations


def _overlap_body(rank, world):
    out = {}
    for overlap in (False, True):
        state = CompressedHookState(codec="int4", error_feedback="ef", min_compress_numel=1000, overlap=overlap)
        params, losses = train(rank, state, 8)
        out[overlap] = (params, losses, {k: v.clone() for k, v in state.error_feedback._errors.items()})
    return out


def test_overlapped_hook_equals_the_synchronous_one():
    """Completing the all-reduce in a background thread (overlap=True) changes nothing but the timing: same
    parameters, losses and error-feedback state, for two ranks (one phase) and three (the second phase
    is posted from the background thread while the main thread issues the next bucket)."""
    for world in (2, 3):
        for res in run_ranks(_overlap_body, world):
            sync, overlapped = res[False], res[True]
            assert all(torch.equal(a, b) for a, b in zip(sync[0], overlapped[0]))
            assert sync[1] == overlapped[1]
            assert sync[2].keys() == overlapped[2].keys() and sync[2]
            assert all(torch.equal(sync[2][k], overlapped[2][k]) for k in sync[2])



def _powersgd_body(rank, world):
    from megacomp.compression import PowerSGD

    plain, _ = train(rank, None, 4)
    # full rank on every matrix: equals plain DDP up to fp32 round-off (tests/test_comm_low_rank.py bounds it)
    full = CompressedHookState(codec=PowerSGD(rank=256, min_compression_rate=0, error_feedback=False,
                                              warm_start=False), min_compress_numel=0, start_iter=0)
    exact, _ = train(rank, full, 4)
    comm.reset_stats()
    low = CompressedHookState(codec={"name": "powersgd", "rank": 2}, min_compress_numel=0)
    _, losses = train(rank, low, 150)
    stats = comm.stats()["dp_gradient"]
    with pytest.raises(ValueError, match="start_iter must be >= 2"):
        CompressedHookState(codec={"name": "powersgd", "rank": 2}, start_iter=1)
    again = CompressedHookState(codec={"name": "powersgd", "rank": 2}, min_compress_numel=0)
    again.load_state_dict(low.state_dict())
    restored = (again.iteration == low.iteration and again.channel.q.keys() == low.channel.q.keys()
                and all(torch.equal(again.channel.q[k], low.channel.q[k]) for k in low.channel.q)
                and all(torch.equal(again.error_feedback.error(k), low.error_feedback.error(k))
                        for k in low.error_feedback.keys()))
    return plain, exact, losses, stats.wire_bytes / stats.uncompressed_bytes, len(low.channel.q), restored


def test_powersgd_hook_on_gloo_with_several_buckets():
    """torch's PowerSGD hook races on gloo with more than one bucket; megacomp's runs each bucket's P and Q
    all-reduces in the hook's thread: full rank reproduces plain DDP over 3 ranks and several buckets, and
    rank 2 with error feedback trains at a fraction of the bytes; its state round-trips."""
    for plain, exact, losses, ratio, matrices, restored in run_ranks(_powersgd_body, 3):
        for a, b in zip(plain, exact):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        tail = lambda ls: sum(ls[-20:]) / 20  # noqa: E731
        assert tail(losses) < 0.5 * tail(losses[:20])
        assert ratio < 0.1  # rank 2 of the 256 x 256 and 256 x 16 matrices; biases and the 4 x 256 plain
        assert matrices == 2 and restored


def _accordion_body(rank, world):
    acc = {"name": "accordion", "low": {"name": "int8", "block_size": 128}, "high": {"name": "int2", "block_size": 128},
           "eta": 0.5, "interval": 5}
    state = CompressedHookState(codec=acc, error_feedback="ef", min_compress_numel=1000)
    _, losses = train(rank, state, 60)
    return losses, state.channel.switches, state.channel.low.error_feedback is state.channel.high.error_feedback


def test_accordion_hook_switches_codecs_alike_on_every_rank():
    results = run_ranks(_accordion_body, 3)
    for losses, switches, shared in results:
        assert shared and switches  # int8 while the gradient norm moves fast, int2 once it settles
        assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    assert results[0][1] == results[1][1] == results[2][1]


def _run(rank, state, steps, first=0, resume=None, cap=0.1, named=True, reset_stats_at=None):
    """``steps`` optimizer steps from step ``first`` (data of step i is the same in every run); ``resume``: the
    (model, optimizer, hook) state dicts to start from (``state`` None: plain DDP); ``reset_stats_at``: the step
    before which comm.stats() is reset. Returns losses, parameters and the saved state dicts."""
    ddp = DDP(model(), bucket_cap_mb=cap)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if resume is not None:
        resume = copy.deepcopy(resume)  # the optimizer would adopt (and update) the saved momentum buffers
        ddp.module.load_state_dict(resume[0])
        opt.load_state_dict(resume[1])
        state.load_state_dict(resume[2])
    if state is None:  # plain DDP
        pass
    elif named:
        state.register(ddp)
    else:
        ddp.register_comm_hook(state, compressed_allreduce_hook)
    w_true = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    losses = []
    for i in range(first, first + steps):
        if i == reset_stats_at:
            comm.reset_stats()
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * i + rank))
        loss = ((ddp(x) - torch.tanh(x @ w_true)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    saved = (ddp.module.state_dict(), opt.state_dict(), state.state_dict() if state is not None else None)
    return losses, [p.detach().clone() for p in ddp.parameters()], saved


HOOKS = {"off": dict(codec=None), "int4+loco": dict(codec="int4", error_feedback="loco", min_compress_numel=1000),
         "int8+ef": dict(codec="int8", error_feedback="ef", min_compress_numel=1000),
         "powersgd": dict(codec={"name": "powersgd", "rank": 2}, min_compress_numel=0)}


def _resume_body(rank, world, names, named):
    out = {}
    for name in names:
        straight, params, _ = _run(rank, CompressedHookState(**HOOKS[name]), 8, named=named)
        first, _, saved = _run(rank, CompressedHookState(**HOOKS[name]), 4, named=named)
        rest, resumed, _ = _run(rank, CompressedHookState(**HOOKS[name]), 4, first=4, resume=saved, named=named)
        out[name] = (straight == first + rest, all(torch.equal(a, b) for a, b in zip(params, resumed)))
    return out


def test_a_resumed_run_continues_bit_for_bit():
    """8 steps straight equal 4 steps + save + a fresh DDP, optimizer and hook state loaded + 4 steps, exactly
    (losses and parameters), compressed and not: the fresh DDP's first iteration (its initial bucket layout) is
    reduced in the saved layout, where the restored residuals belong."""
    for res in run_ranks(_resume_body, 2, ["off", "int4+loco"], True):
        assert res == {"off": (True, True), "int4+loco": (True, True)}


@pytest.mark.slow
def test_a_resumed_run_continues_bit_for_bit_with_every_hook_and_three_ranks():
    """As above over three ranks (server errors, two phases), int8 + EF and PowerSGD too, and without parameter
    names (registered with ddp.register_comm_hook: parameters keyed by their order)."""
    for named in (True, False):
        for res in run_ranks(_resume_body, 3, list(HOOKS), named):
            assert res == {name: (True, True) for name in HOOKS}, (named, res)


def _other_cap_body(rank, world):
    hook = dict(codec="int4", error_feedback="ef", min_compress_numel=0)
    _, _, saved = _run(rank, CompressedHookState(**hook), 4, cap=0.1)
    before = CompressedHookState(**hook)
    before.load_state_dict(saved[2])
    # two uncompressed iterations on a DDP with other buckets: the first is reduced in the saved layout, the second
    # in the new DDP's rebuilt one, into which the residuals then move
    after = CompressedHookState(**hook, start_iter=4 + 2)
    _run(rank, after, 2, first=4, resume=saved, cap=0.004)
    old_keys, new_keys = {k for k, _ in before.layout}, {k for k, _ in after.layout}
    server = [torch.cat([s.error_feedback.error(k + "/server").reshape(-1) for k in keys])
              for s, keys in ((before, old_keys), (after, new_keys))] if world > 2 else []
    return before.parameter_residuals(), after.parameter_residuals(), old_keys, new_keys, server


def test_residuals_follow_their_parameters_into_other_buckets():
    """Residuals saved from a DDP with bucket_cap_mb=0.1 and restored into one with 0.004 (other buckets, other
    keys) are the same per-parameter values, bit for bit."""
    for before, after, old_keys, new_keys, _ in run_ranks(_other_cap_body, 2):
        assert len(new_keys) > len(old_keys) and new_keys - old_keys  # really other buckets
        assert before.keys() == after.keys() == {n for n, _ in model().named_parameters()}
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert any(v.abs().sum() > 0 for v in after.values())


@pytest.mark.slow
def test_server_residuals_follow_their_parameters_into_other_buckets():
    """Over three ranks each rank's server error (its shard of a bucket) moves too: the ranks' server errors
    together hold the same values before and after (each element went to the rank that now keeps it)."""
    results = run_ranks(_other_cap_body, 3)
    for before, after, old_keys, new_keys, _ in results:
        assert new_keys - old_keys and all(torch.equal(before[k], after[k]) for k in before)
    old = torch.cat([r[4][0] for r in results]).sort().values
    new = torch.cat([r[4][1] for r in results]).sort().values
    assert old.abs().sum() > 0 and torch.equal(old, new)


def _per_parameter(state, table):
    """PowerSGD's per-matrix state (``<bucket key>/<j>``) by parameter name, through the state's layout."""
    return {p: table[f"{key}/{j}"] for key, entries in state.layout for j, (p, _) in enumerate(entries)
            if f"{key}/{j}" in table}


def _powersgd_other_cap_body(rank, world):
    hook = dict(codec={"name": "powersgd", "rank": 2}, min_compress_numel=0)
    _, _, saved = _run(rank, CompressedHookState(**hook), 4, cap=0.1)
    before = CompressedHookState(**hook)
    before.load_state_dict(saved[2])
    moved = CompressedHookState(**hook, start_iter=4 + 2)  # two plain iterations: the second moves the state
    _run(rank, moved, 2, first=4, resume=saved, cap=0.004)
    go_on = CompressedHookState(**hook)  # iteration 5 in the saved layout, 6 moved into the new one and compressed
    _, p_go_on, _ = _run(rank, go_on, 2, first=4, resume=saved, cap=0.004)
    ref = CompressedHookState(**hook)  # the same two iterations in the saved layout throughout
    _, p_ref, _ = _run(rank, ref, 2, first=4, resume=saved, cap=0.1)
    errors = lambda s: {k: s.error_feedback.error(k) for k in s.error_feedback.keys()}  # noqa: E731
    same = lambda a, b: a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    q_moved = same(_per_parameter(before, before.channel.q), _per_parameter(moved, moved.channel.q))
    e_moved = same(_per_parameter(before, errors(before)), _per_parameter(moved, errors(moved)))
    layout_keys = {k for k, _ in go_on.layout}
    only_current = all(k.rsplit("/", 1)[0] in layout_keys for k in list(go_on.channel.q) + list(errors(go_on)))
    # PowerSGD works per matrix (and two ranks sum P and Q exactly in any order): the new layout changes nothing
    as_ref = (same(_per_parameter(ref, ref.channel.q), _per_parameter(go_on, go_on.channel.q))
              and same(_per_parameter(ref, errors(ref)), _per_parameter(go_on, errors(go_on)))
              and all(torch.equal(a, b) for a, b in zip(p_ref, p_go_on)))
    return q_moved, e_moved, only_current, as_ref, len(before.channel.q)


@pytest.mark.slow
def test_powersgd_state_follows_its_parameters_into_other_buckets():
    """PowerSGD's warm-start Q and residual are per matrix: restored under another bucket_cap_mb each parameter's
    are the saved ones bit for bit; a compressed iteration that moves it into the new layout continues exactly as
    the saved layout would (state and parameters), and leaves state under the new layout's keys only."""
    for q_moved, e_moved, only_current, as_ref, matrices in run_ranks(_powersgd_other_cap_body, 2):
        assert matrices >= 2 and q_moved and e_moved and only_current and as_ref


# -- hop by hop: 4 ranks as 2 nodes x 2 ranks ----------------------------------------------------------------------
TOPOLOGY = Topology.uniform(4, 2)


def _hop_off_body(rank, world):
    plain, _ = train(rank, None, 6)
    state = CompressedHookState(codec=None, topology=TOPOLOGY)
    comm.reset_stats()
    hooked, _ = train(rank, state, 6)
    assert set(comm.stats()) == {"dp_gradient"}  # torch's all-reduce on the whole group, no hop
    powersgd = CompressedHookState(codec={"name": "powersgd", "rank": 2}, topology=TOPOLOGY)  # whole buckets: flat
    return (all(torch.equal(a, b) for a, b in zip(plain, hooked)), state.hierarchy is not None, state.describe(),
            powersgd.hierarchy, powersgd.describe())


def test_hop_by_hop_hook_with_compression_off_is_plain_ddp_bit_for_bit():
    """codec=None with a topology: the state builds the hops (2 nodes x 2 ranks), and every bucket is torch's
    all-reduce on the whole group: the parameters after 6 SGD steps equal plain DDP's exactly. PowerSGD with a
    topology stays flat and says so."""
    for identical, hop_by_hop, line, powersgd_hops, powersgd_line in run_ranks(_hop_off_body, 4):
        assert identical and hop_by_hop
        assert "hop by hop, intra-node (2 ranks) then inter-node (2 ranks)" in line and "\n" not in line
        assert powersgd_hops is None and "PowerSGD, Accordion and LGC run flat" in powersgd_line


def _flat_wire(codec, numel, world, rank, segment):
    """Bytes a rank sends in a flat compressed all-reduce over ``world`` > 2 ranks (megacomp.comm.collectives'
    reduce-scatter + all-gather): per pipeline segment, its encoded chunks for the others, then its re-encoded
    shard to each of them (the all-gather sends the largest chunk's size)."""
    total = 0
    for length in pipeline_segments(numel, segment):
        w = [codec.wire_bytes(s) for s in split_sizes(length, world)]
        total += sum(w) - w[rank] + (world - 1) * max(w)
    return total


def _slow_wire(codec, numel, per_node, segment):
    """Bytes a rank sends over the slow hop, two nodes: its 1/m chunk of its node's sum (the bucket padded to a
    multiple of m), encoded once and sent to its peer on the other node."""
    return sum(codec.wire_bytes(length) for length in pipeline_segments(-(-numel // per_node), segment))


def _hop_bytes_body(rank, world, steps):
    hook = dict(codec="int4", error_feedback="loco", min_compress_numel=1000)
    base, _, _ = _run(rank, None, steps)
    flat = CompressedHookState(**hook)
    _run(rank, flat, 6, reset_stats_at=2)  # counted after the 2 uncompressed iterations
    flat_stats = {k: (v.calls, v.wire_bytes) for k, v in comm.stats().items()}
    hop = CompressedHookState(**hook, topology=TOPOLOGY)
    losses, _, _ = _run(rank, hop, steps, reset_stats_at=2)
    hop_stats = {k: (v.calls, v.wire_bytes) for k, v in comm.stats().items()}
    numels = [sum(n for _, n in entries) for _, entries in hop.layout]
    keys = {k: tuple(hop.error_feedback.error(k).shape) for k in hop.error_feedback.keys()}
    _, overlapped, _ = _run(rank, CompressedHookState(**hook, topology=TOPOLOGY), 6)
    _, synchronous, _ = _run(rank, CompressedHookState(**hook, topology=TOPOLOGY, overlap=False), 6)
    return dict(base=base, losses=losses, flat=flat_stats, hop=hop_stats, numels=numels, keys=keys,
                layout=[k for k, _ in hop.layout], segment=hop.channel.options.segment_numel,
                same_sync=all(torch.equal(a, b) for a, b in zip(overlapped, synchronous)))


def test_hop_by_hop_hook_trains_and_sends_each_nodes_bytes_once():
    """int4 + LoCo hop by hop: trains like plain DDP; the fast hop is counted under dp_gradient@intra_node
    (uncompressed: reduce-scatter + all-gather of the padded bucket, 2 calls per bucket), the slow hop under
    dp_gradient at exactly the bytes of each rank's 1/2 chunk of its node's sum encoded once; the flat hook's
    dp_gradient is exactly its reduce-scatter + all-gather count, and the slow hop carries a third of it (2 nodes x 2
    ranks: 0.5 S per rank against 1.5 S). The residuals sit on the chunk the slow hop sends; finishing the buckets
    in the hook's thread (overlap) gives the same parameters as finishing each before the hook returns."""
    steps = 40
    res = run_ranks(_hop_bytes_body, 4, steps)
    codec = make_codec("int4")
    for rank, r in enumerate(res):
        numels, seg, iters = r["numels"], r["segment"], steps - 2
        assert numels and min(numels) >= 1000  # every bucket compressed
        slow = sum(_slow_wire(codec, n, 2, seg) for n in numels)
        flat = sum(_flat_wire(codec, n, 4, rank, seg) for n in numels)
        assert r["hop"]["dp_gradient"] == (iters * len(numels), iters * slow)
        assert r["hop"]["dp_gradient@intra_node"] == (2 * iters * len(numels),
                                                      iters * sum(2 * 4 * -(-n // 2) for n in numels))
        assert r["flat"]["dp_gradient"] == (4 * len(numels), 4 * flat)
        assert 0.32 < slow / flat < 0.34, slow / flat
        assert r["keys"] == {f"{k}/worker": (-(-n // 2),) for k, n in zip(r["layout"], numels)}
        assert r["same_sync"]
        tail = lambda ls: sum(ls[-10:]) / 10  # noqa: E731
        assert tail(r["losses"]) < 0.5 * tail(r["losses"][:10])  # it trains
        assert abs(tail(r["losses"]) - tail(r["base"])) <= 0.1 * tail(r["base"]) + 1e-3, (
            tail(r["losses"]), tail(r["base"]))


HOP_HOOKS = {"int4+loco": dict(codec="int4", error_feedback="loco", min_compress_numel=1000),
             "int4 slow, bf16 fast + ef": dict(codec={"inter_node": "int4", "intra_node": "bf16"}, error_feedback="ef",
                                               min_compress_numel=1000)}


def _hop_resume_body(rank, world):
    out = {}
    for name, hook in HOP_HOOKS.items():
        straight, params, _ = _run(rank, CompressedHookState(**hook, topology=TOPOLOGY), 8)
        first, _, saved = _run(rank, CompressedHookState(**hook, topology=TOPOLOGY), 4)
        rest, resumed, _ = _run(rank, CompressedHookState(**hook, topology=TOPOLOGY), 4, first=4, resume=saved)
        keys = {k: tuple(v.shape) for k, v in saved[2]["error_feedback"]["errors"].items()}
        numels = {k: sum(n for _, n in entries) for k, entries in saved[2]["layout"]}
        out[name] = (straight == first + rest, all(torch.equal(a, b) for a, b in zip(params, resumed)), keys, numels)
    return out


def test_hop_by_hop_residuals_resume_bit_for_bit():
    """8 steps straight equal 4 steps + save + a fresh DDP, optimizer and hook state (hops built anew) loaded + 4
    steps, exactly; the saved residuals are every hop's: the slow hop's on its half of the padded bucket, a lossy
    fast hop's (bf16) on the whole padded bucket."""
    for res in run_ranks(_hop_resume_body, 4):
        for name, (same_losses, same_params, keys, numels) in res.items():
            assert same_losses and same_params, name
            expected = {f"{k}/worker": (-(-n // 2),) for k, n in numels.items()}
            if "bf16" in name:
                expected.update({f"{k}@intra_node/worker": (2 * -(-n // 2),) for k, n in numels.items()})
            assert keys == expected, name


def _hop_bad_body(rank, world):
    errors = []

    def expect(make):
        try:
            make()
        except ValueError as e:
            errors.append(str(e))
        else:
            errors.append(None)

    expect(lambda: CompressedHookState(codec="int4", topology=Topology.uniform(8, 2)))
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    mine = halves[rank // 2]
    expect(lambda: CompressedHookState(codec="int4", topology=TOPOLOGY, process_group=mine))
    expect(lambda: CompressedHookState(codec="int4", topology=TOPOLOGY, process_group=mine, groups=[[0, 2], [1, 3]]))
    expect(lambda: CompressedHookState(codec="int4", topology=Topology((0, 0, 0, 1))))
    expect(lambda: CompressedHookState(codec={"inter_node": "int4"}))
    inside = CompressedHookState(codec="int4", topology=TOPOLOGY, process_group=mine, groups=[[0, 1], [2, 3]])
    hook = dict(codec="int4", error_feedback="ef", min_compress_numel=1000)
    _, _, saved = _run(rank, CompressedHookState(**hook, topology=TOPOLOGY), 4)
    _, _, saved_flat = _run(rank, CompressedHookState(**hook), 4)
    expect(lambda: CompressedHookState(**hook, topology=TOPOLOGY).load_state_dict(saved_flat[2]))
    expect(lambda: CompressedHookState(**hook).load_state_dict(saved[2]))
    loaded = CompressedHookState(**hook, topology=TOPOLOGY)
    loaded.load_state_dict(saved[2])
    expect(loaded.parameter_residuals)
    return errors, inside.hierarchy, inside.describe()


def test_hop_by_hop_bad_settings_one_line_each():
    """Refused in one line each, alike on every rank: a topology of another world size, a subgroup without groups
    (or not among them), ranks sitting unevenly over nodes, a codec per link kind without a topology, a state saved
    flat loaded hop by hop and the reverse, per-parameter residuals hop by hop. A subgroup inside one node runs flat."""
    errors, hierarchy, line = run_ranks(_hop_bad_body, 4)[0]
    assert all(e is not None and "\n" not in e for e in errors), errors
    assert "the topology places 8 ranks but the job has 4" in errors[0]
    assert "process_group holds ranks [0, 1] of the 4" in errors[1] and "groups=" in errors[1]
    assert "are not one of groups" in errors[2]
    assert "sit unevenly (node 0: 3, node 1: 1)" in errors[3] and "(topology=None)" in errors[3]
    assert "a codec per link kind ({'inter_node': 'int4'}) needs the hops: set topology" in errors[4]
    assert "saved flat, this hook runs hop by hop, intra_node x2 then inter_node x2" in errors[5]
    assert "saved hop by hop, intra_node x2 then inter_node x2, this hook runs flat" in errors[6]
    assert "not per parameter" in errors[7]
    assert len(errors) == 8
    # a subgroup inside one node (groups given): flat, and said so
    assert hierarchy is None and "flat over process_group (the group stays inside one node)" in line


def _hop_residuals(state):
    """Every residual of a hop-by-hop state on this rank: (bucket key, suffix) -> (block, positions, values)."""
    out = {}
    for key, entries in state.layout:
        for sfx, (block, positions) in _hop_slots(state, sum(n for _, n in entries)).items():
            e = state.error_feedback.error(key + sfx)
            if e is not None:
                out[key, sfx] = (block, positions, e.reshape(-1).clone())
    return out


def _per_parameter_hops(results):
    """(suffix, block, parameter) -> that parameter's residual elements, from every rank's (layout, residuals): each
    block's slots put back into the padded bucket, then cut along the layout."""
    layout, slots, full = results[0][0], {}, {}
    for _, residuals in results:
        for (key, sfx), (block, positions, values) in residuals.items():
            slots.setdefault((key, sfx, block), []).append((positions, values))
    for where, parts in slots.items():
        full[where] = torch.full((max(p.max().item() for p, _ in parts) + 1,), math.nan)
        for positions, values in parts:
            full[where][positions] = values
    out = {}
    for (key, sfx, block), whole in full.items():
        pos = 0
        for pkey, n in dict(layout)[key]:
            out[sfx, block, pkey] = whole[pos:pos + n]
            pos += n
    return out


def _hop_other_cap_body(rank, world, topology, hook):
    _, _, saved = _run(rank, CompressedHookState(**hook, topology=topology), 4, cap=0.1)
    before = CompressedHookState(**hook, topology=topology)
    before.load_state_dict(saved[2])
    # two uncompressed iterations on a DDP with other buckets: the first is reduced in the saved layout, the second
    # in the new DDP's rebuilt one, into which the residuals then move
    after = CompressedHookState(**hook, topology=topology, start_iter=4 + 2)
    _run(rank, after, 2, first=4, resume=saved, cap=0.004)
    # and on: compressed iterations in the new buckets
    losses, _, _ = _run(rank, CompressedHookState(**hook, topology=topology), 3, first=4, resume=saved, cap=0.004)
    return ((before.layout, _hop_residuals(before)), (after.layout, _hop_residuals(after)), losses,
            sorted(after.error_feedback.keys()))


def _check_moved(results):
    before = _per_parameter_hops([r[0] for r in results])
    after = _per_parameter_hops([r[1] for r in results])
    old_keys, new_keys = {k for k, _ in results[0][0][0]}, {k for k, _ in results[0][1][0]}
    assert len(new_keys) > len(old_keys) and new_keys - old_keys  # really other buckets
    assert before.keys() == after.keys()
    assert all(not v.isnan().any() for v in before.values())  # each block's slots cover its buckets
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert any(v.abs().sum() > 0 for v in after.values())
    for _, _, losses, keys in results:  # only the new buckets' residuals are left, and training goes on
        assert all(k.split("@")[0].split("/")[0] in new_keys for k in keys)
        assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    return {sfx for sfx, _, _ in after}


def test_hop_by_hop_residuals_follow_their_parameters_into_other_buckets():
    """Hop-by-hop residuals saved from a DDP with bucket_cap_mb=0.1 and restored into one with 0.004 (other buckets,
    other keys, other chunks per rank): per hop and per block of ranks that tile a bucket (a node for the slow hop's
    worker error, each rank for a bf16 fast hop's), every parameter's residual is the saved one, bit for bit."""
    hook = dict(codec={"inter_node": "int4", "intra_node": "bf16"}, error_feedback="ef", min_compress_numel=0)
    results = run_ranks(_hop_other_cap_body, 4, TOPOLOGY, hook)
    assert _check_moved(results) == {"/worker", "@intra_node/worker"}
    # the slots are where megacomp.comm.hierarchical keeps them: the slow hop's worker error on the chunk the
    # intra-node reduce-scatter leaves local rank l (the l-th half of the padded bucket), shared by the node's ranks;
    # the bf16 fast hop's on the whole padded bucket, each rank its own
    for rank, r in enumerate(results):
        for stage in r[:2]:
            numels = {k: sum(n for _, n in entries) for k, entries in stage[0]}
            for (key, sfx), (block, positions, _) in stage[1].items():
                c = -(-numels[key] // 2)
                if sfx == "/worker":
                    l = rank % 2  # noqa: E741
                    assert block == (rank // 2,) and torch.equal(positions, torch.arange(l * c, (l + 1) * c))
                else:
                    assert block == (rank % 2, rank // 2) and torch.equal(positions, torch.arange(2 * c))


@pytest.mark.slow
def test_hop_by_hop_server_residuals_follow_their_parameters_into_other_buckets():
    """As above over 3 nodes x 2 ranks: the slow hop's all-reduce over three nodes keeps a server error (each rank
    its shard of its chunk), which moves too."""
    hook = dict(codec={"inter_node": "int4", "intra_node": "bf16"}, error_feedback="ef", min_compress_numel=0)
    assert _check_moved(run_ranks(_hop_other_cap_body, 6, Topology.uniform(6, 2), hook)) == {
        "/worker", "/server", "@intra_node/worker"}


def _hop_subgroup_body(rank, world):
    groups = [[0, 1, 4, 5], [2, 3, 6, 7]]  # two DP groups, each 2 ranks on each of the 2 nodes of 4 ranks
    pgs = [dist.new_group(g) for g in groups]  # every rank creates both
    pg = pgs[0] if rank in groups[0] else pgs[1]
    topology = Topology.uniform(8, 4)

    def run(state, steps=6):
        torch.manual_seed(0)
        ddp = DDP(model(), bucket_cap_mb=0.1, process_group=pg)
        if state is not None:
            state.register(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for i in range(steps):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * i + rank))
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in ddp.parameters()]

    plain = run(None)
    off = run(CompressedHookState(codec=None, topology=topology, process_group=pg, groups=groups))
    int4 = CompressedHookState(codec="int4", error_feedback="loco", min_compress_numel=1000, topology=topology,
                               process_group=pg, groups=groups)
    comm.reset_stats()
    run(int4)
    return (all(torch.equal(a, b) for a, b in zip(plain, off)), [h.ranks for h in int4.hierarchy.hops],
            set(comm.stats()))


@pytest.mark.slow
def test_hop_by_hop_hook_over_subgroups_given_every_group():
    """8 ranks as 2 nodes x 4, DDP over two DP groups of 2 ranks on each node (groups= lists both, every rank builds
    both groups' hops): compression off equals plain DDP on the subgroup bit for bit; int4 + LoCo runs hop by hop
    over this rank's node-mates in its group, then its peer on the other node."""
    for rank, (identical, hops, tags) in enumerate(run_ranks(_hop_subgroup_body, 8)):
        group = [0, 1, 4, 5] if rank in (0, 1, 4, 5) else [2, 3, 6, 7]
        assert identical
        assert hops == [tuple(r for r in group if r // 4 == rank // 4), tuple(r for r in group if r % 4 == rank % 4)]
        assert tags == {"dp_gradient", "dp_gradient@intra_node"}


FINISH_THEN_EXIT = r"""
import time, torch, torch.distributed as dist
from megacomp.optimizer.ddp_hook import _finish_in_thread
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
buf = torch.ones(8)
fut = torch.futures.Future()
def busy(f):  # keeps the finishing thread inside torch's future code, taking the GIL back every millisecond
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        time.sleep(0.001)
    return f.value()
fut.then(busy)
_finish_in_thread(dist.all_reduce(buf, async_op=True), buf, fut, 0)
fut.wait()
dist.destroy_process_group()
"""


def test_a_process_exits_cleanly_while_a_bucket_thread_finishes(tmp_path):
    """The hook's finishing thread may still be in torch's C++ future code when the main thread (woken by the
    completed future) reaches interpreter shutdown; that must wait for it, not abort ("terminate called without
    an active exception", exit -6, as a daemon thread did)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([sys.executable, "-c", FINISH_THEN_EXIT.format(store=tmp_path / "store")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"exit status {res.returncode}: {res.stderr[-2000:]}"

"""The DDP communication hook (megacomp.optimizer.ddp_hook): with codec=None it is bit-identical to plain
DDP; with int4 + LoCo it trains like plain DDP on a small regression task."""
import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from megacomp import comm
from megacomp.optimizer import CompressedHookState, compressed_allreduce_hook


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


def _run(rank, state, steps, first=0, resume=None, cap=0.1, named=True):
    """``steps`` optimizer steps from step ``first`` (data of step i is the same in every run); ``resume``: the
    (model, optimizer, hook) state dicts to start from. Returns losses, parameters and the saved state dicts."""
    ddp = DDP(model(), bucket_cap_mb=cap)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if resume is not None:
        resume = copy.deepcopy(resume)  # the optimizer would adopt (and update) the saved momentum buffers
        ddp.module.load_state_dict(resume[0])
        opt.load_state_dict(resume[1])
        state.load_state_dict(resume[2])
    if named:
        state.register(ddp)
    else:
        ddp.register_comm_hook(state, compressed_allreduce_hook)
    w_true = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    losses = []
    for i in range(first, first + steps):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * i + rank))
        loss = ((ddp(x) - torch.tanh(x @ w_true)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    saved = (ddp.module.state_dict(), opt.state_dict(), state.state_dict())
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

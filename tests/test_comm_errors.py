"""Bad input to megacomp.comm: the same clear error on every rank, never a hang, never a silent
uncompressed fallback; inf/NaN propagate. After each error the group still works."""
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import comm
from megacomp.compression import ErrorFeedback


def expect_error(exc, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__}")


def healthy(world):
    """The group still works after the error: a plain compressed all-reduce is right."""
    t = torch.ones(64)
    comm.all_reduce(t, codec="int8")
    assert torch.equal(t, torch.full((64,), float(world)))


def _mismatch_body(rank, world):
    msgs = {}
    msgs["numel"] = expect_error(ValueError, comm.all_reduce, torch.ones(10 + rank), codec="int4")
    healthy(world)
    msgs["codec"] = expect_error(ValueError, comm.all_reduce, torch.ones(10), codec="int4" if rank else "int8")
    healthy(world)
    msgs["dtype"] = expect_error(ValueError, comm.all_reduce,
                                 torch.ones(10, dtype=torch.float32 if rank else torch.bfloat16), codec="int8")
    healthy(world)
    msgs["op"] = expect_error(ValueError, comm.all_reduce, torch.ones(10), op=dist.ReduceOp.SUM if rank else dist.ReduceOp.AVG)
    healthy(world)
    out = torch.empty(5 + (rank == 0))
    msgs["rs"] = expect_error(ValueError, comm.reduce_scatter_tensor, out, torch.ones(world * out.numel()), codec="int8")
    healthy(world)
    ins = [2] * world
    outs = [2] * world
    if rank == 0:
        ins = [3] + [2] * (world - 1)
    x = torch.ones(sum(ins), 4)
    msgs["a2a"] = expect_error(ValueError, comm.all_to_all_single, torch.empty(sum(outs), 4), x, outs, ins, codec="int8")
    healthy(world)
    return msgs


@pytest.mark.parametrize("world", [2, 3])
def test_mismatches_across_ranks_raise_on_every_rank(world):
    for msgs in run_ranks(_mismatch_body, world):
        assert "numel differs across ranks (rank 0: 10, rank 1: 11" in msgs["numel"]
        assert "codec differs across ranks" in msgs["codec"]
        assert "dtype differs across ranks (rank 0: torch.bfloat16, rank 1: torch.float32" in msgs["dtype"]
        assert "op differs across ranks (rank 0: AVG, rank 1: SUM" in msgs["op"]
        assert "reduce_scatter_tensor: numel differs" in msgs["rs"]
        assert "rank 0 sends 3 rows to rank 0, which expects 2" in msgs["a2a"]


def _one_rank_refuses_body(rank, world):
    """Arguments that only some ranks' local checks refuse: every rank must raise, at once (no rank left waiting
    for the others within the process-group timeout)."""
    msgs = {}
    msgs["dtype"] = expect_error(ValueError, comm.all_reduce,
                                 torch.ones(10, dtype=torch.int64 if rank else torch.float32), codec="int8")
    healthy(world)
    msgs["op"] = expect_error(ValueError, comm.all_reduce, torch.ones(10),
                              op=dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM, codec="int8")
    healthy(world)
    msgs["codec"] = expect_error(ValueError, comm.all_reduce, torch.ones(10),
                                 codec={"name": "int4", "block_size": 64} if rank else "int8")
    healthy(world)
    big = rank == 1
    msgs["rs"] = expect_error(ValueError, comm.reduce_scatter_tensor, torch.empty(4),
                              torch.ones(world * 4 + big), codec="int8")
    healthy(world)
    msgs["ag"] = expect_error(ValueError, comm.all_gather_into_tensor, torch.empty(world * 4 + big), torch.ones(4),
                              codec="int8")
    healthy(world)
    msgs["ag_dtype"] = expect_error(TypeError, comm.all_gather_into_tensor,
                                    torch.empty(world * 4, dtype=torch.float64 if big else torch.float32),
                                    torch.ones(4), codec="int8")
    healthy(world)
    splits = [2] * world if rank == 0 else [2] * (world + 1)
    msgs["a2a"] = expect_error(ValueError, comm.all_to_all_single, torch.empty(2 * world, 4),
                               torch.ones(2 * world, 4), splits, splits, codec="int8")
    healthy(world)
    return msgs


@pytest.mark.parametrize("world", [2, 3])
def test_a_local_refusal_on_some_ranks_raises_on_every_rank(world):
    # a hang would end in the process-group timeout's RuntimeError, which expect_error does not take
    for msgs in run_ranks(_one_rank_refuses_body, world, timeout=90, pg_timeout=20):
        assert "dtype differs across ranks (rank 0: torch.float32, rank 1: torch.int64" in msgs["dtype"]
        assert "op differs across ranks (rank 0: MAX, rank 1: SUM" in msgs["op"]
        assert "codec differs across ranks (rank 0: int8" in msgs["codec"] and "rank 1: int4" in msgs["codec"]
        assert "input has" in msgs["rs"] and "(on rank(s) [1]; every rank of the group raises this)" in msgs["rs"]
        assert "output has" in msgs["ag"] and "on rank(s) [1]" in msgs["ag"]
        assert "input dtype torch.float32 != output dtype torch.float64" in msgs["ag_dtype"]
        assert "split sizes" in msgs["a2a"] and f"on rank(s) {list(range(1, world))}" in msgs["a2a"]


def _local_errors_body(rank, world):
    msgs = {}
    msgs["dtype"] = expect_error(TypeError, comm.all_reduce, torch.ones(10, dtype=torch.int32), codec="int8")
    msgs["name"] = expect_error(ValueError, comm.all_reduce, torch.ones(10), codec="int5")
    msgs["op"] = expect_error(ValueError, comm.all_reduce, torch.ones(10), op=dist.ReduceOp.MAX, codec="int8")
    msgs["ef"] = expect_error(ValueError, comm.all_reduce, torch.ones(10), error_feedback=ErrorFeedback("ef"))
    msgs["ef_spec"] = expect_error(ValueError, comm.all_reduce, torch.ones(10), codec="int4", error_feedback="loco")
    msgs["rs"] = expect_error(ValueError, comm.reduce_scatter_tensor, torch.empty(3), torch.ones(7), codec="int8")
    msgs["ag"] = expect_error(ValueError, comm.all_gather_into_tensor, torch.empty(3), torch.ones(7), codec="int8")
    healthy(world)
    # codec=None with an op the codec path does not support is simply torch's MAX
    t = torch.full((4,), float(rank))
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    assert torch.equal(t, torch.full((4,), float(world - 1)))
    return msgs


def test_unsupported_arguments_raise_clear_local_errors():
    for msgs in run_ranks(_local_errors_body, 2):
        assert "encodes floating tensors" in msgs["dtype"] and "codec='none'" in msgs["dtype"]
        assert "unknown codec 'int5'" in msgs["name"]
        assert "supports ReduceOp SUM and AVG, got MAX" in msgs["op"]
        assert "error feedback needs a lossy codec" in msgs["ef"]
        assert "must be an ErrorFeedback object" in msgs["ef_spec"] and "Channel" in msgs["ef_spec"]
        assert "world_size * output.numel()" in msgs["rs"] and "world_size * input.numel()" in msgs["ag"]


def _non_finite_body(rank, world):
    x = torch.randn(1000)
    if rank == 1:
        x[5] = float("nan")
        x[700] = float("inf")
    msg = expect_error(FloatingPointError, comm.all_reduce, x.clone(), codec="int8", check_finite=True)
    healthy(world)
    y = x.clone()
    comm.all_reduce(y, codec="int8")
    # two ranks exchange whole encodings: blocks of 128 from element 0, so [0, 128) and [640, 768) hold the
    # bad values (with more ranks blocks would start at each rank's chunk)
    bad = torch.zeros(1000, dtype=torch.bool)
    bad[0:128] = True
    bad[640:768] = True
    out = torch.empty(world * 1000)
    comm.all_gather_into_tensor(out, x, codec="int4")
    rs = torch.empty(500)
    comm.reduce_scatter_tensor(rs, torch.cat([x[:500], x[:500]]) if world == 2 else x[:500].repeat(world), codec="fp8_e4m3")
    return msg, y, bad, out.view(world, 1000)[1]


def test_non_finite_values_propagate_or_raise_naming_the_rank():
    for msg, y, bad, gathered in run_ranks(_non_finite_body, 2):
        assert "non-finite values (inf/NaN) in the input on rank(s) [1]" in msg
        assert not torch.isfinite(y[5]) and not torch.isfinite(y[700])
        assert torch.isfinite(y[~bad]).all()
        assert not torch.isfinite(gathered[5]) and not torch.isfinite(gathered[700])


def _p2p_body(rank, world):
    msgs = {}
    if rank == 0:
        comm.send(torch.ones(10), 1, codec="int8")  # the receiver expects 12 elements: it raises, we don't hang
        comm.send(torch.ones(10), 1, codec="int8")
        comm.send(torch.ones(10), 1, codec="int8")
        bad = torch.ones(10)
        bad[2] = float("nan")
        msgs["nan"] = expect_error(FloatingPointError, comm.send, bad, 1, codec="int8", check_finite=True)
    else:
        msgs["size"] = expect_error(ValueError, comm.recv, torch.empty(12), 0, codec="int8")
        msgs["codec"] = expect_error(ValueError, comm.recv, torch.empty(10), 0, codec="int4")
        got = torch.empty(10)
        comm.recv(got, 0, codec="int8")
        assert torch.equal(got, torch.ones(10))
        msgs["nan"] = expect_error(FloatingPointError, comm.recv, torch.empty(10), 0, codec="int8", check_finite=True)
    healthy(world)
    return msgs


def test_p2p_mismatch_raises_on_the_receiver_and_the_sender_completes():
    sender, receiver = run_ranks(_p2p_body, 2)
    assert "from rank 0 to rank 1 does not match" in receiver["size"] and "numel: sender 10 vs receiver 12" in receiver["size"]
    assert "codec: sender" in receiver["codec"]
    assert "rank 0 sent non-finite values" in receiver["nan"]
    assert "non-finite values (inf/NaN) in the tensor sent from rank 0 to rank 1" in sender["nan"]


def _outstanding_irecvs_body(rank, world):
    if rank == 0:
        works = [comm.isend(torch.full((5,), float(i), dtype=torch.float64), 1, codec="int8") for i in range(3)]
        for w in works:
            w.wait()
        return None
    outs = [torch.empty(5, dtype=torch.float64) for _ in range(3)]
    handles = [comm.irecv(o, 0, codec="int8") for o in outs]  # validation on: header + payload each
    for h in handles:
        h.wait()
    return [o[0].item() for o in outs]


def test_several_outstanding_irecvs_from_one_sender_match_in_order():
    assert run_ranks(_outstanding_irecvs_body, 2)[1] == [0.0, 1.0, 2.0]


def _fp16_overflow_body(rank, world):
    t = torch.ones(64)
    t[:4] = 40000.0  # each input fits fp16; the sum does not
    comm.all_reduce(t, codec="fp16")
    healthy(world)
    return t


def test_fp16_sum_overflow_becomes_inf_on_every_rank_instead_of_hanging():
    # three ranks re-encode the reduced shard in fp16: 120000 overflows to inf on every rank, no hang
    for t in run_ranks(_fp16_overflow_body, 3, timeout=60):
        assert torch.isinf(t[:4]).all() and torch.equal(t[4:], torch.full((60,), 3.0))
    # two ranks exchange the fp16 inputs (which fit) and sum them in fp32: the fp32 result is exact
    for t in run_ranks(_fp16_overflow_body, 2, timeout=60):
        assert torch.equal(t[:4], torch.full((4,), 80000.0)) and torch.equal(t[4:], torch.full((60,), 2.0))


def _requires_grad_body(rank, world):
    p = torch.nn.Parameter(torch.ones(300))
    comm.all_reduce(p, codec="int8")
    return p.detach()


def test_lossy_collectives_accept_tensors_that_require_grad():
    for t in run_ranks(_requires_grad_body, 2):
        assert torch.equal(t, torch.full((300,), 2.0))


def _group_mismatch_body(rank, world):
    """Ranks that pass different groups meet in the rendezvous store before any collective: each raises the same line
    at once, and every group works afterwards (on gloo's duplex transport, whose direction communicators are made
    after groups that left ranks out)."""
    import time
    from datetime import timedelta
    ch = comm.Channel("groups", "int8")
    world_group = dist.group.WORLD
    tps = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    dps = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    tp, dp = tps[rank // 2], dps[rank % 2]
    twin = dist.new_group([0, 1])  # the members of tps[0], another group

    def reduced(group, size):
        t = torch.ones(64)
        ch.all_reduce(t, group=group)
        assert torch.equal(t, torch.full((64,), float(size)))

    def timed(exc, fn, *args, **kwargs):
        start = time.monotonic()
        return expect_error(exc, fn, *args, **kwargs), time.monotonic() - start

    out = {}
    # rank 0 passes its TP group, the others the world group
    out["subset"] = timed(ValueError, ch.all_reduce, torch.ones(10), group=tp if rank == 0 else world_group)
    reduced(world_group, world)
    reduced(tp, 2)
    # ranks 0 and 1 pass two groups of the same members; ranks 2 and 3 all-reduce on their TP group meanwhile
    if rank < 2:
        out["twin"] = timed(ValueError, ch.all_reduce, torch.ones(10), group=tp if rank == 0 else twin)
        reduced(twin, 2)
    else:
        for _ in range(3):
            reduced(tp, 2)
    reduced(tp, 2)
    # legitimately different groups at once, with a straggler: rank 0 waits in TP for rank 1 while rank 2 waits in DP
    # for rank 0 (searching for a deadlock meanwhile) and must just wait
    if rank == 1:
        time.sleep(0.35)
    start = time.monotonic()
    reduced(tp, 2)
    reduced(dp, 2)
    out["straggler"] = time.monotonic() - start
    # validation off: the hot path does not touch the store; a validated call on a fresh group does
    store = dist.distributed_c10d._get_default_store()
    fresh = dist.new_group([0, 1, 2, 3])
    ch.all_reduce(torch.ones(10), group=fresh, validate=False)  # a group's first collective connects its members
    dist.barrier()
    before = store.num_keys()
    dist.barrier()
    ch.all_reduce(torch.ones(10), group=fresh, validate=False)
    dist.barrier()
    out["keys_unvalidated"] = store.num_keys() - before
    dist.barrier()
    ch.all_reduce(torch.ones(10), group=fresh)
    dist.barrier()
    out["keys_validated"] = store.num_keys() - before
    # a rank that skips a validated call: the others raise at the store's timeout, naming it
    if rank < 3:
        store.set_timeout(timedelta(seconds=1))
        out["missing"] = timed(RuntimeError, ch.all_reduce, torch.ones(10), group=fresh)
    # a rank whose heartbeat says it stopped (an error of its own): the others raise within a second, not at the timeout
    from megacomp.training.heartbeat import Heartbeat
    store.set_timeout(timedelta(seconds=20))
    hb = Heartbeat(60.0, progress=lambda: 0, on_verdict=lambda line, claimed: None).start()
    dist.barrier()
    if rank == 3:
        hb.stop(2)
    else:
        out["stopped"] = timed(RuntimeError, ch.all_reduce, torch.ones(10), group=fresh)
    dist.barrier()
    if rank != 3:
        hb.stop(0)
    return out


def test_ranks_passing_different_groups_raise_the_same_error_at_once():
    results = run_ranks(_group_mismatch_body, 4, timeout=90, pg_timeout=20)
    subset = ("ranks disagree on the group of megacomp.comm.all_reduce: rank 0 passed the group of ranks [0, 1], "
              "rank 1 the group of ranks [0, 1, 2, 3]; every rank of a group must call it with that group")
    for rank, out in enumerate(results):
        text, seconds = out["subset"]
        assert text == subset and seconds < 5, (rank, out["subset"])
        assert out["straggler"] < 5
        assert out["keys_unvalidated"] == 0 and out["keys_validated"] >= 1  # its counter (and a waiting rank's record)
    for out in results[:2]:
        text, seconds = out["twin"]
        assert seconds < 5 and text.startswith("ranks disagree on the group of megacomp.comm.all_reduce: rank 0 passed "
                                               "the group of ranks [0, 1] (group name '"), text
        assert "rank 1 the group of ranks [0, 1] (group name '" in text
    assert results[0]["twin"][0] == results[1]["twin"][0]
    assert len({out["missing"][0] for out in results[:3]}) == 1  # one line, worded by the first rank to give up
    for out in results[:3]:
        text, seconds = out["missing"]
        assert "rank(s) [3] of the group of ranks [0, 1, 2, 3] did not reach this call" in text and seconds < 5, text
        text, seconds = out["stopped"]
        assert text == ("megacomp.comm.all_reduce: rank(s) [3] of the group of ranks [0, 1, 2, 3] stopped (exit status "
                        "2) before reaching this call") and seconds < 5, (text, seconds)

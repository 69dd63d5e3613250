"""megacomp.comm.spans: the phases a step's profile is drawn from.

- Off (the default): nothing is recorded, results unchanged.
- On: a compressed reduce-scatter / all-gather / all-reduce records encode, wire and decode on the calling thread; an
  uncompressed synchronous collective is one wire span; the sharded optimizer adds reduce_wait, update and
  param_all_gather; ACCO's jobs run on a background thread (acco_estimate, acco_update, with their own collectives'
  phases) while the main thread records acco_wait; spans nest inside their parents' time.
"""
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import comm
from megacomp.comm import spans
from megacomp.optimizer import DistributedOptimizer
from megacomp.optimizer.acco import ACCO
from test_optimizer_distributed import batch, loss_fn, make_model


def _collectives_body(rank, world):
    torch.manual_seed(rank)
    x = torch.randn(4096 * world)
    out = torch.empty(4096)
    ch = comm.Channel("dp_gradient", "int8", min_compress_numel=0)
    ch.reduce_scatter_tensor(out, x)
    assert spans.records() == []  # off by default
    spans.enable()
    try:
        ch.reduce_scatter_tensor(out, x)
        compressed = {name for thread, name, _, _ in spans.records()}
        spans.reset()
        comm.Channel("dp_gradient").reduce_scatter_tensor(out, x)
        plain = [name for _, name, _, _ in spans.records()]
        spans.reset()
        full = torch.empty(4096 * world)
        ch.all_gather_into_tensor(full, out)
        gathered = {name for _, name, _, _ in spans.records()}
        spans.reset()
        y = x.clone()
        ch.all_reduce(y)
        reduced = {name for _, name, _, _ in spans.records()}
        threads = {t for t, *_ in spans.records()}
    finally:
        spans.enable(False)
        spans.reset()
    return compressed, plain, gathered, reduced, threads


def test_collectives_record_encode_wire_decode_on_the_calling_thread():
    for compressed, plain, gathered, reduced, threads in run_ranks(_collectives_body, 2):
        assert compressed == {"encode", "wire", "decode"}
        assert plain == ["wire"]
        assert gathered == {"encode", "wire", "decode"}
        assert reduced == {"encode", "wire", "decode"}
        assert threads == {"MainThread"}


def _optimizer_body(rank, world, acco):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, grad_codec="int4", error_feedback="loco",
                               param_codec="int8", bucket_size=60, min_compress_numel=0, lr=1e-2)
    wrapped = ACCO(opt) if acco else opt
    spans.enable()
    try:
        for step in range(2):
            if acco:
                loss_fn(model, *batch(rank, step, 0)).div(2).backward()
                wrapped.estimate(2.0)
                loss_fn(model, *batch(rank, step, 1)).div(2).backward()
                wrapped.step()
            else:
                loss_fn(model, *batch(rank, step)).backward()
                wrapped.step()
        if acco:
            wrapped.finish()
        recs = spans.records()
    finally:
        spans.enable(False)
        spans.reset()
    by_thread = {}
    for thread, name, t0, t1 in recs:
        by_thread.setdefault("main" if thread == "MainThread" else "background", set()).add(name)
    jobs = [(t0, t1) for _, name, t0, t1 in recs if name.startswith("acco_") and name != "acco_wait"]
    inner = [(t0, t1) for thread, name, t0, t1 in recs if thread != "MainThread" and not name.startswith("acco_")]
    nested = all(any(a <= t0 and t1 <= b for a, b in jobs) for t0, t1 in inner)
    return by_thread, nested, spans.totals(recs)


def test_sharded_optimizer_and_acco_phases():
    for by_thread, _, totals in run_ranks(_optimizer_body, 2, False):
        assert {"reduce_wait", "update", "param_all_gather", "encode", "wire", "decode"} <= by_thread["main"]
        assert "background" not in by_thread
        assert totals["main"]["update"] > 0
    for by_thread, nested, _ in run_ranks(_optimizer_body, 2, True):
        assert by_thread["main"] == {"acco_wait"}
        assert {"acco_estimate", "acco_update", "update", "param_all_gather", "encode", "wire", "decode"} \
            <= by_thread["background"]
        assert nested  # every phase of a job lies inside the job's span


def test_exclusive_totals_subtract_nested_spans():
    ms = 1_000_000
    recs = [("MainThread", "reduce_wait", 0, 10 * ms), ("MainThread", "wire", 1 * ms, 7 * ms),
            ("MainThread", "decode", 7 * ms, 9 * ms), ("MainThread", "update", 10 * ms, 13 * ms),
            ("megacomp-acco_0", "acco_update", 2 * ms, 12 * ms), ("megacomp-acco_0", "wire", 3 * ms, 8 * ms)]
    inclusive = spans.totals(recs)
    exclusive = spans.totals(recs, exclusive=True)
    assert inclusive["main"] == {"reduce_wait": 0.010, "wire": 0.006, "decode": 0.002, "update": 0.003}
    assert exclusive["main"] == {"reduce_wait": 0.002, "wire": 0.006, "decode": 0.002, "update": 0.003}
    assert exclusive["background"] == {"acco_update": 0.005, "wire": 0.005}
    assert spans.totals(recs, start_ns=10 * ms)["main"] == {"update": 0.003}

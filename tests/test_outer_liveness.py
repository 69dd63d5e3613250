"""megacomp.outer.liveness on real gloo ranks: a replica that stops is named after a bounded wait, and
replicas that are all alive never trip the check (Streaming DiLoCo's overlapping exchanges included).

A "dead" replica is simulated by a rank that stops calling the outer loop and returns: a rank killed
outright would also take the test harness's result with it; the surviving ranks see the same thing
either way (its key never appears in the store)."""
import time

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp.outer import DiLoCo, DiLoCoConfig, ReplicaLost, ReplicaWatch


def _params(rank):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=g)) for _ in range(3)]


def _lost_body(rank, world, timeout):
    params = _params(rank)
    ranks = list(range(world))
    outer = DiLoCo(params, None, DiLoCoConfig(outer_steps=2, outer_momentum=0.0),
                   watch=ReplicaWatch(ranks, rank, timeout))
    steps = 2 if rank == world - 1 else 6  # the last replica stops after its first exchange
    began = time.monotonic()
    try:
        for _ in range(steps):
            with torch.no_grad():
                params[0].add_(0.1 * (rank + 1))
            outer.step()
    except ReplicaLost as e:
        outer.finish()  # returns at once: nothing pending can complete without the lost replica
        return "lost", str(e), time.monotonic() - began
    return "finished", "", time.monotonic() - began


def test_a_replica_that_stops_is_named_after_the_timeout():
    results = run_ranks(_lost_body, 3, 1.5)
    assert results[2][0] == "finished"
    for kind, message, elapsed in results[:2]:
        assert kind == "lost", message
        assert "outer exchange 1: replica 2 (global rank 2, last at exchange 0) did not arrive within 1.5 s" in message
        assert "--outer-timeout" in message and "--load" in message
        assert 1.5 <= elapsed < 30  # bounded: the timeout, not the process group's 60 s


def _alive_body(rank, world, fragments, delay):
    params = _params(rank)
    watch = ReplicaWatch(list(range(world)), rank, 30.0)
    outer = DiLoCo(params, None, DiLoCoConfig(outer_steps=4, fragments=fragments, delay=delay), watch=watch)
    for t in range(40):
        if rank == t % world:
            time.sleep(0.01)  # replicas out of step with each other
        with torch.no_grad():
            params[t % 3].add_(0.01 * (rank + 1))
        outer.step()
    outer.finish()
    dist.barrier()
    return outer.exchanges, [watch.reached(r) for r in range(world)]


@pytest.mark.parametrize("fragments,delay", [(1, 0), (3, 3)])
def test_replicas_that_are_all_alive_pass(fragments, delay):
    results = run_ranks(_alive_body, 3, fragments, delay)
    for exchanges, reached in results:
        assert exchanges == 10 * fragments and reached == [exchanges - 1] * 3


def test_bad_watch_settings():
    with pytest.raises(ValueError, match="timeout must be > 0"):
        ReplicaWatch([0, 1], 0, 0.0, store=object())
    with pytest.raises(ValueError, match="replica 2 is not in the outer group"):
        ReplicaWatch([0, 1], 2, 1.0, store=object())

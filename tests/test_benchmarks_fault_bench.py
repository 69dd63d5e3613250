"""benchmarks.fault_bench's arithmetic on hand-made timelines: the per-kill times, goodput, the paired loss and the
straggler rates are what the module docstring defines (the launches themselves are the benchmark, not a test)."""
from __future__ import annotations

import pytest

from benchmarks.fault_bench import analyse, straggler_rates, table


def _rows(times, first_iteration=1, loss=3.0, committed=True, life=0):
    return [{"iteration": first_iteration + i, "loss": loss, "ft_time": t, "ft_committed": committed, "life": life}
            for i, t in enumerate(times)]


def _launch(steps, kills=(), end=20.0, seed=1, kill_every=None):
    return {"kill_every": kill_every, "seed": seed, "t0": 0.0, "end": end, "kills": list(kills), "steps": steps}


def test_kill_figures_goodput_and_paired_loss():
    # fault-free: 2 groups, one step per second from t = 1 to t = 10 (rate 1 step/s per group), loss 3.0
    free = _launch({0: _rows([float(t) for t in range(1, 11)]), 1: _rows([float(t) for t in range(1, 11)])}, end=10.0)
    # faulty: group 1 killed at t = 4.5 (its life 0 ends at iteration 4), back at t = 7 (life 1); group 0 never stops
    fault = _launch({0: _rows([float(t) for t in range(1, 11)], loss=3.3),
                     1: _rows([1.0, 2.0, 3.0, 4.0], loss=3.3) + _rows([7.0, 8.0, 9.0, 10.0], 7, loss=3.3, life=1)},
                    kills=[{"t": 4.5, "replica": 1, "life": 1}], end=10.0, kill_every=60.0)
    r = analyse(fault, free, replicas=2, tokens_per_step=64)
    kill = r["kills"][0]
    assert kill["survivors_next_step_s"] == pytest.approx(0.5)  # group 0's step at t = 5
    assert kill["rejoined_steps_s"] == pytest.approx(2.5)  # group 1's first step of its new life, t = 7
    assert r["fault_free_steps_per_s"] == pytest.approx(1.0)
    # 18 replica-batches over 9 s (first committed step to the end) against 2 groups x 1 step/s
    assert r["wall_s"] == pytest.approx(9.0) and r["goodput"] == pytest.approx(18 / 18)
    assert r["loss_mean20_rel_diff"] == pytest.approx(0.1)  # every group's loss 3.3 against 3.0
    text = table([r], [3.0, 3.0])
    assert "| 60 s | 1 | 1 | 0.5 / 0.5 | 2.5 / 2.5 | - (1 never) | 100 ± 0 | +10.00 ± 0.00 |" in text


def test_straggler_rates_use_the_second_half_of_the_launch():
    steps = {0: _rows([10.0 + 2 * i for i in range(6)]),  # straggler: 0.5 it/s
             1: _rows([10.0 + i for i in range(11)]), 2: _rows([10.0 + 0.5 * i for i in range(21)])}  # 1 and 2 it/s
    rates = straggler_rates(_launch(steps, end=20.0) | {"t0": 0.0})
    assert rates["straggler_it_per_s"] == pytest.approx(0.5)
    assert rates["others_it_per_s"] == pytest.approx(1.5)

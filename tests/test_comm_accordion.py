"""Accordion (megacomp.compression.accordion settings, megacomp.comm.accordion_channel policy) on real gloo groups:
the regime rule on controlled gradient norms, shards vs replicated tensors, identical decisions on every
rank, the shared residual, state round trip, and bad settings."""
import pytest
import torch

from distributed import run_ranks
from megacomp.comm import AccordionChannel
from megacomp.compression import Accordion, make_accordion

LEVELS = {"name": "accordion", "low": {"name": "int8", "block_size": 64}, "high": {"name": "int2", "block_size": 64},
          "eta": 0.5, "interval": 2}


def _policy(rank, world):
    ch = AccordionChannel("dp_gradient", LEVELS, error_feedback="ef")
    seen = []
    # per interval (2 steps): the shard each rank observes; rank r holds entries [r::world] of the tensor
    norms = [10.0, 10.5, 20.0, 20.0]  # accumulated norm per interval: first, -5% (calm), +90% (critical), 0%
    for target in norms:
        for _ in range(2):
            seen.append(ch.channel_for("b0") is ch.low)
            full = torch.zeros(8)
            full[0], full[1] = 0.6 * target / 2, 0.8 * target / 2  # norm of the full step: target / 2
            ch.observe("b0", full[rank::world], replicated=False)
            ch.observe("b1", full, replicated=True)  # the same tensor whole on every rank: counted once
            ch.end_step()
    return seen, ch.switches, ch.previous, ch.state_dict()


def test_regimes_follow_the_norm_change_and_agree_across_ranks():
    results = run_ranks(_policy, 2)
    for seen, switches, previous, _ in results:
        # interval 1 is critical (no a_old); after interval 2 (10 -> 10.5: 5% < eta) strong compression; after
        # interval 3 (10.5 -> 20: 90%) light again; after interval 4 (no change) strong
        assert seen == [True, True, True, True, False, False, True, True]
        assert [(s, k, level) for s, k, level, _ in switches] == [(4, "b0", "high"), (4, "b1", "high"),
                                                                 (6, "b0", "low"), (6, "b1", "low"),
                                                                 (8, "b0", "high"), (8, "b1", "high")]
        assert previous["b0"] == pytest.approx(20.0) and previous["b1"] == pytest.approx(20.0)
    assert results[0][1] == results[1][1]


def _round_trip(rank, world):
    ch = AccordionChannel("dp_gradient", LEVELS, error_feedback="ef")
    x = torch.randn(256, generator=torch.Generator().manual_seed(rank))
    for step in range(3):
        y = x * (1 + step)
        ch.channel_for("k").all_reduce(y, key="k")
        ch.observe("k", y, replicated=True)
        ch.end_step()
    shared = ch.low.error_feedback is ch.high.error_feedback
    other = AccordionChannel("dp_gradient", LEVELS, error_feedback="ef")
    other.load_state_dict(ch.state_dict())
    same = (other.steps == 3 and other.critical == ch.critical and torch.equal(other.sums["k"], ch.sums["k"])
            and torch.equal(other.error_feedback.error("k/worker"), ch.error_feedback.error("k/worker")))
    with pytest.raises(ValueError, match="resume with the same compression config"):
        AccordionChannel("dp_gradient", {**LEVELS, "eta": 0.3}, error_feedback="ef").load_state_dict(ch.state_dict())
    return shared, same


def test_levels_share_one_residual_and_the_state_round_trips():
    for shared, same in run_ranks(_round_trip, 2):
        assert shared and same


def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="needs both levels"):
        Accordion(low="int8")
    with pytest.raises(ValueError, match="mix PowerSGD with an element codec"):
        Accordion(low={"name": "powersgd", "rank": 4}, high="int2")
    with pytest.raises(ValueError, match="uncompressed"):
        Accordion(low="none", high="int2")
    with pytest.raises(ValueError, match="eta must be a number > 0"):
        Accordion(low="int8", high="int2", eta=0)
    with pytest.raises(ValueError, match="interval must be an int >= 1"):
        Accordion(low="int8", high="int2", interval=0)
    with pytest.raises(ValueError, match="unknown accordion option"):
        make_accordion({**LEVELS, "etaa": 1})
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        Accordion(low={"name": "powersgd", "rank": 0}, high={"name": "powersgd", "rank": 1})
    assert make_accordion(make_accordion(LEVELS).to_dict()) == make_accordion(LEVELS)


def _skipped(rank, world):
    ch = AccordionChannel("dp_gradient", {**LEVELS, "interval": 1}, error_feedback="ef")
    ch.observe("b", torch.full((4,), 2.0), replicated=True)
    ch.end_step()
    ch.observe("b", torch.tensor([float("inf"), 0.0, 0.0, 0.0]), replicated=True)
    ch.discard_step()  # the optimizer skipped this step: its inf must not reach the norms
    ch.end_step()
    return ch.previous["b"], ch.critical["b"]


def test_a_skipped_step_does_not_reach_the_norms():
    for previous, critical in run_ranks(_skipped, 2):
        assert previous == 0.0 and critical  # the discarded interval reads as no gradient: a change of 100%

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


# -- the reference's rule, restated ----------------------------------------------------------------------------
LOW, HIGH = "low", "high"


def _reference_levels(norms: list, lrs: list, switch_freq: int) -> list:
    """The level each epoch uses under the reference code (uw-mad-dash/Accordion at 82046df: main.py's epoch loop
    with --auto-switch --start-k, auto_scale.run_auto_scale_gng), restated in plain python: epoch 0 runs the start
    level (the light one); after epoch e, when e % switch_freq == 0, e == 0 picks the light level, otherwise the
    ratio |prev - new| / prev of epoch e's accumulated gradient norm against epoch e - switch_freq's (9 when prev is
    0) picks strong compression below 0.5, light otherwise; then a learning rate lower for epoch e + 1 than for
    epoch e picks the light level. ``lrs`` holds one rate more than ``norms`` (the next epoch's)."""
    level, used = LOW, []
    for epoch, new in enumerate(norms):
        used.append(level)
        if epoch % switch_freq == 0:
            if epoch == 0:
                level = LOW
            else:
                prev = norms[epoch - switch_freq]
                ratio = abs(prev - new) / prev if prev != 0.0 else 9
                level = HIGH if ratio < 0.5 else LOW
        if lrs[epoch + 1] < lrs[epoch]:
            level = LOW
    return used


# epochs 0, 3, 6, ... are the compared windows (switch_freq 3): calm (+5%), critical (+90%), calm, calm while the
# rate falls after epochs 9 and 12, a fall to 0, a rise from 0, calm; the others' norms are never read
NORMS = [10.0, 7, 7, 10.5, 7, 7, 20.0, 7, 7, 20.0, 7, 7, 21.0, 7, 7, 0.0, 7, 7, 5.0, 7, 7, 5.1, 7]
LRS = [0.02, 0.05, 0.1] + [0.1] * 7 + [0.01] * 3 + [0.001] * 11  # warm-up (rising: no trigger), two decays


def _reference_rule(rank, world, window):
    # two channels: norm_of reduced (each rank observes its shard of the reduced gradient) and norm_of local (rank
    # 0's own gradient follows the script; rank 1's own and every reduced tensor are noise the rule must not read)
    spec = {**LEVELS, "interval": 3 * window, "window": window, "lr_trigger": True}
    reduced = AccordionChannel("dp_gradient", spec, error_feedback="ef")
    local = AccordionChannel("dp_gradient", {**spec, "norm_of": "local"}, error_feedback="ef")
    lr = [LRS[0]]
    noise = torch.Generator().manual_seed(rank)
    seen = {"reduced": [], "local": []}
    for ch in (reduced, local):
        ch.follow_lr(lambda: lr[0])
    for epoch, norm in enumerate(NORMS):
        lr[0] = LRS[epoch]
        for step in range(window):
            full = torch.zeros(8)
            full[0], full[1] = 0.6 * norm / window, 0.8 * norm / window  # the window sums to `norm`
            for name, ch in (("reduced", reduced), ("local", local)):
                seen[name].append((epoch, ch.channel_for("b0") is ch.low))
                ch.observe_local("b0", full if (name == "reduced" or rank == 0) else 50 * torch.rand(8, generator=noise))
                ch.observe("b0", full[rank::world] if name == "reduced" else torch.rand(4, generator=noise), replicated=False)
                ch.end_step()
    return seen


def test_decisions_equal_the_reference_code_rule_on_scripted_norms_and_rates():
    expected = _reference_levels(NORMS, LRS + [LRS[-1]], 3)
    assert expected.count(HIGH) >= 4 and expected[10:13] == [LOW] * 3  # both rules move the scripted run
    steps = [(e, level == LOW) for e, level in enumerate(expected) for _ in range(2)]
    for seen in run_ranks(_reference_rule, 2, 2):
        assert seen["reduced"] == steps and seen["local"] == steps


def test_the_learning_rate_trigger_needs_a_rate():
    spec = {**LEVELS, "interval": 2, "lr_trigger": True}
    ch = AccordionChannel("dp_gradient", spec, error_feedback="ef")
    ch.end_step()
    with pytest.raises(ValueError, match="lr_trigger needs the learning rate"):
        ch.end_step()
    with pytest.raises(ValueError, match="window must be an int that divides interval"):
        Accordion(low="int8", high="int2", interval=10, window=3)


def _q_on_switch(rank, world, keep_q):
    ranks = {"low": {"name": "powersgd", "rank": 2, "min_compression_rate": 0},
             "high": {"name": "powersgd", "rank": 1, "min_compression_rate": 0}}
    ch = AccordionChannel("dp_gradient", {"name": "accordion", **ranks, "eta": 100.0, "interval": 1,
                                          "keep_q": keep_q})
    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(rank))
    qs = []
    for step in range(4):  # low, low (first decision), high from step 2 on, and low again never (eta 100)
        level = ch.channel_for("b")
        level.all_reduce_coalesced([g.clone()], key="b")
        ch.observe("b", g, replicated=True)
        qs.append({name: lv.q["b/0"].clone() for name, lv in (("low", ch.low), ("high", ch.high)) if "b/0" in lv.q})
        ch.end_step()
    ch.critical["b"] = False  # as a decision would: back to low, then see what low starts from
    ch._set("b", True, 0.0, "test")
    return qs, ch.low.q["b/0"].clone(), ch.low.draws["b/0"]


@pytest.mark.parametrize("keep_q", [False, True])
def test_a_switch_restarts_the_entered_levels_power_iteration_unless_keep_q(keep_q):
    for qs, low_after, draws in run_ranks(_q_on_switch, 2, keep_q):
        if keep_q:  # megacomp's earlier behaviour: low resumes the Q it left at step 1
            assert torch.equal(low_after, qs[1]["low"]) and draws == 1
        else:  # the reference: a new reducer, a fresh random Q (a second draw)
            assert not torch.equal(low_after, qs[1]["low"]) and draws == 2

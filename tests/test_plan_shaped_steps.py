"""megacomp.plan.shaped_steps: the DP-step model of the shaped-link runs, hand-computed."""
from __future__ import annotations

import pytest

from megacomp.plan import shaped_steps as ss, wire
from megacomp.plan.calibration import Codec, Model

LINK = Model(alpha_s=0.0, eta=1.0, links={"all_reduce": (0.002, 0.8, 4)},
             codecs={"int4": Codec(4e9, 8e9, "measured")})
RATE = 12.5e6


def test_methods_take_their_bytes_from_the_codecs():
    n = 3_438_080
    (ph,) = ss.method_phases("ddp_fp32", n, 2, 2 * 2 ** 20)
    assert ph.wire_bytes == 4 * n == 13_752_320 and ph.calls == 7  # 13.75 MB in 2 MiB buckets
    (ph,) = ss.method_phases("megacomp_hook_int4_loco", n, 2, 2 * 2 ** 20)
    assert ph.wire_bytes == wire.all_reduce_bytes({"name": "int4", "block_size": 128}, n, 2) == 1_826_480
    rs, ag = ss.method_phases("megacomp_zero1_int4_loco_int8", n, 2, 2 * 2 ** 20)
    # the benchmark's measured 2,703,744 bytes: within 2% (it reduces in 2 MiB buckets, each chunk with its own
    # padding and scales; the model codes the whole shard at once)
    assert rs.wire_bytes + ag.wire_bytes == pytest.approx(2_703_744, rel=0.02)
    assert ss.method_phases("ddp_powersgd4", n, 2, 2 ** 20) is None  # low-rank bytes: only when measured
    assert ss.method_phases("something_else", n, 2, 2 ** 20) is None


def test_exposure_per_window():
    floor = 0.3
    ph = ss.Phase("all_reduce", "none", 1e6, 0, 4, "in_backward")
    t = 4 * 0.002 + 1e6 / (0.8 * RATE)  # 0.108 s
    # in backward: what o x 2/3 of the floor does not hide, at least the last bucket
    assert ss.predict_step(LINK, [ph], RATE, 2, floor, 0.5) == pytest.approx(floor + max(t / 4, t - 0.5 * 0.2))
    after = ss.Phase("all_reduce", "none", 1e6, 0, 4, "after_backward")
    assert ss.predict_step(LINK, [after], RATE, 2, floor) == pytest.approx(floor + t)
    step = ss.Phase("all_reduce", "none", 1e6, 0, 4, "in_step")
    assert ss.predict_step(LINK, [step], RATE, 2, floor, 0.1) == pytest.approx(floor)  # the next step hides it whole
    # kappa: codec seconds added for contention, only where the codec runs while the model computes
    coded = ss.Phase("all_reduce", "int4", 1e5, 4e6, 1, "in_forward")
    comm, codec = ss.phase_seconds(LINK, coded, RATE, 2)
    assert codec == pytest.approx(4e6 / 4e9 + 2 * 4e6 / 8e9)  # p = 2: encode once, decode-sum both
    assert ss.predict_step(LINK, [coded], RATE, 2, floor, 1.0, 2.0) == pytest.approx(
        floor + max(0.0, comm - floor / 3) + 2 * codec)
    after = ss.Phase("all_reduce", "int4", 1e5, 4e6, 1, "after_backward")  # in step(): its codec time is in comm
    assert ss.predict_step(LINK, [after], RATE, 2, floor, 1.0, 2.0) == pytest.approx(floor + comm)


def test_each_engine_has_its_own_overlap():
    n, floor = 3_438_080, 0.3
    (torch_ph,) = ss.method_phases("ddp_fp32", n, 2, 2 * 2 ** 20)
    (mc_ph,) = ss.method_phases("megacomp_hook_int4_loco", n, 2, 2 * 2 ** 20)
    assert (torch_ph.engine, mc_ph.engine) == ("torch", "megacomp")
    # (o_torch, o_megacomp): only the megacomp exchange's share changes its prediction
    assert ss.predict_step(LINK, [torch_ph], RATE, 2, floor, (0.2, 0.9)) == ss.predict_step(LINK, [torch_ph], RATE, 2,
                                                                                          floor, 0.2)
    assert ss.predict_step(LINK, [mc_ph], RATE, 2, floor, (0.2, 0.9)) == ss.predict_step(LINK, [mc_ph], RATE, 2,
                                                                                       floor, 0.9)


def test_torch_zero_broadcasts_hold_the_link_for_the_whole_model():
    """torch's ZeroRedundancyOptimizer broadcasts each rank's shard in turn: its phase is timed on S, not (p-1)/p S."""
    n = 1_000_000
    phases = ss.method_phases("zero_redundancy", n, 2, 25 * 2 ** 20)
    assert [(p.op, p.wire_bytes, p.window) for p in phases][1] == ("broadcast", 4.0 * n, "after_backward")

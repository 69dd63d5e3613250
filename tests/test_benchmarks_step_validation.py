"""benchmarks.step_validation: the validation on the stored measurements, and the unmodelled CPU cost it measures."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import step_validation as sv
from megacomp.plan import shaped_steps as ss
from megacomp.plan.calibration import Codec, Model


@pytest.mark.slow
def test_validate_all_on_the_stored_measurements():
    model, o, kappa, v, notes, extra = sv.validate_all(Path(__file__).resolve().parent.parent / "benchmarks" / "results")
    kinds = {(r.kind, r.held_out) for r in v.rows}
    assert {("collective", False), ("collective", True), ("ddp", False), ("ddp", True), ("train", True),
            ("local_steps", True)} <= kinds
    assert all(0.0 <= x <= 1.0 for x in o) and kappa >= 0.0  # (torch DDP, megacomp) overlap shares
    assert all("300mbit" in r.point for r in v.rows if r.kind == "collective" and r.held_out)
    text = sv.validation_markdown(model, o, kappa, v, notes, None, extra)
    assert text.count("| held out |") == sum(r.held_out for r in v.rows)


def test_unmodelled_work_is_the_step_the_model_misses_per_parameter():
    """A method whose unshaped step is the model's prediction plus c seconds per parameter (c differing by seed) gets
    the median c: on the critical path for the DDP hook, in the codec stage for the 1-bit family (found back by
    bisection); a method the model predicts exactly gets 0."""
    model = Model(2.5e-3, 0.9, {"int4": Codec(3.0e8, 6.0e8, "truth"), "sign": Codec(3.0e8, 6.0e8, "truth")})
    mach = ss.Machine(1e11, 1e10)
    floor, Bps, params = 0.13, 1.25e9, 3_438_080  # the benchmark GPT at hidden 256, 4 layers
    cases = (("megacomp_hook_int4_loco", 1.0), ("megacomp_onebit_adam_in_step", 2.0), ("ddp_fp32", 0.0))
    recs = []
    for seed, c in ((1, 2e-8), (2, 3e-8), (3, 7e-8)):
        base = dict(rate="10gbit", rate_Bps=Bps, method="no_communication", world=2, params=params, hidden=256,
                    layers=4, seed=seed, times_s=[floor] * 5)
        recs.append(base)
        for method, scale in cases:
            d = dict(rate="10gbit", rate_Bps=Bps, method=method, world=2, params=params, hidden=256, layers=4,
                     seed=seed, wire_bytes_per_step=None)
            (_, point), = sv._ddp_records(model, [base, d | {"times_s": [1.0]}], "t", mach, None)
            _, phases, rate, world, _, _, work_s, _ = point
            extra = scale * c * params
            stage = ss.extra_in_codec_stage(method)
            t = ss.predict_step(model, phases, rate, world, floor, (0.5, 0.5), 1.0, work_s + (0 if stage else extra),
                                extra if stage else 0.0)
            recs.append(d | {"times_s": [t] * 5, "all_times_s": [t] * 5})
    got = sv.unmodelled_work(model, (0.5, 0.5), 1.0, recs, mach)
    assert got[("megacomp_hook_int4_loco", False)] == (pytest.approx(3e-8, rel=1e-9), False)
    assert got[("megacomp_onebit_adam_in_step", False)] == (pytest.approx(6e-8, rel=1e-6), True)
    assert got[("ddp_fp32", False)] == (pytest.approx(0.0, abs=1e-15), False)
    flushed = sv.unmodelled_work(model, (0.5, 0.5), 1.0, [d | {"flush_denormal": True} for d in recs], mach)
    assert set(flushed) == {(m, True) for m, _ in cases}  # runs with subnormals flushed get their own
    # in the codec stage the extra hides behind a slower wire: at 10 Mbit/s it adds less than its own size
    (_, point), = sv._ddp_records(model, [recs[0] | {"rate_Bps": 1.25e6}, recs[2] | {"rate_Bps": 1.25e6}], "t", mach,
                                  got)
    _, phases, rate, world, fl, _, work_s, stage_s = point
    assert stage_s == pytest.approx(6e-8 * params, rel=1e-6)
    assert (ss.predict_step(model, phases, rate, world, fl, (0.5, 0.5), 1.0, work_s, stage_s)
            - ss.predict_step(model, phases, rate, world, fl, (0.5, 0.5), 1.0, work_s)) < stage_s
    # a run whose T_extra was never measured (here: subnormals flushed, only unflushed runs measured) is an error,
    # not a prediction without it
    with pytest.raises(KeyError, match="no unshaped-link run of megacomp_onebit_adam_in_step with flush_denormal=True"):
        list(sv._ddp_records(model, [recs[0] | {"flush_denormal": True}, recs[2] | {"flush_denormal": True}], "t",
                             mach, got))


def test_a_floor_is_taken_with_the_same_subnormal_setting_and_a_bad_floor_flags_every_run_on_it():
    """The no-communication floor of a run comes from the launch with its own subnormal setting (flushing changes
    the compute time); a floor one run shows to be slowed (its step below floor + unhidden transfer) is flagged for
    every run that shares it, and for no other."""
    base = dict(rate="1gbit", params=10, seed=1, method="no_communication")
    recs = [base | {"times_s": [0.10] * 3}, base | {"times_s": [0.14] * 3, "flush_denormal": True}]
    run = {"method": "ddp_fp32", "rate": "1gbit", "params": 10, "seed": 1}
    assert sv._floor(recs, run) == 0.10
    assert sv._floor(recs, run | {"flush_denormal": True}) == 0.14
    rows = [(0.14, sv.Row("ddp", "s: a @1gbit seed 1", 0.2, 0.3, True)),
            (0.14, sv.Row("ddp", "s: b @1gbit seed 1", 0.1, 0.2, True, "inconsistent floor: the step ...")),
            (0.10, sv.Row("ddp", "s: a @1gbit seed 2", 0.2, 0.2, True))]
    got = sv.shared_floor_notes(rows)
    assert got[0].note == "inconsistent floor: shared with b @1gbit seed 1"
    assert got[1].note == "inconsistent floor: the step ..." and got[2].note == ""

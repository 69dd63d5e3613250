"""benchmarks.perf_model: calibration recovers known parameters from synthetic, noise-free measurements."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import perf_model as pm

ALPHA, ETA = 2.5e-3, 0.9
CODECS = {"int4": (3.0e8, 6.0e8), "int8": (4.0e8, 8.0e8), "bf16": (1.5e9, 2.0e9)}  # encode, decode fp32 B/s
BITS = {"none": 32.0, "bf16": 16.0, "int8": 8.25, "int4": 4.25}
RATES = {"100mbit": 1.25e7, "1gbit": 1.25e8}


def synthetic(with_throughput: bool = True, codecs=CODECS) -> dict:
    truth = pm.Model(ALPHA, ETA, {c: pm.Codec(e, d, "truth") for c, (e, d) in codecs.items()}, dict(BITS))
    colls = []
    for rate, Bps in RATES.items():
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            for mib in (1.0, 4.0, 25.0, 100.0):
                for codec in ("none", *codecs):
                    S = mib * pm.MiB
                    t = pm.predict_collective(truth, op, codec, S, 2, Bps)
                    colls.append(dict(rate=rate, rate_Bps=Bps, op=op, world=2, mib=mib, codec=codec,
                                      bits_per_element=BITS[codec], times_s=[t * 1.01, t, t * 0.99],
                                      wire_bytes=int(pm.wire_bytes(op, BITS[codec], S, 2)), raw_bytes=int(S)))
    params, t_comp = 3_400_000, 0.2
    ddp = [dict(rate=r, rate_Bps=B, method="no_communication", world=2, params=params, times_s=[t_comp] * 5,
                wire_bytes_per_step=0, loss=5.0) for r, B in RATES.items()]
    for rate, Bps in RATES.items():
        for method, wire in (("ddp_fp32", 4 * params), ("ddp_bf16_hook", 2 * params), ("ddp_powersgd4", 400_000),
                             ("zero_redundancy", 6 * params), ("megacomp_hook_int4_loco", None)):
            t = pm.predict_step(truth, method, params, 2, Bps, t_comp, wire)
            ddp.append(dict(rate=rate, rate_Bps=Bps, method=method, world=2, params=params, times_s=[t] * 5,
                            wire_bytes_per_step=wire, loss=5.0))
    out = {"collectives": colls, "ddp": ddp}
    if with_throughput:
        out["codec_throughput"] = {c: {"encode_Bps": e, "decode_Bps": d} for c, (e, d) in codecs.items()}
    return out


def test_fit_recovers_alpha_eta_and_measured_codecs():
    m = pm.fit(synthetic())
    assert m.alpha_s == pytest.approx(ALPHA, rel=0.03)
    assert m.eta == pytest.approx(ETA, rel=0.01)
    assert m.codecs["int4"].encode_Bps == CODECS["int4"][0] and m.codecs["int4"].source == "measured"
    assert m.bits["int4"] == 4.25


def test_validate_zero_error_on_noise_free_points():
    res = synthetic()
    v = pm.validate(pm.fit(res), res)
    assert {r.kind for r in v.rows} == {"collective", "ddp"}
    assert len([r for r in v.rows if r.kind == "ddp"]) == 10  # no_communication is the input floor
    s = v.summary()
    assert s["max"] < 0.02 and s["median"] < 0.01


def test_missing_codec_throughput_is_fitted():
    equal = {c: (e, e) for c, (e, _) in CODECS.items()}  # fitted model: one throughput per codec
    res = synthetic(with_throughput=False, codecs=equal)
    m = pm.fit(res)
    for c, (e, _) in equal.items():
        assert m.codecs[c].source == "fitted"
        assert m.codecs[c].encode_Bps == pytest.approx(e, rel=0.03)
    assert pm.validate(m, res).summary()["max"] < 0.02
    # unequal encode/decode truth: still a usable single-throughput fit
    res = synthetic(with_throughput=False)
    m = pm.fit(res)
    assert all(c.source == "fitted" for c in m.codecs.values())
    assert pm.validate(m, res).summary("collective")["median"] < 0.1


def test_projection_monotone_in_link_rate():
    proj = pm.project(pm.fit(synthetic()))
    assert len(proj.rows) == 2 * 4 * 4 * 2 * 2
    for N in (1.3e9, 7e9):
        for p in (8, 64, 256, 1024):
            for b in ("bf16", "fp32"):
                sel = sorted((r for r in proj.rows if (r["params"], r["world"], r["codec"], r["baseline"]) ==
                              (N, p, "int4", b)), key=lambda r: r["rate_gbit"])
                coll = [r["coll_speedup"] for r in sel]
                step = [r["step_speedup"] for r in sel]
                assert all(x > y for x, y in zip(coll, coll[1:])), coll  # slower link -> larger speedup
                assert all(x >= y - 1e-12 for x, y in zip(step, step[1:])), step
                assert coll[0] > 1 and all(s >= 1 - 1e-12 for s in step)
    assert any("ASSUMPTION" in a and "codec throughput" in a for a in proj.assumptions)


def test_markdown_and_cli(tmp_path):
    res = synthetic(with_throughput=False)
    m = pm.fit(res)
    text = pm.markdown(m, pm.validate(m, res), pm.project(m, params=(7e9,), worlds=(8,), rates_gbit=(10, 400)))
    assert "median |error|" in text and "Assumptions" in text and "| 8 |" in text
    src = tmp_path / "r.json"
    src.write_text(json.dumps(res))
    out = tmp_path / "s.md"
    r = subprocess.run([sys.executable, "-m", "benchmarks.perf_model", str(src), "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ASSUME" in r.stdout and "### Fitted parameters" in out.read_text()

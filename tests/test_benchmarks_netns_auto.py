"""benchmarks/netns_auto.py's pure parts: the link schedule, the variants' compression configs, bytes per phase and
the verdict (the namespaces themselves need root and are not built here)."""
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def auto_bench():
    """benchmarks.netns_auto, imported when a test runs (as test_benchmarks_netns_nodes does)."""
    import benchmarks.netns_auto

    return benchmarks.netns_auto


def test_phases_parse_and_bad_ones_name_the_item():
    m = auto_bench()
    assert m.parse_phases("1gbit:30,20mbit:5") == [("1gbit", 30), ("20mbit", 5)]
    with pytest.raises(ValueError, match="'1gbit:x' is not RATE:ITERATIONS"):
        m.parse_phases("1gbit:x")
    with pytest.raises(ValueError, match="gbit/mbit/kbit"):
        m.parse_phases("fast:3")
    phases = [("1gbit", 2), ("20mbit", 3)]
    assert [m.phase_of(phases, i) for i in range(1, 6)] == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="past the phases"):
        m.phase_of(phases, 6)


def test_every_variant_is_a_valid_compression_config_with_the_ladders_rungs(tmp_path):
    from megacomp.training.pretrain_config import load_compression

    m = auto_bench()
    paths = m.write_configs(tmp_path, interval=4)
    assert set(paths) == {"auto", *m.STATIC[:4]}  # the shipped ladders have four rungs
    wide = m.write_configs(tmp_path / "wide", interval=4, auto_yaml=REPO / "benchmarks" / "configs" / "auto_int2.yaml")
    assert set(wide) == {"auto", *m.STATIC} and yaml.safe_load(open(wide["int2"]))["dp_gradient"]["name"] == "int2"
    assert str(load_compression(wide["auto"]).auto.allowed("dp_gradient")[-1]) == "int2/b128"  # its budget admits int2
    ladder = yaml.safe_load(m.AUTO_YAML.read_text())["auto"]["ladder"]
    for k, name in enumerate(m.STATIC[:4]):
        cfg = load_compression(paths[name])
        assert cfg.auto is None
        for path, rungs in ladder.items():
            assert yaml.safe_load(open(paths[name]))[path] == rungs[min(k, len(rungs) - 1)]
        assert (cfg.dp_gradient_error_feedback is not None) == (name != "none")  # LoCo on the lossy rungs
    auto = load_compression(paths["auto"])
    assert auto.auto.interval == 4 and set(auto.auto.ladder) == set(ladder)


def test_run_arguments_per_layout():
    m = auto_bench()
    argv = m.pretrain_argv("tp2dp2", "x.yaml", 80, 2, "/tmp/log")
    assert argv[argv.index("--tensor-model-parallel-size") + 1] == "2"
    assert argv[argv.index("--micro-batch-size") + 1] == "8"  # DP 2 across the link
    assert argv[argv.index("--eval-interval") + 1] == "80" and argv[argv.index("--compression") + 1] == "x.yaml"
    dp = m.pretrain_argv("dp2", "x.yaml", 80, 2, "/tmp/log")
    assert dp[dp.index("--micro-batch-size") + 1] == "8" and dp[dp.index("--tensor-model-parallel-size") + 1] == "1"


def test_bytes_per_phase_from_the_samples_that_first_show_each_phase_end():
    # (time, lines, tx A, tx B); phase 1 = iterations 1-2, phase 2 = 3-4
    samples = [(0, 0, 100, 50), (1, 1, 200, 150), (2, 2, 300, 250), (3, 3, 1300, 1250), (4, 4, 2300, 2250),
               (5, 4, 2400, 2300)]
    assert auto_bench().phase_bytes(samples, [("1gbit", 2), ("20mbit", 2)]) == {"A": [200, 2000], "B": [200, 2000]}


def _record(variant, seed, loss, times, codec=None):
    n = len(times)
    return {"layout": "dp2", "variant": variant, "seed": seed, "phases": [["1gbit", 2], ["20mbit", 2]],
            "times_s": times, "run_s": sum(times) + 10, "valid_loss": loss, "wire_bytes": [4e6] * n,
            "auto_codec": codec or [None] * n, "tx_per_phase": {"A": [2e6, 2e6], "B": [2e6, 2e6]}}


def test_the_verdict_takes_the_fastest_static_rung_within_uncompressed_trainings_spread():
    m = auto_bench()
    grad = ["none", "none", "none", "int4/b128"]
    codec = [{"dp_gradient": c} for c in grad]
    recs = []
    for seed, base in ((1, 5.00), (2, 5.02), (3, 5.04)):  # none's spread: sample std 0.02
        recs += [_record("none", seed, base, [1, 1, 8, 8]),
                 _record("int8", seed, base + 0.01, [1, 1, 4, 4]),   # inside: mean +0.01
                 _record("int4", seed, base + 0.05, [1, 1, 2, 2]),   # outside: mean +0.05
                 _record("bf16", seed, base - 0.05, [1, 1, 6, 6]),   # lower: within (costs no quality), slower
                 _record("auto", seed, base + 0.015, [1, 1, 8, 2], codec)]
    s = m.summarise(recs)["dp2"]
    assert s["spread"] == pytest.approx(0.02)
    assert s["best_static"] == "int8" and s["auto_speedup"] == pytest.approx(10 / 12)
    assert s["auto_within_spread"] and not s["variants"]["int4"]["within_spread"]
    assert s["variants"]["bf16"]["within_spread"] and s["variants"]["bf16"]["auto_speedup"] == pytest.approx(14 / 12)
    assert s["variants"]["int8"]["paired_pct"] == pytest.approx([0.2, 0.01 / 5.02 * 100, 0.01 / 5.04 * 100])
    assert s["variants"]["auto"]["phase_codecs"][1][0] == "grad: none > int4/b128@4"
    page = "\n".join(m.table(m.summarise(recs)))
    assert "Fastest static rung within none's spread: **int8**; it takes **0.83x** auto's training time" in page


def test_the_plot_is_written_where_asked_and_nowhere_else(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    m = auto_bench()
    monkeypatch.chdir(tmp_path)
    codec = [{"dp_gradient": c, "dp_parameter": "none"} for c in ("none", "none", "int8/b128", "int4/b128")]
    recs = [_record("none", 1, 5.0, [1, 1, 8, 8]), _record("auto", 1, 5.0, [1, 1, 4, 2], codec)]
    assert m.plot(recs, tmp_path / "out.png") == tmp_path / "out.png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png"]


def test_a_steady_link_counts_autos_switches_and_compares_from_its_last_one():
    m = auto_bench()
    one = [["100mbit", 5]]
    recs = []
    for seed, switch_at in ((1, 3), (2, 4)):  # the codec of iteration i is the list's i-1th entry
        grad = ["none"] * (switch_at - 1) + ["int4/b128"] * (6 - switch_at)
        codec = [{"dp_gradient": c, "dp_parameter": "int8/b256"} for c in grad]
        recs += [{**_record("auto", seed, 5.0, [4, 4, 4, 1.05, 0.95], codec), "phases": one},
                 {**_record("int4", seed, 5.0, [1, 1, 1, 1.0, 1.0]), "phases": one},
                 {**_record("none", seed, 5.0, [4, 4, 4, 4, 4]), "phases": one}]
    st = m.summarise(recs)["dp2"]["steady"]
    assert st["settled_from"] == 4  # seed 2's last switch took effect at iteration 4
    assert st["switches"] == [{"dp_gradient": 1, "dp_parameter": 0}] * 2
    assert st["fastest_static"] == "int4" and st["auto_over_fastest"] == pytest.approx(1.0)
    assert st["per_iter_s"]["none"] == [4.0, 4.0]
    assert "| auto | 1.000 ± 0.000 | 1.000 |" in "\n".join(m.steady_lines(st)) and st["decided"] == {}
    recs[0]["decisions"] = [{"iteration": 4, "compute_s": 0.1,
                             "dp_gradient": {"predicted_s": [0.03, 0.012, 0.010], "overlap_s": 0.008,
                                             "rate_Mbps": 900.0, "codec": "none", "link": "inter_node"}},
                            {"iteration": 8, "compute_s": 0.1,
                             "dp_gradient": {"predicted_s": [0.02, 0.011, 0.004], "overlap_s": 0.011,
                                             "rate_Mbps": 2100.0, "codec": "none", "link": "inter_node"}}]
    page = "\n".join(m.steady_lines(m.summarise(recs)["dp2"]["steady"]))
    assert ("dp_gradient over auto's 2 decisions: link rate estimated 900-2100 Mbit/s, overlapped compute 8.0-11.0 ms; "
            "predicted ms per iteration above the fastest rung, per rung least lossy first: 16.0-20.0, 2.0-7.0, "
            "0.0-0.0.") in page
    assert m.summarise([{**r, "phases": [["1gbit", 2], ["20mbit", 3]]} for r in recs])["dp2"]["steady"] is None


def test_records_of_several_link_schedules_are_summarised_apart():
    m = auto_bench()
    recs = [{**_record(v, 1, 5.0, [1, 1]), "phases": [[rate, 2]]}
            for rate in ("1gbit", "20mbit") for v in ("none", "int4")]
    assert list(m.summarise(recs)) == ["dp2 at 1gbit x 2", "dp2 at 20mbit x 2"]
    assert list(m.summarise(recs[:2])) == ["dp2"]

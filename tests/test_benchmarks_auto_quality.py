"""benchmarks/auto_quality.py: its variants are valid compression configs matching netns_auto's rungs, a run's log is
read back, the page judges "within uncompressed training's spread" by netns_auto's rule, and a real two-iteration run
goes from torchrun to the page."""
import json

import pytest
import yaml

from megacomp.training.pretrain_config import load_compression


def quality():
    import benchmarks.auto_quality

    return benchmarks.auto_quality


def test_variants_are_valid_configs_and_the_int8_parameter_ones_are_netns_autos_rungs(tmp_path):
    import benchmarks.netns_auto as auto

    m = quality()
    rungs = auto.write_configs(tmp_path / "auto", interval=4)
    for v in m.VARIANTS:
        path = tmp_path / f"{v}.yaml"
        path.write_text(yaml.safe_dump(m.compression(v)))
        cfg = load_compression(str(path))
        assert cfg.auto is None and (cfg.dp_gradient_error_feedback is not None) == (v != "none")
        if v in rungs:  # none, int8 and int4 send what netns_auto's static rungs send
            assert m.compression(v) == yaml.safe_load(open(rungs[v]))
    assert m.compression("int2_p4")["dp_parameter"] == {"name": "int4", "block_size": 256}
    assert m.compression("int2")["dp_gradient"] == {"name": "int2", "block_size": 128}


def _metrics(path, losses, valid):
    path.mkdir(parents=True)
    rows = [{"iteration": i + 1, "loss": x, "iteration_time_s": 0.1 * (i + 1), "wire_bytes": 2e6}
            for i, x in enumerate(losses)]
    rows[-1]["valid_loss"] = valid
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_finished_log_is_read_back_and_an_unfinished_one_is_not(tmp_path):
    m = quality()
    _metrics(tmp_path / "done", [6.0] * 10, 5.5)
    rec = m.read_run(tmp_path / "done")
    assert rec["valid_loss"] == 5.5 and rec["iterations"] == 10 and rec["wire_MB_per_iter"] == 2.0
    assert rec["iteration_s"] == pytest.approx(0.95)  # iterations 9 and 10: the first 8 left out
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "iteration_time_s": 1.0}) + "\n")
    assert m.read_run(tmp_path / "partial") is None and m.read_run(tmp_path / "missing") is None


def test_within_the_spread_is_netns_autos_rule_and_a_lower_loss_counts_as_within():
    m = quality()
    base = [5.40, 5.42, 5.38]  # mean 5.40, sample standard deviation 0.02
    rec = lambda v, s, x: {"variant": v, "iters": 96, "seed": s, "valid_loss": x,  # noqa: E731
                           "wire_MB_per_iter": 1.0, "iteration_s": 0.2}
    records = [rec("none", s + 1, x) for s, x in enumerate(base)]
    records += [rec("int4", s + 1, x + 0.019) for s, x in enumerate(base)]  # +0.019 <= 0.02: within
    records += [rec("int2", s + 1, x + 0.021) for s, x in enumerate(base)]  # +0.021 > 0.02: outside
    records += [rec("int2_p4", s + 1, x - 0.5) for s, x in enumerate(base)]  # lower: costs no quality
    s = m.summarise(records)[96]
    assert s["spread"] == pytest.approx(0.02)
    assert {v: d["within_spread"] for v, d in s["variants"].items()} == {"none": True, "int4": True, "int2": False,
                                                                         "int2_p4": True}
    assert s["variants"]["int4"]["paired_pct"] == pytest.approx([100 * 0.019 / x for x in base])
    page = m.page({"argv": ["-m", "benchmarks.auto_quality"], "out": "o", "source": "abc", "records": records,
                   "notes": ["## Notes", "- a note"]})
    assert "| int2 | 5.4210 ± 0.0200 |" in page and "| no |" in page and page.rstrip().endswith("- a note")


def test_an_unknown_variant_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="unknown variant.*'int3'.*choose from none, int8"):
        quality().main(["--variants", "int3", "--out", str(tmp_path)])


@pytest.mark.slow
def test_two_iteration_runs_from_torchrun_to_the_page(tmp_path):
    m = quality()
    out, work = tmp_path / "out", tmp_path / "work"
    m.main(["--iters", "2", "--seeds", "1", "--variants", "none,int2_p4", "--work", str(work), "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    by = {r["variant"]: r for r in results["records"]}
    assert set(by) == {"none", "int2_p4"} and by["none"]["iterations"] == 2
    assert 0 < by["int2_p4"]["wire_MB_per_iter"] < by["none"]["wire_MB_per_iter"]
    assert yaml.safe_load((out / "configs" / "int2_p4.yaml").read_text()) == m.compression("int2_p4")
    page = (out / "README.md").read_text()
    assert "### 2 iterations" in page and "| int2_p4 |" in page
    m.main(["--from-results", "--out", str(out)])  # the page again, from results.json alone
    assert (out / "README.md").read_text() == page
    mtime = (work / "2" / "none" / "seed1" / "metrics.jsonl").stat().st_mtime
    m.main(["--iters", "2", "--seeds", "1", "--variants", "none", "--work", str(work), "--out", str(tmp_path / "o2")])
    assert (work / "2" / "none" / "seed1" / "metrics.jsonl").stat().st_mtime == mtime  # reused, not retrained

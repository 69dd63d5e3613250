"""The validation-loss study's driver (benchmarks/validation_quality.py), its statistics and page
(benchmarks/validation_report.py) and its corpus (benchmarks/validation_corpus.py): the statistics on synthetic
records, the corpus reader on a dictd-layout file, and one 2-iteration study of a variant and its baseline."""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest

from benchmarks import validation_corpus as corpus
from benchmarks import validation_quality as vq
from benchmarks import validation_report as report

REPO = Path(__file__).resolve().parents[1]


def run(variant, seed, loss, train, wire, baseline=None, layout="dp4"):
    return {"variant": variant, "seed": seed, "layout": layout, "baseline": baseline, "iters": 10,
            "valid": [[5, loss + 1], [10, loss]], "final_valid": loss, "final_train": train,
            "wire_bytes": wire * 10, "uncompressed_bytes": 4e6 * 10, "traffic": {}, "wall_s": 1.0}


def study(runs, references=None):
    return {"preset": "75min", "size": "tiny", "iters": 10, "eval_interval": 5, "eval_iters": 1, "global_batch": 16,
            "seq_length": 32, "seeds": [1, 2, 3], "command": "python -m benchmarks.validation_quality",
            "references": references or {}, "runs": runs, "wall_s": 60}


def test_paired_statistics_and_verdicts():
    runs = [run("none", s, 4.0 + 0.1 * s, 4.0, 4e6) for s in (1, 2, 3)]
    # +1%, +2%, +3% of each seed's own baseline loss; a quarter of its bytes
    runs += [run("int4", s, (4.0 + 0.1 * s) * (1 + s / 100), 4.0, 1e6, baseline="none") for s in (1, 2, 3)]
    refs = {"int4": ["convergence_zero", "int4", 0.56, 0.65, 1.0]}
    rows = {r["variant"]: r for r in report.variant_rows(study(runs, refs))}
    mean, sd, lo, hi = rows["int4"]["diff_pct"]
    assert (mean, lo, hi) == pytest.approx((2.0, 1.0, 3.0)) and sd == pytest.approx(1.0)
    assert rows["int4"]["valid"][0] == pytest.approx(sum((4 + 0.1 * s) * (1 + s / 100) for s in (1, 2, 3)) / 3)
    assert rows["int4"]["fewer_bytes"] == pytest.approx(4.0) and rows["int4"]["paired_seeds"] == [1, 2, 3]
    assert rows["int4"]["verdict"] == {"here": False, "before": True, "changes": True, "target": 1.0}
    assert "diff_pct" not in rows["none"] and "verdict" not in rows["none"]
    lines = report.table(study(runs, refs))
    assert len(lines) == 4 and "**changes**" in lines[3] and "+2.00% ± 1.00% (+1.00% … +3.00%)" in lines[3]


def test_pairs_only_the_seeds_both_have():
    runs = [run("none", s, 4.0, 4.0, 4e6) for s in (1, 2)] + [run("x", s, 4.4, 4.0, 2e6, baseline="none")
                                                              for s in (2, 3)]
    row = report.variant_rows(study(runs))[1]
    assert row["paired_seeds"] == [2] and row["diff_pct"] == pytest.approx((10.0, 0.0, 10.0, 10.0))


def test_summarise_run_sums_every_iteration_and_needs_the_final_validation():
    records = [{"iteration": i, "loss": 10.0 - i, "wire_bytes": 100, "uncompressed_bytes": 400,
                "traffic": {"dp_gradient": [100, 400]}} for i in range(1, 11)]
    records[4]["valid_loss"], records[9]["valid_loss"] = 6.5, 1.5
    records[9]["eval_wire_bytes"] = 7
    entry = vq.summarise_run(records, variant="v", seed=1)
    assert entry["valid"] == [[5, 6.5], [10, 1.5]] and entry["final_valid"] == 1.5 and entry["final_train"] == 0.0
    assert (entry["wire_bytes"], entry["uncompressed_bytes"], entry["eval_wire_bytes"]) == (1000, 4000, 7)
    assert entry["traffic"] == {"dp_gradient": [1000, 4000]}
    del records[9]["valid_loss"]
    with pytest.raises(ValueError, match="no validation loss after the last iteration"):
        vq.summarise_run(records, variant="v", seed=1)


def test_variant_selection_adds_baselines_and_names_unknown_ones():
    a = vq.parse_args(["--variants", "all_int8|1-bit Adam (freeze 20%)"])
    assert vq.selected(a) == ["none (DP 4)", "none (TP 2 x DP 2)", "all_int8", "1-bit Adam (freeze 20%)"]
    assert (a.size, a.iters, a.eval_interval) == ("h128", 200, 50)
    assert vq.parse_args(["--preset", "3h", "--iters", "7"]).iters == 7
    with pytest.raises(ValueError, match=r"--variants: unknown \['int3'\]"):
        vq.selected(vq.parse_args(["--variants", "int3"]))
    assert vq.variant_flags("1-bit Adam (freeze 20%)", 200)[2:4] == ["--freeze-step", "40"]
    for name, spec in vq.VARIANTS.items():  # every baseline named is a variant of the same layout
        if spec.get("baseline"):
            assert vq.VARIANTS[spec["baseline"]]["layout"] == spec["layout"], name


def dictd_file(path: Path, n_entries: int) -> Path:
    """A corpus in dictd's layout (headword line, indented wrapped lines, blank lines between entries, dictd's
    header entry first), its text the repository's English documentation."""
    words = re.findall(r"[A-Za-z][a-z]+", " ".join(p.read_text(encoding="utf-8") for p in sorted(
        (REPO / "docs").glob("**/*.md"))))
    lines = ["00-database-info", "   This file was converted from the original database", ""]
    for i in range(n_entries):
        body = words[(i * 37) % (len(words) - 60):][:60]
        lines += [f"{body[0].capitalize()} \\{body[0]}\\, n.", *("   " + " ".join(body[j:j + 12])
                                                                  for j in range(0, 60, 12)), "   [1913 Webster]", ""]
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return path


def test_corpus_entries_join_wrapped_lines_and_drop_dictd_headers(tmp_path):
    docs = corpus.entries(dictd_file(tmp_path / "gcide.dict.dz", 3))
    assert len(docs) == 3 and not any(d.startswith("00-database") for d in docs)
    assert "\n" not in docs[0] and "   " not in docs[0] and docs[0].endswith("[1913 Webster]")
    with pytest.raises(ValueError, match="no such corpus file; install it with apt-get install dict-gcide"):
        corpus.entries(tmp_path / "missing.dict.dz")


def test_two_iteration_study_run(tmp_path):
    """One real run (4 gloo ranks, 2 iterations) from the dictd file through the indexed data to the page."""
    src = dictd_file(tmp_path / "gcide.dict.dz", 1500)
    out = tmp_path / "out"
    vq.main(["--corpus", str(src), "--work", str(tmp_path / "work"), "--size", "tiny", "--iters", "2",
             "--eval-interval", "1", "--eval-iters", "1", "--seeds", "1", "--variants", "none (DP 4)",
             "--out", str(out)])
    assert (tmp_path / "work" / "gcide_text_document.idx").exists()
    results = json.loads((out / "results.json").read_text())
    (entry,) = results["runs"]
    assert entry["variant"] == "none (DP 4)" and [it for it, _ in entry["valid"]] == [1, 2]
    assert entry["wire_bytes"] == entry["uncompressed_bytes"] > 0 and entry["iters"] == 2
    page = (out / "README.md").read_text()
    assert "| none (DP 4) | dp4 |" in page and (out / "validation_quality.png").stat().st_size > 0
    vq.main(["--from-results", "--out", str(out)])  # the page again, from results.json alone
    assert (out / "README.md").read_text() == page

"""megacomp.plan.published: every published run gets the model's figure, its source and, when it misses, why."""
from __future__ import annotations

from megacomp.plan import published


def test_every_row_cites_its_source_and_explains_a_miss():
    table = published.rows()
    assert {r.run.split(" (")[0] for r in table} >= {"INTELLECT-1", "Covenant-72B / SparseLoCo", "1-bit Adam",
                                                      "ZeRO++", "DeMo", "TACO"}
    for r in table:
        assert r.source.startswith("arXiv ") and r.assumed
        assert r.model > 0
        assert r.within or r.note, f"{r.run}: a miss must say why"
    text = published.markdown(table)
    assert text.count("\n") == len(table) + 2 and "arXiv 2412.01152" in text


def test_within_thresholds():
    row = published.PublishedRow("x", "arXiv 0", "s", "utilisation", 0.83, 0.74, "a")
    assert row.within and not published.PublishedRow("x", "arXiv 0", "s", "utilisation", 0.83, 0.72, "a").within
    assert published.PublishedRow("x", "arXiv 0", "s", "speedup", 2.0, 2.39, "a").within
    assert not published.PublishedRow("x", "arXiv 0", "s", "speedup", 2.0, 2.41, "a").within

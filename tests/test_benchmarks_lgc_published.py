"""benchmarks.lgc_published: every variant names a valid channel setting, and the committed results give the
README's table (the runs themselves take minutes: `python -m benchmarks.lgc_published`)."""
from __future__ import annotations

import argparse
import json

from benchmarks import lgc_published as bench
from megacomp.compression import LGC, make_compressor


def test_variants_name_valid_settings_and_the_committed_results_give_the_readme_table():
    args = argparse.Namespace(density=0.01, warmup=100, train=100, train_iters=10, ae_lr=3e-3, steps=400)
    assert bench._spec("uncompressed", args) is None
    specs = {v: make_compressor(bench._spec(v, args)) for v in bench.VARIANTS[1:]}
    assert all(isinstance(s, LGC) for s in specs.values())
    assert specs["top-k"].warmup_steps > args.steps  # never leaves the warm-up: top-k with accumulation
    assert (specs["LGC ps"].variant, specs["LGC ring"].variant) == ("ps", "ring")
    runs = json.loads((bench.OUT / "results.json").read_text())["runs"]
    table = bench._table(runs)
    readme = (bench.OUT / "README.md").read_text()
    assert all(line in readme for line in table.splitlines())  # the README shows the measured numbers

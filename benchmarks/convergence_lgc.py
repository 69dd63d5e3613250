"""Learned gradient compression, megacomp's chunked PCA / MLP reading (``lgc_pca``; the "LGC" variants below), on
the tiny GPT, next to PowerSGD rank 4 and int4 + LoCo. (LGC as published is ``lgc``: megacomp.compression.lgc.)

    python -m benchmarks.convergence_lgc --seeds 1,2,3 --iters 200 --nproc 2
    python -m benchmarks.convergence_lgc --from-results          # the page and plots only, no training

The ``lgc`` suite, every variant on megacomp's sharded AdamW (``megacomp.pretrain``, dp_gradient path), paired
by seed with the uncompressed run:

  none                     the uncompressed baseline;
  PowerSGD r4              ``{name: powersgd, rank: 4}`` (error feedback and warm start, its defaults);
  int4+LoCo                int4 per 128 elements with LoCo's moving-average error feedback;
  LGC ring (linear)        an autoencoder per bucket, trained on every rank's gradients for the first
                           ``train_steps`` iterations (sent uncompressed, counted), then frozen; the codes are
                           summed by an all-reduce and decoded once (exact for its linear decoder);
  LGC PS (MLP decoder)     the same with a one-hidden-layer decoder: every rank's code is all-gathered and
                           decoded separately (the parameter-server form; summing codes would not be exact);
  LGC ring, retrain above 0.75   the ring variant retraining whenever the senders' measured relative error of a
                           step exceeds 0.75 (each retraining: ``train_steps`` more uncompressed steps).

It reuses benchmarks/convergence.py (run_variant, the tables and plots) by import: this module only adds the
suite and the defaults (``--suites lgc``, ``--out benchmarks/results/convergence_lgc``), so every option of
benchmarks.convergence applies (``--variants``, ``--merge``, ``--reuse``, ``--runs``). Bytes are counted over every
iteration of the run, the training phase's uncompressed all-reduces and sample all-gathers included.
Numbers are measured, never asserted.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

from benchmarks import convergence
from benchmarks import plot_metrics as pm
from benchmarks.convergence_suites import SUITES

INT4 = {"name": "int4", "block_size": 128}
LGC = {"name": "lgc_pca", "latent": 32, "chunk": 512, "train_steps": 20}
SUITE = "lgc"
OUT = "benchmarks/results/convergence_lgc"

VARIANTS = {
    "none": {},
    "PowerSGD r4": {"dp_gradient": {"name": "powersgd", "rank": 4}},
    "int4+LoCo": {"dp_gradient": INT4, "dp_gradient_error_feedback": "loco"},
    "LGC ring (linear)": {"dp_gradient": {**LGC, "variant": "ring", "decoder": "linear"}},
    "LGC PS (MLP decoder)": {"dp_gradient": {**LGC, "variant": "ps", "decoder": "mlp"}},
    "LGC ring, retrain above 0.75": {"dp_gradient": {**LGC, "variant": "ring", "decoder": "linear",
                                                     "retrain_threshold": 0.75}},
}


def gradient_table(results: dict) -> list[str]:
    """The dp_gradient path alone, per variant over seeds: its bytes over the run (all ranks, every iteration: LGC's
    training steps included), per iteration in the second half of the run (LGC frozen), and the final loss's paired
    gap to ``none`` (the study's other DP traffic, the sharded optimizer's fp32 parameter all-gather, is the same in
    every variant)."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for run in results["runs"]:
        runs.setdefault(run["variant"], {})[run["seed"]] = pm.expand_run(run)
    tail = max(1, len(next(iter(runs["none"].values()))) // 10)
    final = {v: {s: sum(r["loss"] for r in recs[-tail:]) / tail for s, recs in per.items()} for v, per in runs.items()}
    lines = ["### dp_gradient alone", "",
             "Bytes of the data-parallel gradient path only, summed over ranks, mean over seeds (a retraining variant "
             "can send different bytes per seed); final loss gap to `none`, paired by seed.", "",
             "| variant | dp_gradient MB over the run | x fewer than none | MB/iteration, second half | "
             "vs none, paired mean ± std |", "|---|---|---|---|---|"]
    def grad(recs):
        return sum(r["traffic"].get("dp_gradient", [0, 0])[0] for r in recs)
    base = statistics.mean(grad(recs) for recs in runs["none"].values())
    for name, per in runs.items():
        total = statistics.mean(grad(recs) for recs in per.values())
        half = statistics.mean(grad(recs[len(recs) // 2:]) / (len(recs) - len(recs) // 2) for recs in per.values())
        gaps = [100 * (final[name][s] - final["none"][s]) / final["none"][s] for s in per if s in final["none"]]
        sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        lines.append(f"| {name} | {total / 1e6:.1f} | {base / total:.1f}x | {half / 1e6:.3f} | "
                     f"{statistics.mean(gaps):+.2f}% ± {sd:.2f}% |")
    return lines + [""]


def main() -> None:
    """Register the suite with benchmarks.convergence, run its main with this study's defaults, then add the
    dp_gradient table to the page."""
    SUITES[SUITE] = {"layout": [], "variants": VARIANTS}
    argv = sys.argv[1:]
    defaults = {"--suites": SUITE, "--out": OUT, "--runs": "results/convergence_runs"}
    for flag, value in defaults.items():
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            argv = [flag, value, *argv]
    sys.argv = [sys.argv[0], *argv]
    convergence.main()
    out = Path(argv[argv.index("--out") + 1])
    page = out / "convergence.md"
    lines = gradient_table(pm.read_results(out / "results.json"))
    page.write_text(page.read_text() + "\n" + "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

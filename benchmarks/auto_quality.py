"""Whether the static rungs of ``--compression auto``'s ladders cost validation loss at a given run length: the
precondition for auto to finish faster than every static setting whose loss is within uncompressed training's seed
spread (the changing-link benchmark, :mod:`benchmarks.netns_auto`).

    python -m benchmarks.auto_quality --iters 96,300 --seeds 1,2,3 --out benchmarks/results/auto_quality
    python -m benchmarks.auto_quality --from-results --out benchmarks/results/auto_quality   # the page only

Why it matters: a faster static setting is a more compressed one. If every static setting is within the spread, the
most compressed one is both admissible and the fastest, and auto, which chooses among the same rungs, can at best
match it. Auto can beat the best admissible static setting only where a more compressed setting is outside the
spread (auto may use it for part of the run and stay inside).

Workload: netns_auto's, run for run (:func:`benchmarks.netns_auto.pretrain_argv`: the 3.44M GPT at DP 2, global
batch 16, the sharded AdamW optimizer, ``--split 95,5,0``, one evaluation of 4 batches after the last iteration),
launched with ``torchrun --standalone --nproc-per-node 2`` on this machine's loopback. No link is shaped: the
validation loss does not depend on the link (gloo's reductions are deterministic; a static int4 run here gave
netns_auto_kinds' recorded loss for the same seed bit for bit on the same CPU). The learning-rate schedule spans
``--iters``, so a longer run is another run, not a continuation.

Variants (their compression files are written to ``<out>/configs/``): ``none``; ``int8``, ``int4`` and ``int2``,
the gradient on that codec with 128-element blocks and LoCo error feedback and the parameters on int8 with
256-element blocks (netns_auto's static rungs and auto_int2.yaml's fifth); ``int4_p4`` and ``int2_p4``, the same with
the parameters on int4 with 256-element blocks (a parameter rung no shipped ladder has).

Per run (a record in ``results.json``): the validation loss, megacomp's wire bytes per iteration summed over ranks,
and the mean iteration time after the first 8 (loopback: compute and codecs, no link; recorded, not compared: this
study is about loss, and its runs may share the cores with other work). The page, per run length and
variant over the seeds: validation loss mean ± standard deviation, the paired difference to uncompressed training,
whether it is within uncompressed training's spread (netns_auto's rule: the variant's mean at most one sample
standard deviation of uncompressed training's above uncompressed training's mean; a lower loss counts as within),
and the wire bytes. Runs whose log directory (``<work>/<iters>/<variant>/seed<n>``) holds a validation loss are
reused unless ``--no-reuse``. A run that fails stops the study with its log's path.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import yaml

from benchmarks import invocation
from benchmarks.netns_auto import _ms, pretrain_argv
from benchmarks.netns_nodes import source_state

_GRAD = {"int8": {"name": "int8", "block_size": 128}, "int4": {"name": "int4", "block_size": 128},
         "int2": {"name": "int2", "block_size": 128}}
_PARAM = {"p8": {"name": "int8", "block_size": 256}, "p4": {"name": "int4", "block_size": 256}}
VARIANTS = ("none", "int8", "int4", "int2", "int4_p4", "int2_p4")
"""In order of bytes on the wire, most first."""


def compression(variant: str) -> dict:
    """The compression config of ``variant`` (module docstring)."""
    if variant == "none":
        return {"min_compress_numel": 4096, "dp_gradient": "none", "dp_parameter": "none"}
    grad, _, param = variant.partition("_")
    return {"dp_gradient_error_feedback": "loco", "min_compress_numel": 4096, "dp_gradient": _GRAD[grad],
            "dp_parameter": _PARAM[param or "p8"]}


def read_run(log_dir: Path) -> Optional[dict]:
    """The record of a finished run's ``metrics.jsonl`` (None when it holds no validation loss)."""
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    valid = [r["valid_loss"] for r in rows if "valid_loss" in r]
    train = [r for r in rows if "iteration_time_s" in r]
    if not valid or not train:
        return None
    return {"valid_loss": valid[-1], "iterations": len(train),
            "iteration_s": statistics.mean(r["iteration_time_s"] for r in train[8:] or train),
            "wire_MB_per_iter": statistics.mean(r["wire_bytes"] for r in train) / 1e6}


def run_one(work: Path, configs: Path, variant: str, iters: int, seed: int, reuse: bool) -> dict:
    """Train ``variant`` for ``iters`` iterations with ``seed`` (or reuse its finished log); its record."""
    log_dir = work / str(iters) / variant / f"seed{seed}"
    argv = pretrain_argv("dp2", str(configs / f"{variant}.yaml"), iters, seed, str(log_dir))
    rec = read_run(log_dir) if reuse else None
    if rec is None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "metrics.jsonl").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv]
        with open(log_dir / "stdout.txt", "w") as out:
            status = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
        rec = read_run(log_dir)
        if status != 0 or rec is None:
            raise SystemExit(f"auto_quality: {variant} seed {seed} at {iters} iterations failed (status {status}); "
                             f"see {log_dir / 'stdout.txt'}")
    return {"variant": variant, "iters": iters, "seed": seed, "argv": argv, **rec}


def summarise(records: list[dict]) -> dict:
    """Per run length, per variant: the losses, the paired differences to ``none`` and whether the variant is within
    its spread."""
    out = {}
    for iters in sorted({r["iters"] for r in records}):
        rows = [r for r in records if r["iters"] == iters]
        base = {r["seed"]: r["valid_loss"] for r in rows if r["variant"] == "none"}
        spread = statistics.stdev(base.values()) if len(base) > 1 else 0.0
        per = {}
        for v in [v for v in VARIANTS if any(r["variant"] == v for r in rows)]:
            rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["seed"])
            loss = [r["valid_loss"] for r in rs]
            paired = [100 * (r["valid_loss"] - base[r["seed"]]) / base[r["seed"]] for r in rs if r["seed"] in base]
            diff = statistics.mean(loss) - statistics.mean(base.values()) if base else None
            per[v] = {"seeds": [r["seed"] for r in rs], "valid_loss": loss, "paired_pct": paired,
                      "within_spread": diff is not None and diff <= spread,
                      "wire_MB": statistics.mean(r["wire_MB_per_iter"] for r in rs),
                      "iteration_s": statistics.mean(r["iteration_s"] for r in rs)}
        out[iters] = {"spread": spread, "variants": per}
    return out


def page(results: dict) -> str:
    """The results page (markdown)."""
    lines = ["# Does a static rung cost validation loss? (the precondition for auto to beat one)", "",
             f"Command: `python {' '.join(results['argv'])}`. Method and variants: benchmarks/auto_quality.py's "
             f"docstring. Source measured: {results['source']}. Raw records: `results.json`; compression files: "
             "`configs/`. Regenerate this page by `python -m benchmarks.auto_quality --from-results --out "
             f"{results['out']}`.", ""]
    for iters, s in summarise(results["records"]).items():
        lines += [f"### {iters} iterations (uncompressed training's spread: {s['spread']:.4f})", "",
                  "| variant | validation loss | vs none, paired (per seed) | within none's spread | "
                  "megacomp wire MB/iter (all ranks) |", "|---|---|---|---|---|"]
        for v, d in s["variants"].items():
            per_seed = ", ".join(f"{p:+.2f}" for p in d["paired_pct"])
            lines.append(f"| {v} | {_ms(d['valid_loss'], '{:.4f}')} | "
                         f"{_ms(d['paired_pct'], '{:+.2f}')}% ({per_seed}) | {'yes' if d['within_spread'] else 'no'} | "
                         f"{d['wire_MB']:.2f} |")
        lines.append("")
    return "\n".join(lines + results.get("notes", [])) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", default="96", help="run lengths, comma-separated")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--work", default="results/auto_quality-runs", help="the runs' log directories")
    ap.add_argument("--out", default="benchmarks/results/auto_quality")
    ap.add_argument("--no-reuse", action="store_true", help="retrain runs whose log already holds a validation loss")
    ap.add_argument("--from-results", action="store_true", help="rewrite the page from results.json, no runs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.from_results:
        results = json.loads((out / "results.json").read_text())
    else:
        variants = args.variants.split(",")
        unknown = sorted(set(variants) - set(VARIANTS))
        if unknown:
            raise SystemExit(f"auto_quality: unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
        configs = out / "configs"
        configs.mkdir(parents=True, exist_ok=True)
        for v in VARIANTS:
            (configs / f"{v}.yaml").write_text(f"# benchmarks.auto_quality variant {v!r}\n"
                                               + yaml.safe_dump(compression(v), sort_keys=False))
        results = {"argv": invocation(), "out": str(out), "source": source_state(), "records": []}
        for iters in [int(x) for x in args.iters.split(",")]:
            for seed in [int(x) for x in args.seeds.split(",")]:
                for v in variants:
                    results["records"].append(run_one(Path(args.work), configs, v, iters, seed, not args.no_reuse))
                    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "README.md").write_text(page(results))
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()

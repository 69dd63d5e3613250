"""The headline quality rows of benchmarks/results/ re-measured on VALIDATION loss: the Llama-style model (RoPE,
SwiGLU, RMSNorm, grouped-query attention, untied output) on an English corpus (GCIDE, benchmarks/validation_corpus.py),
3 seeds, each compressed variant paired by seed with uncompressed training at the same layout.

    python -m benchmarks.validation_quality --out benchmarks/results/validation_quality            # the study as run
    python -m benchmarks.validation_quality --preset 3h --out benchmarks/results/validation_quality_3h
    python -m benchmarks.validation_quality --from-results --out benchmarks/results/validation_quality  # page only

Every run is ``torchrun -m megacomp.pretrain`` (4 CPU gloo ranks) with Megatron's data flags (``--data-path`` an
indexed dataset, ``--tokenizer-type HuggingFaceTokenizer``, ``--split 98,2,0``, ``--eval-interval``,
``--eval-iters``); its logs stay under ``--runs`` (``<variant>/seed<n>/metrics.jsonl``, ``stdout.txt``). Under
``--out``: ``results.json`` (one entry per run, rewritten after each, so an interrupted study keeps what finished),
``README.md`` (the table: validation loss after the last iteration, mean ± standard deviation over seeds and
min-max; the paired difference to the variant's own uncompressed baseline; bytes on the wire per iteration over
every training iteration, evaluation traffic apart; the training-loss study's figure and whether the verdict
against the same target changes) and ``validation_quality.png``. Statistics and the page come from
:mod:`benchmarks.validation_report`, which reads ``results.json`` only.

Validation loss is the mean over ``--eval-iters`` rounds of the global batch of the same first validation samples
(megacomp.training.evaluation), so every run of a seed and layout is scored on the same tokens. A run that fails
stops the study with its log's path; runs whose ``metrics.jsonl`` holds every iteration are reused (``--no-reuse``
retrains).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks import validation_report as report
from benchmarks.validation_corpus import DEFAULT_CORPUS, prepare

INT4 = {"name": "int4", "block_size": 128}
INT8H = {"name": "int8", "block_size": 128, "hadamard": 128}  # all_int8's TP/SP codec
FP8H = {"name": "fp8_e4m3", "block_size": 128, "hadamard": 128}  # tp_fp8's
TP_PATHS = ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter")

# The Llama-style shapes. "h128" is what this study ran (2.84M parameters with the 8192-piece vocabulary, 2.1M of
# them the untied embedding and output layer); "tiny" is configs/llama_tiny.yaml's for the smoke test.
SIZES = {
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings", "32"],
    "h128": ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "352", "--num-attention-heads", "4",
             "--num-query-groups", "2", "--seq-length", "128", "--max-position-embeddings", "128"],
}
LLAMA = ["--position-embedding-type", "rope", "--rotary-base", "10000", "--swiglu", "--normalization", "RMSNorm",
         "--group-query-attention", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
LAYOUTS = {"dp4": [], "tp2dp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]}

# Variant: layout, compression (a preset name of configs/compression/ or a mapping), further pretrain flags
# ("@f": that fraction of --iters), the variant it is paired with. In priority order (--variants picks, the order
# stays). `reference`: the training-loss study's row, its figure and the target both verdicts are read against.
VARIANTS = {
    "none (DP 4)": {"layout": "dp4", "compression": "none"},
    "int4 + LoCo": {"layout": "dp4", "compression": {"dp_gradient": INT4, "dp_gradient_error_feedback": "loco"},
                    "baseline": "none (DP 4)",
                    "reference": ("convergence_zero", "int4 + LoCo, DP 4, 300 iterations", 0.56, 0.65, 1.0)},
    "none (TP 2 x DP 2)": {"layout": "tp2dp2", "compression": "none"},
    "all_int8": {"layout": "tp2dp2", "compression": "all_int8", "baseline": "none (TP 2 x DP 2)",
                 "reference": ("convergence_ablation", "all, TP 2 x DP 2, 300 iterations", 0.10, None, 1.0)},
    "TP int8 (Hadamard, /128)": {"layout": "tp2dp2", "compression": {k: INT8H for k in TP_PATHS},
                                 "baseline": "none (TP 2 x DP 2)",
                                 "reference": ("convergence_tp_codecs", "int8 /128 + Hadamard, 60 iterations", 0.09,
                                               None, 1.0)},
    "TP fp8 e4m3 (Hadamard, /128)": {"layout": "tp2dp2", "compression": "tp_fp8", "baseline": "none (TP 2 x DP 2)",
                                     "reference": ("convergence_tp_codecs", "fp8 e4m3 + Hadamard, 60 iterations",
                                                   1.76, None, 1.0)},
    "DiLoCo H=50": {"layout": "dp4", "compression": "none", "baseline": "none (DP 4)",
                    "args": ["--outer-algorithm", "diloco", "--num-replicas", "4", "--outer-steps", "50"],
                    "reference": ("convergence_diloco", "DiLoCo H = 50, 4 replicas, 500 iterations", 13.5, 0.4,
                                  2.0)},
    "DeMo lr 6e-3 (bf16, top-24)": {"layout": "dp4", "compression": {"dp_gradient": "bf16"},
                                    "baseline": "none (DP 4)",
                                    "args": ["--optimizer", "demo", "--lr", "6e-3", "--min-lr", "6e-4",
                                             "--demo-topk", "24"],
                                    "reference": ("convergence_demo_long", "bf16 top-24, 2000 iterations", 1.55, 0.75,
                                                  3.0)},
    "1-bit Adam (freeze 20%)": {"layout": "dp4", "compression": "none", "baseline": "none (DP 4)",
                                "args": ["--optimizer", "onebit_adam", "--freeze-step", "@0.2",
                                         "--no-shard-optimizer"],
                                "reference": ("convergence_onebit", "1-bit Adam, DP 4, 600 iterations", -2.11, 0.61,
                                              1.0)},
}
# What a preset sets: the study as run on a shared 2-core machine, and the one that fills about three hours there
# (the same matrix at three times the tokens, from this study's measured seconds per run; not yet run).
PRESETS = {"75min": {"size": "h128", "iters": 200, "eval_interval": 50, "eval_iters": 8},
           "3h": {"size": "h128", "iters": 600, "eval_interval": 100, "eval_iters": 16}}


def variant_flags(name: str, iters: int) -> list[str]:
    """A variant's own pretrain flags, "@f" fractions resolved against ``iters``."""
    return [str(max(1, int(float(f[1:]) * iters))) if f.startswith("@") else f
            for f in VARIANTS[name].get("args", [])]


def compression_arg(name: str, run_dir: Path) -> str:
    """The --compression value of a variant: a preset's name, or a YAML file written into its run folder."""
    comp = VARIANTS[name]["compression"]
    if isinstance(comp, str):
        return comp
    path = run_dir / "compression.yaml"
    path.write_text(yaml.safe_dump({**comp, "min_compress_numel": 4096}))
    return str(path)


def command(name: str, seed: int, run_dir: Path, a, data: Path, tokenizer: Path) -> list[str]:
    """The torchrun command line of one run."""
    warmup = max(1, a.iters // 20)
    return ["torchrun", "--standalone", "--nproc-per-node", "4", "-m", "megacomp.pretrain",
            *SIZES[a.size], *LLAMA, *LAYOUTS[VARIANTS[name]["layout"]],
            "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(a.iters),
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", str(warmup), "--clip-grad", "1.0",
            "--weight-decay", "0.1", "--adam-beta2", "0.95",
            "--data-path", str(data), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
            "--split", "98,2,0", "--eval-interval", str(a.eval_interval), "--eval-iters", str(a.eval_iters),
            "--log-interval", "1", "--log-dir", str(run_dir), "--seed", str(seed),
            "--compression", compression_arg(name, run_dir), *variant_flags(name, a.iters)]


def summarise_run(records: list[dict], **labels) -> dict:
    """A results.json entry from one run's metrics records (one per iteration, sorted): the validation curve, the
    final validation loss (after the last iteration), the mean training loss of the last tenth, and the training
    traffic summed over every iteration (per kind [wire, uncompressed]); evaluation traffic apart."""
    valid = [[r["iteration"], r["valid_loss"]] for r in records if "valid_loss" in r]
    if not valid or valid[-1][0] != records[-1]["iteration"]:
        raise ValueError(f"{labels}: no validation loss after the last iteration (--eval-interval and --split set?)")
    tail = records[-max(1, len(records) // 10):]
    kinds: dict[str, list[int]] = {}
    for r in records:
        for kind, (w, u) in r.get("traffic", {}).items():
            row = kinds.setdefault(kind, [0, 0])
            row[0] += int(w)
            row[1] += int(u)
    return {**labels, "iters": len(records), "valid": valid, "final_valid": valid[-1][1],
            "final_train": sum(r["loss"] for r in tail) / len(tail),
            "wire_bytes": sum(int(r.get("wire_bytes", 0)) for r in records),
            "uncompressed_bytes": sum(int(r.get("uncompressed_bytes", 0)) for r in records), "traffic": kinds,
            "eval_wire_bytes": sum(int(r.get("eval_wire_bytes", 0)) for r in records)}


def read_metrics(path: Path) -> list[dict]:
    """The last record written for each iteration of a metrics.jsonl, sorted by iteration."""
    by_iter = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            by_iter[int(rec["iteration"])] = rec
    return [by_iter[k] for k in sorted(by_iter)]


def run_one(name: str, seed: int, a, data: Path, tokenizer: Path) -> dict:
    """Train one variant x seed (or reuse its complete log); its results.json entry."""
    run_dir = Path(a.runs) / report.slug(name) / f"seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    wall = None
    if a.reuse and metrics.exists() and len(read_metrics(metrics)) == a.iters:
        print(f"  {name:32s} seed {seed}: reused", flush=True)
        wall_file = run_dir / "wall_s.txt"
        wall = float(wall_file.read_text()) if wall_file.exists() else None
    else:
        metrics.unlink(missing_ok=True)  # a fresh run, not appended to an older log
        cmd = command(name, seed, run_dir, a, data, tokenizer)
        t0 = time.time()
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        wall = time.time() - t0
        (run_dir / "stdout.txt").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode:
            raise SystemExit(f"validation_quality: {name} seed {seed} failed ({proc.returncode}); "
                             f"see {run_dir / 'stdout.txt'}")
        (run_dir / "wall_s.txt").write_text(f"{wall:.1f}")
        print(f"  {name:32s} seed {seed}: {wall:6.1f} s", flush=True)
    spec = VARIANTS[name]
    return summarise_run(read_metrics(metrics), variant=name, seed=seed, layout=spec["layout"],
                         baseline=spec.get("baseline"), wall_s=wall, args=variant_flags(name, a.iters),
                         compression=spec["compression"])


def parse_args(argv=None):
    """The command line, the preset's values filling what it leaves unset."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/validation_quality", help="results.json, README.md, plot")
    p.add_argument("--runs", default=None, help="run logs (default results/validation_quality/runs-<preset>)")
    p.add_argument("--work", default="results/validation_quality", help="corpus, tokenizer and indexed data")
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="dictd's gcide.dict.dz (Debian package dict-gcide)")
    p.add_argument("--preset", default="75min", choices=sorted(PRESETS), help="size, iterations and evaluation")
    p.add_argument("--size", choices=sorted(SIZES), help="model shapes (overrides the preset's)")
    p.add_argument("--iters", type=int, help="training iterations per run (overrides the preset's)")
    p.add_argument("--eval-interval", type=int, help="evaluate every this many iterations and after the last")
    p.add_argument("--eval-iters", type=int, help="validation rounds of the global batch per evaluation")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    p.add_argument("--variants", default=None, help="'|'-separated variant names (default: all, in priority order)")
    p.add_argument("--no-reuse", dest="reuse", action="store_false", help="retrain runs whose logs are complete")
    p.add_argument("--from-results", action="store_true", help="only redraw the page and plot from results.json")
    a = p.parse_args(argv)
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.runs = a.runs or f"{a.work}/runs-{a.preset}"
    return a


def selected(a) -> list[str]:
    """The variants to run, with every baseline they need, in VARIANTS' order; an unknown name is one line."""
    if a.variants is None:
        return list(VARIANTS)
    names = [n.strip() for n in a.variants.split("|") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; known: {' | '.join(VARIANTS)}")
    wanted = set(names) | {VARIANTS[n]["baseline"] for n in names if VARIANTS[n].get("baseline")}
    return [n for n in VARIANTS if n in wanted]


def main(argv=None) -> None:
    """Prepare the corpus, train every selected variant x seed (results.json and the page after each), or with
    --from-results only redraw the page."""
    a = parse_args(argv)
    out = Path(a.out)
    if a.from_results:
        report.write(out, json.loads((out / "results.json").read_text()))
        return
    try:
        names, seeds = selected(a), [int(s) for s in a.seeds.split(",")]
        data, tokenizer = prepare(Path(a.corpus), Path(a.work))
    except ValueError as e:
        raise SystemExit(f"validation_quality: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    study = {"preset": a.preset, "size": a.size, "model_flags": [*SIZES[a.size], *LLAMA], "iters": a.iters,
             "eval_interval": a.eval_interval, "eval_iters": a.eval_iters, "global_batch": 16,
             "seq_length": int(SIZES[a.size][SIZES[a.size].index("--seq-length") + 1]), "seeds": seeds,
             "corpus": a.corpus, "command": " ".join(["python -m benchmarks.validation_quality", *(argv or sys.argv[1:])]),
             "references": {n: VARIANTS[n]["reference"] for n in names if "reference" in VARIANTS[n]}, "runs": []}
    t0 = time.time()
    for name in names:  # variant-major: the first variants finish all their seeds before the next starts
        for seed in seeds:
            study["runs"].append(run_one(name, seed, a, data, tokenizer))
            study["wall_s"] = sum(r.get("wall_s") or 0.0 for r in study["runs"])  # reused runs: their own time
            (out / "results.json").write_text(json.dumps(study, indent=1))
            report.write(out, study)
    print(f"validation_quality: {len(study['runs'])} runs in {time.time() - t0:.0f} s -> {out / 'README.md'}")


if __name__ == "__main__":
    main()

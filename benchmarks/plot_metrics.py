#!/usr/bin/env python3
"""Plot training loss against iterations and against cumulative wire bytes for one or several runs.

    python -m benchmarks.plot_metrics results/runs/a results/runs/b --labels none int4+LoCo --out plots/
    python -m benchmarks.plot_metrics results/ci_launchers/latest      # every metrics.jsonl below a folder
    python -m benchmarks.plot_metrics benchmarks/results/convergence_zero/results.json --match seed1 --out plots/

Inputs are metrics.jsonl files (written by ``python -m megacomp.pretrain --log-dir DIR``), study results
files (``results.json``, see below) or directories: a directory holding metrics.jsonl is one run;
otherwise every metrics.jsonl below it is a run, or, when there is none, the directory's results.json.
Labels default to the run directory's name (``suite/variant/seedN`` for a results file's runs).
``--match`` keeps the runs whose label contains one of the given strings. Writes ``loss_vs_iteration.png``
and ``loss_vs_wire_bytes.png`` to ``--out`` (default: the first path given when it is a directory, else the
folder of that file: next to the run, never into the current directory) and prints a one-line summary per
run, its bytes as the trainer prints them (``wire W MB of U MB (W/Ux)``: sent over uncompressed, 0.25x for a
4x compression); ``--save FILE`` also writes the runs read into one results file.

Study results file (``results.json``; benchmarks/convergence.py writes one per study and regenerates its
tables and plots from it): a JSON object with the study's settings and ``runs``, one run per line, each
holding what tables and plots use and nothing else: ``iterations`` as ranges ``[first, last, step]``,
``loss`` per logged iteration, ``traffic`` as segments ``[first_iteration, wire_bytes,
uncompressed_bytes, {kind: [wire, uncompressed]}]`` (each logged iteration's bytes, summed over all
ranks, from that iteration on), the totals ``wire_bytes_total`` / ``uncompressed_bytes_total``, and the
run's labels (suite, variant, seed, compression preset, extra pretrain arguments). ``expand_run`` gives
back the records (iteration, loss, wire_bytes, uncompressed_bytes, traffic) of the metrics.jsonl it came
from.

Cumulative wire bytes: each record carries its own iteration's traffic summed over all ranks. When a
run logs every k iterations (``--log-interval k``) a record stands for the k iterations since the
previous one, so its bytes are counted k times (traffic is the same every iteration of a run). A
resumed run appends to its file; a repeated iteration keeps the last record written.

Needs matplotlib (``pip install matplotlib``); it is imported only when plotting.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence


RESULTS_FORMAT = "megacomp-study-results/1"


def find_metrics(paths: Sequence[str]) -> list[Path]:
    """metrics.jsonl (or study results.json) files named by ``paths`` (files, run directories or folders
    of runs)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif (p / "metrics.jsonl").is_file():
            found.append(p / "metrics.jsonl")
        elif p.is_dir():
            below = sorted(p.rglob("metrics.jsonl"))
            if not below and (p / "results.json").is_file():
                below = [p / "results.json"]
            if not below:
                raise FileNotFoundError(f"{p}: no metrics.jsonl in this directory or below it")
            found.extend(below)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return found


def read_run(path: Path) -> list[dict]:
    """Records of one metrics.jsonl, sorted by iteration, one per iteration (the last one written)."""
    by_iter: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if "iteration" not in rec or "loss" not in rec:
                raise ValueError(f"{path}:{n}: a metrics record needs 'iteration' and 'loss'")
            by_iter[int(rec["iteration"])] = rec
    if not by_iter:
        raise ValueError(f"{path}: no records")
    return [by_iter[k] for k in sorted(by_iter)]


def cumulative_wire_bytes(records: list[dict]) -> list[float]:
    """Wire bytes sent up to and including each record's iteration (see the module docstring)."""
    total, prev, out = 0.0, 0, []
    for rec in records:
        it = int(rec["iteration"])
        total += float(rec.get("wire_bytes", 0)) * max(1, it - prev)
        prev = it
        out.append(total)
    return out


# ---- study results files: one compact file per study instead of one metrics.jsonl per run ----------------
def _ranges(values: list[int]) -> list[list[int]]:
    """Increasing ``values`` as ranges [first, last, step] (a single value: [v, v, 1])."""
    out: list[list[int]] = []
    for v in values:
        if out:
            first, last, step = out[-1]
            if first == last and v > last:  # a range's second value sets its step
                out[-1] = [first, v, v - first]
                continue
            if v == last + step:
                out[-1][1] = v
                continue
        out.append([v, v, 1])
    return out


def compact_run(records: list[dict], **labels) -> dict:
    """One run's records (as read by ``read_run``) as a results-file entry: ``labels`` (suite, variant,
    seed, compression, ...) first, then iterations, losses, byte segments and totals."""
    segments: list[list] = []
    for rec in records:
        key = [int(rec.get("wire_bytes", 0)), int(rec.get("uncompressed_bytes", 0)), rec.get("traffic", {})]
        if not segments or segments[-1][1:] != key:
            segments.append([int(rec["iteration"])] + key)
    total_raw = cumulative_wire_bytes([{**r, "wire_bytes": r.get("uncompressed_bytes", 0)} for r in records])
    out = {**labels, "iterations": _ranges([int(r["iteration"]) for r in records]),
           "loss": [r["loss"] for r in records], "traffic": segments,
           "wire_bytes_total": int(cumulative_wire_bytes(records)[-1]), "uncompressed_bytes_total": int(total_raw[-1])}
    probe = compact_probe(records)
    return {**out, "probe": probe} if probe else out


def compact_probe(records: list[dict]) -> dict:
    """The compression-error probes of a run (records with ``probe``, see megacomp.training.metrics_log.gather_probe):
    ``{"iterations": [...], "paths": {path: [[relative error, worst call, max crest, max kurtosis, calls] per
    probed iteration]}, "calls": {"path#index": [key, numel, mean relative error over the probed iterations,
    max crest, max kurtosis]}}``; empty when the run was not probed."""
    probed = [r for r in records if r.get("probe")]
    if not probed:
        return {}
    paths: dict[str, list] = {}
    calls: dict[str, list] = {}
    for r in probed:
        for path, row in r["probe"]["paths"].items():
            paths.setdefault(path, []).append(row)
        for path, key, index, numel, rel, crest, kurt in r["probe"]["calls"]:
            c = calls.setdefault(f"{path}#{index}", [key, numel, [], 0.0, 0.0])
            c[2].append(rel)
            c[3], c[4] = max(c[3], crest), max(c[4], kurt)
    return {"iterations": [int(r["iteration"]) for r in probed], "paths": paths,
            "calls": {k: [key, numel, sum(rels) / len(rels), crest, kurt]
                      for k, (key, numel, rels, crest, kurt) in calls.items()}}


def expand_run(run: dict) -> list[dict]:
    """The records (iteration, loss, wire_bytes, uncompressed_bytes, traffic) of a results-file run."""
    iterations = [i for first, last, step in run["iterations"] for i in range(first, last + 1, step)]
    if len(iterations) != len(run["loss"]):
        raise ValueError(f"{run_label(run)}: {len(iterations)} iterations but {len(run['loss'])} losses")
    records, seg = [], 0
    for it, loss in zip(iterations, run["loss"]):
        while seg + 1 < len(run["traffic"]) and run["traffic"][seg + 1][0] <= it:
            seg += 1
        _, wire, raw, traffic = run["traffic"][seg]
        records.append({"iteration": it, "loss": loss, "wire_bytes": wire, "uncompressed_bytes": raw,
                        "traffic": traffic})
    return records


def run_label(run: dict) -> str:
    """``label`` if the run has one, else ``suite/variant/seedN`` from the parts it has."""
    if run.get("label"):
        return run["label"]
    seed = run.get("seed")
    return "/".join(str(x) for x in (run.get("suite"), run.get("variant"), None if seed is None else f"seed{seed}")
                    if x is not None)


def dump_results(results: dict) -> str:
    """JSON text of a results object: one line per top-level key, one line per element of a top-level list
    (a run, a record); diff-friendly and compact."""
    items = []
    for key, value in results.items():
        if isinstance(value, list) and value:
            inner = ",\n".join("  " + json.dumps(v) for v in value)
            items.append(f" {json.dumps(key)}: [\n{inner}\n ]")
        else:
            items.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(items) + "\n}\n"


def write_results(path: Path, results: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(dump_results({"format": RESULTS_FORMAT, **results}), encoding="utf-8")


def read_results(path: Path) -> dict:
    """A study results file (see the module docstring); raises ValueError when it is not one."""
    try:
        results = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(results, dict) or results.get("format") != RESULTS_FORMAT or "runs" not in results:
        raise ValueError(f"{path}: not a study results file (format {RESULTS_FORMAT!r} with 'runs')")
    return results


def default_label(path: Path, all_paths: Sequence[Path]) -> str:
    """The run directory's name, with its parent's when two runs share a name."""
    name = path.parent.name or str(path)
    if sum(p.parent.name == path.parent.name for p in all_paths) > 1:
        name = f"{path.parent.parent.name}/{name}"
    return name


def _bytes_formatter():
    from matplotlib.ticker import FuncFormatter

    def fmt(x, _pos):
        for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(x) >= scale:
                return f"{x / scale:g} {unit}"
        return f"{x:g} B"

    return FuncFormatter(fmt)


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_metrics.py needs matplotlib, which is not installed: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list[tuple[str, list[dict]]], out: Path, title: Optional[str] = None) -> list[Path]:
    """Write the two figures for ``runs`` ([(label, records)]) into ``out``; returns their paths."""
    plt = _import_pyplot()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, xlabel, xs_of in (
            ("loss_vs_iteration.png", "iteration", lambda recs: [r["iteration"] for r in recs]),
            ("loss_vs_wire_bytes.png", "cumulative wire bytes (all ranks)", cumulative_wire_bytes)):
        fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
        for label, recs in runs:
            xs, ys = xs_of(recs), [r["loss"] for r in recs]
            ax.plot(xs, ys, label=label, linewidth=1.6, marker="o" if len(recs) <= 30 else None, markersize=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("training loss")
        if "wire" in name:
            ax.xaxis.set_major_formatter(_bytes_formatter())
        ax.set_title(title or ("loss vs " + xlabel.replace(" (all ranks)", "")))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def summary_line(label: str, recs: list[dict]) -> str:
    wire = cumulative_wire_bytes(recs)[-1]
    raw = cumulative_wire_bytes([{**r, "wire_bytes": r.get("uncompressed_bytes", 0)} for r in recs])[-1]
    ratio = f"{wire / raw:.2f}x" if raw else "n/a"  # sent / uncompressed, as the trainer's lines and summary
    return (f"{label}: {len(recs)} records, iterations {recs[0]['iteration']}..{recs[-1]['iteration']}, "
            f"loss {recs[0]['loss']:.4f} -> {recs[-1]['loss']:.4f}, wire {wire / 1e6:.2f} MB of "
            f"{raw / 1e6:.2f} MB ({ratio})")


def default_out(paths: Sequence[str]) -> Path:
    """Where the PNGs go without ``--out``: the first path when it is a directory, else its folder."""
    first = Path(paths[0])
    return first if first.is_dir() else first.parent


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="metrics.jsonl files, run directories, or folders of runs")
    p.add_argument("--labels", nargs="+", help="one legend label per run (default: run directory names)")
    p.add_argument("--out", help="directory for the PNGs (default: the first path when it is a directory, else "
                   "its folder)")
    p.add_argument("--title", help="title for both figures")
    p.add_argument("--match", nargs="+", help="keep only runs whose label contains one of these strings")
    p.add_argument("--save", help="also write the runs read into this study results file (JSON)")
    args = p.parse_args(argv)
    try:
        files = find_metrics(args.paths)
        runs, names = [], []
        for f in files:
            if f.suffix == ".json":  # a study results file: all its runs
                for run in read_results(f)["runs"]:
                    runs.append((run_label(run), expand_run(run)))
                    names.append(f"{f}:{run_label(run)}")
            else:
                runs.append((default_label(f, files), read_run(f)))
                names.append(str(f))
        if args.labels and len(args.labels) != len(runs):
            raise ValueError(f"{len(args.labels)} labels for {len(runs)} runs: " + ", ".join(names))
        if args.labels:
            runs = [(label, recs) for label, (_, recs) in zip(args.labels, runs)]
        if args.match:
            runs = [(label, recs) for label, recs in runs if any(m in label for m in args.match)]
            if not runs:
                raise ValueError(f"no run label contains any of {args.match}")
    except (OSError, ValueError) as e:
        print(f"plot_metrics.py: error: {e}", file=sys.stderr)
        return 2
    for label, recs in runs:
        print(summary_line(label, recs))
    if args.save:
        write_results(Path(args.save), {"runs": [compact_run(recs, label=label) for label, recs in runs]})
        print(f"wrote {args.save}")
    for path in plot(runs, Path(args.out) if args.out else default_out(args.paths), args.title):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

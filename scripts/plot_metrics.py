#!/usr/bin/env python3
"""Plot training loss against iterations and against cumulative wire bytes for one or several runs.

    python scripts/plot_metrics.py results/runs/a results/runs/b --labels none int4+LoCo --out plots/
    python scripts/plot_metrics.py results/ci_launchers/latest      # every metrics.jsonl below a folder

Inputs are metrics.jsonl files (written by ``python -m megacomp.pretrain --log-dir DIR``) or directories:
a directory holding metrics.jsonl is one run; otherwise every metrics.jsonl below it is a run. Labels
default to the run directory's name. Writes ``loss_vs_iteration.png`` and ``loss_vs_wire_bytes.png``
to ``--out`` (default: the current directory) and prints a one-line summary per run.

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


def find_metrics(paths: Sequence[str]) -> list[Path]:
    """metrics.jsonl files named by ``paths`` (files, run directories or folders of runs)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif (p / "metrics.jsonl").is_file():
            found.append(p / "metrics.jsonl")
        elif p.is_dir():
            below = sorted(p.rglob("metrics.jsonl"))
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
    ratio = f"{raw / wire:.2f}x" if wire else "n/a"
    return (f"{label}: {len(recs)} records, iterations {recs[0]['iteration']}..{recs[-1]['iteration']}, "
            f"loss {recs[0]['loss']:.4f} -> {recs[-1]['loss']:.4f}, wire {wire / 1e6:.2f} MB "
            f"(uncompressed {raw / 1e6:.2f} MB, {ratio})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="metrics.jsonl files, run directories, or folders of runs")
    p.add_argument("--labels", nargs="+", help="one legend label per run (default: run directory names)")
    p.add_argument("--out", default=".", help="directory for the PNGs (default: current directory)")
    p.add_argument("--title", help="title for both figures")
    args = p.parse_args(argv)
    try:
        files = find_metrics(args.paths)
        if args.labels and len(args.labels) != len(files):
            raise ValueError(f"{len(args.labels)} labels for {len(files)} runs: " + ", ".join(map(str, files)))
        labels = args.labels or [default_label(f, files) for f in files]
        runs = [(label, read_run(f)) for label, f in zip(labels, files)]
    except (OSError, ValueError) as e:
        print(f"plot_metrics.py: error: {e}", file=sys.stderr)
        return 2
    for label, recs in runs:
        print(summary_line(label, recs))
    for path in plot(runs, Path(args.out), args.title):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

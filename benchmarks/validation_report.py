"""Statistics, table and plot of the validation-loss study (benchmarks/validation_quality.py), from its results.json
only (``write``), so the page is redrawn without training.

Per variant over its seeds: the final validation loss's mean, sample standard deviation and min-max; the paired
difference to its baseline (the uncompressed run of the same layout and seed), in percent of the baseline's loss,
as mean ± standard deviation over the seeds both have; the training bytes on the wire per iteration (mean over every
iteration of every seed, evaluation traffic apart) and how many times fewer than the baseline's. The verdict: the
mean paired difference at or below the training-loss study's target (1% for a DP or TP codec, 2% for DiLoCo, 3% for
DeMo: the targets its page was read against); "changes" when the training-loss study's figure read against the same
target gives the other answer.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional


RESULTS = Path(__file__).resolve().parent / "results"
"""benchmarks/results/: the studies this page compares with are its sibling folders."""


def study_page(name: str) -> str:
    """The relative link from this study's page to study ``name``'s page (its README.md, else its convergence.md),
    so that it resolves on GitHub and in the strict documentation build."""
    page = "README.md" if (RESULTS / name / "README.md").exists() else "convergence.md"
    return f"../{name}/{page}"


def slug(name: str) -> str:
    """A folder name for a variant."""
    return "".join(c if c.isalnum() else "_" for c in name).strip("_").lower()


def spread(values: list[float]) -> tuple[float, float, float, float]:
    """(mean, sample standard deviation (0 for one value), min, max)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), sd, min(values), max(values)


def variant_rows(study: dict) -> list[dict]:
    """One row per variant in the order its runs appear: the statistics the table shows."""
    by_variant: dict[str, dict[int, dict]] = {}
    for run in study["runs"]:
        by_variant.setdefault(run["variant"], {})[run["seed"]] = run
    rows = []
    for name, seeds in by_variant.items():
        runs = [seeds[s] for s in sorted(seeds)]
        loss = spread([r["final_valid"] for r in runs])
        train = spread([r["final_train"] for r in runs])
        wire = sum(r["wire_bytes"] for r in runs) / sum(r["iters"] for r in runs)
        raw = sum(r["uncompressed_bytes"] for r in runs) / sum(r["iters"] for r in runs)
        row = {"variant": name, "layout": runs[0]["layout"], "baseline": runs[0].get("baseline"),
               "seeds": sorted(seeds), "valid": loss, "train": train, "wire_per_iter": wire, "raw_per_iter": raw,
               "wall_s": [r.get("wall_s") for r in runs]}
        base = by_variant.get(row["baseline"] or "")
        if base:
            paired = sorted(set(seeds) & set(base))
            if paired:
                row["paired_seeds"] = paired
                row["diff_pct"] = spread([100 * (seeds[s]["final_valid"] - base[s]["final_valid"])
                                          / base[s]["final_valid"] for s in paired])
                row["train_diff_pct"] = spread([100 * (seeds[s]["final_train"] - base[s]["final_train"])
                                                / base[s]["final_train"] for s in paired])
                base_wire = sum(base[s]["wire_bytes"] for s in paired) / sum(base[s]["iters"] for s in paired)
                row["fewer_bytes"] = base_wire / wire if wire else float("inf")
        ref = study.get("references", {}).get(name)
        if ref is not None and "diff_pct" in row:
            study_name, what, figure, _, target = ref
            row["verdict"] = verdict(row["diff_pct"][0], figure, target)
        rows.append(row)
    return rows


def verdict(here: float, before: float, target: float) -> dict:
    """Both studies read against the same target (percent above the baseline's loss)."""
    met_here, met_before = here <= target, before <= target
    return {"here": met_here, "before": met_before, "changes": met_here != met_before, "target": target}


def _pm(stats: Optional[tuple], fmt: str = "{:.4f}", pct: bool = False) -> str:
    if stats is None:
        return "—"
    mean, sd, lo, hi = stats
    f = (lambda v: f"{v:+.2f}%") if pct else fmt.format
    return f"{f(mean)} ± {sd:.2f}{'%' if pct else ''} ({f(lo)} … {f(hi)})" if pct else \
        f"{f(mean)} ± {sd:.4f} ({f(lo)} … {f(hi)})"


def table(study: dict) -> list[str]:
    """The markdown table of the study."""
    lines = ["| variant | layout | validation loss, mean ± std (min … max) | vs its uncompressed baseline, paired "
             "(mean ± std, min … max) | training loss vs baseline | wire MB / iteration (uncompressed) | fewer bytes "
             "than baseline | training-loss study | verdict here (target) |",
             "|---|---|---|---|---|---|---|---|---|"]
    refs = study.get("references", {})
    for row in variant_rows(study):
        ref = refs.get(row["variant"])
        before = "—" if ref is None else (f"[{ref[0]}]({study_page(ref[0])}): {ref[2]:+.2f}%"
                                          + (f" ± {ref[3]:.2f}%" if ref[3] is not None else "") + f" ({ref[1]})")
        v = row.get("verdict")
        said = "—" if v is None else (("within" if v["here"] else "not within") + f" {v['target']:g}%"
                                      + (" — **changes** from the training-loss study" if v["changes"] else
                                         ", as in the training-loss study"))
        fewer = f"{row['fewer_bytes']:.1f}x" if "fewer_bytes" in row else "(baseline)"
        name = row["variant"] if row["seeds"] == list(study["seeds"]) else \
            f"{row['variant']} (seeds {', '.join(map(str, row['seeds']))} only)"
        lines.append(f"| {name} | {row['layout']} | {_pm(row['valid'])} | {_pm(row.get('diff_pct'), pct=True)}"
                     f" | {_pm(row.get('train_diff_pct'), pct=True)} | {row['wire_per_iter'] / 1e6:.2f} "
                     f"({row['raw_per_iter'] / 1e6:.2f}) | {fewer} | {before} | {said} |")
    return lines


def plot(study: dict, path: Path) -> None:
    """Validation loss against iteration (mean over seeds), one panel per layout, and the paired differences."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r["layout"] for r in study["runs"]})
    fig, axes = plt.subplots(1, len(layouts) + 1, figsize=(5.5 * (len(layouts) + 1), 4.2))
    for ax, layout in zip(axes, layouts):
        curves: dict[str, list] = {}
        for r in study["runs"]:
            if r["layout"] == layout:
                curves.setdefault(r["variant"], []).append(r["valid"])
        for name, runs in curves.items():
            its = [it for it, _ in runs[0]]
            mean = [statistics.fmean(run[i][1] for run in runs) for i in range(len(its))]
            ax.plot(its, mean, marker="o", ms=3, label=name, ls="--" if name.startswith("none") else "-")
        ax.set(title=f"{layout}: validation loss (mean over seeds)", xlabel="iteration", ylabel="validation loss")
        ax.legend(fontsize=7)
    rows = [r for r in variant_rows(study) if "diff_pct" in r]
    ax = axes[-1]
    ax.barh([r["variant"] for r in rows], [r["diff_pct"][0] for r in rows],
            xerr=[r["diff_pct"][1] for r in rows], color="tab:blue")
    ax.axvline(0, color="k", lw=0.8)
    ax.set(title="validation loss vs own baseline (mean ± std)", xlabel="% above the uncompressed run")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, study: dict) -> None:
    """README.md and validation_quality.png under ``out`` from a study's results (the page's prose is
    ``intro.md`` beside them, kept by hand, put above the generated table)."""
    out.mkdir(parents=True, exist_ok=True)
    intro = out / "intro.md"
    seq, batch = study["seq_length"], study["global_batch"]
    tokens = study["iters"] * batch * seq
    lines = [intro.read_text(encoding="utf-8").rstrip() + "\n" if intro.exists() else "# Validation-loss study\n",
             f"## Table ({study['preset']} preset: {study['size']}, {study['iters']} iterations of {batch} x {seq} "
             f"tokens = {tokens:,} training tokens per run; evaluation every {study['eval_interval']} iterations, "
             f"{study['eval_iters']} rounds of {batch} samples; seeds {', '.join(map(str, study['seeds']))}; "
             f"{len(study['runs'])} runs in {study.get('wall_s', 0) / 60:.0f} min)", "",
             "Validation loss after the last iteration. Spread: sample standard deviation over seeds, and min … max. "
             "Paired: each seed's run against its baseline's run of the same seed, in percent of the baseline's "
             "loss. Bytes: training traffic of all ranks per iteration, the mean over every iteration (warm-ups "
             "included), evaluation traffic apart.", "", *table(study), "",
             "![validation loss](validation_quality.png)", "",
             f"Regenerate: `python -m benchmarks.validation_quality --from-results --out {out}`; the run: "
             f"`{study['command']}`.", ""]
    (out / "README.md").write_text("\n".join(lines), encoding="utf-8")
    plot(study, out / "validation_quality.png")

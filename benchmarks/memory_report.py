"""The report of benchmarks/memory_bench.py: its rows (one dict per method and rank, from
megacomp.training.memory.MemoryTracker.summary() plus the bench's fields) as markdown tables and a bar plot. Split
out of memory_bench.py to keep it under 500 lines; it only formats numbers, it measures nothing."""
from __future__ import annotations

from pathlib import Path

from megacomp.training.memory import CATEGORIES

MiB = 1 << 20
LABELS = {"adamw": "AdamW (torch DDP)", "zero1": "ZeRO-1 DistributedOptimizer", "zero2": "ZeRO-2 DistributedOptimizer",
          "lomo": "LOMO", "adalomo": "AdaLomo", "loqt": "LoQT (int8, AdamW)"}
ZERO_GROUPS = {"optimizer gradients": "optimizer:", "full buckets": "optimizer: bucket", "shards": "optimizer: shard"}
"""MemoryTracker label groups of the ZeRO rows (memory_bench.build_zero labels the optimizer's buffers so)."""


def _mib(n) -> str:
    return f"{n / MiB:,.1f}"


def table(rows: list[dict], args) -> str:
    """Markdown: the split at each rank's peak, category peaks, RSS / CUDA sanity, the gradient check."""
    cuda = any("cuda_max_allocated" in r for r in rows)
    head = ["method", "rank", "params", "grads", "optimizer state", "activations", "comm buffers", "other",
            "**peak (tracked)**", "tracked peak - live at start", "RSS growth, untracked iteration",
            "RSS growth, tracked iteration"] + (["CUDA max allocated"] if cuda else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def growth(a, b):
        return _mib(b["VmHWM"] - a["VmRSS"]) if "VmHWM" in b and "VmRSS" in a else "-"
    for r in rows:
        a = r["at_peak"]
        cells = [LABELS.get(r["method"], r["method"]), str(r["rank"])] + [_mib(a[c]) for c in CATEGORIES]
        cells += [f"**{_mib(r['peak'])}**", _mib(r["peak"] - sum(r["start"].values())),
                  growth(r["rss_untracked_start"], r["rss_untracked_end"]), growth(r["rss_start"], r["rss_end"])]
        if cuda:
            cells.append(_mib(r["cuda_max_allocated"]))
        lines.append("| " + " | ".join(cells) + " |")
    base = {r["rank"]: r for r in rows if r["method"] == "adamw"}
    lines += ["", "| method | rank | peak gradients (all) | of which partials held by autograd | peak of whole "
              "gradients | largest parameter gradient | largest bucket / message | bound = largest + bucket | "
              "bound, all gradients | bound, whole gradients | gradients vs AdamW | peak vs AdamW | activations (own peak) | "
              "optimizer state (own peak) |", "|" + "---|" * 14]
    for r in rows:
        g, ref = r["cat_peak"]["grad"], base.get(r["rank"])
        checks = [("PASS" if r[k] else "FAIL") if r["grad_bound_applies"] else "(n/a)"
                  for k in ("grad_bound_ok", "whole_grad_bound_ok")]
        vs = f"{g / ref['cat_peak']['grad']:.2f}x" if ref else "-"
        pk = f"{r['peak'] / ref['peak']:.2f}x" if ref else "-"
        lines.append(f"| {LABELS.get(r['method'], r['method'])} | {r['rank']} | {_mib(g)} | "
                     f"{_mib(r['partial_at_grad_peak'])} | {_mib(r['whole_grad_peak'])} | "
                     f"{_mib(r['largest_grad_bytes'])} | {_mib(r['bucket_bytes'])} | {_mib(r['grad_bound_bytes'])} | "
                     f"{checks[0]} | {checks[1]} | {vs} | {pk} | {_mib(r['cat_peak']['act'])} | "
                     f"{_mib(r['cat_peak']['optim'])} |")
    return "\n".join(lines)


def zero_table(rows: list[dict], dp: int) -> str:
    """ZeRO-1 vs ZeRO-2 per rank (ZeRO-2's memory target): the peak of the optimizer's gradient storage (full-size
    buffers + reduced shards, one label group), its parts' own peaks, ZeRO-1's buffers / DP + the largest bucket (the
    expectation), and what was alive at the peak. Empty without both ZeRO rows."""
    ref = {r["rank"]: r for r in rows if r["method"] == "zero1" and "label_peak" in r}
    zero = [r for r in rows if r["method"] in ("zero1", "zero2") and r["rank"] in ref and "label_peak" in r]
    if not any(r["method"] == "zero2" for r in zero):
        return ""
    lines = ["| method | rank | optimizer gradient storage, peak | full-size buffers, own peak | reduced shards, own peak "
             "| ZeRO-1's buffers / DP + largest bucket | peak / that | peak vs ZeRO-1 | all gradients (autograd's too), "
             "peak | alive at the storage peak |", "|" + "---|" * 10]
    for r in zero:
        lp, z1 = r["label_peak"], ref[r["rank"]]
        expect = z1["label_peak"]["full buckets"] / dp + r["bucket_bytes"]
        live = r["label_live_at_peak"]["optimizer gradients"]
        bufs = [b for n, b in live if n.startswith(ZERO_GROUPS["full buckets"])]
        shards = sum(b for n, b in live if n.startswith(ZERO_GROUPS["shards"]))
        counts = {}
        for b in bufs:
            counts[b] = counts.get(b, 0) + 1
        sizes = ", ".join(f"{n} x {_mib(b)}" if n > 1 else _mib(b) for b, n in counts.items()) or "none"
        alive = f"{len(bufs)} full-size buffer(s) ({sizes}), shards {_mib(shards)}"
        lines.append(f"| {LABELS[r['method']]} | {r['rank']} | **{_mib(lp['optimizer gradients'])}** | "
                     f"{_mib(lp['full buckets'])} | {_mib(lp['shards'])} | {_mib(expect)} | "
                     f"{lp['optimizer gradients'] / expect:.2f}x | "
                     f"{lp['optimizer gradients'] / z1['label_peak']['optimizer gradients']:.2f}x | "
                     f"{_mib(r['cat_peak']['grad'])} | {alive} |")
    return "\n".join(lines)


def grad_detail(rows: list[dict]) -> str:
    """The gradients alive at each LOMO / AdaLomo rank's gradient peak (labels: parameter names)."""
    out = []
    for r in rows:
        if r["grad_bound_applies"]:
            live = ", ".join(f"{n} {_mib(b)}" for n, b in r["grad_live_at_peak"])
            out.append(f"- {LABELS.get(r['method'], r['method'])} rank {r['rank']}: {live} (MiB)")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["rank"] == 0]
    names = [LABELS.get(r["method"], r["method"]).replace(" ", "\n", 1) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(rows)
    names_cat = {"param": "parameters", "grad": "gradients", "optim": "optimizer state", "act": "activations",
                 "comm": "comm buffers", "temp": "other"}
    for cat in CATEGORIES:
        vals = [r["at_peak"][cat] / MiB for r in rows]
        ax.bar(names, vals, bottom=bottom, label=names_cat[cat])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        if r["grad_bound_applies"]:
            ax.annotate(f"grad peak {r['cat_peak']['grad'] / MiB:.0f} MiB, whole {r['whole_grad_peak'] / MiB:.0f}\n"
                        f"bound {r['grad_bound_bytes'] / MiB:.0f}: {'PASS' if r['grad_bound_ok'] else 'FAIL'} / "
                        f"{'PASS' if r['whole_grad_bound_ok'] else 'FAIL'}", (i, bottom[i]), ha="center",
                        va="bottom", fontsize=7)
    ax.set_ylabel("MiB at the rank's peak (rank 0)")
    ax.set_title("Measured peak memory per rank, split at the peak")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

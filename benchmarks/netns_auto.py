"""``--compression auto`` against every static rung of its ladder, on a two-node link whose rate changes mid-run.

    python -m benchmarks.netns_auto --layouts dp2,tp2dp2 --seeds 1,2,3 --out benchmarks/results/netns_auto
    python -m benchmarks.netns_auto --from-results --out benchmarks/results/netns_auto   # page + plot, no runs

Cluster: benchmarks/netns_nodes.py's two namespaces (m ranks each, torchrun with a static rendezvous, loopback
inside a namespace, a veth pair shaped with ``tc tbf`` between). The link's rate follows ``--phases`` (default
``1gbit:30,100mbit:30,20mbit:30,1gbit:30``: 30 iterations at each rate): the driver watches rank 0's
metrics.jsonl (one line per finished iteration, sampled every 0.05 s) and, when the line count reaches a phase's
first iteration, changes both veth ends' qdisc (``tc qdisc change ... tbf rate R``); the time of each change is in
the record.

Layouts: ``dp2`` (one rank per node: data parallelism across the link) and ``tp2dp2`` (two ranks per node: tensor
parallelism inside a node, two data-parallel groups across the link). Workload: the 3.44M GPT of netns_nodes
(``MODEL``), global batch 16, one micro-batch per rank, the sharded AdamW optimizer (ZeRO-1, pretraining's
default), ``--split 95,5,0`` and one evaluation after the last iteration (``--eval-iters 4``: the same 64
validation samples for every run).

Variants: the ladders of ``configs/compression/auto.yaml`` (dp_gradient none -> bf16 -> int8 -> int4,
dp_parameter none -> bf16 -> int8, LoCo error feedback on every lossy gradient rung). ``auto`` is that file with
``interval`` set by ``--auto-interval`` (default 5: the phases are 30 iterations, the shipped 20 would leave a
switch 40 iterations after the change); static rung k sends every iteration with rung k of each ladder (the
shortest ladder's last rung where it has fewer), with the same error feedback and ``min_compress_numel``. Their
YAML files are written to ``<out>/configs/`` and named in the records.

Per run (a record): rank 0's iteration times, losses, megacomp's wire bytes and ``auto_codec`` per iteration, auto's
decision records (per path the predicted seconds of every rung, the overlapped compute and the link's rate), the
validation loss after the last iteration, the bytes leaving each node per phase (veth tx counters, as netns_nodes
attributes them), the auto switches rank 0 printed, and the run's wall time. The page gives, per layout and
variant over the seeds: the training time (the sum of rank 0's iteration times, start-up left out) in total and
per phase, the codecs sent in each phase, the bytes per phase, the validation loss and its difference from
uncompressed training paired by seed, and whether it is within uncompressed training's seed spread (its mean
validation loss at most one sample standard deviation of uncompressed training's above uncompressed training's mean:
a lower loss counts as within, it costs no quality); then auto's speed-up against the fastest static rung within
that spread, and against every static rung. Times are measured and printed, never asserted: two CPU
cores run every rank, so compute is slow and codec time is CPU time.

A steady link is one phase (``--phases 100mbit:48``): the page then adds, per layout, auto's switches per path and
every variant's mean iteration time from the iteration after auto's last switch (in any seed) to the end, against the
fastest static rung's over the same iterations. Records of several schedules in one results file (steady links of
several rates, ``--append``) are summarised apart.

Pure functions (no namespaces needed): :func:`parse_phases`, :func:`static_config`, :func:`auto_config`,
:func:`phase_of`, :func:`phase_bytes`, :func:`groups`, :func:`summarise`, :func:`steady`, :func:`table`.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import yaml

from benchmarks import invocation
from benchmarks.netns_bench import rate_bytes_per_s, sh
from benchmarks.netns_nodes import (DEV, MODEL, NS, claim_host, launch, micro_batch, next_port, source_state, setup,
                                    teardown, wait_sampling)
from benchmarks.plot_metrics import dump_results

AUTO_YAML = Path(__file__).resolve().parent.parent / "configs" / "compression" / "auto.yaml"
LAYOUTS = {"dp2": {"m": 1, "tp": 1}, "tp2dp2": {"m": 2, "tp": 2}}
"""Layout name -> ranks per node m and the tensor-parallel size (DP = 2m / tp, across the link)."""
STATIC = ("none", "bf16", "int8", "int4", "int2")
"""Static variants: rung 0..4 of the ladders, named after the gradient's rung (as many as the longest ladder has:
the shipped one has four, ``int2`` needs a ladder of five given by ``--auto-yaml``)."""


# -- the variants' configs (pure) ------------------------------------------------------------------------------
def parse_phases(text: str) -> list[tuple[str, int]]:
    """``"1gbit:30,100mbit:30"`` -> [("1gbit", 30), ("100mbit", 30)] (ValueError on a bad rate or count)."""
    out = []
    for item in text.split(","):
        rate, _, n = item.partition(":")
        rate_bytes_per_s(rate)  # raises on a bad unit
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"--phases: {item!r} is not RATE:ITERATIONS (e.g. 100mbit:30)")
        out.append((rate, int(n)))
    return out


def static_config(auto: dict, rung: int) -> dict:
    """The compression config that sends rung ``rung`` of each ladder of ``auto`` (auto.yaml's mapping) every
    iteration: the auto block removed, each laddered path set to its rung (its last where the ladder is shorter), no
    gradient error feedback on an uncompressed gradient."""
    out = {k: v for k, v in auto.items() if k != "auto"}
    for path, ladder in auto["auto"]["ladder"].items():
        out[path] = ladder[min(rung, len(ladder) - 1)]
    if out.get("dp_gradient", "none") == "none":  # a lossless gradient has no error to feed back
        out.pop("dp_gradient_error_feedback", None)
    return out


def auto_config(auto: dict, interval: int) -> dict:
    """auto.yaml's mapping with the decision interval ``interval``."""
    return {**auto, "auto": {**auto["auto"], "interval": interval}}


def write_configs(out: Path, interval: int, auto_yaml: Path = AUTO_YAML) -> dict[str, str]:
    """Every variant's compression YAML under ``out``/configs, from ``auto_yaml``'s ladders (a static rung per rung
    of the longest ladder); variant -> path."""
    auto = yaml.safe_load(Path(auto_yaml).read_text())
    rungs = max(len(ladder) for ladder in auto["auto"]["ladder"].values())
    (out / "configs").mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, cfg in [("auto", auto_config(auto, interval))] + [(s, static_config(auto, k))
                                                                 for k, s in enumerate(STATIC[:rungs])]:
        path = out / "configs" / f"{name}.yaml"
        path.write_text(f"# benchmarks.netns_auto variant {name!r}, from {Path(auto_yaml).name}\n"
                        + yaml.safe_dump(cfg, sort_keys=False))
        paths[name] = str(path)
    return paths


def pretrain_argv(layout: str, compression: str, iters: int, seed: int, log_dir: str, global_batch: int = 16) -> list:
    """The megacomp.pretrain arguments of one run of ``layout``."""
    m, tp = LAYOUTS[layout]["m"], LAYOUTS[layout]["tp"]
    return ["-m", "megacomp.pretrain", *MODEL, "--train-iters", str(iters), "--log-interval", "1", "--log-dir", log_dir,
            "--global-batch-size", str(global_batch), "--micro-batch-size", str(micro_batch(global_batch, 2 * m // tp)),
            "--tensor-model-parallel-size", str(tp), "--seed", str(seed), "--compression", compression,
            "--split", "95,5,0", "--eval-interval", str(iters), "--eval-iters", "4"]


# -- one run ----------------------------------------------------------------------------------------------------
def phase_of(phases: Sequence[tuple[str, int]], iteration: int) -> int:
    """The phase index of 1-based ``iteration``."""
    end = 0
    for i, (_, n) in enumerate(phases):
        end += n
        if iteration <= end:
            return i
    raise ValueError(f"iteration {iteration} is past the phases ({end} iterations)")


def phase_bytes(samples: Sequence[Sequence], phases: Sequence[tuple[str, int]]) -> dict:
    """Bytes leaving each node in each phase from samples ``(t, lines, tx_A, tx_B)``: the counter at the first
    sample that shows a phase's last iteration finished less the one at the first sample that shows the previous
    phase's (the first phase from the first sample: start-up included). node -> [bytes per phase]."""
    ends, total = [], 0
    for _, n in phases:
        total += n
        ends.append(total)
    firsts = [next(i for i, s in enumerate(samples) if s[1] >= e) for e in ends]
    out = {}
    for node, col in (("A", 2), ("B", 3)):
        at = [samples[0][col]] + [samples[i][col] for i in firsts]
        out[node] = [b - a for a, b in zip(at, at[1:])]
    return out


def run_one(args, layout: str, variant: str, seed: int, configs: dict) -> dict:
    """Train one variant on the changing link; its record."""
    phases, iters = args.phase_list, sum(n for _, n in args.phase_list)
    m = LAYOUTS[layout]["m"]
    source = source_state()  # per run, when it starts: the tree may change between runs
    setup(phases[0][0])
    changes = []
    starts = {sum(n for _, n in phases[:i]): rate for i, (rate, _) in enumerate(phases) if i}  # lines -> new rate

    def follow(lines: int) -> None:
        for at, rate in starts.items():
            if lines >= at and at not in (c["after_iteration"] for c in changes):
                for ns, dev in zip(NS, DEV):
                    sh(f"ip netns exec {ns} tc qdisc change dev {dev} root tbf rate {rate} burst 1mbit latency 50ms")
                changes.append({"after_iteration": at, "seen_at_line": lines, "rate": rate, "t": time.time()})

    with tempfile.TemporaryDirectory() as d:
        logs = Path(d)
        t0 = time.time()
        argv = pretrain_argv(layout, configs[variant], iters, seed, str(logs / "log"), args.global_batch)
        procs = launch(m, next_port(args.port), argv, logs)
        samples = wait_sampling(procs, logs / "log" / "metrics.jsonl", args.timeout, logs, on_sample=follow)
        run_s = time.time() - t0
        metrics = [json.loads(x) for x in (logs / "log" / "metrics.jsonl").read_text().splitlines()]
        log0 = (logs / "node0.log").read_text()
    train = [r for r in metrics if "loss" in r]
    valid = [r["valid_loss"] for r in metrics if "valid_loss" in r]
    return {"layout": layout, "variant": variant, "seed": seed, "phases": phases, "compression": configs[variant],
            "argv": argv, "source": source, "run_s": run_s,
            "changes": [{**c, "t": c["t"] - t0} for c in changes],
            "times_s": [r["iteration_time_s"] for r in train], "losses": [r["loss"] for r in train],
            "wire_bytes": [r["wire_bytes"] for r in train], "fp32_bytes": [r["uncompressed_bytes"] for r in train],
            "auto_codec": [r.get("auto_codec") for r in train], "valid_loss": valid[-1] if valid else None,
            "decisions": [{"iteration": r.get("iteration"), **r["auto_decision"]} for r in metrics
                          if "auto_decision" in r],  # predicted seconds per rung, rate, overlap: why it switched
            "tx_per_phase": phase_bytes(samples, phases),
            "switches": re.findall(r"megacomp-pretrain: auto: (.*)", log0)}


# -- summaries (pure) -------------------------------------------------------------------------------------------
def _ms(xs: Sequence[float], fmt: str = "{:.1f}") -> str:
    if len(xs) < 2:
        return fmt.format(xs[0]) if xs else "-"
    return f"{fmt.format(statistics.mean(xs))} ± {fmt.replace('+', '').format(statistics.stdev(xs))}"


def _codecs_in(rec: dict, lo: int, hi: int) -> str:
    """The codecs that sent iterations lo..hi (1-based) of an auto run, per laddered path, with where each began."""
    if not rec["auto_codec"][lo - 1]:  # a static rung
        return rec["variant"]
    parts = []
    for path in sorted(rec["auto_codec"][lo - 1] or {}):
        runs, prev = [], None
        for it in range(lo, hi + 1):
            c = rec["auto_codec"][it - 1][path]
            if c != prev:
                runs.append(c if prev is None else f"{c}@{it}")
                prev = c
        parts.append(f"{path.split('_')[1][:4]}: {' > '.join(runs)}")
    return "; ".join(parts)


def _variant_order(v: str) -> tuple:
    """auto first, then the static rungs least lossy first, then any other variant (e.g. an earlier auto)."""
    return (0 if v == "auto" else 1 + STATIC.index(v) if v in STATIC else 9, v)


def groups(records: list[dict]) -> dict[str, list[dict]]:
    """The records per layout, or per layout and link schedule where the records hold more than one schedule (e.g.
    steady links of several rates): ``dp2`` or ``dp2 at 1gbit x 48``."""
    schedules = dict.fromkeys(json.dumps(r["phases"]) for r in records)
    out: dict = {}
    for r in records:
        rates = " / ".join(f"{rate} x {n}" for rate, n in r["phases"])
        out.setdefault(r["layout"] if len(schedules) == 1 else f"{r['layout']} at {rates}", []).append(r)
    return out


def summarise(records: list[dict]) -> dict:
    """Per layout: per variant the seeds' totals and phases, and the verdict (fastest static rung within
    uncompressed training's seed spread, auto's speed-up against it)."""
    out = {}
    for layout, rows in groups(records).items():
        phases = rows[0]["phases"]
        bounds, end = [], 0
        for _, n in phases:
            bounds.append((end + 1, end + n))
            end += n
        base = {r["seed"]: r["valid_loss"] for r in rows if r["variant"] == "none"}
        spread = statistics.stdev(base.values()) if len(base) > 1 else 0.0
        variants = {}
        for v in sorted(dict.fromkeys(r["variant"] for r in rows), key=_variant_order):
            rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["seed"])
            paired = [100 * (r["valid_loss"] - base[r["seed"]]) / base[r["seed"]] for r in rs if r["seed"] in base]
            diff = statistics.mean(r["valid_loss"] for r in rs) - statistics.mean(base.values()) if base else None
            variants[v] = {
                "seeds": [r["seed"] for r in rs], "train_s": [sum(r["times_s"]) for r in rs],
                "run_s": [r["run_s"] for r in rs], "valid_loss": [r["valid_loss"] for r in rs], "paired_pct": paired,
                "within_spread": diff is not None and diff <= spread,  # a lower loss costs no quality
                "phase_s": [[sum(r["times_s"][lo - 1:hi]) for r in rs] for lo, hi in bounds],
                "phase_MB_node": [[(r["tx_per_phase"]["A"][i] + r["tx_per_phase"]["B"][i]) / 2e6 / (hi - lo + 1)
                                   for r in rs] for i, (lo, hi) in enumerate(bounds)],
                "phase_codecs": [[_codecs_in(r, lo, hi) for r in rs] for lo, hi in bounds],
                "wire_MB": statistics.mean(sum(r["wire_bytes"]) / len(r["wire_bytes"]) / 1e6 for r in rs)}
        ok = [v for v in STATIC if v in variants and variants[v]["within_spread"]]
        best = min(ok, key=lambda v: statistics.mean(variants[v]["train_s"])) if ok else None
        auto_s = statistics.mean(variants["auto"]["train_s"]) if "auto" in variants else None
        for d in variants.values():
            d["auto_speedup"] = statistics.mean(d["train_s"]) / auto_s if auto_s else None
        speedup = variants[best]["auto_speedup"] if best else None
        out[layout] = {"phases": phases, "spread": spread, "variants": variants, "best_static": best,
                       "auto_speedup": speedup, "auto_within_spread": variants.get("auto", {}).get("within_spread"),
                       "steady": steady(rows) if len(phases) == 1 else None}
    return out


def switches_at(rec: dict) -> list[tuple[int, str]]:
    """An auto run's switches as (the first iteration sent with the new codec, 1-based; path), in order."""
    codecs = rec["auto_codec"]
    return [(i + 2, p) for i, (a, b) in enumerate(zip(codecs, codecs[1:])) for p in sorted(a or {}) if a[p] != b[p]]


def switch_counts(rec: dict) -> dict:
    """Per laddered path of an auto run, how many times its codec changed between iterations."""
    at = [p for _, p in switches_at(rec)]
    return {p: at.count(p) for p in sorted(rec["auto_codec"][0] or {})}


def steady(rows: list[dict]) -> Optional[dict]:
    """On a steady link: auto's switches per path (each seed), the first iteration after auto's last switch in any
    seed (``settled_from``), and every variant's mean iteration time from there to the end (each seed), so auto
    settled is compared with each static rung over the same iterations. None without auto runs."""
    autos = [r for r in rows if r["variant"] == "auto"]
    if not autos:
        return None
    start = max(max([it for it, _ in switches_at(r)] or [1]) for r in autos)  # every seed on its final codecs
    per_iter = {}
    for v in sorted(dict.fromkeys(r["variant"] for r in rows), key=_variant_order):
        rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["seed"])
        per_iter[v] = [statistics.mean(r["times_s"][start - 1:]) for r in rs if len(r["times_s"]) >= start]
    fastest = min((v for v in STATIC if per_iter.get(v)), key=lambda v: statistics.mean(per_iter[v]), default=None)
    decided: dict = {}  # per path, over every decision of every seed: the ranges the choices were made from
    for r in autos:
        for d in r.get("decisions", []):
            for p, rec in d.items():
                if isinstance(rec, dict) and "predicted_s" in rec:
                    g = decided.setdefault(p, {"rate_Mbps": [], "overlap_ms": [], "predicted_ms": []})
                    g["rate_Mbps"].append(rec["rate_Mbps"])
                    g["overlap_ms"].append(1e3 * rec["overlap_s"])
                    g["predicted_ms"].append([1e3 * x for x in rec["predicted_s"]])
    return {"settled_from": start, "switches": [switch_counts(r) for r in sorted(autos, key=lambda r: r["seed"])],
            "decided": decided,
            "final": [{p: c[p] for p in sorted(c)} for c in (r["auto_codec"][-1] for r in autos)],
            "per_iter_s": per_iter, "fastest_static": fastest,
            "auto_over_fastest": (statistics.mean(per_iter["auto"]) / statistics.mean(per_iter[fastest])
                                  if fastest and per_iter.get("auto") else None)}


def table(summary: dict) -> list[str]:
    """One Markdown table per layout, and its verdict line."""
    lines = []
    for layout, s in summary.items():
        rates = " / ".join(f"{r} x {n}" for r, n in s["phases"])
        lines += [f"### {layout} (link: {rates} iterations)", "",
                  "| variant | training s (sum of iterations) | s per phase | MB leaving a node per iteration, per phase "
                  "| what it sent per phase (seed 1) | validation loss | vs none, paired | within none's spread "
                  f"(+{s['spread']:.4f}) | megacomp wire MB/iter | its time / auto's |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for v, d in s["variants"].items():
            lines.append(
                f"| {v} | {_ms(d['train_s'])} | {' / '.join(_ms(x) for x in d['phase_s'])} | "
                f"{' / '.join(_ms(x, '{:.2f}') for x in d['phase_MB_node'])} | "
                f"{' / '.join(x[0] for x in d['phase_codecs'])} | {_ms(d['valid_loss'], '{:.4f}')} | "
                f"{_ms(d['paired_pct'], '{:+.2f}') + '%' if d['paired_pct'] and v != 'none' else '-'} "
                f"({', '.join(format(x, '+.2f') for x in d['paired_pct'])}) | "
                f"{'yes' if d['within_spread'] else 'no'} | {d['wire_MB']:.2f} | "
                f"{'-' if d['auto_speedup'] is None else format(d['auto_speedup'], '.2f')} |")
        if s.get("steady"):
            lines += ["", *steady_lines(s["steady"])]
        best = s["best_static"]
        lines += ["", (f"Fastest static rung within none's spread: **{best}**; it takes **{s['auto_speedup']:.2f}x** "
                       f"auto's training time" if best and s["auto_speedup"] else
                       "No static rung within none's spread, or no auto runs") +
                  f"; auto's validation loss is {'within' if s['auto_within_spread'] else 'outside'} that spread.", ""]
    return lines


def steady_lines(st: dict) -> list[str]:
    """The steady-link check of one layout: auto's switches, the ranges its decisions were made from, and its settled
    step time against each static rung's."""
    switches = "; ".join(", ".join(f"{p.split('_')[1][:4]} {n}" for p, n in c.items()) for c in st["switches"])
    finals = "; ".join(", ".join(f"{p.split('_')[1][:4]} {c}" for p, c in f.items()) for f in st["final"])
    lines = [f"Steady link: auto's switches per path, each seed: {switches} (final codecs: {finals})."]
    for p, g in sorted(st.get("decided", {}).items()):
        above = list(zip(*[[x - min(row) for x in row] for row in g["predicted_ms"]]))  # per rung, per decision
        lines += ["", f"{p} over auto's {len(g['rate_Mbps'])} decisions: link rate estimated "
                  f"{min(g['rate_Mbps']):.0f}-{max(g['rate_Mbps']):.0f} Mbit/s, overlapped compute "
                  f"{min(g['overlap_ms']):.1f}-{max(g['overlap_ms']):.1f} ms; predicted ms per iteration above the "
                  "fastest rung, per rung least lossy first: " + ", ".join(f"{min(x):.1f}-{max(x):.1f}" for x in above)
                  + "."]
    lines += ["", f"Mean seconds per iteration from iteration {st['settled_from']} (after auto's last switch in any "
              "seed) to the end:", "", "| variant | s per iteration, settled | its time / fastest static rung's |",
              "|---|---|---|"]
    fast = st["per_iter_s"].get(st["fastest_static"])
    for v, xs in st["per_iter_s"].items():
        ratio = statistics.mean(xs) / statistics.mean(fast) if fast and xs else None
        lines.append(f"| {v} | {_ms(xs, '{:.3f}')} | {'-' if ratio is None else format(ratio, '.3f')} |")
    return lines


def plot(records: list[dict], path: Path) -> Optional[Path]:
    """Per layout: iteration time of every variant (seed 1) with the link rate drawn in, and auto's rung per path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    by_group = groups(records)
    layouts = list(by_group)
    fig, axes = plt.subplots(2, len(layouts), figsize=(6.5 * len(layouts), 7), squeeze=False, sharex="col")
    for col, layout in enumerate(layouts):
        ax, ax2 = axes[0][col], axes[1][col]
        rows = by_group[layout]
        seed = min(r["seed"] for r in rows)
        for i, v in enumerate(["auto", *STATIC]):
            r = next((r for r in rows if r["variant"] == v and r["seed"] == seed), None)
            if r:
                ax.plot(range(1, len(r["times_s"]) + 1), r["times_s"], color=f"C{i}", lw=1.4 if v == "auto" else 0.9,
                        label=v)
        rate_ax = ax.twinx()
        xs, ys, end = [], [], 0
        for rate, n in rows[0]["phases"]:
            xs += [end + 0.5, end + n + 0.5]
            ys += [rate_bytes_per_s(rate) * 8 / 1e6] * 2
            end += n
        rate_ax.plot(xs, ys, color="black", ls=":", lw=1.2, label="link Mbit/s")
        rate_ax.set(yscale="log", ylabel="link rate (Mbit/s, dotted)")
        ax.set(ylabel="iteration time (s)", yscale="log", title=f"{layout}, seed {seed}")
        ax.legend(fontsize=8, loc="upper left")
        for j, r in enumerate(r for r in rows if r["variant"] == "auto"):
            for k, traffic in enumerate(sorted(r["auto_codec"][0] or {})):
                rungs = [_rung(c[traffic]) for c in r["auto_codec"]]
                ax2.step(range(1, len(rungs) + 1), [x + 0.06 * (j - 1) + 0.02 * k for x in rungs], where="mid",
                         color=f"C{k}", alpha=0.8, label=f"{traffic}, seed {r['seed']}")
        ax2.set(xlabel="iteration", ylabel="auto's rung", yticks=range(len(STATIC)), yticklabels=STATIC)
        ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rung(codec: str) -> int:
    """The rung index a codec name stands for (its family: none, bf16, int8, int4)."""
    return next((i for i, s in enumerate(STATIC) if codec.startswith(s)), len(STATIC) - 1)


def write(results: dict, out: Path) -> list[str]:
    """netns_auto.md (and netns_auto.png) from the results object; returns the page's lines."""
    summary = summarise(results["records"])
    link = "a steady" if all(len(r["phases"]) == 1 for r in results["records"]) else "a changing"
    lines = [f"# `--compression auto` on {link} link: {len(results['records'])} runs", "",
             f"Command: `{results['command']}` ({results['elapsed_s'] / 60:.0f} min). Method: "
             "benchmarks/netns_auto.py's docstring. Source measured: "
             f"{'; '.join(dict.fromkeys(str(r.get('source')) for r in results['records']))}. Raw records: "
             "`netns_auto.json`; the variants' compression files: `configs/`. Regenerate this page by "
             f"`python -m benchmarks.netns_auto --from-results --out {results['out']}`.", "", *table(summary)]
    if results.get("notes"):
        lines += ["## Notes", "", *results["notes"], ""]
    if results["records"] and plot(results["records"], out / "netns_auto.png"):
        lines += ["![iteration time and auto's codecs against iteration](netns_auto.png)", ""]
    (out / "netns_auto.md").write_text("\n".join(lines))
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="dp2,tp2dp2", help="comma list of " + ",".join(LAYOUTS))
    p.add_argument("--variants", default="auto," + ",".join(STATIC[:4]), help="auto and the static rungs to run")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--phases", default="1gbit:30,100mbit:30,20mbit:30,1gbit:30", help="RATE:ITERATIONS,...")
    p.add_argument("--auto-interval", type=int, default=5, help="auto's decision interval (iterations)")
    p.add_argument("--auto-yaml", default=str(AUTO_YAML), help="the compression file whose auto: ladders are run")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--port", type=int, default=29871)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", default="benchmarks/results/netns_auto")
    p.add_argument("--append", action="store_true", help="add the new runs to <out>/netns_auto.json's records")
    p.add_argument("--from-results", action="store_true", help="no runs: rewrite the page and plot from the JSON")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.from_results:
        print("\n".join(write(json.loads((out / "netns_auto.json").read_text()), out)))
        return
    args.phase_list = parse_phases(args.phases)
    configs = write_configs(out, args.auto_interval, Path(args.auto_yaml))
    bad = [x for x in args.layouts.split(",") if x not in LAYOUTS] + [
        v for v in args.variants.split(",") if v not in configs]
    if bad:
        p.error(f"unknown layout or variant {bad} (variants of {args.auto_yaml}: {', '.join(configs)})")
    claim_host()
    old = json.loads((out / "netns_auto.json").read_text()) if args.append else {}
    command = f"python {' '.join(invocation())}"  # appended runs keep the earlier commands and notes
    results = {"command": f"{old['command']}`, then `{command}" if old.get("command") else command, "out": args.out,
               "elapsed_s": old.get("elapsed_s", 0.0), "records": old.get("records", []), "notes": old.get("notes", [])}
    t0 = time.time() - results["elapsed_s"]
    try:
        for layout in args.layouts.split(","):
            for seed in [int(s) for s in args.seeds.split(",")]:
                for variant in args.variants.split(","):
                    rec = run_one(args, layout, variant, seed, configs)
                    results["records"].append(rec)
                    results["elapsed_s"] = time.time() - t0
                    (out / "netns_auto.json").write_text(dump_results(results))
                    print(f"{layout} {variant} seed {seed}: {sum(rec['times_s']):.1f} s training, "
                          f"{rec['run_s']:.0f} s run, valid loss {rec['valid_loss']}, switches {rec['switches']}",
                          flush=True)
    finally:
        teardown()
    print("\n".join(write(results, out)))


if __name__ == "__main__":
    main()

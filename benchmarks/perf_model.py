"""Calibration and validation driver of megacomp.plan's step model, plus the old collective projection.

    python -m benchmarks.perf_model --validate-all benchmarks/results --out-dir benchmarks/results/plan
    python -m benchmarks.perf_model results.json [--out section.md] [--plot proj.png]

``--validate-all`` runs benchmarks.step_validation (what is fitted on what, what is held out) and writes
calibration.md (every point, fitted or held out), calibration.json and published.md (megacomp.plan.published). It
measures nothing and prints tables; it never asserts a time.

With a bench_report results file it writes the older report section: the fitted constants, every point of that
file, and a projection of compressed vs bf16/fp32 gradient all-reduce to 8-1024 GPUs, where every GPU number
(per-hop latency, codec throughput, FLOP/s, tokens) is an explicit, labelled assumption.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.step_validation import _ddp_points, benchmark_machine, validate_all, validation_markdown
from megacomp.plan import shaped_steps as ss

from megacomp.plan.calibration import (SEGMENT_ELEMS, MiB, Codec, Model, Row, Validation, _codec_time, _points,  # noqa: F401
                                       codec_work, fit, pipeline, predict_collective, wire_bytes)
from megacomp.plan.calibration import DEFAULT_BITS as _BITS_TABLE

DEFAULT_BITS = dict(_BITS_TABLE)


# -- step model on the shaped-link runs (megacomp.plan.shaped_steps) -----------------------------------
def predict_step(model: Model, method: str, params: int, world: int, rate_Bps: float, t_compute: float,
                 wire_bytes_per_step: float | None = None, bucket_bytes: float = 25 * MiB, overlap: float = 1.0,
                 contention: float = 0.0) -> float | None:
    """Predicted DP step seconds of a benchmark method (None when the method is not modelled)."""
    if method == "no_communication":
        return t_compute
    phases = ss.method_phases(method, params, world, bucket_bytes, wire_bytes_per_step)
    if phases is None:
        return None
    return ss.predict_step(model, phases, rate_Bps, world, t_compute, overlap, contention)


def validate(model: Model, results: dict, overlap: float = 1.0, contention: float = 0.0) -> Validation:
    """Every collective and DP-step point of one bench_report results file (all marked as fitted)."""
    rows = []
    for r, S, tm in _points(results):
        label = f"{r['op']} {r['codec']} {r['mib']:g} MiB p{r['world']} @{r['rate']}"
        rows.append(Row("collective", label, tm, predict_collective(model, r["op"], r["codec"], S, r["world"],
                                                                    r["rate_Bps"])))
    for label, phases, rate, world, floor, tm, *_ in _ddp_points(model, results.get("ddp", []), "benchmarks"):
        rows.append(Row("ddp", label, tm, ss.predict_step(model, phases, rate, world, floor, overlap, contention)))
    return Validation(rows)


# -- projection to GPU clusters ------------------------------------------------------------------------
@dataclass
class Projection:
    rows: list[dict]
    assumptions: list[str]


def project(model: Model, params=(1.3e9, 7e9), worlds=(8, 64, 256, 1024), rates_gbit=(10, 100, 200, 400),
            codecs=("int4", "int8"), baselines=("bf16", "fp32"), alpha_s: float = 10e-6,
            gpu_codec_Bps: float = 2.0e12, tokens_per_gpu: int = 16384, flops: float = 400e12,
            eta: float | None = None) -> Projection:
    """Speedup of compressed over bf16/fp32 gradient all-reduce and of the DP step, per (N, p, B, codec)."""
    eta = model.link("all_reduce")[1] if eta is None else eta
    rows = []

    def step(t_comm: float) -> float:  # DP step: compute + communication not hidden behind backward
        return t_compute + max(0.0, t_comm - (2.0 / 3.0) * t_compute)

    for N in params:
        t_compute = 6 * N * tokens_per_gpu / flops
        for p in worlds:
            lat = 2 * (p - 1) * alpha_s
            for gb in rates_gbit:
                B = gb * 1e9 / 8 * eta
                base_t = {b: lat + 2 * (p - 1) / p * N * DEFAULT_BITS[b] / 8 / B for b in baselines}
                for c in codecs:
                    t_wire = 2 * (p - 1) / p * N * model.bits.get(c, DEFAULT_BITS[c]) / 8 / B
                    E, D = codec_work("all_reduce", p)
                    t_codec = (E + D) * 2 * N / gpu_codec_Bps  # bf16 gradient bytes per pass
                    t_c = lat + pipeline(t_wire, t_codec, math.ceil(N / SEGMENT_ELEMS))
                    for b, t_b in base_t.items():
                        rows.append(dict(params=N, world=p, rate_gbit=gb, codec=c, baseline=b, t_base=t_b,
                                         t_comp=t_c, t_codec=t_codec, t_compute=t_compute,
                                         coll_speedup=t_b / t_c, step_speedup=step(t_b) / step(t_c)))
    assumptions = [
        f"ASSUMPTION: GPU codec throughput {gpu_codec_Bps:.3g} B/s of bf16 gradient per encode/decode pass "
        "(about 60% of an H100's HBM bandwidth); not measured here (CPU-only machine).",
        f"ASSUMPTION: per-hop latency alpha = {alpha_s * 1e6:g} us (NCCL-class inter-node), paid 2(p-1) times "
        "per gradient all-reduce, once for the whole gradient (bucketing adds latency to both sides).",
        f"Link efficiency eta = {eta:.3f} (the fitted value from this link unless given), for both sides.",
        f"Compute per step = 6 * params * {tokens_per_gpu} tokens/GPU / {flops:.3g} FLOP/s achieved (assumed); "
        "backward = 2/3 of it, and the gradient exchange overlaps backward fully (o = 1) for all methods.",
        "Compressed all-reduce = reduce-scatter (all-to-all of encoded chunks) + all-gather of re-encoded "
        "shards, pipelined over 1M-element segments; error-feedback updates are not costed.",
        "Ring algorithms for the baselines; NCCL tree/NVLS variants and intra-node NVLink hierarchy ignored.",
    ]
    return Projection(rows, assumptions)


# -- report --------------------------------------------------------------------------------------------
def markdown(model: Model, validation: Validation, projection: Projection) -> str:
    out = ["## Analytical alpha-beta model", "",
           "T = alpha + W/(eta*B) uncompressed; compressed all-reduce T = alpha + max(T_wire, T_codec) + "
           "min(T_wire, T_codec)/n_segments (codec and wire pipelined over 1M-element segments); compressed "
           "RS/AG pipelined the same way. DDP step = compute floor + max(0, T_comm - o * 2/3 compute).",
           "", "### Fitted parameters", "", "| parameter | value | source |", "|---|---|---|",
           f"| alpha (per-call latency), pooled | {model.alpha_s * 1e3:.3f} ms | least squares, {model.n_points} fp32 "
           f"points of every collective |",
           f"| eta (link efficiency), pooled | {model.eta:.3f} | the same |"]
    for op, (alpha, eta, n) in sorted(model.links.items()):
        use = ("every compressed collective (encoded bytes travel as p2p), DDP steps and the projection too"
               if op == "all_reduce" else f"uncompressed {op}")
        out.append(f"| {op}: alpha, eta | {alpha * 1e3:.3f} ms, {eta:.3f} | least squares, its own {n} fp32 points "
                   f"(used for {use}) |")
    for name, c in sorted(model.codecs.items()):
        out.append(f"| {name}: encode / decode throughput, wire bits/elem | {c.encode_Bps / 1e9:.3f} / "
                   f"{c.decode_Bps / 1e9:.3f} GB/s (fp32 bytes), {model.bits.get(name, math.nan):g} b | {c.source} |")
    out += ["", "### Validation against the measured points", "", "| point | measured s | predicted s | rel. error |",
            "|---|---|---|---|"] + [f"| {r.point} | {r.measured_s:.4f} | {r.predicted_s:.4f} | "
                                    f"{100 * r.rel_err:+.1f}% |" for r in validation.rows] + [""]
    for kind, title in (("collective", "collectives"), ("ddp", "DDP steps"), (None, "all points")):
        if (s := validation.summary(kind))["n"]:
            out.append(f"- {title} ({s['n']} points): median |error| {100 * s['median']:.1f}%, "
                       f"max {100 * s['max']:.1f}%")
    rates = sorted({r["rate_gbit"] for r in projection.rows})
    out += ["", "### Projected speedups (cell: all-reduce speedup / DP-step speedup)", ""]
    keys = sorted({(r["params"], r["baseline"], r["codec"]) for r in projection.rows},
                  key=lambda k: (k[0], k[1] != "bf16", k[2]))
    for N, b, c in keys:
        sel = [r for r in projection.rows if (r["params"], r["baseline"], r["codec"]) == (N, b, c)]
        out += [f"**{N / 1e9:g}B params, {c} vs {b} gradient all-reduce** (compute/step "
                f"{sel[0]['t_compute']:.3f} s)", "", "| GPUs | " + " | ".join(f"{g:g} Gbit/s" for g in rates) + " |",
                "|---" * (len(rates) + 1) + "|"]
        for p in sorted({r["world"] for r in sel}):
            cells = {r["rate_gbit"]: r for r in sel if r["world"] == p}
            out.append(f"| {p} | " + " | ".join(f"{cells[g]['coll_speedup']:.2f}x / {cells[g]['step_speedup']:.2f}x"
                                                  for g in rates) + " |")
        out.append("")
    out += ["### Assumptions", ""] + [f"- {a}" for a in projection.assumptions] + [
        "- Calibration: alpha and eta from the fp32 points only, per collective where it has two or more sizes or "
        "rates (gloo's reduce-scatter and all-gather use less of the link than its all-reduce: one pooled fit "
        "over-predicted every all-reduce by 8-11%); compressed collectives use the all-reduce link (their bytes "
        "travel as direction-split p2p, not through gloo's reduce-scatter / all-gather); codec throughput as measured single-threaded "
        "on this CPU (codec_throughput) or fitted (one throughput per codec, encode = decode) when absent.",
        "- DDP step: T_backward = 2/3 of the no_communication floor; overlap o = 1 for DDP fp32/fp16/bf16 and "
        "the megacomp hook, 0 for PowerSGD (one bucket); PowerSGD matmuls/QR, casts and CPU contention between "
        "codec and backward are not costed; ZeRO's parameter broadcast is exposed."]
    return "\n".join(out) + "\n"


def plot(projection: Projection, path: str, codec: str = "int4", baseline: str = "bf16") -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = sorted({r["params"] for r in projection.rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, N in zip(axes[0], sizes):
        sel = [r for r in projection.rows if r["params"] == N and r["codec"] == codec and r["baseline"] == baseline]
        for p in sorted({r["world"] for r in sel}):
            pts = sorted((r["rate_gbit"], r["coll_speedup"], r["step_speedup"]) for r in sel if r["world"] == p)
            line, = ax.plot([q[0] for q in pts], [q[1] for q in pts], marker="o", label=f"{p} GPUs all-reduce")
            ax.plot([q[0] for q in pts], [q[2] for q in pts], marker="s", ls="--", color=line.get_color(),
                    label=f"{p} GPUs DP step")
        ax.set(xscale="log", xlabel="link rate (Gbit/s)", ylabel=f"projected speedup, {codec} vs {baseline}",
               title=f"{N / 1e9:g}B params")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("alpha-beta model projection (GPU codec throughput and latency assumed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", help="JSON written by benchmarks/bench_report.py")
    ap.add_argument("--validate-all", metavar="DIR", help="fit and validate on every shaped-link study under DIR "
                    "(benchmarks/results) and write calibration.md and calibration.json to --out-dir")
    ap.add_argument("--out-dir", default="benchmarks/results/plan", help="folder for --validate-all's page")
    ap.add_argument("--out", help="write the Markdown section here (default: stdout)")
    ap.add_argument("--plot", help="PNG of projected speedup vs link rate per cluster size")
    ap.add_argument("--refit-codecs", action="store_true", help="fit codec throughput even when measured")
    ap.add_argument("--gpu-codec-Bps", type=float, default=2.0e12, help="ASSUMED GPU codec throughput")
    ap.add_argument("--alpha-us", type=float, default=10.0, help="ASSUMED cluster per-hop latency (us)")
    ap.add_argument("--tokens-per-gpu", type=int, default=16384)
    ap.add_argument("--tflops", type=float, default=400.0, help="ASSUMED achieved TFLOP/s per GPU")
    a = ap.parse_args(argv)
    if a.validate_all:
        model, o, kappa, v, notes, extra = validate_all(a.validate_all)
        out = Path(a.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        bench = json.loads((Path(a.validate_all) / "benchmarks" / "results.json").read_text())
        mach = benchmark_machine(bench["ddp"], float(bench["codec_throughput"]["memcpy"]["encode_Bps"]))
        (out / "calibration.md").write_text(validation_markdown(model, o, kappa, v, notes, mach, extra))
        (out / "calibration.json").write_text(json.dumps({
            "overlap": o, "contention": kappa, "links": model.links,
            "rows": [dict(kind=r.kind, point=r.point, held_out=r.held_out, measured_s=r.measured_s,
                          predicted_s=r.predicted_s) for r in v.rows]}, indent=1))
        for kind in ("collective", "ddp", "train", "local_steps"):
            sm = v.summary(kind, True)
            print(f"{kind}: held out {sm['n']} points, median |error| {100 * sm['median']:.1f}%, max {100 * sm['max']:.1f}%")
        from megacomp.plan import published
        table = published.rows()
        (out / "published.md").write_text(
            "# The step model against published runs\n\nGenerated by `python -m benchmarks.perf_model --validate-all "
            "benchmarks/results --out-dir benchmarks/results/plan` (megacomp.plan.published: every input and source "
            "is in the row).\n\n" + published.markdown(table))
        print(f"published runs: {sum(r.within for r in table)} of {len(table)} within 10 points / 20%")
        print(f"wrote {out / 'calibration.md'} and {out / 'published.md'}")
        return
    if not a.results:
        ap.error("give a results JSON or --validate-all DIR")
    results = json.loads(Path(a.results).read_text())
    model = fit(results, refit_codecs=a.refit_codecs)
    proj = project(model, alpha_s=a.alpha_us * 1e-6, gpu_codec_Bps=a.gpu_codec_Bps,
                   tokens_per_gpu=a.tokens_per_gpu, flops=a.tflops * 1e12)
    text = markdown(model, validate(model, results), proj)
    print(f"note: projections ASSUME GPU codec throughput {a.gpu_codec_Bps:.3g} B/s and per-hop latency "
          f"{a.alpha_us:g} us (not measured here)")
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)
    if a.plot:
        print(f"plot: {a.plot}" if plot(proj, a.plot) else "plot skipped: matplotlib not installed")


if __name__ == "__main__":
    main()

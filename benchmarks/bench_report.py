"""One command for the whole bandwidth-limited performance report.

    python -m benchmarks.bench_report --iters 80 --out benchmarks/results/benchmarks   # benchmarks/results/benchmarks: ~23 min on the 2-core dev machine
    python -m benchmarks.bench_report --quick --out /tmp/report       # smoke run, ~4 min
    python -m benchmarks.bench_report --from-results --out benchmarks/results/benchmarks   # no measurement: redraw from results.json

Runs, over shaped veth links between two network namespaces (benchmarks/netns_bench.py; root needed):
  1. codec throughput on this CPU (one thread, preallocated buffers): the compute side of every codec;
  2. collectives: all-reduce of 4-100 MiB, reduce-scatter and all-gather of 25 MiB, per codec and link
     rate, against the fp32 collective and the ideal time (wire bytes / link rate);
  3. a DP training step of a small GPT under torch DDP (fp32, fp16/bf16 hooks, PowerSGD ranks 1 and 4),
     ZeroRedundancyOptimizer, megacomp's int4+LoCo DDP hook and a no-communication floor, per link rate:
     step times, wire bytes, loss after the same iterations, and loss against wall time;
  4. megacomp pretraining steps across the link: its ZeRO-1 optimizer (DP 2, the DDP workload's GPT:
     uncompressed, int4+LoCo gradients, plus int8 parameter gathers) and tensor and pipeline parallelism;
  5. the alpha-beta model (benchmarks/perf_model.py) fitted to these measurements, its validation error
     against them, and its projection to larger clusters.
Writes ``results.json`` (every measurement: one record per line, with the run's command, date and commit),
and, drawn from it alone, ``report.md`` and PNG plots into ``--out``; ``--from-results`` redraws them from
an existing results.json. Every number is a median over repeats (or iterations) with its min-max spread;
nothing is asserted.
"""
from __future__ import annotations

import argparse
import atexit
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks import invocation
from benchmarks import netns_bench as nb
from benchmarks.plot_metrics import dump_results

CODEC_SPECS = ("int8", "int4", "fp8_e4m3", "bf16")


def codec_throughput(numel: int, repeats: int) -> dict:
    """Encode/decode GB/s (fp32 input bytes per second) per codec on one thread, into reused buffers."""
    import torch

    from megacomp.compression import make_codec

    torch.set_num_threads(1)
    x = torch.randn(numel)
    out, res = torch.empty(numel), {}
    copy = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out.copy_(x)
        copy.append(time.perf_counter() - t0)
    res["memcpy"] = {"encode_Bps": 4 * numel / statistics.median(copy), "decode_Bps": 4 * numel / statistics.median(copy)}
    for name in CODEC_SPECS:
        codec = make_codec(name)
        buf = codec.encode_flat(x)
        enc, dec = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            codec.encode_flat(x, out=buf) if codec.format.scaled else codec.encode_flat(x)
            enc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            codec.decode_flat(buf, numel, out=out)
            dec.append(time.perf_counter() - t0)
        res[name] = {"encode_Bps": 4 * numel / statistics.median(enc), "decode_Bps": 4 * numel / statistics.median(dec)}
    return res


def throughput_section(tp: dict, numel: int, measured: str, note: str = "") -> list[str]:
    lines = [f"## Codec throughput on this CPU (one thread, {numel / 1e6:.0f}M fp32 elements, reused buffers)", "",
             f"Measured {measured}, with that code's kernels; the alpha-beta model below uses these numbers. "
             "The kernels' own CPU benchmark and its latest table: `megacomp/kernels/README.md` (Speed)." + (f" {note}" if note else ""),
             "", "| codec | encode GB/s | decode GB/s | encode / memcpy |", "|---|---|---|---|"]
    mem = tp["memcpy"]["encode_Bps"]
    for name, r in tp.items():
        lines.append(f"| {name} | {r['encode_Bps'] / 1e9:.2f} | {r['decode_Bps'] / 1e9:.2f} | {r['encode_Bps'] / mem:.2f} |")
    return lines + [""]


def summary(records: dict) -> list[str]:
    """The acceptance figures (the targets the report is judged by), read off the measurements (never asserted)."""
    lines = ["## Summary", ""]
    ar = [r for r in records["collectives"] if r["op"] == "all_reduce"]
    for r in ar:
        if r["codec"] != "int4" or r["mib"] < 25:
            continue
        base = next(b for b in ar if b["rate"] == r["rate"] and b["mib"] == r["mib"] and b["codec"] == "none")
        speedup = statistics.median(base["times_s"]) / statistics.median(r["times_s"])
        ideal = base["wire_bytes"] / r["wire_bytes"]
        lines.append(f"- int4 all-reduce, {r['mib']:g} MiB at {r['rate']}: {speedup:.2f}x over fp32, "
                     f"{speedup / ideal:.0%} of the ideal {ideal:.2f}x.")
    for rate in dict.fromkeys(r["rate"] for r in records["ddp"]):
        rows = {r["method"]: r for r in records["ddp"] if r["rate"] == rate}
        if "megacomp_hook_int4_loco" not in rows or "ddp_fp32" not in rows:
            continue
        ours = rows["megacomp_hook_int4_loco"]
        med = statistics.median(ours["times_s"])
        cmp = ", ".join(f"{m} {statistics.median(r['times_s']):.3f} s" for m, r in rows.items()
                        if m != "megacomp_hook_int4_loco")
        loss = (ours["loss"] / rows["ddp_fp32"]["loss"] - 1) * 100
        lines.append(f"- DP step at {rate}: megacomp int4+LoCo hook {med:.3f} s/step vs {cmp}; its loss after "
                     f"{len(ours['losses'])} iterations is {loss:+.2f}% vs DDP fp32.")
        if "no_communication" in rows:  # where the time goes: compute floor + what communication adds
            floor = statistics.median(rows["no_communication"]["times_s"])
            link = ours["wire_bytes_per_step"] / ours["rate_Bps"]
            parts = [f"{m}: +{statistics.median(r['times_s']) - floor:.3f} s" for m, r in rows.items()
                     if m != "no_communication"]
            lines.append(f"  Where the time goes at {rate}: compute floor (no communication) {floor:.3f} s; "
                         f"megacomp's {ours['wire_bytes_per_step'] / 1e6:.2f} MB/step take {link:.3f} s of link "
                         f"time; its step is {med - floor:+.3f} s above the floor (the transfer not hidden behind "
                         f"backward, plus encode/decode and error-feedback work on the rank's one core). Added to "
                         f"the floor: {'; '.join(parts)}.")
    return lines + [""]


def time_to_loss(records: dict, window: int = 10) -> list[str]:
    """Wall time until a method's running-mean loss (``window`` iterations) first reaches the loss DDP fp32
    ends with (mean of its last ``window`` iterations): speed and convergence in one number."""
    lines = []
    for rate in dict.fromkeys(r["rate"] for r in records["ddp"]):
        rows = [r for r in records["ddp"] if r["rate"] == rate and r["method"] != "no_communication"]
        base = next((r for r in rows if r["method"] == "ddp_fp32"), None)
        if base is None or len(base["losses"]) < 2 * window:
            continue
        target = statistics.mean(base["losses"][-window:])
        if not lines:
            lines = [f"## Time to reach DDP fp32's final loss (running mean over {window} iterations)", "",
                     "| link | method | target loss | iterations | wall time s | vs DDP fp32 |", "|---|---|---|---|---|---|"]
        base_t = None
        for r in rows:
            wall, hit = 0.0, None
            for i, t in enumerate(r["all_times_s"]):
                wall += t
                if i + 1 >= window and statistics.mean(r["losses"][i + 1 - window:i + 1]) <= target:
                    hit = (i + 1, wall)
                    break
            if r["method"] == "ddp_fp32" and hit:
                base_t = hit[1]
            speed = f"{base_t / hit[1]:.2f}x" if hit and base_t else "-"
            lines.append(f"| {rate} | {r['method']} | {target:.4f} | {hit[0] if hit else 'not reached'} | "
                         f"{f'{hit[1]:.1f}' if hit else '-'} | {speed} |")
    return lines + [""] if lines else []


def plots(records: dict, out: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["(matplotlib not installed: no plots)", ""]
    made = []
    ar = [r for r in records["collectives"] if r["op"] == "all_reduce"]
    sizes = sorted({r["mib"] for r in ar})
    if ar:
        fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 3.8), squeeze=False)
        for ax, mib in zip(axes[0], sizes):
            for codec in dict.fromkeys(r["codec"] for r in ar):
                pts = sorted((r["rate_Bps"] * 8 / 1e6, statistics.median(r["times_s"]) * 1e3) for r in ar
                             if r["mib"] == mib and r["codec"] == codec)
                ax.plot(*zip(*pts), marker="o", label=codec)
            ideal = sorted((r["rate_Bps"] * 8 / 1e6, r["wire_bytes"] / r["rate_Bps"] * 1e3) for r in ar
                           if r["mib"] == mib and r["codec"] == "int4")
            if ideal:
                ax.plot(*zip(*ideal), ls=":", color="k", label="int4 ideal")
            ax.set(xscale="log", yscale="log", xlabel="link rate (Mbit/s)", ylabel="all-reduce time (ms)",
                   title=f"{mib:g} MiB, 2 ranks")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "allreduce_time_vs_rate.png", dpi=110)
        plt.close(fig)
        made.append("![all-reduce time vs link rate](allreduce_time_vs_rate.png)")
    rates = list(dict.fromkeys(r["rate"] for r in records["ddp"]))
    if rates:
        fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4), squeeze=False)
        for ax, rate in zip(axes[0], rates):
            for r in records["ddp"]:
                if r["rate"] != rate or r["method"] == "no_communication":
                    continue
                wall, acc = [], 0.0
                for t in r["all_times_s"]:
                    acc += t
                    wall.append(acc)
                ax.plot(wall, r["losses"], label=r["method"], lw=1)
            ax.set(xlabel="wall time (s)", ylabel="training loss", title=f"DP 2 at {rate}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "ddp_loss_vs_wall_time.png", dpi=110)
        plt.close(fig)
        made.append("![loss vs wall time](ddp_loss_vs_wall_time.png)")
    return made + [""]


def model_section(records: dict, out: Path) -> list[str]:
    try:
        from benchmarks import perf_model
    except ImportError as e:
        return [f"(alpha-beta model unavailable: {e})", ""]
    model = perf_model.fit(records)
    projection = perf_model.project(model)
    text = perf_model.markdown(model, perf_model.validate(model, records), projection)
    try:
        if perf_model.plot(projection, out / "projection.png"):
            text += "\n\n![projected speedups](projection.png)\n"
    except Exception as e:  # a plot problem must not lose the measurements
        text += f"\n\n(projection plot failed: {e})\n"
    return [text, ""]


def render(records: dict, out: Path, regenerate: str) -> list[str]:
    """report.md's lines (and the plots), from a results.json object alone."""
    meta = records["meta"]
    header = ["# Bandwidth-limited benchmark report", "",
              f"Produced by one command: `{meta['command']}` ({meta['elapsed_s']:.0f} s). Two ranks, one per network "
              "namespace, joined by a veth pair shaped with `tc tbf` (burst 1mbit) on both ends; gloo over TCP; "
              "one thread per rank on a 2-core machine. Times are medians over repeats (collectives) or "
              "iterations 3.. (training) with min-max spread; ideal = wire bytes / link rate. Raw numbers: "
              f"`results.json`; this page and its plots are regenerated from it (no measurement) by `{regenerate}`.", ""]
    sections = throughput_section(records["codec_throughput"], meta["codec_throughput_numel"], meta["measured"],
                                  meta.get("notes", {}).get("codec_throughput", ""))
    sections += nb.tables("collectives", records["collectives"])
    if records["ddp"]:
        sections += nb.tables("ddp", records["ddp"])
    sections += nb.tables("train", records["train"])
    return (header + summary(records) + time_to_loss(records) + plots(records, out) + sections
            + model_section(records, out))


def _measured() -> str:
    """Today's date and the checkout's commit, for the report."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True).stdout.strip()
        where = f"commit {commit}{' with local changes' if dirty else ''}"
    except (OSError, subprocess.CalledProcessError):
        where = "an unknown commit"
    return f"on {time.strftime('%Y-%m-%d')} at {where}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/report")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke test of the pipeline)")
    p.add_argument("--collective-rates", default="100mbit,300mbit,1gbit")
    p.add_argument("--ddp-rates", default="100mbit,1gbit")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=60, help="DP training iterations per method (loss vs wall time)")
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--from-results", action="store_true",
                   help="no measurement: redraw report.md and the plots from --out/results.json")
    args = p.parse_args()
    out = Path(args.out)
    regenerate = f"python -m benchmarks.bench_report --from-results --out {args.out}"
    if args.from_results:
        records = json.loads((out / "results.json").read_text())
    else:
        records = measure(args, out)
    body = render(records, out, regenerate)
    (out / "report.md").write_text("\n".join(body) + "\n")
    print("\n".join(body))


def measure(args, out: Path) -> dict:
    """Run every workload; writes and returns results.json's object."""
    out.mkdir(parents=True, exist_ok=True)
    atexit.register(nb.teardown)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    t0 = time.time()
    q = args.quick
    common = dict(port=args.port, timeout=1800, model_args=[], config="configs/gpt_tiny.yaml")
    numel = (1 << 22) if q else (1 << 24)
    records: dict = {"meta": {"command": "python " + " ".join(invocation()), "measured": _measured(),
                              "codec_throughput_numel": numel},
                     "codec_throughput": codec_throughput(numel, 3 if q else 7), "collectives": [], "ddp": [], "train": []}
    try:
        nb.bench_collectives(SimpleNamespace(
            **common, rates="1gbit" if q else args.collective_rates, mib="4" if q else "4,25,100",
            codecs="none,bf16,int8,int4", repeats=2 if q else args.repeats, ops="all_reduce"), records["collectives"])
        nb.bench_collectives(SimpleNamespace(
            **common, rates="1gbit" if q else "100mbit,1gbit", mib="4" if q else "25", codecs="none,int8,int4",
            repeats=2 if q else args.repeats, ops="reduce_scatter,all_gather"), records["collectives"])
        nb.bench_ddp(SimpleNamespace(
            **common, rates="1gbit" if q else args.ddp_rates, methods=",".join(nb.DDP_METHODS),
            iters=6 if q else args.iters, hidden=256, layers=4, bucket_mb=2.0), records["ddp"])
        ddp_model = ["--hidden-size", "256", "--num-layers", "4", "--num-attention-heads", "4", "--seq-length", "64",
                     "--vocab-size", "1024", "--lr-warmup-iters", "1"]  # the DDP workload's GPT, megacomp's ZeRO
        nb.bench_train(SimpleNamespace(
            **{**common, "model_args": ddp_model}, rates="1gbit" if q else args.ddp_rates, layout="dp2",
            compression="none,loco4,loco4_qwz", iters=5 if q else 12), records["train"])
        nb.bench_train(SimpleNamespace(
            **common, rates="1gbit" if q else "100mbit,1gbit", layout="tp2", compression="none,tp_fp8,all_int8",
            iters=5 if q else 12), records["train"])
        # the pipeline rows: PP 2 and the interleaved PP 2 x VP 2 on the DDP workload's GPT, none / int8 / AQ-SGD int4
        # (32 samples: iterations 1-2 are AQ-SGD's uncompressed first visits, which the median leaves out)
        nb.bench_train(SimpleNamespace(
            **{**common, "model_args": ddp_model}, rates="1gbit" if q else "100mbit,1gbit", layout="pp2,pp2vp2",
            compression="none,pp_int8,pp_aqsgd4", train_args="--micro-batch-size 4 --dataset-samples 32",
            iters=5 if q else 20), records["train"])
    finally:
        nb.teardown()
    records["meta"]["elapsed_s"] = time.time() - t0
    (out / "results.json").write_text(dump_results(records))
    return records


if __name__ == "__main__":
    main()

"""Local-step training over a shaped link: time to DDP fp32's final loss (the local-step methods over a slow link).

    python -m benchmarks.netns_local_steps --rates 100mbit,10mbit --iters 300

Two network namespaces joined by a tc-shaped veth pair (benchmarks/netns_bench.py: the same setup and teardown,
addresses only inside the namespaces it creates), one rank in each: the tiny GPT trained by
``python -m megacomp.pretrain`` with DP 2 across the link, per variant:

    DDP fp32                  every step all-reduces (reduce-scatters and all-gathers) fp32 gradients
    LoCo int4                 the same with the loco4 preset (int4 + LoCo on the DP gradients)
    PowerSGD r4+EF            the powersgd4 preset (rank-4 factors of every DP gradient matrix, error feedback)
    DeMo, SparseLoCo, DCT-DiLoCo   the structured methods with benchmarks/convergence.py's settings
    DiLoCo H=50 (+ int4+EF)   2 replicas (one rank each), one pseudo-gradient exchange every 50 steps
    Streaming DiLoCo          4 fragments at staggered steps, each overlapped with 5 inner steps, int4+EF

Reported per link rate and variant: mean iteration time over all iterations (warm-up included: local-step
methods pay their traffic in bursts, so a median would hide it), total training time, wire MB over the run,
the final loss (mean of the last 20 iterations), the time to DDP fp32's final loss at the same rate
(the first iteration whose 20-iteration running mean reaches it; "not reached" when none does within the
run), and the time to the highest final loss of the variants at that rate (a quality every variant reaches,
so the times compare at equal loss). Same seed and data order for every variant. ``netns_bench.py ddp`` measures
torch's PowerSGD hook and megacomp's on a torch-DDP loop.

Output: a Markdown table on stdout and in ``--out`` (default results/netns): ``local_steps.md`` and the
records it is drawn from, ``local_steps.json``; ``--from-results`` rewrites the Markdown without measuring.
Numbers are measured, never asserted.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import invocation
from benchmarks import netns_bench as nb  # namespaces, shaping, the two-rank runner
from benchmarks.plot_metrics import dump_results  # one line per record

TWO = ["--num-replicas", "2", "--outer-steps", "50"]
INT4_EF = ["--outer-codec", "int4", "--outer-error-feedback", "ef"]
VARIANTS = {
    "DDP fp32": ["--compression", "none"],
    "LoCo int4": ["--compression", "loco4"],
    "PowerSGD r4+EF": ["--compression", "powersgd4"],
    "DiLoCo H=50": ["--compression", "none", "--outer-algorithm", "diloco", *TWO],
    "DiLoCo H=50 int4+EF outer": ["--compression", "none", "--outer-algorithm", "diloco", *TWO, *INT4_EF],
    "Streaming DiLoCo H=50 P=4 tau=5 int4+EF": ["--compression", "none", "--outer-algorithm", "streaming_diloco",
                                                 *TWO, "--outer-fragments", "4", "--outer-delay", "5", *INT4_EF],
    # the structured methods, at convergence.py's settings
    "DeMo lr 6e-3 top-32": ["--compression", "none", "--optimizer", "demo", "--lr", "6e-3", "--min-lr", "6e-4"],
    "SparseLoCo H=50": ["--compression", "none", "--outer-algorithm", "sparseloco", *TWO],
    "DCT-DiLoCo H=50": ["--compression", "none", "--outer-algorithm", "sparseloco", *TWO,
                        "--outer-codec", "{name: bf16, transform: dct, chunk: 64, k: 4}"],
}
WINDOW = 20  # iterations of the running mean that decides the final loss and the time to target


def time_to(losses: list[float], times: list[float], target: float):
    """Seconds until the running mean of the loss first reaches ``target`` (None: never)."""
    return nb.time_to(losses, times, target, WINDOW)


def table(records: list[dict]) -> list[str]:
    first = records[0]
    lines = [f"## Local-step training over a shaped link (DP 2, one rank per namespace; {first['config']}, "
             f"{first['iters']} iterations, global batch 16)", "",
             "| link | variant | mean iteration s | total s | wire MB (run) | final loss | time to DDP fp32's final loss "
             "| time to the highest final loss (every variant reaches it) |",
             "|---|---|---|---|---|---|---|---|"]
    for rate in dict.fromkeys(r["rate"] for r in records):
        rows = [r for r in records if r["rate"] == rate]
        base = next((r for r in rows if r["variant"] == "DDP fp32"), None)
        target = nb.running_mean(base["losses"], WINDOW)[-1] if base else None
        common = max(nb.running_mean(r["losses"], WINDOW)[-1] for r in rows)
        for r in rows:
            final = nb.running_mean(r["losses"], WINDOW)[-1]
            reach = time_to(r["losses"], r["times_s"], target) if target is not None else None
            reach_s = "n/a" if target is None else (f"{reach:.1f} s" if reach is not None else "not reached")
            total = sum(r["times_s"])
            lines.append(f"| {rate} | {r['variant']} | {total / len(r['times_s']):.3f} | {total:.1f} | "
                         f"{r['wire_bytes'] / 1e6:.1f} | {final:.4f} | {reach_s} | "
                         f"{time_to(r['losses'], r['times_s'], common):.1f} s ({common:.4f}) |")
    return lines + ["", f"Final loss: mean of the last {WINDOW} iterations; the target is DDP fp32's at the same "
                        f"rate. Wire MB: every rank's bytes over every iteration, warm-up included."]


def markdown(results: dict, out: str) -> list[str]:
    return ["# netns benchmark: local-step training", "", f"Command: `{results['command']}` "
            f"({results['elapsed_s']:.0f} s; tbf burst 1mbit on both veth ends)", "",
            f"Raw numbers: `local_steps.json`; this page is regenerated from them by "
            f"`python -m benchmarks.netns_local_steps --from-results --out {out}`.", "", *table(results["records"])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,10mbit")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    p.add_argument("--config", default="configs/gpt_tiny.yaml")
    p.add_argument("--port", type=int, default=29931)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default="results/netns")
    p.add_argument("--from-results", action="store_true", help="no measurement: rewrite local_steps.md")
    args = p.parse_args()
    out = Path(args.out)
    if args.from_results:
        lines = markdown(json.loads((out / "local_steps.json").read_text()), args.out)
        (out / "local_steps.md").write_text("\n".join(lines))
        print("\n".join(lines))
        return
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; pick from {list(VARIANTS)}")
    if os.geteuid() != 0:
        raise SystemExit("network namespaces and tc need root (CAP_NET_ADMIN)")
    atexit.register(nb.teardown)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    t0, records = time.time(), []
    try:
        for rate in args.rates.split(","):
            nb.setup(rate)
            for name in names:
                with tempfile.TemporaryDirectory() as log_dir:
                    nb.run_pair([sys.executable, "-m", "megacomp.pretrain", "--config", args.config, "--train-iters",
                                 str(args.iters), "--log-dir", log_dir, "--log-interval", "1", "--global-batch-size",
                                 "16", "--micro-batch-size", "8", *VARIANTS[name]], args.port, args.timeout)
                    recs = [json.loads(x) for x in Path(log_dir, "metrics.jsonl").read_text().splitlines()]
                records.append({"rate": rate, "variant": name, "config": args.config, "iters": args.iters,
                                "times_s": [r["iteration_time_s"] for r in recs], "losses": [r["loss"] for r in recs],
                                "wire_bytes": sum(r["wire_bytes"] for r in recs)})
                print(table(records)[-3], flush=True)
    finally:
        nb.teardown()
    results = {"command": f"python {' '.join(invocation())}", "elapsed_s": time.time() - t0, "records": records}
    out.mkdir(parents=True, exist_ok=True)
    (out / "local_steps.json").write_text(dump_results(results))
    lines = markdown(results, args.out)
    (out / "local_steps.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

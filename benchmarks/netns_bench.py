"""Benchmarks over a bandwidth-limited link between two network namespaces (one rank in each).

    python -m benchmarks.netns_bench collectives --rates 1gbit,100mbit --mib 25,100
    python -m benchmarks.netns_bench train --rates 100mbit --iters 20 --compression none,loco4,dp_int8

Creates two namespaces joined by a veth pair whose both ends are shaped with ``tc tbf`` (netem is not
available here; burst 1mbit, as research/platform.md §2 found smaller bursts cost CPU and rate), runs
rank 0 in the first and rank 1 in the second (gloo over the veth, GLOO_SOCKET_IFNAME set), and always
tears everything down, also on Ctrl-C or failure. Only addresses inside the namespaces it creates
(192.168.231.0/24) are used. TCP slow start after idle is turned off inside the namespaces (a standard
setting for links with a large bandwidth-delay product), since collectives are bursts between compute.

``collectives``: fp32 vs compressed all-reduce per size and codec: median time over repeats, wire bytes
(comm.stats), the ideal time = wire bytes / link rate, the measured speedup over fp32 and the fraction
of the ideal speedup (ideal speedup = fp32 wire bytes / compressed wire bytes).
``train``: ``python -m megacomp.pretrain`` on the tiny GPT, DP 2 across the link, per compression preset:
median iteration time (first 2 iterations excluded), wire MB per iteration, final loss.
``ddp``: the same GPT code (TP 1, larger by default) under torch DDP with fp32 all-reduce, the fp16 and
bf16 compress hooks, PowerSGD ranks 1 and 4 (one bucket: torch's hook breaks with several on gloo),
ZeroRedundancyOptimizer, and megacomp's int4 + LoCo DDP hook, plus a no-communication floor (buckets
not averaged): median step time, wire bytes per step (measured for megacomp, from the algorithms'
byte counts for torch's), the loss after the same iterations.
``profile``: the ``ddp`` workload's runs (``--methods``) with megacomp.comm.spans recorded: per method, rank 0's
milliseconds per step in compute, codec work, waiting for the wire and the optimizer on the main thread, what ran
in background threads, and the phase that bounds the step.
``--ops`` picks the collectives (all_reduce, reduce_scatter, all_gather). benchmarks/bench_report.py runs
all workloads and writes the report.
Output: Markdown tables on stdout and in ``--out`` (default results/netns): ``<workload>.md`` and the
measurements it is drawn from, ``<workload>.json`` (one record per line); ``--from-results`` rewrites the
Markdown from the JSON without measuring. Numbers are measured, never asserted; medians with min-max spread.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks import invocation
from benchmarks.netns_dp_worker import DDP_METHODS, LOW_RANK_METHODS, ONEBIT_METHODS, SHARDED_METHODS
from benchmarks.plot_metrics import dump_results

NS = ("mcbenchA", "mcbenchB")
DEV = ("mcvA", "mcvB")
ADDR = ("192.168.231.1", "192.168.231.2")
RATE_BPS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}


def sh(cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, shell=True, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def teardown() -> None:
    for ns in NS:
        sh(f"ip netns del {ns}", check=False)  # deleting a namespace destroys its veth end and qdisc


def setup(rate: str) -> None:
    teardown()
    sh(f"ip netns add {NS[0]} && ip netns add {NS[1]}")
    sh(f"ip link add {DEV[0]} type veth peer name {DEV[1]}")
    for ns, dev, addr in zip(NS, DEV, ADDR):
        sh(f"ip link set {dev} netns {ns}")
        sh(f"ip -n {ns} addr add {addr}/24 dev {dev}")
        sh(f"ip -n {ns} link set lo up && ip -n {ns} link set {dev} up")
        sh(f"ip netns exec {ns} tc qdisc add dev {dev} root tbf rate {rate} burst 1mbit latency 50ms")
        # collectives are bursts separated by compute: keep TCP's window across the idle gaps, as one
        # would on a WAN link (Linux otherwise restarts slow start after every idle period)
        sh(f"ip netns exec {ns} sysctl -qw net.ipv4.tcp_slow_start_after_idle=0")


def rate_bytes_per_s(rate: str) -> float:
    for unit, mult in RATE_BPS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * mult / 8
    raise ValueError(f"rate must end in gbit/mbit/kbit, got {rate!r}")


_runs = 0


def run_pair(argv: list[str], port: int, timeout: float) -> list[str]:
    """Run ``argv`` as rank 0 in namespace A and rank 1 in namespace B; return both stdouts. Every run
    gets its own rendezvous port (no reuse of a port the previous run's sockets may still hold)."""
    global _runs
    port, _runs = port + _runs, _runs + 1
    procs = []
    for rank, (ns, dev) in enumerate(zip(NS, DEV)):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": ADDR[0],
               "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": dev, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"timed out after {timeout} s: {' '.join(argv)}")
        if p.returncode:
            for q in procs:
                q.kill()
            raise SystemExit(f"rank failed ({p.returncode}): {' '.join(argv)}\n{out[-3000:]}")
        outs.append(out)
    return outs


# -- workload run inside the namespaces (python -m benchmarks.netns_bench _collective ...) ------------------
OPS = ("all_reduce", "reduce_scatter", "all_gather")


def collective_worker(mib: float, codecs: list[str], repeats: int, op: str = "all_reduce") -> None:
    """Time ``op`` of ``mib`` MiB of fp32 (the full tensor; reduce-scatter output / all-gather input is
    1/world of it) per codec; every repeat's time is the slowest rank's."""
    import torch
    import torch.distributed as dist

    from megacomp import comm
    from megacomp.launch import init_distributed

    torch.set_num_threads(1)
    init_distributed()
    world = dist.get_world_size()
    n = int(mib * (1 << 20)) // 4 // world * world
    x = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    shard = torch.empty(n // world)
    results = {}
    for name in codecs:
        codec = None if name == "none" else name
        times = []
        for i in range(repeats + 1):
            t = x.clone()
            comm.reset_stats()
            dist.barrier()
            t0 = time.perf_counter()
            if op == "all_reduce":
                comm.all_reduce(t, codec=codec, tag="bench", validate=False)
            elif op == "reduce_scatter":
                comm.reduce_scatter_tensor(shard, t, codec=codec, tag="bench", validate=False)
            else:
                comm.all_gather_into_tensor(t, x[:n // world], codec=codec, tag="bench", validate=False)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i:
                times.append(dt.item())
        s = comm.stats()["bench"]
        results[name] = {"times": times, "wire": s.wire_bytes, "raw": s.uncompressed_bytes}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results))
    dist.destroy_process_group()



def median_spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(xs) * scale)} ({fmt.format(min(xs) * scale)}-{fmt.format(max(xs) * scale)})"


def running_mean(xs: list[float], n: int) -> list[float]:
    """Mean of the last ``n`` values at each position (fewer at the start): one iteration's loss is one
    batch's, too noisy to compare."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def time_to(losses: list[float], times: list[float], target: float, window: int) -> Optional[float]:
    """Seconds (the measured iteration times, summed) until the ``window``-iteration running mean of the loss
    first reaches ``target`` (None: never within the run)."""
    elapsed = 0.0
    for loss, t in zip(running_mean(losses, window), times):
        elapsed += t
        if loss <= target:
            return elapsed
    return None


TIME_TO_WINDOW = 5  # iterations of the running mean in the DP-step table's time to DDP fp32's loss


def _seconds_to(record: dict, target: Optional[float]) -> str:
    """The DP-step table's cell: :func:`time_to` DDP fp32's smoothed final loss on the same link."""
    if target is None:
        return "-"
    t = time_to(record["losses"], record["all_times_s"], target, TIME_TO_WINDOW)
    return "not reached" if t is None else f"{t:.1f}"


def ddp_table(records: list[dict]) -> list[str]:
    """The DP-step table of ``bench_ddp``'s records (in run order; hidden, layers, bucket_mb from the first)."""
    first = records[0]
    lines = [f"## DP training step: torch DDP, its comm hooks, ZeroRedundancyOptimizer, megacomp's hook and sharded optimizer (ZeRO-1, ACCO, DPU) (GPT "
             f"h={first['hidden']}, {first['layers']} layers, DP 2 across the link, {len(first['all_times_s'])} "
             f"iterations, DDP buckets {first['bucket_mb']:g} MB; torch's PowerSGD one bucket)", "",
             "| link | method | median step s (min-max), iterations 3.. | speedup vs DDP fp32 | x no-communication step | "
             f"wire MB/step/rank | loss at iteration {len(first['all_times_s'])} | s to DDP fp32's final loss |",
             "|---|---|---|---|---|---|---|---|"]
    floors = {(r["rate"], r.get("seed")): statistics.median(r["times_s"]) for r in records
              if r["method"] == "no_communication"}
    base, rate, target = None, None, None
    for r in records:
        key = (r["rate"], r.get("seed"))
        if key != rate:
            base, rate, target = None, key, None
        med = statistics.median(r["times_s"])
        if r["method"] == "ddp_fp32":
            base, target = med, running_mean(r["losses"], TIME_TO_WINDOW)[-1]
        speed = f"{base / med:.2f}x" if base else "-"
        floor = f"{med / floors[key]:.2f}" if key in floors else "-"
        name = r["method"] + (f" (seed {r['seed']})" if "seed" in r else "")
        lines.append(f"| {r['rate']} | {name} | {median_spread(r['times_s'])} | {speed} | {floor} | "
                     f"{r['wire_bytes_per_step'] / 1e6:.2f} | {r['losses'][-1]:.4f} | {_seconds_to(r, target)} |")
    if any("seed" in r for r in records):
        lines += [""] + seeds_table(records)
    return lines + [""]


def seeds_table(records: list[dict]) -> list[str]:
    """Over seeds, per link and method: the median step (the median of the seeds' medians, min-max of them), its
    ratio to the no-communication step of the same seed, the loss at the last iteration (mean ± std) and its gap to
    DDP fp32's of the same seed, and the seconds to DDP fp32's final loss (per seed)."""
    lines = ["### Over seeds", "", "| link | method | seeds | median step s (seeds' min-max) | x no-communication | "
             "loss at last iteration, mean ± std | vs DDP fp32, paired mean ± std | s to DDP fp32's final loss, per "
             "seed |", "|---|---|---|---|---|---|---|---|"]
    by = {(r["rate"], r["method"], r.get("seed")): r for r in records}
    for rate in dict.fromkeys(r["rate"] for r in records):
        for method in dict.fromkeys(r["method"] for r in records if r["rate"] == rate):
            rows = [r for r in records if r["rate"] == rate and r["method"] == method]
            meds = [statistics.median(r["times_s"]) for r in rows]
            ratios, gaps, reach = [], [], []
            for r, med in zip(rows, meds):
                floor = by.get((rate, "no_communication", r.get("seed")))
                if floor:
                    ratios.append(med / statistics.median(floor["times_s"]))
                ddp = by.get((rate, "ddp_fp32", r.get("seed")))
                if ddp:
                    gaps.append((r["loss"] / ddp["loss"] - 1) * 100)
                    reach.append(_seconds_to(r, running_mean(ddp["losses"], TIME_TO_WINDOW)[-1]))
            sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
            losses = [r["loss"] for r in rows]
            lines.append(f"| {rate} | {method} | {len(rows)} | {statistics.median(meds):.3f} ({min(meds):.3f}-"
                         f"{max(meds):.3f}) | {statistics.median(ratios):.2f} | " if ratios else
                         f"| {rate} | {method} | {len(rows)} | {statistics.median(meds):.3f} ({min(meds):.3f}-"
                         f"{max(meds):.3f}) | - | ")
            lines[-1] += (f"{statistics.mean(losses):.4f} ± {sd(losses):.4f} | "
                          + (f"{statistics.mean(gaps):+.2f}% ± {sd(gaps):.2f}% | " if gaps else "- | ")
                          + (", ".join(reach) if reach else "-") + " |")
    return lines


def bench_ddp(args, records: Optional[list] = None, profile: bool = False) -> list[str]:
    records = [] if records is None else records
    start = len(records)
    seeds = [int(x) for x in getattr(args, "seeds", "").split(",") if x] or [None]
    for rate in args.rates.split(","):
        setup(rate)
        for seed, method in [(sd, m) for sd in seeds for m in args.methods.split(",")]:
            out = run_pair([sys.executable, "-m", "benchmarks.netns_dp_worker", method, str(args.iters), str(args.hidden),
                            str(args.layers), str(args.bucket_mb), *(["profile"] if profile else []),
                            *([f"seed={seed}"] if seed is not None else []),
                            *(["flush_denormal"] if getattr(args, "flush_denormal", False) else [])],
                           args.port, args.timeout)[0]
            res = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
            records.append({"rate": rate, "rate_Bps": rate_bytes_per_s(rate), "method": method, "world": 2,
                            "params": res["params"], "hidden": args.hidden, "layers": args.layers,
                            "bucket_mb": args.bucket_mb, "times_s": res["times"][2:], "all_times_s": res["times"],
                            "losses": res["losses"], "loss": res["losses"][-1], "wire_bytes_per_step": res["wire"],
                            **({"seed": seed} if seed is not None else {}),
                            **({"flush_denormal": True} if res.get("flush_denormal") else {}),
                            **({"profile": res["profile"]} if profile else {})})
            print((profile_table if profile else ddp_table)(records[start:])[-2], flush=True)
    return (profile_table if profile else ddp_table)(records[start:])


PHASES = {"compute": ("forward_backward",), "codec": ("encode", "decode"),
          "wire wait": ("wire", "reduce_wait", "acco_wait"), "optimizer": ("update", "param_all_gather")}


def profile_table(records: list[dict]) -> list[str]:
    """Where a DP step's time goes, from megacomp.comm.spans (rank 0, exclusive times, mean per step, iterations 3..):
    the main thread's phases (what the step waits for), what ran in background threads (hidden unless the main
    thread waited for it: ``acco_wait``), and the phase that bounds the step."""
    first = records[0]
    lines = [f"## Profile of a DP step from measured spans (GPT h={first['hidden']}, {first['layers']} layers, DP 2 "
             f"across the link, rank 0, ms per step, iterations 3..{len(first['all_times_s'])})", "",
             "main thread: compute = forward + backward (under torch DDP also the reducer's waits, which it does not "
             "expose), codec = encode + decode, wire wait = waiting for bytes (collectives, the sharded optimizer's "
             "reduce-scatters, ACCO's jobs), optimizer = update + parameter all-gather outside their own wire/codec "
             "time, other = the rest of the step; background = span time in other threads (ACCO's jobs with their "
             "wire and codec time), overlapped with the main thread.", "",
             "compute vs floor: this method's compute less the no-communication run's on the same link, i.e. what "
             "communication work in other threads (codec, gloo, the background update) costs the compute sharing the "
             "rank's cores.", "",
             "| link | method | median step ms | compute | codec | wire wait | optimizer | other | background "
             "(of which wire) | compute vs floor | bound by |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    floors = {(r["rate"], r.get("seed")): r["profile"].get("main", {}).get("forward_backward", 0.0) * 1e3
              for r in records if r["method"] == "no_communication"}
    for r in records:
        step = statistics.median(r["times_s"]) * 1e3
        main = r["profile"].get("main", {})
        bg = r["profile"].get("background", {})
        parts = {k: sum(main.get(n, 0.0) for n in names) * 1e3 for k, names in PHASES.items()}
        parts["other"] = max(0.0, step - sum(parts.values()))
        bound = max(parts, key=parts.get)
        cells = " | ".join(f"{parts[k]:.0f}" for k in (*PHASES, "other"))
        key = (r["rate"], r.get("seed"))
        inflation = f"{parts['compute'] - floors[key]:+.0f}" if key in floors else "-"
        lines.append(f"| {r['rate']} | {r['method']} | {step:.0f} | {cells} | {sum(bg.values()) * 1e3:.0f} "
                     f"({bg.get('wire', 0.0) * 1e3:.0f}) | {inflation} | {bound} |")
    return lines + [""]


BITS = {"none": 32.0, "bf16": 16.0, "fp16": 16.0, "int8": 8.25, "int4": 4.25, "int2": 2.25}


def collectives_table(records: list[dict], op: str) -> list[str]:
    """The table of ``op`` from ``bench_collectives``' records (in run order)."""
    rows = [r for r in records if r["op"] == op]
    lines = [f"## Compressed {op} over a shaped link (2 ranks, one per namespace)", "",
             "| link | MiB | codec | median ms (min-max) | wire MB/rank | ideal ms | speedup vs fp32 | ideal speedup | "
             "fraction of ideal |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        none = next(b for b in rows if b["rate"] == r["rate"] and b["mib"] == r["mib"] and b["codec"] == "none")
        ideal_speedup = none["wire_bytes"] / r["wire_bytes"]
        speedup = statistics.median(none["times_s"]) / statistics.median(r["times_s"])
        lines.append(f"| {r['rate']} | {r['mib']:g} | {r['codec']} | {median_spread(r['times_s'], 1e3, '{:.1f}')} | "
                     f"{r['wire_bytes'] / 1e6:.2f} | {r['wire_bytes'] / r['rate_Bps'] * 1e3:.1f} | {speedup:.2f}x | "
                     f"{ideal_speedup:.2f}x | {speedup / ideal_speedup:.0%} |")
    return lines + [""]


def bench_collectives(args, records: Optional[list] = None) -> list[str]:
    records = [] if records is None else records
    start = len(records)
    codecs = args.codecs.split(",")
    for op in args.ops.split(","):
        for rate in args.rates.split(","):
            setup(rate)
            bps = rate_bytes_per_s(rate)
            for mib in [float(m) for m in args.mib.split(",")]:
                out = run_pair([sys.executable, "-m", "benchmarks.netns_bench", "_collective", str(mib), args.codecs, str(args.repeats), op],
                               args.port, args.timeout)[0]
                res = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
                for name in codecs:
                    r = res[name]
                    records.append({"rate": rate, "rate_Bps": bps, "op": op, "world": 2, "mib": mib, "codec": name,
                                    "bits_per_element": BITS.get(name, 32.0), "times_s": r["times"],
                                    "wire_bytes": r["wire"], "raw_bytes": r["raw"]})
                print("\n".join(collectives_table(records[start:], op)[-len(codecs) - 1:-1]), flush=True)
    return [line for op in args.ops.split(",") for line in collectives_table(records[start:], op)]


LAYOUTS = {"dp2": [], "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"],
           # the interleaved schedule: 2 chunks of 1 layer per stage on the tiny config's 4 layers
           "pp2vp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]}


def train_table(records: list[dict], layout: str) -> list[str]:
    """The table of ``bench_train``'s records for ``layout`` (in run order; config, model and iterations from the
    first)."""
    rows = [r for r in records if r["layout"] == layout]
    first = rows[0]
    lines = [f"## megacomp pretraining step over a shaped link ({layout}: one rank per namespace; "
             f"{first['config']}{' + ddp model' if first['ddp_model'] else ''}, {first['iters']} iterations)", "",
             "| link | layout | compression | median iteration s (min-max), iterations 3.. | wire MB/iter (all ranks) | "
             "fp32 MB/iter | loss at last iteration |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']} | {layout} | {r['compression']} | {median_spread(r['times_s'])} | "
                     f"{r['wire_bytes_per_iter'] / 1e6:.2f} | {r['fp32_bytes_per_iter'] / 1e6:.2f} | {r['loss']:.4f} |")
    return lines + [""]


def bench_train(args, records: Optional[list] = None) -> list[str]:
    """``python -m megacomp.pretrain`` across the link: per layout (dp2, tp2, pp2 or pp2vp2: the two ranks hold
    data, tensor or pipeline parallel halves; ``--layout`` may list several) and compression preset, the median
    iteration time."""
    layouts = getattr(args, "layout", "dp2").split(",")
    records = [] if records is None else records
    start = len(records)
    for layout in layouts:
        for rate in args.rates.split(","):
            setup(rate)
            for preset in args.compression.split(","):
                with tempfile.TemporaryDirectory() as log_dir:
                    run_pair([sys.executable, "-m", "megacomp.pretrain", "--config", args.config, "--train-iters",
                              str(args.iters), "--compression", preset, "--log-dir", log_dir, "--log-interval", "1",
                              "--global-batch-size", "16", "--micro-batch-size", "8", *LAYOUTS[layout],
                              *args.model_args, *getattr(args, "train_args", "").split()], args.port, args.timeout)
                    recs = [json.loads(x) for x in Path(log_dir, "metrics.jsonl").read_text().splitlines()]
                records.append({"rate": rate, "rate_Bps": rate_bytes_per_s(rate), "layout": layout,
                                "compression": preset, "config": args.config, "ddp_model": bool(args.model_args),
                                "iters": args.iters, "times_s": [r["iteration_time_s"] for r in recs[2:]],
                                "wire_bytes_per_iter": recs[-1]["wire_bytes"],
                                "fp32_bytes_per_iter": recs[-1]["uncompressed_bytes"], "loss": recs[-1]["loss"]})
                print(train_table(records[start:], layout)[-2], flush=True)
    return [line for layout in layouts for line in train_table(records[start:], layout)]


def tables(workload: str, records: list[dict]) -> list[str]:
    """Every table of ``workload``'s records, as the workload prints them."""
    if workload == "collectives":
        return [line for op in dict.fromkeys(r["op"] for r in records) for line in collectives_table(records, op)]
    if workload == "ddp":
        return ddp_table(records)
    if workload == "profile":
        return profile_table(records)
    return [line for layout in dict.fromkeys(r["layout"] for r in records) for line in train_table(records, layout)]


def markdown(results: dict, out: str) -> list[str]:
    """``<workload>.md`` from ``<workload>.json`` (written by a run; read back by ``--from-results``)."""
    return [f"# netns benchmark: {results['workload']}", "", f"Command: `{results['command']}` "
            f"({results['elapsed_s']:.0f} s; tbf burst 1mbit on both veth ends)", "",
            "Raw numbers: `" + results["workload"] + ".json`; this page is regenerated from them by "
            f"`python -m benchmarks.netns_bench {results['workload']} --from-results --out {out}`.", "",
            *tables(results["workload"], results["records"])]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_collective":
        collective_worker(float(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=["collectives", "train", "ddp", "profile"])
    p.add_argument("--rates", default="1gbit,100mbit")
    p.add_argument("--mib", default="25,100")
    p.add_argument("--codecs", default="none,bf16,int8,int4")
    p.add_argument("--ops", default="all_reduce", help="collectives: comma list of " + ",".join(OPS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--config", default="configs/gpt_tiny.yaml")
    p.add_argument("--layout", default="dp2", help="train workload: what the two ranks split, a comma list of "
                                                   + ", ".join(LAYOUTS))
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--compression", default="none,loco4,dp_int8")
    p.add_argument("--methods", default=",".join(DDP_METHODS),
                   help="comma list of " + ",".join(DDP_METHODS + LOW_RANK_METHODS + ONEBIT_METHODS + SHARDED_METHODS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DDP bucket_cap_mb for every method but PowerSGD (one bucket: torch's hook breaks with more on gloo)")
    p.add_argument("--seeds", default="", help="ddp / profile: comma list of seeds (weights and data order), each "
                                               "method run once per seed, with a table over seeds")
    p.add_argument("--flush-denormal", action="store_true",
                   help="ddp / profile: the workers flush subnormal floats to zero (torch.set_flush_denormal), so a "
                        "method whose weights lead the CPU into subnormal arithmetic is timed without that slowdown")
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="results/netns")
    p.add_argument("--train-model", choices=["tiny", "ddp"], default="tiny",
                   help="train workload: the tiny config, or the ddp workload's GPT (--hidden, --layers, seq 64)")
    p.add_argument("--train-args", default="",
                   help="train workload: more pretrain flags, one string (e.g. '--micro-batch-size 4 --dataset-samples 32')")
    p.add_argument("--from-results", action="store_true",
                   help="no measurement: rewrite <out>/<workload>.md from the <out>/<workload>.json of a run")
    args = p.parse_args()
    bad = [x for x in args.layout.split(",") if x not in LAYOUTS]
    if bad:
        p.error(f"unknown layout(s) {bad}; pick from {sorted(LAYOUTS)}")
    out = Path(args.out)
    if args.from_results:
        results = json.loads((out / f"{args.workload}.json").read_text())
        lines = markdown(results, args.out)
        (out / f"{args.workload}.md").write_text("\n".join(lines))
        print("\n".join(lines))
        return
    args.model_args = [] if args.train_model == "tiny" else [
        "--hidden-size", str(args.hidden), "--num-layers", str(args.layers), "--num-attention-heads", "4",
        "--seq-length", "64", "--vocab-size", "1024", "--lr-warmup-iters", "1"]
    if os.geteuid() != 0:
        raise SystemExit("network namespaces and tc need root (CAP_NET_ADMIN)")
    atexit.register(teardown)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    t0 = time.time()
    records: list = []
    try:
        {"collectives": bench_collectives, "train": bench_train, "ddp": bench_ddp,
         "profile": lambda a, r: bench_ddp(a, r, profile=True)}[args.workload](args, records)
    finally:
        teardown()
    results = {"workload": args.workload, "command": f"python {' '.join(invocation())}", "elapsed_s": time.time() - t0,
               "records": records}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.workload}.json").write_text(dump_results(results))
    lines = markdown(results, args.out)
    (out / f"{args.workload}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

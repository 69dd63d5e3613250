"""Benchmarks over a bandwidth-limited link between two network namespaces (one rank in each).

    python scripts/netns_bench.py collectives --rates 1gbit,100mbit --mib 25,100
    python scripts/netns_bench.py train --rates 100mbit --iters 20 --compression none,loco4,dp_int8

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
Output: Markdown tables on stdout and in ``--out`` (default results/netns). Numbers are measured, never
asserted; medians with min-max spread.
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


def run_pair(argv: list[str], port: int, timeout: float) -> list[str]:
    """Run ``argv`` as rank 0 in namespace A and rank 1 in namespace B; return both stdouts."""
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


# -- workload run inside the namespaces (python scripts/netns_bench.py _collective ...) ------------------
def collective_worker(mib: float, codecs: list[str], repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from megacomp import comm
    from megacomp.launch import init_distributed

    torch.set_num_threads(1)
    init_distributed()
    comm.set_validation(False)
    n = int(mib * (1 << 20)) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(dist.get_rank()))
    results = {}
    for name in codecs:
        codec = None if name == "none" else name
        times = []
        for i in range(repeats + 1):
            t = x.clone()
            comm.reset_stats()
            dist.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(t, codec=codec, tag="bench")
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i:
                times.append(dt.item())
        s = comm.stats()["bench"]
        results[name] = {"times": times, "wire": s.wire_bytes, "raw": s.uncompressed_bytes}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results))
    dist.destroy_process_group()


def bench_collectives(args) -> list[str]:
    lines = ["## Compressed all-reduce over a shaped link (2 ranks, one per namespace)", "",
             "| link | MiB | codec | median ms (min-max) | wire MB/rank | ideal ms | speedup vs fp32 | ideal speedup | "
             "fraction of ideal |", "|---|---|---|---|---|---|---|---|---|"]
    codecs = args.codecs.split(",")
    for rate in args.rates.split(","):
        setup(rate)
        bps = rate_bytes_per_s(rate)
        for mib in [float(m) for m in args.mib.split(",")]:
            out = run_pair([sys.executable, __file__, "_collective", str(mib), args.codecs, str(args.repeats)],
                           args.port, args.timeout)[0]
            res = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
            base = statistics.median(res["none"]["times"])
            for name in codecs:
                r = res[name]
                med = statistics.median(r["times"])
                ideal_speedup = res["none"]["wire"] / r["wire"]
                speedup = base / med
                lines.append(f"| {rate} | {mib:g} | {name} | {med * 1e3:.1f} ({min(r['times']) * 1e3:.1f}-"
                             f"{max(r['times']) * 1e3:.1f}) | {r['wire'] / 1e6:.2f} | {r['wire'] / bps * 1e3:.1f} | "
                             f"{speedup:.2f}x | {ideal_speedup:.2f}x | {speedup / ideal_speedup:.0%} |")
            print("\n".join(lines[-len(codecs):]), flush=True)
    return lines + [""]


def bench_train(args) -> list[str]:
    lines = ["## DP training step over a shaped link (tiny GPT, DP 2, one rank per namespace)", "",
             "| link | compression | median iteration s (min-max) | wire MB/iter (all ranks) | fp32 MB/iter | "
             "loss at last iteration |", "|---|---|---|---|---|---|"]
    for rate in args.rates.split(","):
        setup(rate)
        for preset in args.compression.split(","):
            with tempfile.TemporaryDirectory() as log_dir:
                run_pair([sys.executable, "-m", "megacomp.pretrain", "--config", args.config, "--train-iters",
                          str(args.iters), "--compression", preset, "--log-dir", log_dir, "--log-interval", "1",
                          "--global-batch-size", "16", "--micro-batch-size", "8"], args.port, args.timeout)
                recs = [json.loads(x) for x in Path(log_dir, "metrics.jsonl").read_text().splitlines()]
            steps = [r["iteration_time_s"] for r in recs[2:]]
            lines.append(f"| {rate} | {preset} | {statistics.median(steps):.3f} ({min(steps):.3f}-{max(steps):.3f}) | "
                         f"{recs[-1]['wire_bytes'] / 1e6:.2f} | {recs[-1]['uncompressed_bytes'] / 1e6:.2f} | "
                         f"{recs[-1]['loss']:.4f} |")
            print(lines[-1], flush=True)
    return lines + [""]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_collective":
        collective_worker(float(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=["collectives", "train"])
    p.add_argument("--rates", default="1gbit,100mbit")
    p.add_argument("--mib", default="25,100")
    p.add_argument("--codecs", default="none,bf16,int8,int4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--config", default="configs/gpt_tiny.yaml")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--compression", default="none,loco4,dp_int8")
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="results/netns")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("network namespaces and tc need root (CAP_NET_ADMIN)")
    atexit.register(teardown)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    t0 = time.time()
    try:
        lines = bench_collectives(args) if args.workload == "collectives" else bench_train(args)
    finally:
        teardown()
    header = [f"# netns benchmark: {args.workload}", "", f"Command: `python {' '.join(sys.argv)}` "
              f"({time.time() - t0:.0f} s; tbf burst 1mbit on both veth ends)", ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.workload}.md").write_text("\n".join(header + lines))
    print("\n".join(header + lines))


if __name__ == "__main__":
    main()

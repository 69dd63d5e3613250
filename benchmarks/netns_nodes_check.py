"""Do ranks of one namespace keep their traffic off the veth? Plain gloo collectives on benchmarks/netns_nodes.py's
two-namespace cluster, bytes leaving each node against what a ring (all_to_all: direct sends) would send.

    python -m benchmarks.netns_nodes_check --mib 8 --ranks-per-node 1,2,4 --rates 1gbit \
        --out benchmarks/results/netns_nodes

Per m: torchrun with m ranks in each namespace (netns_nodes.launch) runs all_reduce, reduce_scatter_tensor,
all_gather_into_tensor and all_to_all_single of an MIB-MiB fp32 tensor (the full tensor; a shard is 1/2m of it),
each once to open connections and then ``--reps`` times; local rank 0 of each node reads its veth's
/sys/class/net/<dev>/statistics/tx_bytes before and after (a barrier first: every peer has then received this node's
bytes). With nodes holding consecutive ranks a ring crosses each way once: all_reduce 2(n-1)/n x size,
reduce_scatter and all_gather (n-1)/n x size; a direct all_to_all sends m x m pieces of size/2m across (n = 2m).
Measured = expected means intra-namespace traffic stays on loopback. Writes ``collectives_check.json`` into
``--out``; netns_nodes.py's page shows it (:func:`check_section`). Numbers are measured, never asserted.
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
from typing import Optional, Sequence

from benchmarks import invocation
from benchmarks import netns_nodes as nn
from benchmarks.plot_metrics import dump_results

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def expected_collective_bytes(op: str, m: int, size: int) -> float:
    """Bytes leaving one node for one collective of ``size`` bytes (the full tensor) over 2m ranks, nodes holding
    consecutive ranks: a ring crosses each way once, a direct all_to_all sends m * m pieces of size / 2m across."""
    n = 2 * m
    return {"all_reduce": 2 * (n - 1) / n * size, "reduce_scatter": (n - 1) / n * size,
            "all_gather": (n - 1) / n * size, "all_to_all": m * m * size / n}[op]


def check_table(records: list[dict]) -> list[str]:
    """The Markdown table of the check's records."""
    lines = ["| link | m | op | MB (full tensor) | MB leaving node A / B per call | ring (all_to_all: direct) "
             "expectation MB | measured / expected |", "|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['rate']} | {r['m']} | {r['op']} | {r['size'] / 1e6:.2f} | {r['tx_A'] / 1e6:.3f} / "
                     f"{r['tx_B'] / 1e6:.3f} | {r['expected'] / 1e6:.3f} | {r['tx_A'] / r['expected']:.3f} |")
    return lines


def check_section(out: Path) -> list[str]:
    """The page section of ``out``/collectives_check.json (none when absent)."""
    path = out / "collectives_check.json"
    if not path.exists():
        return []
    check = json.loads(path.read_text())
    return ["## Plain gloo collectives across the two namespaces (is intra-node traffic kept off the veth?)", "",
            f"`{check['command']}`: bytes leaving each node per call against a ring's (all_to_all: direct sends) "
            "expectation (benchmarks/netns_nodes_check.py's docstring); measured = expected means ranks of one "
            "namespace exchange over loopback.", "", *check_table(check["records"]), ""]


def worker(mib: float, reps: int) -> None:
    """Run in every rank: per op, local rank 0 prints its node's veth tx bytes per call (``CHECK {...}``)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    numel = int(mib * (1 << 20)) // 4 // n * n
    path = Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes")
    x, shard, out = torch.randn(numel), torch.randn(numel // n), torch.empty(numel)
    calls = {"all_reduce": lambda: dist.all_reduce(x), "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, x),
             "all_gather": lambda: dist.all_gather_into_tensor(out, shard),
             "all_to_all": lambda: dist.all_to_all_single(out, x)}
    res = {}
    for op in OPS:
        calls[op]()  # opens the connections
        dist.barrier()
        before, t0 = int(path.read_text()), time.perf_counter()
        for _ in range(reps):
            calls[op]()
        dist.barrier()  # every peer has received this node's bytes: they left the veth
        res[op] = {"bytes": (int(path.read_text()) - before) / reps, "s": (time.perf_counter() - t0) / reps}
    if int(os.environ["LOCAL_RANK"]) == 0:
        print("CHECK " + json.dumps({"node": int(os.environ["GROUP_RANK"]), "size": numel * 4, **res}), flush=True)
    dist.destroy_process_group()


def check(rates: str, ranks_per_node: str, mib: float, reps: int, port: int, timeout: float) -> list[dict]:
    out = []
    for rate in rates.split(","):
        nn.setup(rate)
        for m in [int(x) for x in ranks_per_node.split(",")]:
            with tempfile.TemporaryDirectory() as d:
                procs = nn.launch(m, nn.next_port(port), ["-m", "benchmarks.netns_nodes_check", "_worker", str(mib),
                                                          str(reps)], Path(d))
                nn.wait_sampling(procs, None, timeout, Path(d))
                res = sorted((json.loads(ln[6:]) for n in (0, 1) for ln in Path(d, f"node{n}.log").read_text()
                              .splitlines() if ln.startswith("CHECK ")), key=lambda r: r["node"])
            for op in OPS:
                exp = expected_collective_bytes(op, m, res[0]["size"])
                out.append({"rate": rate, "m": m, "op": op, "size": res[0]["size"], "tx_A": res[0][op]["bytes"],
                            "tx_B": res[1][op]["bytes"], "expected": exp, "s": res[0][op]["s"]})
                print("\n".join(check_table(out)[-1:]), flush=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_worker"]:
        worker(float(argv[1]), int(argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=8.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rates", default="1gbit")
    p.add_argument("--ranks-per-node", default="1,2,4")
    p.add_argument("--port", type=int, default=29871)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="benchmarks/results/netns_nodes")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("network namespaces and tc need root (CAP_NET_ADMIN)")
    atexit.register(nn.teardown)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    try:
        res = check(args.rates, args.ranks_per_node, args.mib, args.reps, args.port, args.timeout)
    finally:
        nn.teardown()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "collectives_check.json").write_text(dump_results({"command": f"python {' '.join(invocation())}",
                                                                         "records": res}))


if __name__ == "__main__":
    main()

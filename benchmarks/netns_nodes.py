"""Pretraining on a two-"node" cluster: two network namespaces, m ranks in each, joined by a shaped veth pair.

    python -m benchmarks.netns_nodes --rates 100mbit,1gbit --ranks-per-node 1,2,4 --variants none,flat --seeds 1 \\
        --iters 12 --out benchmarks/results/netns_nodes
    python -m benchmarks.netns_nodes --from-results --out benchmarks/results/netns_nodes   # table + plot, no runs
    python -m benchmarks.netns_nodes_check --mib 8 --ranks-per-node 1,2,4   # plain gloo: is intra-node on lo?

Cluster: namespaces mcnodeA / mcnodeB (192.168.233.1 / .2 on veth ends mcnA / mcnB, both shaped with
``tc tbf rate R burst 1mbit``; TCP slow start after idle off), so it coexists with benchmarks/netns_bench.py. Each
namespace runs ``torchrun --nnodes 2 --nproc-per-node m --node-rank n --master-addr 192.168.233.1`` (static
rendezvous) of ``megacomp.pretrain`` with ``GLOO_SOCKET_IFNAME`` = its veth end: ranks of one namespace talk
over its loopback (gloo binds the veth address, but a connection to a local address is routed over lo: checked by
benchmarks/netns_nodes_check.py, whose table the page includes), ranks of different namespaces over the veth.
torchrun's GROUP_RANK / LOCAL_WORLD_SIZE tell megacomp the node of each rank.
Always torn down, also on Ctrl-C, SIGTERM or failure.

Workload: the 3.44M-parameter GPT of netns_bench's ``train --train-model ddp`` and netns_dp_targets (configs/
gpt_tiny.yaml with hidden 256, 4 layers, 4 heads, seq 64, vocab 1024), TP 1, PP 1, DP 2m, global batch 16 for
every m (one micro-batch of 16 / 2m samples per rank: the same samples per iteration, strong scaling), a variant's
pretraining flags from :data:`VARIANTS`, ``--seed`` per seed.

Bytes leaving a node per iteration (the method): while the run goes, the driver samples every 0.05 s, with a
timestamp, both veth ends' tx byte counters (``/proc/<pid>/net/dev`` of the torchrun agent inside each namespace:
the same kernel counter as that namespace's /sys/class/net/<dev>/statistics/tx_bytes, which is read with
``ip netns exec`` before and after the run) and the number of lines in rank 0's metrics.jsonl (one line per
iteration, written and flushed after the iteration's last collective). The bytes of iterations skip+1..N are the
counter at the first sample that sees line N less the counter at the first sample that sees line ``skip`` (=2):
start-up (rendezvous, process-group set-up, initial broadcasts) and the first two iterations fall before, shutdown
after. Iteration boundaries are quiet (the next iteration computes its forward before it sends anything), so a
sample taken up to 0.05 s late does not move bytes across a boundary; ``*_bounds`` in the records hold the interval
from the samples on either side of each boundary, and ``per_iter_*`` the bytes of every counted iteration alone.
The count is what a NIC would send: payload, TCP/IP headers (once per GSO packet on a veth), the ACKs of the
traffic the node receives, and the trainer's per-iteration loss/statistics collectives.

A row: one run (link rate, variant, m, seed): bytes leaving node A and node B per iteration (MB, mean over
iterations 3..N), megacomp's own wire bytes per iteration summed over all 2m ranks (metrics.jsonl ``wire_bytes``,
in brackets its ``*@intra_node`` hops of hierarchical collectives; per traffic kind in the JSON) and the crossing
fraction = node A's veth bytes / (megacomp's wire bytes less the intra-node hops, / 2) (1 when every byte a node's
ranks send crosses; a ring crosses fewer, a flat all-to-all m/(2m-1); gloo's uncompressed reduce-scatter is an
all-reduce, 2x the bytes megacomp counts); the median iteration
time (rank 0's iteration_time_s, iterations 3..N, min-max); the loss at the last iteration; the run's wall time.
Output in ``--out``: netns_nodes.md, netns_nodes.json (benchmarks.plot_metrics.dump_results: one record per line),
netns_nodes.png; rewritten after every run. Numbers are measured and printed, never asserted.

Engines (``--engine``, default ``pretrain``): ``ddp_hook`` and ``fsdp2`` run benchmarks/netns_nodes_engines.py's
worker instead of megacomp.pretrain (torch DDP with megacomp's comm hook, FSDP2 with FSDPCompression; the same
model, batch and variants, the same metrics.jsonl lines), and the table's plan column becomes that module's target
(:func:`benchmarks.netns_nodes_engines.target_bytes`), with an engine column.

Pure functions (no namespaces needed): :func:`parse_net_dev`, :func:`attribute_bytes`, :func:`pretrain_argv`,
:func:`run_argv`, :func:`micro_batch`, :func:`summarise_run`, :func:`table` (netns_nodes_check.py:
:func:`expected_collective_bytes`, :func:`check_table`; netns_nodes_engines.py: ``engine_argv``, ``model_numels``,
``target_bytes``, ``table``).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks import invocation, netns_nodes_engines
from benchmarks.netns_bench import median_spread, rate_bytes_per_s, sh
from benchmarks.plot_metrics import dump_results

NS = ("mcnodeA", "mcnodeB")
DEV = ("mcnA", "mcnB")
ADDR = ("192.168.233.1", "192.168.233.2")
SKIP = 2  # iterations left out of bytes and step time (warm-up)
SAMPLE_S = 0.05
MODEL = ["--config", "configs/gpt_tiny.yaml", "--hidden-size", "256", "--num-layers", "4", "--num-attention-heads", "4",
         "--seq-length", "64", "--vocab-size", "1024", "--lr-warmup-iters", "1"]  # the 3.44M GPT (netns_dp_targets)
# variant -> pretraining flags (one line per variant); none keeps pretraining's default collectives
VARIANTS = {"none": ["--compression", "none"],
            "flat": ["--compression", "loco4_qwz", "--dp-collectives", "flat"],
            "hier": ["--compression", "loco4_qwz", "--dp-collectives", "auto"]}


# -- namespaces ------------------------------------------------------------------------------------------------
def kill_namespace_processes() -> None:
    """SIGKILL every process inside our namespaces (torchrun's workers run in sessions of their own, and a
    pretraining rank answers SIGTERM by trying to save, which hangs once its peers are gone)."""
    for ns in NS:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def teardown() -> None:
    kill_namespace_processes()
    for ns in NS:
        sh(f"ip netns del {ns}", check=False)  # deletes its veth end and qdisc too


def claim_host() -> None:
    """Refuse without root (namespaces and tc need CAP_NET_ADMIN); tear the namespaces down at exit, on SIGTERM too."""
    if os.geteuid() != 0:
        raise SystemExit("network namespaces and tc need root (CAP_NET_ADMIN)")
    atexit.register(teardown)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))


def setup(rate: str) -> None:
    teardown()
    sh(f"ip netns add {NS[0]} && ip netns add {NS[1]} && ip link add {DEV[0]} type veth peer name {DEV[1]}")
    for ns, dev, addr in zip(NS, DEV, ADDR):
        sh(f"ip link set {dev} netns {ns} && ip -n {ns} addr add {addr}/24 dev {dev}")
        sh(f"ip -n {ns} link set lo up && ip -n {ns} link set {dev} up")
        sh(f"ip netns exec {ns} tc qdisc add dev {dev} root tbf rate {rate} burst 1mbit latency 50ms")
        sh(f"ip netns exec {ns} sysctl -qw net.ipv4.tcp_slow_start_after_idle=0")


def sysfs_tx(node: int) -> int:
    """Node ``node``'s veth tx_bytes, read inside its namespace."""
    path = f"/sys/class/net/{DEV[node]}/statistics/tx_bytes"
    return int(subprocess.run(["ip", "netns", "exec", NS[node], "cat", path],
                              check=True, capture_output=True, text=True).stdout)


def parse_net_dev(text: str, dev: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of ``dev`` in a /proc/net/dev text (KeyError when it is not listed)."""
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == dev:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    raise KeyError(dev)


def proc_tx(pid: int, dev: str) -> Optional[int]:
    try:
        return parse_net_dev(Path(f"/proc/{pid}/net/dev").read_text(), dev)[1]
    except (OSError, KeyError, ValueError, IndexError):
        return None  # the process has exited


# -- launching -------------------------------------------------------------------------------------------------
def micro_batch(global_batch: int, dp: int) -> int:
    """One micro-batch per DP rank per iteration: ``global_batch / dp`` (ValueError unless it divides)."""
    if global_batch % dp:
        raise ValueError(f"--global-batch {global_batch} must divide by the DP size {dp}")
    return global_batch // dp


def pretrain_argv(variant: str, m: int, iters: int, seed: int, log_dir: str, global_batch: int = 16,
                  extra: Sequence[str] = ()) -> list[str]:
    """The ``megacomp.pretrain`` arguments of one run (DP 2m)."""
    return ["-m", "megacomp.pretrain", *MODEL, "--train-iters", str(iters), "--log-interval", "1", "--log-dir", log_dir,
            "--global-batch-size", str(global_batch), "--micro-batch-size", str(micro_batch(global_batch, 2 * m)),
            "--seed", str(seed), *VARIANTS[variant], *extra]


def launch(m: int, port: int, module_argv: list[str], logs: Path) -> list[subprocess.Popen]:
    """torchrun with ``m`` ranks in each namespace (static rendezvous on node A); output in ``logs``/node<n>.log."""
    procs = []
    for n, (ns, dev) in enumerate(zip(NS, DEV)):
        cmd = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={dev}", "OMP_NUM_THREADS=1", sys.executable, "-m",
               "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(m), "--node-rank", str(n),
               "--master-addr", ADDR[0], "--master-port", str(port), *module_argv]
        procs.append(subprocess.Popen(cmd, stdout=open(logs / f"node{n}.log", "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def wait_sampling(procs: list[subprocess.Popen], metrics: Optional[Path], timeout: float, logs: Path,
                  on_sample: Optional[Callable[[int], None]] = None) -> list[tuple]:
    """Wait for both nodes, sampling (time, metrics.jsonl lines, tx A, tx B) every SAMPLE_S seconds; ``on_sample``
    is called with each sample's line count (the iterations finished), before the counters are read."""
    samples, t_end, last = [], time.time() + timeout, [None, None]
    try:
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):  # stop at a failure
            if time.time() > t_end:
                raise SystemExit(f"timed out after {timeout} s; logs in {logs}")
            lines = metrics.read_bytes().count(b"\n") if metrics is not None and metrics.exists() else 0
            if on_sample is not None:
                on_sample(lines)
            tx = [proc_tx(p.pid, dev) for p, dev in zip(procs, DEV)]
            last = [t if t is not None else x for t, x in zip(tx, last)]
            if None not in last:
                samples.append((time.time(), lines, *last))
            time.sleep(SAMPLE_S)
    finally:
        if any(p.poll() is None for p in procs):  # timeout, Ctrl-C: end the ranks too, not only torchrun
            kill_namespace_processes()
        for p in procs:
            p.wait()
    bad = [n for n, p in enumerate(procs) if p.returncode]
    if bad:
        tail = (logs / f"node{bad[0]}.log").read_text()[-3000:]
        raise SystemExit(f"node {bad[0]} failed ({procs[bad[0]].returncode}):\n{tail}")
    return samples


# -- attribution and summaries (pure) ---------------------------------------------------------------------------
def attribute_bytes(samples: Sequence[Sequence], skip: int, iters: int) -> dict:
    """Bytes of iterations skip+1..iters from timestamped samples ``(t, lines, tx_A, tx_B)`` (lines = iterations
    finished; counters cumulative). Each boundary k (line k appears) is taken at the first sample that shows it;
    ``bounds`` widen it to the samples on either side. Returns per node (A, B): ``bytes``, ``per_iter`` (mean),
    ``bounds`` ([low, high] of the per-iteration mean), ``per_iter_list`` (None where two boundaries share a sample)
    and ``window_s`` (seconds between the outer boundaries). ValueError when the samples miss a boundary."""
    first = {}
    for i, s in enumerate(samples):
        for k in range(skip, iters + 1):
            if k not in first and s[1] >= k:
                first[k] = i
    if skip not in first or iters not in first:
        raise ValueError(f"samples do not show iterations {skip} and {iters} finishing (sampled lines: "
                         f"{sorted({s[1] for s in samples})})")
    a, b, n = first[skip], first[iters], iters - skip
    out = {"window_s": samples[b][0] - samples[a][0]}
    for node, col in (("A", 2), ("B", 3)):
        tx = [s[col] for s in samples]
        low = tx[max(b - 1, a)] - tx[a]
        high = tx[b] - tx[max(a - 1, 0)]
        steps = [tx[first[k]] - tx[first[k - 1]] if first[k] != first[k - 1] else None
                 for k in range(skip + 1, iters + 1)]
        out[node] = {"bytes": tx[b] - tx[a], "per_iter": (tx[b] - tx[a]) / n, "bounds": [low / n, high / n],
                     "per_iter_list": steps}
    return out


def summarise_run(metrics: list[dict], att: dict, skip: int = SKIP) -> dict:
    """A record's measured fields from metrics.jsonl's lines and :func:`attribute_bytes`' result."""
    counted = metrics[skip:]
    kinds = sorted({k for r in counted for k in r["traffic"]})
    wire = statistics.mean(r["wire_bytes"] for r in counted)
    intra = statistics.mean(sum(w for k, (w, _) in r["traffic"].items() if k.endswith("@intra_node")) for r in counted)
    return {"times_s": [r["iteration_time_s"] for r in counted],
            "all_times_s": [r["iteration_time_s"] for r in metrics],
            "losses": [r["loss"] for r in metrics], "loss": metrics[-1]["loss"],
            "tx_per_iter": {n: att[n]["per_iter"] for n in "AB"}, "tx_bounds": {n: att[n]["bounds"] for n in "AB"},
            "tx_per_iter_list": {n: att[n]["per_iter_list"] for n in "AB"}, "window_s": att["window_s"],
            "megacomp_wire_per_iter": wire, "megacomp_intra_node_per_iter": intra,
            "megacomp_fp32_per_iter": statistics.mean(r["uncompressed_bytes"] for r in counted),
            "megacomp_traffic_per_iter": {k: statistics.mean(r["traffic"].get(k, [0, 0])[0] for r in counted)
                                          for k in kinds},
            "crossing_fraction": att["A"]["per_iter"] / ((wire - intra) / 2) if wire > intra else None}


PLAN_CODECS = {"none": (None, None), "flat": ({"name": "int4", "block_size": 128}, {"name": "int8", "block_size": 256}),
               "hier": ({"name": "int4", "block_size": 128}, {"name": "int8", "block_size": 256})}
"""Each variant's dp_gradient / dp_parameter codecs as megacomp.plan sees them (loco4_qwz's)."""


def planned_bytes(variant: str, m: int, global_batch: int = 16) -> float:
    """Bytes leaving a node per iteration that ``python -m megacomp.plan`` predicts for a run (the same model, DP 2m
    over 2 nodes, the variant's codecs and collectives) with ``--backend gloo``, as the runs use: gloo's uncompressed
    reduce-scatter moves all-reduce bytes and megacomp's compressed exchanges are direct (a node sends every local
    rank's pieces for the other node), and the parameters are fp32 (pretraining's default params_dtype). The plan
    counts payload; the veth counters add TCP/IP headers, ACKs and the trainer's small per-iteration collectives."""
    from megacomp.plan import Cluster, Layout, Method, ModelSpec, device, estimate

    grad, param = PLAN_CODECS[variant]
    spec = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=64, vocab_size=1024,
                     micro_batch_size=micro_batch(global_batch, 2 * m), global_batch_size=global_batch,
                     params_dtype="float32")  # configs/gpt_tiny.yaml sets none: pretraining's default
    method = Method(variant, "zero1", dp_gradient=grad, dp_parameter=param,
                    dp_collectives="flat" if variant == "flat" else "auto")
    e = estimate(spec, Layout(1, 1, 2 * m), Cluster(device("h100"), 2 * m, 2, backend="gloo"), method)
    return sum(t.tier_bytes["inter_node"] for t in e.transfers) / 2  # both nodes send alike


def table(records: list[dict]) -> list[str]:
    """The Markdown table of the records (in run order)."""
    lines = ["| link | variant | ranks/node m | DP | MB leaving node A / B per iteration | megacomp plan MB (A / plan) | "
             "megacomp wire MB/iter, all ranks (of it intra-node hops) | crossing fraction | median iteration s "
             "(min-max), iterations 3.. | loss at last iteration | run s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        cross = f"{r['crossing_fraction']:.2f}" if r.get("crossing_fraction") is not None else "-"
        seed = "" if r.get("seed") is None else f" (seed {r['seed']})"
        intra = f" ({r['megacomp_intra_node_per_iter'] / 1e6:.2f})" if r.get("megacomp_intra_node_per_iter") else ""
        plan = planned_bytes(r["variant"], r["m"], r.get("global_batch", 16))
        lines.append(f"| {r['rate']} | {r['variant']}{seed} | {r['m']} | {2 * r['m']} | "
                     f"{r['tx_per_iter']['A'] / 1e6:.2f} / {r['tx_per_iter']['B'] / 1e6:.2f} | "
                     f"{plan / 1e6:.2f} ({r['tx_per_iter']['A'] / plan:.3f}) | {r['megacomp_wire_per_iter'] / 1e6:.2f}{intra} | {cross} | {median_spread(r['times_s'])} | "
                     f"{r['loss']:.4f} | {r['run_s']:.0f} |")
    return lines


def source_state() -> str:
    """The checkout's commit, and whether megacomp/ has uncommitted changes (the runs measure the working tree)."""
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()  # noqa: E731
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes in megacomp/"
                                                  if git("status", "--porcelain", "megacomp") else "")


# -- the benchmark ----------------------------------------------------------------------------------------------
_port_offset = 0


def next_port(base: int) -> int:
    """A fresh rendezvous port per run (none reused while the previous run's sockets may hold it)."""
    global _port_offset
    _port_offset += 1
    return base + _port_offset - 1


def run_argv(engine: str, variant: str, m: int, iters: int, seed: int, log_dir: str, global_batch: int = 16,
             extra: Sequence[str] = ()) -> list[str]:
    """The module and arguments torchrun runs in each namespace: megacomp.pretrain (:func:`pretrain_argv`) or an
    engine's worker (benchmarks.netns_nodes_engines.engine_argv), DP 2m."""
    if engine == "pretrain":
        return pretrain_argv(variant, m, iters, seed, log_dir, global_batch, extra)
    return netns_nodes_engines.engine_argv(engine, variant, micro_batch(global_batch, 2 * m), iters, seed, log_dir,
                                           extra)


def run_one(args, rate: str, variant: str, m: int, seed: int) -> dict:
    engine = getattr(args, "engine", "pretrain")
    keep = getattr(args, "keep_logs", "")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(tempfile.mkdtemp(prefix=f"{rate}_{variant}_m{m}_s{seed}_", dir=keep)) if keep
          else tempfile.TemporaryDirectory()) as d:
        log_dir = Path(d)
        before = [sysfs_tx(0), sysfs_tx(1)]
        t0 = time.time()
        procs = launch(m, next_port(args.port), run_argv(engine, variant, m, args.iters, seed, str(log_dir / "log"),
                                                         args.global_batch, shlex.split(args.extra_args)), log_dir)
        samples = wait_sampling(procs, log_dir / "log" / "metrics.jsonl", args.timeout, log_dir)
        run_s = time.time() - t0
        after = [sysfs_tx(0), sysfs_tx(1)]
        metrics = [json.loads(x) for x in (log_dir / "log" / "metrics.jsonl").read_text().splitlines()]
    att = attribute_bytes(samples, SKIP, args.iters)
    variant_args = VARIANTS[variant] if engine == "pretrain" else netns_nodes_engines.VARIANTS[variant]
    return {"engine": engine, "rate": rate, "rate_Bps": rate_bytes_per_s(rate), "variant": variant,
            "variant_args": variant_args,
            "m": m, "dp": 2 * m, "seed": seed, "iters": args.iters, "global_batch": args.global_batch,
            "extra_args": args.extra_args, "source": args.source, "run_s": run_s, "samples": len(samples),
            "first_iteration_done_s": next((t - t0 for t, lines, *_ in samples if lines >= 1), None),
            "tx_run_total": {"A": after[0] - before[0], "B": after[1] - before[1]},
            "tx_outside_counted": {n: after[i] - before[i] - att[n]["bytes"] for i, n in enumerate("AB")},
            # start-up + shutdown: the run's bytes less N iterations at the counted mean
            "tx_startup_shutdown": {n: after[i] - before[i] - args.iters * att[n]["per_iter"]
                                    for i, n in enumerate("AB")},
            **summarise_run(metrics, att)}


def plot(records: list[dict], path: Path) -> Optional[Path]:
    """Bytes leaving a node per iteration and the median iteration time against m, one line per variant and rate."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    rates = list(dict.fromkeys(r["rate"] for r in records))
    engines = list(dict.fromkeys(r.get("engine", "pretrain") for r in records))
    for key in dict.fromkeys((r["variant"], r["rate"], r.get("engine", "pretrain")) for r in records):
        rows = sorted((r for r in records if (r["variant"], r["rate"], r.get("engine", "pretrain")) == key),
                      key=lambda r: r["m"])
        ms = sorted({r["m"] for r in rows})
        per_m = {m: [r for r in rows if r["m"] == m] for m in ms}
        tx = [statistics.mean((r["tx_per_iter"]["A"] + r["tx_per_iter"]["B"]) / 2e6 for r in per_m[m]) for m in ms]
        st = [statistics.mean(statistics.median(r["times_s"]) for r in per_m[m]) for m in ms]
        label = f"{key[0]} @ {key[1]}" if engines == ["pretrain"] else f"{key[2]} {key[0]} @ {key[1]}"
        style = dict(color=f"C{list(VARIANTS).index(key[0]) if key[0] in VARIANTS else 9}",
                     marker="osD^"[engines.index(key[2]) % 4],
                     linestyle=["-", "--", ":", "-."][rates.index(key[1]) % 4], label=label)
        ax1.plot(ms, tx, **style)
        ax2.plot(ms, st, **style)
    for ax, ylabel in ((ax1, "MB leaving a node per iteration (veth tx)"), (ax2, "median iteration time (s)")):
        ax.set(xlabel="ranks per node m (DP = 2m)", ylabel=ylabel, xscale="log", ylim=(0, None))
        ax.set_xticks(sorted({r["m"] for r in records}), [str(m) for m in sorted({r["m"] for r in records})])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    what = "" if engines == ["pretrain"] else f" ({', '.join(engines)})"
    fig.suptitle(f"Two namespaces x m ranks, 3.44M GPT, global batch 16{what}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


ENGINE_NAMES = {"ddp_hook": "DDP comm hook", "fsdp2": "FSDP2"}


def write(results: dict, out: Path) -> list[str]:
    """netns_nodes.md and netns_nodes.png from ``results`` (netns_nodes.json's object); returns the page's lines."""
    out.mkdir(parents=True, exist_ok=True)
    engines = list(dict.fromkeys(r.get("engine", "pretrain") for r in results["records"]))
    pretrain = engines in ([], ["pretrain"])
    what = "pretraining" if pretrain else " / ".join(ENGINE_NAMES.get(e, e) for e in engines) + " training"
    lines = [f"# Two-node {what} over a shaped link: {len(results['records'])} runs", "",
             f"Command: `{results['command']}` ({results['elapsed_s']:.0f} s). Two network namespaces, m ranks each "
             "(torchrun, static rendezvous), loopback inside, a veth pair with `tc tbf burst 1mbit` on both ends "
             "between; the 3.44M GPT (netns_dp_targets), DP 2m, global batch 16. Method and columns: "
             "benchmarks/netns_nodes.py's docstring"
             + ("" if pretrain else " and netns_nodes_engines.py's (engines, targets)")
             + ". 2 CPU cores shared by all 2m ranks and other work on the "
             "machine: times are indicative, bytes are the measurement. Raw records: `netns_nodes.json`; "
             f"regenerate this page and `netns_nodes.png` by `python -m benchmarks.netns_nodes --from-results "
             f"--out {results['out']}`. Source measured: "
             f"{'; '.join(dict.fromkeys(str(r.get('source')) for r in results['records']))}.", "",
             *(table(results["records"]) if pretrain else netns_nodes_engines.table(results["records"])), ""]
    from benchmarks.netns_nodes_check import check_section  # its collectives_check.json, if any
    lines += check_section(out)
    if results.get("notes"):
        lines += ["## Notes", "", *results["notes"], ""]
    if results["records"] and plot(results["records"], out / "netns_nodes.png"):
        lines += ["![bytes and step time against m](netns_nodes.png)", "",
                  "(Bytes per iteration do not depend on the link rate: the two rates' byte lines lie on each other.)",
                  ""]
    (out / "netns_nodes.md").write_text("\n".join(lines))
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--ranks-per-node", default="1,2,4", help="comma list of m (ranks in each namespace)")
    p.add_argument("--engine", choices=("pretrain", *netns_nodes_engines.ENGINES), default="pretrain",
                   help="what trains: megacomp.pretrain, torch DDP with megacomp's hook, or FSDP2 (module docstring)")
    p.add_argument("--variants", default="none,flat", help="comma list of " + ",".join(VARIANTS))
    p.add_argument("--seeds", default="1")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=16, help="samples per iteration, for every m")
    p.add_argument("--extra-args", default="", help="more megacomp.pretrain (or engine worker) flags, one string")
    p.add_argument("--port", type=int, default=29831)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", default="benchmarks/results/netns_nodes")
    p.add_argument("--keep-logs", default="", metavar="DIR", help="keep every run's node logs and metrics.jsonl here")
    p.add_argument("--append", action="store_true", help="add the new runs to <out>/netns_nodes.json's records")
    p.add_argument("--from-results", action="store_true", help="no runs: rewrite the table and plot from the JSON")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.from_results:
        results = json.loads((out / "netns_nodes.json").read_text())
        print("\n".join(write(results, out)))
        return
    bad = [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; pick from {sorted(VARIANTS)}")
    claim_host()
    t0 = time.time()
    old = json.loads((out / "netns_nodes.json").read_text()) if args.append else {}
    args.source = source_state()
    results = {"command": f"python {' '.join(invocation())}", "out": args.out, "elapsed_s": 0.0,
               **({"notes": old["notes"]} if old.get("notes") else {}), "records": old.get("records", [])}
    try:
        for rate in args.rates.split(","):
            setup(rate)
            for seed in [int(s) for s in args.seeds.split(",")]:
                for variant in args.variants.split(","):
                    for m in [int(x) for x in args.ranks_per_node.split(",")]:
                        results["records"].append(run_one(args, rate, variant, m, seed))
                        results["elapsed_s"] = time.time() - t0
                        out.mkdir(parents=True, exist_ok=True)
                        (out / "netns_nodes.json").write_text(dump_results(results))
                        write(results, out)
                        print((table if args.engine == "pretrain" else netns_nodes_engines.table)(
                            results["records"])[-1], flush=True)
    finally:
        teardown()
    print("\n".join(write(results, out)))


if __name__ == "__main__":
    main()

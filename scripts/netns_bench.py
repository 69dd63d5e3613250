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
``ddp``: the same GPT code (TP 1, larger by default) under torch DDP with fp32 all-reduce, the fp16
compress hook, PowerSGD rank 4 (one bucket: torch's hook breaks with several on gloo), and megacomp's
int4 + LoCo DDP hook: median step time and the loss after the same iterations.
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


DDP_METHODS = ("ddp_fp32", "ddp_fp16_hook", "ddp_powersgd4", "megacomp_hook_int4_loco")


def ddp_worker(method: str, iters: int, hidden: int, layers: int, bucket_mb: float = 25.0) -> None:
    """One rank of a torch-DDP training run of a small GPT (TP 1) with ``method``'s communication."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from megacomp import comm, parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.data import DistributedBatchSampler, get_batch, prepare_data
    from megacomp.launch import init_distributed
    from megacomp.models.gpt import GPTConfig, GPTModel
    from megacomp.optimizer import CompressedHookState, compressed_allreduce_hook

    torch.set_num_threads(1)
    init_distributed()
    comm.set_validation(False)
    groups = parallel_state.initialize_model_parallel(1, 1)
    tok, data = prepare_data(None, 1024, 64)
    cfg = GPTConfig(hidden_size=hidden, num_attention_heads=4, num_layers=layers, vocab_size=1024, max_seq_length=64)
    model = GPTModel(cfg, ModelParallelConfig(process_groups=groups))
    one_bucket = method == "ddp_powersgd4"  # torch's PowerSGD hook breaks with several buckets on gloo
    ddp = DDP(model, bucket_cap_mb=1024 if one_bucket else bucket_mb)
    if method == "ddp_fp16_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "ddp_powersgd4":
        ddp.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4,
                                                           start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
    elif method == "no_communication":  # the compute floor: buckets are not averaged (timing only)
        def no_comm(_state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        ddp.register_comm_hook(None, no_comm)
    elif method == "megacomp_hook_int4_loco":
        ddp.register_comm_hook(CompressedHookState(codec="int4", error_feedback="loco"), compressed_allreduce_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sampler = iter(DistributedBatchSampler(len(data), 8, dist.get_rank(), 2, seed=1))
    times, losses = [], []
    for _ in range(iters):
        ids, labels = get_batch(data, next(sampler))
        dist.barrier()
        t0 = time.perf_counter()
        loss = ddp(ids, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        l = loss.detach().reshape(1)
        dist.all_reduce(l)
        times.append(dt.item())
        losses.append(l.item() / 2)
    params = sum(p.numel() for p in model.parameters())
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"times": times, "losses": losses, "params": params}))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def bench_ddp(args) -> list[str]:
    lines = [f"## Torch DDP and its comm hooks vs megacomp's hook over a shaped link (GPT h={args.hidden}, "
             f"{args.layers} layers, DP 2, {args.iters} iterations)", "",
             "| link | method | params | median step s (min-max, iterations 3..) | loss at last iteration |",
             "|---|---|---|---|---|"]
    for rate in args.rates.split(","):
        setup(rate)
        base = None
        for method in args.methods.split(","):
            out = run_pair([sys.executable, __file__, "_ddp", method, str(args.iters), str(args.hidden),
                            str(args.layers), str(args.bucket_mb)], args.port, args.timeout)[0]
            res = json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])
            steps = res["times"][2:]
            med = statistics.median(steps)
            base = base or med
            lines.append(f"| {rate} | {method} | {res['params']:,} | {med:.3f} ({min(steps):.3f}-{max(steps):.3f}); "
                         f"{base / med:.2f}x vs first | {res['losses'][-1]:.4f} |")
            print(lines[-1], flush=True)
    return lines + [""]


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
                          "--global-batch-size", "16", "--micro-batch-size", "8", *args.model_args],
                         args.port, args.timeout)
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
    if len(sys.argv) > 1 and sys.argv[1] == "_ddp":
        ddp_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=["collectives", "train", "ddp"])
    p.add_argument("--rates", default="1gbit,100mbit")
    p.add_argument("--mib", default="25,100")
    p.add_argument("--codecs", default="none,bf16,int8,int4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--config", default="configs/gpt_tiny.yaml")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--compression", default="none,loco4,dp_int8")
    p.add_argument("--methods", default=",".join(DDP_METHODS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DDP bucket_cap_mb for every method but PowerSGD (one bucket: torch's hook breaks with more on gloo)")
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="results/netns")
    p.add_argument("--train-model", choices=["tiny", "ddp"], default="tiny",
                   help="train workload: the tiny config, or the ddp workload's GPT (--hidden, --layers, seq 64)")
    args = p.parse_args()
    args.model_args = [] if args.train_model == "tiny" else [
        "--hidden-size", str(args.hidden), "--num-layers", str(args.layers), "--num-attention-heads", "4",
        "--seq-length", "64", "--vocab-size", "1024", "--lr-warmup-iters", "1"]
    if os.geteuid() != 0:
        raise SystemExit("network namespaces and tc need root (CAP_NET_ADMIN)")
    atexit.register(teardown)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    t0 = time.time()
    try:
        lines = {"collectives": bench_collectives, "train": bench_train, "ddp": bench_ddp}[args.workload](args)
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

"""Benchmark megacomp codecs and compressed collectives on CPU. Prints Markdown tables; never asserts timings.

Part A, codec throughput (this process, --threads torch threads, inputs torch.randn fp32):
  For each codec, time ``codec.encode_flat(x)`` and ``codec.decode_flat(buf, numel)`` of --numel elements:
  one warm-up call, then the median of --repeats timed calls. GB/s = fp32 input bytes (4 * numel) / time,
  for encode and decode alike. The reference is memcpy measured in the same run with the same convention:
  ``dst.copy_(src)`` into a preallocated dst of the same size (GB/s of fp32 bytes, not read+write).
  Encode and decode write into preallocated outputs (``out=``), like the memcpy reference: a fresh
  >32 MiB buffer per call would time glibc's page faults instead (platform.md §6). Scaled int/fp8 codecs
  run the fused kernels of megacomp.kernels (backend printed in the header; MEGACOMP_KERNELS=reference
  measures the eager reference); casts are eager torch; stochastic rounding computes its counter-based
  draws (megacomp.compression.counter_rng) inside the kernel.
  wire B/elem = codec.wire_bytes(numel) / numel (scales included); ratio = 4 / that.
  rel err = ||x - decode(encode(x))|| / ||x||.
  Then one LoCo error-feedback step per EF_SPECS codec on x (an error already stored): the three
  whole-tensor passes (compensate, encode, update_encoded) against ef_encoder.chunk_encoder's one pass.

Part B, collectives (--world ranks via torch.multiprocessing spawn, gloo over file:// rendezvous on this
  machine, OMP_NUM_THREADS=1 and 1 torch thread per rank, validation off: validate=False on every call):
  For each size S MiB of fp32 (nccl-tests convention: all_reduce in/out S; reduce_scatter in S, out S/N;
  all_gather in S/N, out S), each op and codec: restore the input (untimed), barrier, time one call.
  One warm-up, --repeats timed iterations; per iteration the max over ranks, then the median.
  algbw = S / time. wire B/call = comm.stats() bytes rank 0 sends per call (stats reset before each
  measurement, divided by calls), next to the bytes the uncompressed collective sends.
  rel err = ||ref - out|| / ||ref|| against the codec=None result on the same inputs, max over ranks.
  "int4 + loco" rows (reductions only): the same calls with error_feedback, one ErrorFeedback("loco") state
  per rank kept across the warm-up and timed calls (its steady state: an error stored, updated each call).

Run:  python -m benchmarks.bench_codecs [--quick] [--numel 64M] [--coll-mib 4,32] [--ops all_reduce,...] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings

import torch

from benchmarks import invocation
from megacomp.compression import ErrorFeedback, make_codec, relative_error

CODEC_SPECS = [dict(name=n) for n in ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2", "sign")] + [
    dict(name="int8", block_size=32, dual_scale=True),
    dict(name="int4", block_size=32, dual_scale=True),
    dict(name="int4", block_size=0),
    dict(name="sign", block_size=0),
    dict(name="int4", rounding="stochastic", seed=0),
    dict(name="int8", rounding="stochastic", seed=0),
    dict(name="sign", rounding="stochastic", seed=0),
]
COLL_CODECS = ("none", "bf16", "fp8_e4m3", "int8", "int4", "int2", "sign", "int4+loco")  # +loco: error feedback
OPS = ("all_reduce", "reduce_scatter", "all_gather")
MiB = 1 << 20


# -- helpers -------------------------------------------------------------------------------------------
def parse_count(s: str) -> int:
    """'64M' -> 67108864, '1k' -> 1024, '1000' -> 1000."""
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1].lower(), 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def time_calls(fn, repeats: int, warmup: int = 1, setup=None) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones; ``setup`` runs untimed."""
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return times


def md_table(header: list[str], rows: list[list]) -> list[str]:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]


def machine_info(threads: int) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "threads": threads, "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
            "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable)] + invocation())}


# -- part A: codec throughput -----------------------------------------------------------------------------
def bench_memcpy(x: torch.Tensor, repeats: int) -> dict:
    dst = torch.empty_like(x)
    t = statistics.median(time_calls(lambda: dst.copy_(x), repeats))
    return {"ms": t * 1e3, "GBps": x.numel() * 4 / t / 1e9}


def bench_codec(spec: dict, x: torch.Tensor, repeats: int) -> dict:
    codec, n = make_codec(**spec), x.numel()
    buf = codec.encode_flat(x)
    err = relative_error(x, codec.decode_flat(buf, n))
    # preallocated outputs, as the memcpy reference has: fresh >32 MiB buffers would time page faults
    dec_out = torch.empty(n, dtype=torch.float32)
    t_enc = statistics.median(time_calls(lambda: codec.encode_flat(x, out=buf), repeats))
    t_dec = statistics.median(time_calls(lambda: codec.decode_flat(buf, n, out=dec_out), repeats))
    wire = codec.wire_bytes(n) / n
    return {"codec": str(codec), "spec": spec, "wire_B_per_elem": wire, "ratio_vs_fp32": 4 / wire,
            "encode_ms": t_enc * 1e3, "encode_GBps": n * 4 / t_enc / 1e9,
            "decode_ms": t_dec * 1e3, "decode_GBps": n * 4 / t_dec / 1e9, "rel_err": err}


EF_SPECS = [dict(name="int4"), dict(name="int8")]


def bench_ef_step(spec: dict, x: torch.Tensor, repeats: int) -> dict:
    """One LoCo error-feedback step (beta 0.8, an error already stored) on the whole tensor: the three
    whole-tensor passes (compensate, encode, update from the bytes) against the chunk encoder (one fused
    pass where the kernel covers it). Both produce the same bytes and error (tests)."""
    from megacomp.compression import ErrorFeedback
    from megacomp.compression.ef_encoder import chunk_encoder

    codec, n = make_codec(**spec), x.numel()
    ef_a, ef_b = ErrorFeedback("loco"), ErrorFeedback("loco")
    buf = torch.empty(codec.wire_bytes(n), dtype=torch.uint8)

    def three_passes():
        h = ef_a.compensate("k", x)
        ef_a.update_encoded("k", h, codec, [codec.encode_flat(h, out=buf)], [n])

    def one_pass():
        enc = chunk_encoder(ef_b, "k", x, codec)
        enc.encode(0, n)
        enc.commit()

    t3 = statistics.median(time_calls(three_passes, repeats))
    t1 = statistics.median(time_calls(one_pass, repeats))
    return {"codec": str(codec), "three_ms": t3 * 1e3, "fused_ms": t1 * 1e3}


def part_a(args) -> tuple[dict, list[str]]:
    torch.manual_seed(0)
    x = torch.randn(args.numel)
    memcpy = bench_memcpy(x, args.repeats)
    rows = [bench_codec(spec, x, args.repeats) for spec in CODEC_SPECS]
    mc = memcpy["GBps"]
    header = ["codec", "wire B/elem", "ratio vs fp32", "encode ms", "encode GB/s", "enc/memcpy",
              "decode ms", "decode GB/s", "dec/memcpy", "rel err"]
    table = [["memcpy (copy_)", 4.0, 1.0, memcpy["ms"], mc, 1.0, memcpy["ms"], mc, 1.0, 0.0]]
    table += [[r["codec"], r["wire_B_per_elem"], r["ratio_vs_fp32"], r["encode_ms"], r["encode_GBps"],
               r["encode_GBps"] / mc, r["decode_ms"], r["decode_GBps"], r["decode_GBps"] / mc, r["rel_err"]]
              for r in rows]
    lines = [f"## A. Codec throughput: {args.numel:,} fp32 elements ({args.numel * 4 / MiB:.0f} MiB), "
             f"{args.threads} thread(s), median of {args.repeats} after 1 warm-up", "",
             "GB/s = fp32 input bytes / time; memcpy = preallocated dst.copy_(src), same size and convention.", ""]
    ef_rows = [bench_ef_step(spec, x, args.repeats) for spec in EF_SPECS]
    ef_lines = ["", "Error-feedback step (LoCo, beta 0.8, error stored; g and e fp32): compensate h = g + e, encode h, "
                "e' = beta e + (1 - beta)(h - decode(bytes)). Three passes = ErrorFeedback.compensate, "
                "codec.encode_flat, ErrorFeedback.update_encoded; one pass = ef_encoder.chunk_encoder (what the "
                "collectives run). x memcpy = time / memcpy time.", ""]
    ef_table = [[r["codec"], r["three_ms"], r["three_ms"] / memcpy["ms"], r["fused_ms"], r["fused_ms"] / memcpy["ms"],
                 r["three_ms"] / r["fused_ms"]] for r in ef_rows]
    ef_lines += md_table(["codec", "three passes ms", "x memcpy", "one pass ms", "x memcpy", "speed-up"], ef_table)
    return ({"memcpy": memcpy, "codecs": rows, "ef_step": ef_rows},
            lines + md_table(header, table) + ef_lines)


# -- part B: collectives (runs in every rank) -------------------------------------------------------------
def op_setup(op: str, numel: int, world: int, rank: int):
    """Tensors and a call for one op: returns (call(codec), restore(), result tensor)."""
    from megacomp import comm
    g = torch.Generator().manual_seed(1000 + rank)
    if op == "all_reduce":
        src = torch.randn(numel, generator=g)
        buf = torch.empty_like(src)
        return ((lambda c, ef: comm.all_reduce(buf, codec=c, error_feedback=ef, ef_key="b", validate=False)),
                (lambda: buf.copy_(src)), buf)
    if op == "reduce_scatter":
        inp, out = torch.randn(numel, generator=g), torch.empty(numel // world)
        return ((lambda c, ef: comm.reduce_scatter_tensor(out, inp, codec=c, error_feedback=ef, ef_key="b",
                                                          validate=False)), None, out)
    inp, out = torch.randn(numel // world, generator=g), torch.empty(numel)
    return (lambda c, ef: comm.all_gather_into_tensor(out, inp, codec=c, validate=False)), None, out


def bench_collective(op: str, mib: float, codec_name: str, ref, args) -> tuple[dict, torch.Tensor]:
    import torch.distributed as dist
    from megacomp import comm
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = int(mib * MiB) // 4 // world * world
    call, restore, result = op_setup(op, numel, world, rank)
    name, _, ef_name = codec_name.partition("+")
    codec = make_codec(name)
    # error feedback: one state across the timed calls (LoCo's steady state after the warm-up call)
    ef = ErrorFeedback(ef_name) if ef_name else None

    def timed():
        call(codec, ef)

    def setup():
        if restore is not None:
            restore()
        dist.barrier()

    comm.reset_stats()
    times = torch.tensor(time_calls(timed, args.repeats, setup=setup), dtype=torch.float64)
    st = comm.stats()
    calls = sum(s.calls for s in st.values())
    wire = sum(s.wire_bytes for s in st.values()) / calls
    raw = sum(s.uncompressed_bytes for s in st.values()) / calls
    err = torch.tensor([0.0 if ref is None else relative_error(ref, result)], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    t = times.median().item()
    row = {"op": op, "MiB": mib, "codec": str(codec) + (f" + {ef_name}" if ef_name else ""), "ms": t * 1e3, "algbw_GBps": numel * 4 / t / 1e9,
           "wire_B_per_call": wire, "uncompressed_B_per_call": raw, "wire_ratio": wire / raw if raw else 0.0,
           "rel_err": err.item()}
    return row, result.clone()


def coll_worker(rank: int, args, init_file: str, result_file: str) -> None:
    import torch.distributed as dist
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor / reduce_scatter_tensor
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.world)
    rows = []
    for mib in args.coll_mib:
        for op in args.ops:
            ref = None
            for name in COLL_CODECS:  # "none" first: it is the reference
                if "+" in name and op == "all_gather":
                    continue  # error feedback applies to reductions
                row, out = bench_collective(op, mib, name, ref, args)
                ref = out if name == "none" else ref
                rows.append(row)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def part_b(args) -> tuple[list[dict], list[str]]:
    import torch.multiprocessing as mp
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "rows.json")
        mp.spawn(coll_worker, args=(args, os.path.join(tmp, "store"), result_file), nprocs=args.world, join=True)
        with open(result_file) as f:
            rows = json.load(f)
    lines = [f"## B. Collectives: {args.world} ranks, gloo (file:// rendezvous), OMP_NUM_THREADS=1, "
             f"validation off (validate=False), median of {args.repeats} after 1 warm-up, "
             f"max over ranks", "",
             "algbw = S / time (S = full fp32 buffer); wire B/call = bytes rank 0 sends per call (comm.stats()); "
             "rel err vs codec=None.", ""]
    header = ["MiB", "codec", "ms", "algbw GB/s", "speedup vs none", "wire B/call", "uncompressed B/call",
              "wire/uncompressed", "rel err"]
    for op in args.ops:
        table = []
        for mib in args.coll_mib:
            sel = [r for r in rows if r["op"] == op and r["MiB"] == mib]
            base = next(r["ms"] for r in sel if r["codec"] == "none")
            table += [[mib, r["codec"], r["ms"], r["algbw_GBps"], base / r["ms"], int(r["wire_B_per_call"]),
                       int(r["uncompressed_B_per_call"]), r["wire_ratio"], r["rel_err"]] for r in sel]
        lines += [f"### {op}", ""] + md_table(header, table) + [""]
    return rows, lines


# -- main -----------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=parse_count, default=parse_count("16M"), help="part A elements (e.g. 64M)")
    p.add_argument("--repeats", type=int, default=5, help="timed iterations (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for part A")
    p.add_argument("--world", type=int, default=2, help="ranks for part B")
    p.add_argument("--coll-mib", default="4,32", help="part B sizes in MiB of fp32, comma separated")
    p.add_argument("--ops", default=",".join(OPS), help=f"part B ops, comma separated from {','.join(OPS)}")
    p.add_argument("--parts", default="A,B", help="which parts to run: A, B or A,B")
    p.add_argument("--quick", action="store_true", help="tiny sizes: 1M elements, 1 MiB, 2 repeats")
    p.add_argument("--out", default=None, help="directory for results.json and results.md")
    args = p.parse_args()
    if args.quick:
        args.numel, args.coll_mib, args.repeats = parse_count("1M"), "1", 2
    args.coll_mib = [float(s) if "." in s else int(s) for s in args.coll_mib.split(",")]
    args.ops = [s.strip() for s in args.ops.split(",")]
    args.parts = {s.strip().upper() for s in args.parts.split(",")}
    bad = set(args.ops) - set(OPS)
    if bad:
        p.error(f"unknown op(s) {sorted(bad)}; choose from {OPS}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    info = machine_info(args.threads)
    lines = ["# megacomp codec benchmark", "",
             f"Machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, python {info['python']}; "
             f"part A threads {args.threads}; LD_PRELOAD={info['LD_PRELOAD'] or '(none, glibc malloc)'}; "
             f"codec kernels: {__import__('megacomp.kernels', fromlist=['x']).backend_name()}",
             f"Command: `{info['command']}`", ""]
    print("\n".join(lines), flush=True)
    results = {"machine": info, "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}}
    for part, fn in (("A", part_a), ("B", part_b)):
        if part in args.parts:
            results[part], part_lines = fn(args)
            print("\n".join(part_lines) + "\n", flush=True)
            lines += part_lines + [""]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}/results.json and results.md")


if __name__ == "__main__":
    main()

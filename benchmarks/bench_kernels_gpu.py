"""GPU codec kernel throughput against device memcpy, in one run. Prints a Markdown table; never asserts.

For --numel elements of --dtype (default 256M bf16) on cuda:0:
  memcpy   ``dst.copy_(src)`` of the input tensor into a preallocated tensor: bytes moved = 2 * numel * itemsize
           (read + write); this is the device bandwidth the kernels are compared with.
  encode   ``quantize.encode_scaled(x, ...)`` into a preallocated wire buffer (the codec dispatch, i.e. the
           Triton kernels for CUDA tensors): bytes moved = numel * itemsize read + wire bytes written.
  decode   ``quantize.decode_scaled(buf, ...)`` into a preallocated output of the input dtype (and of fp32, the
           codec's default): bytes moved = wire bytes read + numel * out itemsize written.
  ef step  (--ef) one LoCo error-feedback step through ``ef_encoder.chunk_encoder`` on the fp32 copy of the
           input (an error already stored): bytes moved = 4n (g) + 4n (e) read + 4n (e') + wire bytes written.
Times: CUDA events around each call, --warmup untimed calls first (the first one compiles the Triton kernels
and is reported separately), then the median of --repeats. ratio = kernel GB/s / memcpy GB/s (both r+w).
Before timing, the encode and decode of the first --check elements are compared bit for bit with the eager
reference on the GPU. MEGACOMP_KERNELS=reference times the eager reference instead.

Run:  python -m benchmarks.bench_kernels_gpu [--numel 256M] [--dtype bf16] [--codecs int8,int4] [--block 128]
      [--rounding stochastic]   (the counter-based draws computed in the encode kernel)
``--numel 16M,256M`` measures each size in turn (one table each, Triton compiled once); ``--json PATH`` also writes
every row (op, codec, dtype, numel, ms, bytes, GB/s, ratio) for scripts/device_checks.sh's results page.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from megacomp import kernels
from megacomp.compression import make_codec, quantize

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_count(s: str) -> int:
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1].lower(), 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def time_cuda(fn, repeats: int, warmup: int, cuda: bool = True) -> tuple[float, float]:
    """(seconds of the first call, median seconds of ``repeats`` calls after ``warmup`` calls); CUDA events,
    or perf_counter for ``--device cpu`` (a smoke run of this script without a GPU)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        fn()
    times = []
    for _ in range(repeats):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return first, statistics.median(times)


def check_identical(codec, x: torch.Tensor) -> str:
    fmt, b, d, sr = codec.format, codec.block_size, codec.dual_scale, codec.rounding == "stochastic"
    g1, g2 = (torch.Generator(device=x.device).manual_seed(0) for _ in range(2))
    ref = quantize.encode_scaled_reference(x.float(), fmt, b, d, sr, g1)
    got = quantize.encode_scaled(x, fmt, b, d, sr, g2)
    dref = quantize.decode_scaled_reference(ref, x.numel(), fmt, b, d)
    dec = quantize.decode_scaled(ref, x.numel(), fmt, b, d)
    ok = torch.equal(got, ref) and torch.equal(dec.view(torch.int32), dref.view(torch.int32))
    return "yes" if ok else "NO"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=lambda s: [parse_count(v) for v in s.split(",") if v.strip()],
                   default=[parse_count("256M")], help="elements, or a comma separated list of sizes (16M,256M)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--codecs", default="int8,int4", help="comma separated codec names (int8,int4,int2,fp8_e4m3,...)")
    p.add_argument("--block", type=int, default=128, help="block size (0: one scale per tensor)")
    p.add_argument("--dual", action="store_true", help="dual scaling")
    p.add_argument("--rounding", choices=("nearest", "stochastic"), default="nearest")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--check", type=parse_count, default=parse_count("1M"), help="elements compared with the reference")
    p.add_argument("--ef", action="store_true", help="also time the one-pass error-feedback step (fp32 input)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run of the script itself (the C++ kernels, perf_counter timing)")
    p.add_argument("--json", default=None, help="also write every row to this JSON file")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_kernels_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    records = []
    for n in args.numel:
        records += measure(args, n)
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        dev_name = torch.cuda.get_device_name(0) if cuda else "cpu (smoke run)"
        with open(args.json, "w") as f:
            json.dump({"device": dev_name, "torch": torch.__version__, "backend": kernels.backend_name(args.device),
                       "repeats": args.repeats, "rows": records}, f, indent=1)


def measure(args, n: int) -> list[dict]:
    """Time every op for ``n`` elements; print the Markdown table; return its rows as dicts."""
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    backend = kernels.backend_name(args.device)
    timed = lambda fn: time_cuda(fn, args.repeats, args.warmup, cuda)
    torch.manual_seed(0)
    x = torch.randn(n, device=dev, dtype=torch.float32).to(dtype)
    isz = x.element_size()

    dst = torch.empty_like(x)
    _, t_mc = timed(lambda: dst.copy_(x))
    del dst
    mc_bytes = 2 * n * isz
    mc = mc_bytes / t_mc / 1e9
    header = ["op", "codec", "ms", "bytes moved (MB)", "GB/s (r+w)", "ratio vs memcpy", "first call s", "bit-identical"]
    rows = [["memcpy copy_", args.dtype, t_mc * 1e3, mc_bytes / 1e6, mc, 1.0, "", ""]]
    for name in [c.strip() for c in args.codecs.split(",") if c.strip()]:
        codec = make_codec(name, block_size=args.block, dual_scale=args.dual, rounding=args.rounding)
        sr = codec.rounding == "stochastic"
        fmt = codec.format
        same = check_identical(codec, x[:min(n, args.check)])
        wire = codec.wire_bytes(n)
        buf = torch.empty(wire, dtype=torch.uint8, device=dev)
        enc = lambda: quantize.encode_scaled(x, fmt, codec.block_size, codec.dual_scale, sr, None, out=buf)
        first, t = timed(enc)
        moved = n * isz + wire
        rows.append([f"encode {args.dtype}", str(codec), t * 1e3, moved / 1e6, moved / t / 1e9, moved / t / 1e9 / mc,
                     first, same])
        for out_dtype in dict.fromkeys([dtype, torch.float32]):
            out = torch.empty(n, dtype=out_dtype, device=dev)
            dec = lambda: quantize.decode_scaled(buf, n, fmt, codec.block_size, codec.dual_scale, out=out)
            first, t = timed(dec)
            moved = wire + n * out.element_size()
            label = str(out_dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float", "fp")
            rows.append([f"decode -> {label}", str(codec), t * 1e3, moved / 1e6, moved / t / 1e9,
                         moved / t / 1e9 / mc, first, same])
            del out
        acc = torch.zeros(n, dtype=torch.float32, device=dev)
        dacc = lambda: quantize.decode_scaled(buf, n, fmt, codec.block_size, codec.dual_scale, accumulate_into=acc)
        first, t = timed(dacc)
        moved = wire + 8 * n
        rows.append(["decode+accumulate fp32", str(codec), t * 1e3, moved / 1e6, moved / t / 1e9, moved / t / 1e9 / mc,
                     first, same])
        del acc, buf
        if args.ef:
            from megacomp.compression import ErrorFeedback
            from megacomp.compression.ef_encoder import chunk_encoder

            g32 = x.float()
            ef = ErrorFeedback("loco")

            def ef_step():
                enc = chunk_encoder(ef, "k", g32, codec)
                enc.encode(0, n)
                enc.commit()

            ef_step()  # an error is stored: the steps below are LoCo's steady state (mode 2)
            first, t = timed(ef_step)
            moved = 12 * n + wire
            rows.append(["ef step fp32 (LoCo)", str(codec), t * 1e3, moved / 1e6, moved / t / 1e9, moved / t / 1e9 / mc,
                         first, ""])
            del g32, ef

    dev_name = torch.cuda.get_device_name(dev) if cuda else "cpu (smoke run)"
    print(f"# megacomp GPU codec kernels: {dev_name}, torch {torch.__version__}, "
          f"backend {backend}, {n:,} {args.dtype} elements, median of {args.repeats} (CUDA events) after "
          f"{args.warmup} warm-up calls\n")
    fmt_v = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(fmt_v(v) for v in r) + " |")
    print()
    return [{"op": r[0], "codec": r[1], "dtype": args.dtype, "numel": n, "ms": r[2], "mb": r[3], "gbps": r[4],
             "ratio": r[5], "first_s": r[6], "identical": r[7]} for r in rows]


if __name__ == "__main__":
    main()

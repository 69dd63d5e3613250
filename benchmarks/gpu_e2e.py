"""End to end on one GPU: the GPT of ``--config`` in bf16, ``--ranks`` data-parallel gloo ranks sharing the device,
megacomp's ZeRO-1 optimizer with compression off and on; tokens/s, MFU, the step split and the loss side by side.

Per configuration (``off``: no codecs; ``on``: ``--grad-codec`` gradients with error feedback and ``--param-codec``
parameters, the codec side stream on), each rank (its own process, the same device, gloo between them; NCCL does
not run two ranks on one GPU) builds the model with the same seed, draws its own token batches from a generator
seeded by (rank, iteration) (the same batches in both configurations), runs ``--warmup`` untimed iterations, then
``--iters`` timed ones (wall clock around all of them; the device is synchronised only at the window's ends), then
one iteration under torch.profiler.

Reported: tokens/s = ranks x micro-batch x seq-length x iters / time (the device's total, every rank's tokens);
MFU = FLOPs per token (Megatron's formula, megacomp.plan.workload.ModelSpec) x tokens/s / the device's dense bf16
peak (megacomp.plan.cluster.DEVICES by device name: H100 and H200 989 TFLOP/s); per iteration: codec = the device
time of megacomp's Triton codec kernels in the profiled iteration (on CPU: the encode + decode spans), wire = the
main thread's time waiting for the backend (megacomp.comm.spans ``wire``; with gloo this includes waiting for the
staging copies, hence for the kernels queued before them), compute = the rest of the iteration. Loss: rank 0's mean
over the timed iterations, compressed next to uncompressed. The profiled iteration of the compressed configuration
is saved as a Chrome trace (``trace_on_rank0.json.gz``): codec kernels on the side stream beside backward.

Run:  python -m benchmarks.gpu_e2e --out DIR [--config configs/gpt_125m.yaml] [--ranks 2] [--device cuda]
``--device cpu`` (with configs/gpt_tiny.yaml) runs the same steps on CPU: a dry run of the script, no figures.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback
from datetime import timedelta

import torch
from benchmarks.spawn_ranks import spawn_ranks

CODEC_KERNELS = ("enc_rows", "enc_flat", "dec_rows", "dec_flat", "ef_rows", "amax_segments", "sign_rows",
                 "sign_segments", "sign_bits", "zero_unless")


def peak_bf16(device_name: str):
    """Dense bf16 FLOP/s of the device named ``device_name`` (megacomp.plan.cluster.DEVICES), or None."""
    from megacomp.plan.cluster import DEVICES

    low = device_name.lower()
    return next((d.peak_flops for d in DEVICES if d.name in low), None)


def _rank(rank, world, init_file, args, settings, q):
    try:
        torch.set_num_threads(1)
        cuda = args.device == "cuda"
        if cuda:
            torch.cuda.set_device(0)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        from benchmarks.memory_bench import model_config
        from megacomp import parallel_state

        dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
        groups = parallel_state.initialize_model_parallel(1)
        gpt, cfg = model_config(args)
        q.put((rank, True, {s: _measure(rank, args, s, gpt, groups, dev, cuda) for s in settings}))
        parallel_state.destroy_model_parallel()
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure(rank, args, setting, gpt, groups, dev, cuda) -> dict:
    """One configuration on this rank (see the module docstring)."""
    from benchmarks.memory_bench import _groups
    from megacomp.comm import spans
    from megacomp.config import ModelParallelConfig
    from megacomp.models.gpt import GPTModel
    from megacomp.optimizer import DistributedOptimizer
    from megacomp.tensor_parallel import vocab_parallel_cross_entropy

    torch.manual_seed(1234)
    model = GPTModel(gpt, ModelParallelConfig(params_dtype=torch.bfloat16, process_groups=groups)).to(dev)
    on = setting == "on"
    opt = DistributedOptimizer(_groups(model, 0.1), torch.optim.AdamW, groups.dp, max_grad_norm=1.0, lr=3e-4,
                               grad_codec=args.grad_codec if on else None,
                               param_codec=args.param_codec if on else None,
                               error_feedback="ef" if on else None, codec_stream=on)

    def iteration(i):
        gen = torch.Generator().manual_seed(1000 * rank + i)
        ids = torch.randint(0, gpt.vocab_size, (args.micro_batch, args.seq_length + 1), generator=gen).to(dev)
        logits = model(ids[:, :-1])
        loss = vocab_parallel_cross_entropy(logits.float(), ids[:, 1:].transpose(0, 1).contiguous(),
                                            tp_group=model.tp_group).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for i in range(args.warmup):
        iteration(i)
    sync()
    spans.enable(True)
    spans.reset()
    t0 = time.perf_counter()
    losses = [iteration(args.warmup + i) for i in range(args.iters)]
    sync()
    elapsed = time.perf_counter() - t0
    tot = spans.totals(spans.records(), exclusive=True).get("main", {})
    spans.enable(False)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        iteration(args.warmup + args.iters)
        sync()
    codec_dev = None
    if cuda:
        codec_dev = sum(e.self_device_time_total for e in prof.key_averages()
                        if any(k in e.key for k in CODEC_KERNELS)) / 1e6
    if rank == 0 and on:
        prof.export_chrome_trace(os.path.join(args.out, "trace_on_rank0.json.gz"))
    per = elapsed / args.iters
    codec = codec_dev if codec_dev is not None else (tot.get("encode", 0.0) + tot.get("decode", 0.0)) / args.iters
    wire = tot.get("wire", 0.0) / args.iters
    flops = _flops_per_token(gpt, args.seq_length)
    return {"iteration_s": per, "codec_s": codec, "wire_s": wire, "compute_s": max(per - codec - wire, 0.0),
            "loss": float(torch.stack(losses).mean()), "flops_per_token": flops,
            "params": sum(p.numel() for p in model.parameters())}


def _flops_per_token(gpt, seq_length: int) -> float:
    from megacomp.plan.workload import ModelSpec

    spec = ModelSpec(num_layers=gpt.num_layers, hidden_size=gpt.hidden_size,
                     num_attention_heads=gpt.num_attention_heads, seq_length=seq_length, vocab_size=gpt.vocab_size,
                     ffn_hidden_size=gpt.ffn_hidden_size)
    return spec.flops_per_token


def launch(settings, args):
    """``args.ranks`` spawned gloo ranks (benchmarks.spawn_ranks), each running every setting in turn."""
    return spawn_ranks(_rank, args.ranks, (args, settings), timeout=args.timeout, prefix="gpu-e2e-")


def table(results: dict, args, device_name: str) -> str:
    peak = peak_bf16(device_name) if args.device == "cuda" else None
    tokens = args.ranks * args.micro_batch * args.seq_length
    lines = [f"# End to end: {args.config} in bf16, {args.ranks} DP gloo ranks on one {device_name}", "",
             f"Command: `python -m benchmarks.gpu_e2e --config {args.config} --ranks {args.ranks} --micro-batch "
             f"{args.micro_batch} --seq-length {args.seq_length} --iters {args.iters} --warmup {args.warmup} "
             f"--grad-codec {args.grad_codec} --param-codec {args.param_codec} --device {args.device}`", "",
             f"Peak (dense bf16) used for MFU: {f'{peak / 1e12:.0f} TFLOP/s' if peak else 'n/a'}", "",
             "| compression | tokens/s | MFU | iteration ms | compute ms | codec ms | wire ms | loss (rank 0, mean) |",
             "|---|---|---|---|---|---|---|---|"]
    for setting, ranks in results.items():
        r0 = ranks[0]
        per = max(r["iteration_s"] for r in ranks)
        tps = tokens / per
        mfu = f"{r0['flops_per_token'] * tps / peak:.1%}" if peak else "-"
        label = "off" if setting == "off" else f"on ({args.grad_codec} grads + EF, {args.param_codec} params)"
        lines.append(f"| {label} | {tps:,.0f} | {mfu} | {per * 1e3:.1f} | {r0['compute_s'] * 1e3:.1f} | "
                     f"{r0['codec_s'] * 1e3:.2f} | {r0['wire_s'] * 1e3:.1f} | {r0['loss']:.4f} |")
    lines += ["", f"Model: {results['off'][0]['params'] / 1e6:.1f}M parameters, "
              f"{results['off'][0]['flops_per_token'] / 1e9:.2f} GFLOP per token (forward + backward)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/gpt_125m.yaml")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--grad-codec", default="int8")
    p.add_argument("--param-codec", default="int8")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--timeout", type=float, default=400.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_e2e: skipped, no CUDA GPU (torch.cuda.is_available() is False); use --device cpu for a dry run")
        return 2
    if args.ranks < 1 or args.iters < 1:
        raise SystemExit(f"gpu_e2e: --ranks and --iters must be >= 1, got {args.ranks} and {args.iters}")
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    per_rank = launch(("off", "on"), args)  # one set of processes: both configurations in turn
    results = {s: [r[s] for r in per_rank] for s in ("off", "on")}
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU (dry run)"
    text = table(results, args, name)
    pathlib.Path(args.out, "e2e.md").write_text(text)
    pathlib.Path(args.out, "e2e.json").write_text(json.dumps({"device": name, "results": results}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

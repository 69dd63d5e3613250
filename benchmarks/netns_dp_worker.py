"""One rank of benchmarks/netns_bench.py's DP-step workloads (``ddp``, ``profile``): a small GPT (TP 1) trained with one
method's data-parallel communication, on two ranks that torchrun-style environment variables describe.

    python -m benchmarks.netns_dp_worker METHOD ITERS HIDDEN LAYERS BUCKET_MB [profile] [seed=N] [flush_denormal]

Methods: torch DDP (fp32, its fp16/bf16 and PowerSGD hooks), ZeroRedundancyOptimizer, a no-communication floor,
megacomp's DDP hook (int4 + LoCo, PowerSGD, Accordion), the 1-bit family, megacomp's sharded optimizer and ACCO / DPU
over it. Rank 0 prints one ``RESULT {json}`` line: per-iteration step times (barrier to barrier, everything
included) and losses, the
parameter count, wire bytes per step, and with ``profile`` the mean exclusive seconds per step of each
megacomp.comm.spans phase, per thread kind.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Optional


DDP_METHODS = ("no_communication", "ddp_fp32", "ddp_fp16_hook", "ddp_bf16_hook", "ddp_powersgd1", "ddp_powersgd4",
               "zero_redundancy", "megacomp_hook_int4_loco")
# megacomp's PowerSGD hook (default buckets: it works on gloo with several) and Accordion over its ranks 4 / 1
LOW_RANK_METHODS = ("megacomp_powersgd1", "megacomp_powersgd4", "megacomp_accordion")
# the 1-bit family (megacomp.optimizer.onebit, unsharded: no DDP wrapper, the optimizer exchanges gradients
# during the warm-up, the first 20% of the iterations, then 1-bit momentum); wire bytes are the mean per
# iteration after the warm-up, measured
ONEBIT_METHODS = ("megacomp_onebit_adam", "megacomp_zero_one_adam", "megacomp_zero_one_adam_c4v128",
                  "megacomp_onebit_lamb", "megacomp_onebit_adam_in_step", "megacomp_onebit_adam_bf16_warmup",
                  "megacomp_onebit_adam_bf16_warmup_in_step")
# 1-bit Adam variants: the momentum exchanged in step() (overlap_momentum=False; the default starts it in backward),
# and the warm-up's gradient all-reduce in bf16 instead of fp32 (the variance frozen after it stays nonzero: an integer
# codec rounds small entries to 0, their frozen variance is 0 and the update divides by eps)
ONEBIT_ADAM_OPTIONS = {"megacomp_onebit_adam": {}, "megacomp_onebit_adam_in_step": {"overlap_momentum": False},
                       "megacomp_onebit_adam_bf16_warmup": {"grad_codec": "bf16"},
                       "megacomp_onebit_adam_bf16_warmup_in_step": {"grad_codec": "bf16", "overlap_momentum": False}}
# 0/1 Adam at DeepSpeed's interval shape, and at the setting benchmarks/results/convergence_onebit finds within 2% of AdamW:
# sync interval clipped at 4, the variance refreshed at every step until its freeze (var_update_scaler 128)
ZERO_ONE_SETTINGS = {"megacomp_zero_one_adam": {}, "megacomp_zero_one_adam_c4v128": {"local_step_clipper": 4,
                                                                                     "var_update_scaler": 128}}
# megacomp's sharded optimizer without a DDP wrapper (ZeRO-1, int4 + LoCo gradients, int8 parameter all-gathers), and
# the same overlapped by ACCO (two halves of the batch, megacomp.optimizer.acco), also uncompressed, and by DPU (the
# update one step late, no halves); wire bytes are the last iteration's, every dp_* kind (ACCO: an estimate and an
# update per step); and ZeRO-1 with its parameter all-gather overlapped with the next forward
SHARDED_METHODS = ("megacomp_zero1_int4_loco_int8", "megacomp_acco_int4_loco_int8", "megacomp_acco_fp32",
                   "megacomp_dpu_int4_loco_int8", "megacomp_zero1_overlap_gather_int4_loco_int8")
ACCORDION_HOOK = {"name": "accordion", "low": {"name": "powersgd", "rank": 4}, "high": {"name": "powersgd", "rank": 1},
                  "eta": 0.5, "interval": 15}


def powersgd_bytes(model, rank: int, world: int) -> int:
    """Bytes each rank sends per step under torch's PowerSGD hook (one bucket; ring all-reduces, as gloo
    runs them): matrices with m*n > (m+n)*rank*2 send P (n x r) and Q (m x r) in fp32, the rest is
    all-reduced uncompressed (torch's min_compression_rate rule)."""
    elems = 0
    for p in model.parameters():
        if p.dim() > 1:
            m, n = p.shape[0], p.numel() // p.shape[0]
            r = min(m, n, rank)
            elems += (m + n) * r if m * n > (m + n) * r * 2 else m * n
        else:
            elems += p.numel()
    return int(elems * 4 * 2 * (world - 1) / world)


def ddp_worker(method: str, iters: int, hidden: int, layers: int, bucket_mb: float = 25.0, profile: bool = False,
               seed: Optional[int] = None, flush_denormal: bool = False) -> None:
    """One rank of a torch-DDP training run of a small GPT (TP 1) with ``method``'s communication. ``profile``: record
    megacomp.comm.spans from iteration 3 on and report rank 0's exclusive seconds per phase and thread, per step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from megacomp import comm, parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.data import DistributedBatchSampler, get_batch, prepare_data
    from megacomp.launch import init_distributed
    from megacomp.models.gpt import GPTConfig, GPTModel
    from megacomp.optimizer import CompressedHookState, compressed_allreduce_hook

    torch.set_num_threads(1)
    # subnormal floats slow x86 arithmetic many times over (GPUs do not pay this); the 1-bit family's weights lead
    # some seeds' forward/backward into them on CPU: flushing them measures its step without that artefact
    torch.set_flush_denormal(flush_denormal)
    init_distributed()
    world = dist.get_world_size()
    groups = parallel_state.initialize_model_parallel(1, 1)
    tok, data = prepare_data(None, 1024, 64)
    cfg = GPTConfig(hidden_size=hidden, num_attention_heads=4, num_layers=layers, vocab_size=1024, max_seq_length=64,
                    **({"seed": 1234 + seed} if seed is not None else {}))  # seed: weights and data order
    model = GPTModel(cfg, ModelParallelConfig(process_groups=groups))
    params = sum(p.numel() for p in model.parameters())
    one_bucket = method.startswith("ddp_powersgd")  # torch's PowerSGD hook breaks with several buckets on gloo
    freeze = max(1, iters // 5)
    # ACCO and DPU are sharded methods of their own ("megacomp_accordion" is not ACCO)
    acco, dpu = method.startswith("megacomp_acco_"), method.startswith("megacomp_dpu_")
    bare = method in ONEBIT_METHODS or method in SHARDED_METHODS  # the optimizer does the exchange, no DDP wrapper
    ddp = model if bare else DDP(model, bucket_cap_mb=1024 if one_bucket else bucket_mb)
    wire = {"ddp_fp32": 4, "zero_redundancy": 4, "ddp_fp16_hook": 2, "ddp_bf16_hook": 2}.get(method, 0) * params
    wire = int(wire * 2 * (world - 1) / world)  # ring all-reduce
    if method == "zero_redundancy":
        wire += int(4 * params * (world - 1) / world)  # each rank's updated shard broadcast to the others
    if method == "ddp_fp16_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "ddp_bf16_hook":
        # DDP refuses the hook by name without CUDA/NCCL; gloo all-reduces bf16 on CPU, so call it through
        # a wrapper (same function, same bytes)
        ddp.register_comm_hook(None, lambda st, bucket: default_hooks.bf16_compress_hook(st, bucket))
    elif method.startswith("ddp_powersgd"):
        rank = int(method[len("ddp_powersgd"):])
        ddp.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank,
                                                           start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
        wire = powersgd_bytes(model, rank, world)
    elif method == "no_communication":  # the compute floor: buckets are not averaged (timing only)
        def no_comm(_state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        ddp.register_comm_hook(None, no_comm)
    elif method == "megacomp_hook_int4_loco":
        ddp.register_comm_hook(CompressedHookState(codec="int4", error_feedback="loco"), compressed_allreduce_hook)
    elif method.startswith("megacomp_powersgd"):
        rank = int(method[len("megacomp_powersgd"):])
        ddp.register_comm_hook(CompressedHookState(codec={"name": "powersgd", "rank": rank}), compressed_allreduce_hook)
    elif method == "megacomp_accordion":
        ddp.register_comm_hook(CompressedHookState(codec=ACCORDION_HOOK), compressed_allreduce_hook)
    if method in ONEBIT_METHODS:
        from megacomp.optimizer import OneBitAdam, OneBitLamb, ZeroOneAdam
        for p in model.parameters():  # what DDP's constructor does: every rank starts from rank 0's weights
            dist.broadcast(p.data, 0)
        kw = dict(lr=1e-3, shard=False, bucket_size=int(bucket_mb * (1 << 20) / 4))
        opt = (OneBitAdam(model.parameters(), freeze_step=freeze, **kw, **ONEBIT_ADAM_OPTIONS[method])
               if method in ONEBIT_ADAM_OPTIONS else
               # LAMB's step is relative to the weight norm: lr 1e-2 (benchmarks/results/convergence_onebit)
               OneBitLamb(model.parameters(), freeze_step=freeze, **{**kw, "lr": 1e-2}) if method == "megacomp_onebit_lamb" else
               ZeroOneAdam(model.parameters(), var_freeze_step=freeze, local_step_scaler=max(1, iters // 10),
                           **ZERO_ONE_SETTINGS[method], **kw))
    elif method in SHARDED_METHODS:
        from megacomp.optimizer import DistributedOptimizer
        from megacomp.optimizer.acco import ACCO
        for p in model.parameters():  # every rank starts from rank 0's weights
            dist.broadcast(p.data, 0)
        codecs = {} if method.endswith("fp32") else dict(
            grad_codec={"name": "int4", "block_size": 128}, error_feedback="loco",
            param_codec={"name": "int8", "block_size": 256}, min_compress_numel=4096)
        opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3,
                                   bucket_size=int(bucket_mb * (1 << 20) / 4), **codecs)
        if acco or dpu:
            opt = ACCO(opt, delay_compensation=acco)  # dpu: the update one step late, no halves
        elif "overlap_gather" in method:  # the parameter all-gather finishes per bucket in the next forward
            opt.overlap_param_gather(model)
    elif method == "zero_redundancy":
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sampler = iter(DistributedBatchSampler(len(data), 8, dist.get_rank(), world, seed=1 if seed is None else seed))
    from megacomp.comm import spans
    times, losses, windows = [], [], []
    # Each iteration is timed from one barrier to the next and includes everything in between (the batch, the loss
    # all-reduce): communication left in flight by one step (an overlapped all-gather, ACCO's jobs) is then paid
    # inside some iteration, never in an untimed gap; the last iteration waits for it before its barrier.
    overlapped = acco or dpu or "overlap_gather" in method
    dist.barrier()
    t_prev, t_prev_ns = time.perf_counter(), time.perf_counter_ns()
    for it in range(iters):
        if it == (freeze if method in ONEBIT_METHODS else iters - 1):
            comm.reset_stats()
        if profile and it == 2:
            spans.enable()
        ids, labels = get_batch(data, next(sampler))
        if acco:  # half A at the estimate, half B at the parameters (megacomp.optimizer.acco)
            h = ids.shape[0] // 2
            with spans.span("forward_backward"):
                first = ddp(ids[:h], labels[:h])
                (first / 2).backward()
            opt.estimate(2.0)
            with spans.span("forward_backward"):
                second = ddp(ids[h:], labels[h:])
                (second / 2).backward()
            opt.step()
            loss = (first + second) / 2
        else:
            if not bare:
                opt.zero_grad()
            with spans.span("forward_backward"):  # under torch DDP this includes the reducer's all-reduce waits
                loss = ddp(ids, labels)
                loss.backward()
            opt.step()
        l = loss.detach().reshape(1)
        dist.all_reduce(l)
        if it == iters - 1 and overlapped:
            # wire bytes of one step (ACCO: an estimate and an update; the gather: the one launched by this step),
            # then the last step's communication lands inside this iteration
            last_step_wire = sum(s.wire_bytes for k, s in comm.stats().items() if k.startswith("dp_"))
            opt.finish() if (acco or dpu) else opt.wait_params()
        dist.barrier()
        now, now_ns = time.perf_counter(), time.perf_counter_ns()
        times.append(now - t_prev)
        windows.append((t_prev_ns, now_ns))
        t_prev, t_prev_ns = now, now_ns
        losses.append(l.item() / world)
    if method in ONEBIT_METHODS:  # measured: mean per iteration after the warm-up, every dp_* kind
        wire = sum(s.wire_bytes for k, s in comm.stats().items() if k.startswith("dp_")) // (iters - freeze)
    elif method in SHARDED_METHODS:  # measured, last iteration, gradients and parameters
        wire = last_step_wire if overlapped else sum(s.wire_bytes for k, s in comm.stats().items()
                                                     if k.startswith("dp_"))
    elif method.startswith("megacomp"):
        wire = comm.stats()["dp_gradient"].wire_bytes  # measured, last iteration
    result = {"times": times, "losses": losses, "params": params, "wire": wire, "flush_denormal": flush_denormal}
    if profile:  # mean exclusive seconds per step of each phase, iterations 3..
        recs, prof = spans.records(), {}
        for start, end in windows[2:]:
            for kind, phases in spans.totals(recs, start, end, exclusive=True).items():
                for name, sec in phases.items():
                    prof.setdefault(kind, {}).setdefault(name, 0.0)
                    prof[kind][name] += sec / len(windows[2:])
        result["profile"] = prof
        spans.enable(False)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    extra = sys.argv[6:]  # "profile", "seed=N", "flush_denormal"
    seeds = [int(a[5:]) for a in extra if a.startswith("seed=")]
    ddp_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]),
               "profile" in extra, seeds[0] if seeds else None, "flush_denormal" in extra)

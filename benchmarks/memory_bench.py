"""Measured peak memory per rank, split into parameters, gradients, optimizer state, activations and
communication buffers, for AdamW (torch DDP), megacomp's DistributedOptimizer as ZeRO-1 and ZeRO-2, LOMO and
AdaLomo.

    python -m benchmarks.memory_bench                 # 125M config, DP 2 gloo ranks, writes benchmarks/results/memory/
    python -m benchmarks.memory_bench --dp 1 --methods lomo,adalomo --out /tmp/mem
    python -m benchmarks.memory_bench --dp 4 --methods zero1,zero2 --out benchmarks/results/memory/zero2

Every rank builds the GPT of ``--config`` (all parameter shapes of that config: vocabulary padded to a
multiple of 8 as the trainer does, the position table of the config's context length), runs ``--warmup``
iterations of a method, then one measured iteration inside a megacomp.training.memory.MemoryTracker (a
dispatch mode counting live storage bytes per category; its docstring says what is and is not counted).
``--seq-length`` / ``--micro-batch-size`` only change activations (shortened by default so a CPU run takes
minutes); parameters are fp32 on CPU (``--params-dtype bfloat16`` for a GPU run: CPU bf16 matmuls are ~15x
slower). On CUDA (``--device cuda``, one GPU per rank) torch.cuda.max_memory_allocated is reported next to the
tracked peak; on CPU the process's peak RSS (VmHWM, reset before the measured iteration) is the sanity column.

Methods are data: METHODS maps a name to a builder ``(model, dp_group, tracker, args) -> Method``; a LoQT row is
one more entry (added automatically when megacomp.tensor_parallel.loqt exists and exposes ``bench_builder``).

The gradient check (LOMO's memory bound): for LOMO / AdaLomo the measured peak of live gradient bytes must not
exceed the largest parameter's gradient plus one communication bucket, both measured (the bucket is the
largest message the method's DP gradient channel sent). PASS / FAIL comes from the numbers, nothing else.

The ZeRO check (ZeRO-2's memory target): with both ZeRO rows, a further table compares the peak of the optimizer's
own gradient storage (its full-size bucket buffers plus its reduced shards, measured as tracker label groups) with
ZeRO-1's buffers / DP + the largest bucket (benchmarks/memory_report.py renders the tables).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool
REPO = Path(__file__).resolve().parents[1]  # the checkout: default config and output folder

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.memory_report import ZERO_GROUPS, grad_detail, plot, table, zero_table  # noqa: E402
from megacomp.training.memory import PARTIAL, MemoryTracker, reset_rss_peak, rss  # noqa: E402
from benchmarks.spawn_ranks import spawn_ranks  # noqa: E402


# -- methods ----------------------------------------------------------------------------------------
@dataclass
class Method:
    """One way to train: ``step(ids, labels)`` runs a whole iteration (forward under the tracker's ``act``
    category, backward, reduction, update). ``bucket_bytes``: the largest gradient message / bucket seen so
    far. ``grad_bound``: whether LOMO's gradient bound applies (LOMO / AdaLomo)."""

    step: Callable
    bucket_bytes: list = field(default_factory=lambda: [0])
    warmup: int = 1
    grad_bound: bool = False
    notes: str = ""
    extra: dict = field(default_factory=dict)
    """More fields for the result row."""


def _forward(model, tracker, ids, labels, watch=None, twice=False):
    """The GPT's loss, as GPTModel.forward computes it, except that ``twice`` keeps the cross entropy's softmax
    intact in backward (inplace_backward=False: one more logits-sized temporary) so that the graph can be
    backpropagated twice (LOMO's norm pass); GPTModel.forward always takes the in-place path."""
    from megacomp.tensor_parallel import vocab_parallel_cross_entropy

    inner = watch if watch is not None else model
    with tracker.category("act"):
        logits = model(ids)
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), tp_group=inner.tp_group,
                                            inplace_backward=not twice).mean()
    tracker.watch_graph(loss, inner)
    return loss


def _tag_state(tracker, optimizer) -> None:
    for st in optimizer.state.values():
        tracker.tag([v for v in st.values() if isinstance(v, torch.Tensor)], "optim")


def _groups(model, wd):
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": wd},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def build_adamw(model, dp, tracker, args) -> Method:
    """torch AdamW on whole parameters; gradients all-reduced by torch DDP (gradient_as_bucket_view=True: the
    gradients are views of DDP's flat buckets, so the buckets are the gradient memory); clip 1.0."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, process_group=dp, gradient_as_bucket_view=True)
    sizes = [0]

    def hook(state, bucket):
        buf = bucket.buffer()
        tracker.tag(buf, "grad", f"DDP bucket {bucket.index()}")
        sizes[0] = max(sizes[0], buf.numel() * buf.element_size())
        with tracker.category("comm"):
            return allreduce_hook(state, bucket)

    ddp.register_comm_hook(dp, hook)
    opt = torch.optim.AdamW(_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))

    def step(ids, labels):
        loss = _forward(ddp, tracker, ids, labels, watch=model)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        opt.step()
        _tag_state(tracker, opt)
        opt.zero_grad(set_to_none=True)
    # DDP rebuilds its buckets in the second iteration's forward: two warm-up iterations
    return Method(step, sizes, warmup=max(2, args.warmup), notes="torch DDP, gradient_as_bucket_view, 25 MB buckets")


def build_zero(model, dp, tracker, args, stage: int = 1) -> Method:
    """megacomp.optimizer.DistributedOptimizer, ZeRO-1 (``stage`` 1: fp32 flat gradient buckets for the whole step) or
    ZeRO-2 (2: a bucket's full-size buffer lives from its first gradient of a backward until it is reduce-scattered;
    this rank's fp32 shard accumulates): the buffers (grad), fp32 master shards and AdamW state (optim), reduce-scatter
    outputs and parameter all-gather buffers (comm). The optimizer's own gradient storage, full-size buffers plus
    reduced shards whatever their category, is also summed as label groups (the ZeRO table)."""
    from megacomp.optimizer import DistributedOptimizer

    opt = DistributedOptimizer(_groups(model, args.weight_decay), torch.optim.AdamW, dp, max_grad_norm=args.clip_grad,
                               lr=args.lr, betas=(0.9, 0.95), zero_stage=stage, bucket_size=args.bucket_size)
    for name, prefix in ZERO_GROUPS.items():
        tracker.track_labels(name, prefix)
    for b in opt.buckets:
        if b.grad is not None:
            tracker.tag(b.grad, "grad", f"optimizer: bucket {b.index} ({b.numel} elements)")
    tracker.tag(list(opt.masters), "optim")
    launch, sync, new_buffer = opt._launch, opt.sync_params, opt._grad_buffer

    def launch_comm(b):
        with tracker.category("comm"):
            launch(b)
        for t in (b.reduced, b.pending):  # the reduced shard (ZeRO-2: accumulated; a later micro-batch's temporary)
            if t is not None:
                tracker.label(t, f"optimizer: shard {b.index}")

    def sync_comm():
        with tracker.category("comm"):
            sync()

    def grad_buffer(b):  # ZeRO-2: one backward's buffer of a bucket
        buf = new_buffer(b)
        tracker.tag(buf, "grad", f"optimizer: bucket {b.index} ({b.numel} elements)")
        return buf
    opt._launch, opt.sync_params, opt._grad_buffer = launch_comm, sync_comm, grad_buffer
    sizes = [max(b.padded * 4 for b in opt.buckets)]
    # buckets fill in parallel per param group (decay / no-decay here): the largest of each, for ZeRO-2's expectation
    per_group = [max(b.padded * 4 for b in opt.buckets if b.group == g) for g in sorted({b.group for b in opt.buckets})]

    def step(ids, labels):
        _forward(model, tracker, ids, labels).backward()
        opt.step()
        _tag_state(tracker, opt.optimizer)
    return Method(step, sizes, warmup=args.warmup, notes=f"megacomp DistributedOptimizer zero_stage={stage}, "
                                                          f"{args.bucket_size:,}-element buckets",
                  extra={"largest_bucket_per_group": per_group})


def _lomo(cls, model, dp, tracker, args, **kw) -> Method:
    from megacomp.training.features.lomo_fused import tie_for_fused_update

    opt = cls(model, lr=args.lr, weight_decay=args.weight_decay, clip_grad_norm=args.clip_grad, dp_group=dp, **kw)
    # as pretraining does: one gradient buffer for the tied word embedding (the lookup's backward adds into the
    # output layer's partial), and the reduction in flight finished before that backward
    tie_for_fused_update(model, opt)
    for name, st in getattr(opt, "state", {}).items():
        tracker.tag(list(st.values()), "optim", name)
    sizes = [0]
    for ch in (opt.channel, opt._norm_channel):  # the update pass's channel and the norm pass's sibling
        def all_reduce(buf, *a, _orig=ch.all_reduce, **k):
            sizes[0] = max(sizes[0], buf.numel() * buf.element_size())  # in place: the buffer is the gradient
            with tracker.category("comm"):
                return _orig(buf, *a, **k)
        ch.all_reduce = all_reduce

    def step(ids, labels):
        loss = _forward(model, tracker, ids, labels, twice=opt.needs_norm_pass)
        if opt.needs_norm_pass:
            opt.grad_norm(loss)
        opt.fused_backward(loss, args.lr)
    return Method(step, sizes, warmup=args.warmup, grad_bound=True,
                  notes=f"clip_grad_norm {args.clip_grad} (two backward passes)" if args.clip_grad else "")


def build_lomo(model, dp, tracker, args) -> Method:
    """megacomp.optimizer.Lomo: SGD fused into backward, DP all-reduce per parameter inside the hook."""
    from megacomp.optimizer.lomo import Lomo
    return _lomo(Lomo, model, dp, tracker, args)


def build_adalomo(model, dp, tracker, args) -> Method:
    """megacomp.optimizer.AdaLomo: factored second moment (optim), otherwise as LOMO."""
    from megacomp.optimizer.lomo import AdaLomo
    return _lomo(AdaLomo, model, dp, tracker, args)


def build_loqt(model, dp, tracker, args) -> Method:
    """megacomp.tensor_parallel.loqt: every linear layer converted (int8 base weights ``qweight`` and the
    projection ``proj``, counted as parameters; trainable factors B of rank ``--loqt-rank``), torch AdamW on the
    trainable parameters (B, biases, norms, embeddings), their gradients all-reduced in place per tensor. The
    measured iteration is an ordinary one (the warm-up iteration 0 is the schedule's first merge)."""
    from megacomp.tensor_parallel.loqt import LoQT, convert_to_loqt

    layers = convert_to_loqt(model, args.loqt_rank, codec={"name": "int8", "block_size": args.loqt_block})
    loqt = LoQT(model, dp_group=dp)
    tracker.watch_params(model)  # the new factors
    for m in layers:
        tracker.tag([b for b in m.buffers()], "param")  # quantised base weights and projections
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    sizes, world, it = [0], dist.get_world_size(dp), [0]

    def step(ids, labels):
        merge = loqt.wants_full_gradient(it[0])
        if merge:
            loqt.start_full_gradient()
        _forward(model, tracker, ids, labels).backward()
        if merge:
            loqt.merge_and_reinit(it[0])
        else:
            for p in params:
                if p.grad is not None:
                    sizes[0] = max(sizes[0], p.grad.numel() * p.grad.element_size())
                    with tracker.category("comm"):
                        dist.all_reduce(p.grad, group=dp)
                    p.grad.div_(world)
            torch.nn.utils.clip_grad_norm_(params, args.clip_grad or float("inf"))
            opt.step()
            _tag_state(tracker, opt)
        opt.zero_grad(set_to_none=True)
        it[0] += 1
    return Method(step, sizes, warmup=max(2, args.warmup),
                  notes=f"rank {args.loqt_rank}, int8/b{args.loqt_block} base, AdamW on the factors, per-tensor all-reduce")


# name -> builder: a further row is one more entry
METHODS: dict[str, Callable] = {"adamw": build_adamw, "zero1": build_zero, "zero2": functools.partial(build_zero, stage=2),
                                "lomo": build_lomo, "adalomo": build_adalomo, "loqt": build_loqt}


# -- one rank ---------------------------------------------------------------------------------------
def model_config(args):
    """GPTConfig of ``args.config`` (vocabulary padded to a multiple of 8, as the trainer pads it at TP 1)."""
    import yaml

    from megacomp.models.gpt import GPTConfig

    cfg = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    over = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
            if getattr(args, k, None) is not None}
    cfg.update(over)
    vocab = -(-int(cfg["vocab_size"]) // 8) * 8
    return GPTConfig(hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"],
                     num_layers=cfg["num_layers"], vocab_size=vocab,
                     max_seq_length=max(int(cfg.get("seq_length", args.seq_length)), args.seq_length),
                     ffn_hidden_size=cfg.get("ffn_hidden_size")), cfg


def run_rank(args, method: str) -> dict:
    """Build the model and ``method`` on this (initialised) rank, warm up, measure one iteration."""
    from megacomp import parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.models.gpt import GPTModel

    device = torch.device(args.device)
    groups = parallel_state.initialize_model_parallel(1)
    gpt, _ = model_config(args)
    dtype = getattr(torch, args.params_dtype)
    model = GPTModel(gpt, ModelParallelConfig(params_dtype=dtype, process_groups=groups)).to(device)
    rank = dist.get_rank(groups.dp)
    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, gpt.vocab_size, (args.micro_batch_size, args.seq_length), generator=gen).to(device)
    labels = torch.randint(0, gpt.vocab_size, (args.micro_batch_size, args.seq_length), generator=gen).to(device)
    tracker = MemoryTracker(device.type)
    with tracker:
        tracker.watch_params(model)
        m = METHODS[method](model, groups.dp, tracker, args)
        for _ in range(m.warmup):
            m.step(ids, labels)
    # one iteration without the dispatch mode: the process's RSS growth, unperturbed by the tracker
    gc.collect()
    reset_ok = reset_rss_peak()
    plain0 = rss()
    m.step(ids, labels)
    plain1 = rss()
    gc.collect()
    with tracker:
        tracker.reset_peak()
        start = tracker.summary()["current"]
        reset_rss_peak()
        rss0 = rss()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            cuda0 = torch.cuda.memory_allocated()
        m.step(ids, labels)
        if device.type == "cuda":
            torch.cuda.synchronize()
    out = tracker.summary()
    out.update(method=method, rank=rank, start=start, rss_start=rss0, rss_end=rss(), rss_peak_reset=reset_ok,
               rss_untracked_start=plain0, rss_untracked_end=plain1,
               bucket_bytes=m.bucket_bytes[0], grad_bound_applies=m.grad_bound, notes=m.notes, **m.extra,
               largest_grad_bytes=max(p.numel() * p.element_size() for p in model.parameters()),
               param_count=sum(p.numel() for p in model.parameters()))
    if device.type == "cuda":
        out.update(cuda_start=cuda0, cuda_max_allocated=torch.cuda.max_memory_allocated())
    out["grad_bound_bytes"] = out["largest_grad_bytes"] + out["bucket_bytes"]
    out["grad_bound_ok"] = out["cat_peak"]["grad"] <= out["grad_bound_bytes"]
    out["whole_grad_bound_ok"] = out["whole_grad_peak"] <= out["grad_bound_bytes"]
    out["partial_at_grad_peak"] = sum(b for n, b in out["grad_live_at_peak"] if n.endswith(PARTIAL))
    parallel_state.destroy_model_parallel()
    return out


def _worker(rank, world, init_file, args, method, queue):
    try:
        torch.set_num_threads(1)
        if args.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=args.timeout))
        queue.put((rank, True, run_rank(args, method)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(args, method: str) -> list[dict]:
    """Fresh processes per method (spawned, so no rank inherits another method's heap): ``args.dp`` gloo ranks."""
    try:
        return spawn_ranks(_worker, args.dp, (args, method), timeout=args.timeout, prefix="megacomp-membench-")
    except RuntimeError as e:
        raise RuntimeError(f"{method}: {e}") from None


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "gpt_125m.yaml"))
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {sorted(METHODS)}")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel ranks (gloo)")
    ap.add_argument("--seq-length", type=int, default=128, help="tokens per sample (the config's 2048 is slow on CPU)")
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--params-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--warmup", type=int, default=1, help="iterations before the measured one (AdamW/DDP: >= 2)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip-grad", type=float, default=1.0, help="0: no clipping (LOMO then runs one backward)")
    ap.add_argument("--num-layers", type=int), ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--num-attention-heads", type=int), ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--bucket-size", type=int, default=1 << 22, help="ZeRO rows: DistributedOptimizer bucket_size "
                    "(elements; its default)")
    ap.add_argument("--loqt-rank", type=int, default=128)
    ap.add_argument("--loqt-block", type=int, default=128, help="int8 block size of LoQT's base weights")
    ap.add_argument("--update", action="store_true", help="keep the other methods' rows of OUT/results.json")
    ap.add_argument("--report-only", action="store_true", help="re-render OUT/results.json, run nothing")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "memory"), help="table.md, results.json, memory.png")
    args = ap.parse_args(argv)
    args.clip_grad = args.clip_grad or None
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; known: {sorted(METHODS)}")
    rows = []
    if args.report_only:
        saved = json.loads((Path(args.out) / "results.json").read_text())
        rows, args = saved["rows"], argparse.Namespace(**{**vars(args), **saved["args"], "out": args.out, "update": False})
    for method in [] if rows else args.methods.split(","):
        print(f"memory_bench: {method} on {args.dp} rank(s) ...", flush=True)
        rows += launch(args, method)
    if args.update and (Path(args.out) / "results.json").exists():
        kept = [r for r in json.loads((Path(args.out) / "results.json").read_text())["rows"]
                if r["method"] not in args.methods.split(",")]
        rows = sorted(kept + rows, key=lambda r: (list(METHODS).index(r["method"]), r["rank"]))
    gpt, _ = model_config(args)
    setup = (f"GPT {gpt.num_layers} layers, hidden {gpt.hidden_size}, {gpt.num_attention_heads} heads, vocab "
             f"{gpt.vocab_size}, position table {gpt.max_seq_length}: {rows[0]['param_count']:,} parameters in "
             f"{args.params_dtype}; DP {args.dp} ({args.device}, gloo); micro-batch {args.micro_batch_size} x "
             f"seq {args.seq_length}; clip {args.clip_grad}; MiB per rank, measured iteration after "
             f"{args.warmup} warm-up (AdamW/DDP 2)")
    text = f"{setup}\n\n{table(rows, args)}\n\nGradients alive at the gradient peak:\n\n{grad_detail(rows)}\n"
    zt = zero_table(rows, args.dp)
    if zt:
        text += f"\nZeRO-1 vs ZeRO-2, the optimizer's gradient storage (MiB per rank):\n\n{zt}\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"setup": setup, "args": vars(args), "rows": rows}, indent=1) + "\n")
    plot(rows, out / "memory.png")
    print(f"memory_bench: wrote {out / 'table.md'}, {out / 'results.json'}, {out / 'memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a torch-DDP or FSDP2 pretraining run with a chosen gradient communication (run under torchrun).

    torchrun --standalone --nproc-per-node 4 -m benchmarks.ddp_convergence --config configs/gpt_tiny.yaml \
        --train-iters 500 --log-dir runs/x --hook torch_powersgd:4

It trains the same model on the same data as ``python -m megacomp.pretrain`` at TP 1 x PP 1 (the tiny GPT,
the sentencepiece token file, the data-parallel batch sampler, AdamW with weight decay on the matrices,
the warm-up + cosine schedule, gradient clipping, micro-batch accumulation under ``no_sync``), but the
data-parallel gradients go through torch DDP and ``--hook``:

  none                 megacomp's hook with codec None: bit-identical to DDP's default all-reduce (counted)
  torch_powersgd:R     torch's PowerSGD hook, rank R, error feedback and warm start on, start at iteration 2,
                       one bucket (with several it races on gloo: its second all-reduce
                       comes from a callback thread while the next bucket's starts)
  megacomp:SPEC        megacomp's hook (megacomp.optimizer.ddp_hook) with the YAML codec SPEC, e.g.
                       ``'{name: powersgd, rank: 4}'`` or an Accordion mapping; DDP's default buckets, or
                       ``--bucket-mb`` MB ones
  fsdp2:none           no DDP: stock FSDP2 (``fully_shard`` on every transformer layer and on the model)
  fsdp2:SPEC           the same FSDP2 with megacomp.integrations.fsdp.FSDPCompression built from the YAML
                       mapping SPEC (a CommCompressionConfig: dp_gradient, dp_gradient_error_feedback,
                       dp_parameter, min_compress_numel), e.g. ``'{dp_gradient: int4, dp_parameter: int8}'``

It writes ``metrics.jsonl`` (iteration, loss, wire_bytes, uncompressed_bytes, traffic) in the format of
megacomp.training.metrics_log, so benchmarks/convergence.py and benchmarks/plot_metrics.py read it like a pretraining
log. Bytes: megacomp's hooks are counted by megacomp.comm.stats; torch's PowerSGD hook by the same
all-reduce model applied to the factors it sends (P and Q of every matrix it compresses, the rest dense)
in every iteration, its two uncompressed warm-up iterations included.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP


def _torch_powersgd_counting(rank: int):
    """torch's PowerSGD hook, wrapped to record each bucket's bytes in megacomp's stats table."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from megacomp.comm.stats import PROCESS_STATS
    from benchmarks.netns_dp_worker import powersgd_bytes

    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                        use_error_feedback=True, warm_start=True)

    def hook(st, bucket):
        world = dist.get_world_size()
        dense = int(4 * sum(p.numel() for p in bucket.parameters()) * 2 * (world - 1) / world)
        compressing = st.iter >= st.start_powerSGD_iter  # read before the hook advances it
        # netns_bench's count of torch's PowerSGD factors (its min_compression_rate rule), for this bucket
        PROCESS_STATS.record("dp_gradient", powersgd_bytes(bucket, rank, world) if compressing else dense, dense)
        return powerSGD_hook.powerSGD_hook(st, bucket)

    return state, hook


def main() -> None:
    from megacomp import parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.data import DistributedBatchSampler, get_batch, prepare_data
    from megacomp.launch import init_distributed
    from megacomp.models.gpt import GPTConfig, GPTModel
    from megacomp.optimizer import CompressedHookState, compressed_allreduce_hook
    from megacomp.training import parse_args
    from megacomp.training.metrics_log import gather_traffic
    from megacomp.training.trainer import learning_rate

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--hook", default="none")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="DDP's bucket_cap_mb for megacomp's hooks (default: DDP's 25); Accordion decides per bucket, "
                        "so small buckets give it a decision per layer as the reference's per-layer norms")
    known, rest = p.parse_known_args()
    cfg = parse_args(rest)
    if known.bucket_mb is not None and (known.hook.startswith("fsdp2:") or known.hook.startswith("torch_powersgd:")):
        p.error(f"--bucket-mb applies to megacomp's hooks (and none); {known.hook} keeps its own buckets "
                f"(torch's PowerSGD one, FSDP2 one per fully_shard module)")
    torch.set_num_threads(1)
    init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = parallel_state.initialize_model_parallel(1, 1)
    tok, data = prepare_data(cfg.data_path, cfg.vocab_size, cfg.seq_length, cfg.data_cache_dir,
                             max_bytes=cfg.tokenizer_max_bytes)
    vocab = -(-tok.vocab_size // 8) * 8  # as the trainer pads it (TP 1)
    gpt = GPTConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                    ffn_hidden_size=cfg.ffn_hidden_size, num_layers=cfg.num_layers, vocab_size=vocab,
                    max_seq_length=cfg.seq_length, seed=cfg.seed)
    model = GPTModel(gpt, ModelParallelConfig(process_groups=groups))
    fsdp = known.hook.startswith("fsdp2:")
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        from megacomp.integrations.fsdp import FSDPCompression

        for block in model.layers:
            fully_shard(block)
        ddp = fully_shard(model)
        spec = known.hook[len("fsdp2:"):]
        if spec != "none":
            comp = FSDPCompression(yaml.safe_load(spec)).apply(model)
            if rank == 0:
                print(comp, flush=True)
        hook_state = None
    elif known.hook.startswith("torch_powersgd:"):
        ddp = DDP(model, bucket_cap_mb=1024)
        ddp.register_comm_hook(*_torch_powersgd_counting(int(known.hook.split(":")[1])))
        hook_state = None
    else:
        ddp = DDP(model) if known.bucket_mb is None else DDP(model, bucket_cap_mb=known.bucket_mb)
        spec = None if known.hook == "none" else yaml.safe_load(known.hook[len("megacomp:"):])
        hook_state = CompressedHookState(codec=spec, min_compress_numel=4096)
        ddp.register_comm_hook(hook_state, compressed_allreduce_hook)
    decay = [q for q in model.parameters() if q.dim() > 1]
    no_decay = [q for q in model.parameters() if q.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr,
                            betas=(cfg.adam_beta1, cfg.adam_beta2))
    micro = cfg.global_batch_size // (cfg.micro_batch_size * world)
    batches = iter(DistributedBatchSampler(len(data), cfg.micro_batch_size, rank, world, seed=cfg.seed))
    log = open(Path(cfg.log_dir) / "metrics.jsonl", "w") if rank == 0 else None
    for it in range(cfg.train_iters):
        for g in opt.param_groups:
            g["lr"] = learning_rate(cfg, it)
        losses = []
        for k in range(micro):
            ids, labels = get_batch(data, next(batches))
            if fsdp:  # FSDP2 accumulates unsharded gradients until the last micro-batch
                ddp.set_requires_gradient_sync(k == micro - 1)
            ctx = ddp.no_sync() if k < micro - 1 and not fsdp else torch.enable_grad()
            with ctx:
                loss = ddp(ids, labels)
                (loss / micro).backward()
            losses.append(loss.item())
        if cfg.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
        dist.all_reduce(t)
        traffic = gather_traffic()
        if log is not None:
            rec = {"iteration": it + 1, "loss": t.item() / world, "lr": learning_rate(cfg, it),
                   "wire_bytes": sum(w for w, _ in traffic.values()),
                   "uncompressed_bytes": sum(u for _, u in traffic.values()), "traffic": traffic}
            log.write(json.dumps(rec) + "\n")
            log.flush()
    if hook_state is not None and rank == 0 and hasattr(hook_state.channel, "switches"):
        for step, key, level, change in hook_state.channel.switches:
            print(f"accordion switch after step {step}: {key} -> {level} (norm change {change:.3g})")
    if log is not None:
        log.close()
    dist.barrier()  # then the model-parallel groups go before the default group (gloo hangs otherwise)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

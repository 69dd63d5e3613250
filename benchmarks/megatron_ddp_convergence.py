"""megatron-core's own GPTModel, DistributedDataParallel and DistributedOptimizer, stock against megacomp on
their data-parallel traffic: final loss (paired by seed) and bytes per step.

    python -m benchmarks.megatron_ddp_convergence --seeds 1,2,3 --iters 300 --nproc 2 \
        --out benchmarks/results/megatron_ddp
    python -m benchmarks.megatron_ddp_convergence --from-results --out benchmarks/results/megatron_ddp

Each seed is one ``torchrun`` job of ``--nproc`` CPU gloo ranks (megacomp.integrations.megatron_ddp_cpu) that
trains every variant in turn from the same initialisation on the same batches:

  stock            megatron-core as it is (DistributedDataParallel with the distributed optimizer,
                   overlap_grad_reduce and overlap_param_gather, 40k-element buckets; Adam, clipping 1.0)
  VARIANT:SPEC     the same under ``MegatronCompression(SPEC)`` (a CommCompressionConfig mapping); the
                   variants are in VARIANTS below

The model and data are those of ``configs/gpt_tiny.yaml`` (4 layers, hidden 64, sequence 64, the sentencepiece
token file of megacomp.data, 16 sequences per global batch, warm-up + cosine learning rate), in megatron-core's
GPTModel (local layer spec; core attention TorchSDPA). Bytes per step: megacomp.comm.stats over every
iteration, summed over ranks; the stock run's bytes are the uncompressed bytes of the same collectives
(megatron-core's reduce-scatter and all-gather of the same buckets). It writes ``results.json`` (after every
seed) and ``table.md`` (final loss mean ± spread over seeds, the gap to stock paired by seed, bytes per step),
which the study's README.md quotes.
Timing is not measured here (the ranks share 2 busy cores).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "int4_loco": {"dp_gradient": {"name": "int4", "block_size": 64}, "dp_gradient_error_feedback": "loco",
                  "min_compress_numel": 4096},
    "int4_loco+int8_params": {"dp_gradient": {"name": "int4", "block_size": 64}, "dp_gradient_error_feedback": "loco",
                              "dp_parameter": {"name": "int8", "block_size": 64}, "min_compress_numel": 4096},
}
BUCKET = 40_000


def _train(cfg, spec, data, vocab: int, iters: int) -> dict:
    """One run (all ranks): losses per iteration and bytes per iteration (summed over ranks)."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from megacomp.data import DistributedBatchSampler, get_batch
    from megacomp.integrations.megatron import MegatronCompression
    from megacomp.integrations.megatron_ddp_cpu import TorchSDPA
    from megacomp.training.metrics_log import gather_traffic
    from megacomp.training.trainer import learning_rate

    world, rank = dist.get_world_size(), dist.get_rank()
    tcfg = TransformerConfig(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                             num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
                             use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    spec_ = get_gpt_layer_local_spec()
    spec_.submodules.self_attention.submodules.core_attention = TorchSDPA
    torch.manual_seed(cfg.seed)
    model = GPTModel(tcfg, spec_, vocab_size=vocab, max_sequence_length=cfg.seq_length)
    ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=BUCKET),
        model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
                                                 adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2,
                                                 use_distributed_optimizer=True, clip_grad=cfg.clip_grad), [ddp])
    comp = MegatronCompression(spec).register(ddp) if spec is not None else MegatronCompression(None)
    micro = cfg.global_batch_size // (cfg.micro_batch_size * world)
    batches = iter(DistributedBatchSampler(len(data), cfg.micro_batch_size, rank, world, seed=cfg.seed))
    losses, wire, raw = [], [], []
    gather_traffic()  # reset
    with comp:  # compression off for the stock run's bytes: the same collectives, counted uncompressed
        for it in range(iters):
            for g in opt.param_groups:
                g["lr"] = learning_rate(cfg, it)
            ddp.zero_grad_buffer()
            opt.zero_grad()
            total = 0.0
            for k in range(micro):
                ids, labels = get_batch(data, next(batches))
                pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
                ctx = ddp.no_sync() if k < micro - 1 else torch.enable_grad()
                with ctx:
                    loss = ddp(ids, pos, None, labels=labels).mean()
                    (loss / micro).backward()
                total += loss.item() / micro
            ddp.finish_grad_sync()
            ok, _, _ = opt.step()
            assert ok, "megatron-core's optimizer step failed"
            t = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(t)
            traffic = gather_traffic()
            losses.append(t.item() / world)
            wire.append(sum(w for w, _ in traffic.values()))
            raw.append(sum(u for _, u in traffic.values()))
    return {"losses": losses, "wire_bytes": wire, "uncompressed_bytes": raw}


def worker(args) -> None:
    """One seed on every variant (run under torchrun); rank 0 writes ``args.result``."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megacomp.data import prepare_data
    from megacomp.integrations.megatron_ddp_cpu import megatron_on_cpu
    from megacomp.training import parse_args

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = parse_args(["--config", "configs/gpt_tiny.yaml", "--seed", str(args.seed)])
    _, data = prepare_data(cfg.data_path, cfg.vocab_size, cfg.seq_length, cfg.data_cache_dir,
                           max_bytes=cfg.tokenizer_max_bytes)
    vocab = -(-cfg.vocab_size // 8) * 8
    out = {}
    with megatron_on_cpu():
        ps.initialize_model_parallel()
        for name, spec in [("stock", None)] + [(n, VARIANTS[n]) for n in args.variants]:
            out[name] = _train(cfg, spec, data, vocab, args.iters)
            if dist.get_rank() == 0:
                print(f"seed {args.seed} {name}: final loss {out[name]['losses'][-1]:.4f}", flush=True)
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(out))
    dist.destroy_process_group()


def _tail(losses, n=10) -> float:
    """Mean of the last ``n`` iterations' losses (the final loss, less one batch's noise)."""
    return sum(losses[-n:]) / len(losses[-n:])


def report(results: dict, out: Path) -> str:
    """The README table from ``results`` ({"config": ..., "seeds": {seed: {variant: run}}})."""
    seeds = sorted(results["seeds"], key=int)
    variants = list(results["seeds"][seeds[0]])
    rows = ["| variant | final loss (mean of last 10 its) mean ± spread | vs stock, paired by seed | "
            "bytes per step (all ranks) | x fewer bytes |", "|---|---|---|---|---|"]
    for v in variants:
        finals = [_tail(results["seeds"][s][v]["losses"]) for s in seeds]
        gaps = [100 * (_tail(results["seeds"][s][v]["losses"]) / _tail(results["seeds"][s]["stock"]["losses"]) - 1)
                for s in seeds]
        runs = [results["seeds"][s][v] for s in seeds]
        its = sum(len(r["losses"]) for r in runs)
        wire = sum(sum(r["wire_bytes"]) for r in runs) / its
        raw = sum(sum(r["uncompressed_bytes"]) for r in runs) / its
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        gspread = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        gap = "-" if v == "stock" else f"{statistics.mean(gaps):+.2f}% ± {gspread:.2f}%"
        rows.append(f"| {v} | {statistics.mean(finals):.4f} ± {spread:.4f} | {gap} | {wire / 1e6:.3f} MB | "
                    f"{raw / wire:.2f}x |")
    c = results["config"]
    return "\n".join(rows) + (f"\n\n{len(seeds)} seeds ({', '.join(seeds)}), {c['iters']} iterations, DP {c['nproc']}; "
                              f"spread = standard deviation over seeds.\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--out", default="benchmarks/results/megatron_ddp")
    p.add_argument("--from-results", action="store_true", help="rewrite the table from OUT/results.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if args.worker:
        return worker(args)
    out = Path(args.out)
    if args.from_results:
        results = json.loads((out / "results.json").read_text())
    else:
        out.mkdir(parents=True, exist_ok=True)
        results = {"config": {"iters": args.iters, "nproc": args.nproc, "variants": {v: VARIANTS[v] for v in args.variants},
                              "command": "python -m benchmarks.megatron_ddp_convergence " + " ".join(sys.argv[1:])},
                   "seeds": {}}
        for seed in args.seeds.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "seed.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                       "-m", "benchmarks.megatron_ddp_convergence", "--worker", "--seed", seed, "--iters",
                       str(args.iters), "--variants", ",".join(args.variants), "--result", str(result)]
                subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                results["seeds"][seed] = json.loads(result.read_text())
            (out / "results.json").write_text(json.dumps(results))  # after every seed: a partial study survives
    table = report(results, out)
    print(table)
    (out / "table.md").write_text(table)


if __name__ == "__main__":
    main()

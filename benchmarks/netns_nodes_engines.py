"""The DDP comm hook and FSDP2 on benchmarks/netns_nodes.py's two-namespace cluster: the training one rank runs
(``python -m benchmarks.netns_nodes_engines``, under torchrun), the runs' arguments and each engine's target bytes.

    sudo python -m benchmarks.netns_nodes --engine ddp_hook --variants none,flat,hier --out ...   # the driver

Workload: netns_nodes' 3.44M GPT (hidden 256, 4 layers, 4 heads, seq 64, vocab 1024, megacomp.models.gpt.GPTModel
at TP 1), global batch 16 split over the DP = 2m ranks (one micro-batch of 16 / 2m samples per rank and iteration,
from the tokenised Python standard library, as pretraining reads it), AdamW at lr 3e-3 (gpt_tiny's peak, constant).

Engines:
  ddp_hook  torch DDP (default buckets) with megacomp.optimizer.CompressedHookState as its communication hook: the
            preset's ``dp_gradient`` codec, ``dp_gradient_error_feedback`` and ``min_compress_numel``; the first two
            iterations uncompressed (the hook's ``start_iter``, netns_nodes leaves them out anyway).
  fsdp2     ``fully_shard`` on each transformer layer and on the root (embeddings, final norm, the tied output
            head), then megacomp.integrations.fsdp.FSDPCompression(preset).apply: the preset's ``dp_gradient``
            reduce-scatter and ``dp_parameter`` all-gathers (FSDP2's default reshard_after_forward: the layers are
            all-gathered in forward and again in backward, the root once).

Variants (:data:`VARIANTS`, as pretraining's): none = ``--compression none`` (megacomp's hook / FSDPCompression with
compression off: torch's own collectives, counted); flat = ``loco4_qwz`` (int4 block 128 + LoCo gradients, int8
block 256 parameters) on the whole DP group; hier = the same hop by hop, on the topology megacomp.placement.
detect_topology finds from torchrun's GROUP_RANK / LOCAL_WORLD_SIZE (``--dp-collectives auto``: uncompressed inside
a namespace, the codec across, when the group has several ranks on each node; one rank per node stays flat).

Per iteration rank 0 appends one metrics.jsonl line (flushed) after the iteration's last collective, the gather of
megacomp's wire statistics (megacomp.training.metrics_log.gather_traffic): ``iteration``, ``loss`` (mean over ranks),
``iteration_time_s`` (batch, forward, backward with its gradient exchange, optimizer step), ``wire_bytes``,
``uncompressed_bytes`` and ``traffic`` (per stats tag, summed over ranks), as pretraining's lines have them, so
netns_nodes attributes the veth bytes to iterations unchanged.

Targets (:func:`target_bytes`): bytes leaving one of n nodes per iteration when each collective crosses the slow
link once per node in its encoded size, S the fp32 model and r a codec's compression ratio:
  ddp_hook  2 (n-1)/n x S/r_g: an all-reduce is a reduce-scatter and an all-gather of the reduced chunks, both
            encoded with the gradient codec (two nodes: each node's hop sends its whole encoding once); no
            parameter traffic.
  fsdp2     (n-1)/n x (S/r_g + (S + S_layers)/r_p): one gradient reduce-scatter, and the parameters all-gathered
            once in forward plus again in backward for the units resharded after forward (the layers, S_layers).
r from the codec's exact encoded size (megacomp.compression.make_codec(...).wire_bytes); TCP/IP headers and ACKs
are not in the target (netns_nodes counts them: a few per cent).

Failure behaviour: the worker raises what megacomp raises (a topology that cannot be split evenly, a bad preset),
after which torchrun and netns_nodes report the node's log; :func:`engine_argv` raises KeyError for an unknown
engine or variant.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional, Sequence

ENGINES = ("ddp_hook", "fsdp2")
VARIANTS = {"none": ["--compression", "none", "--dp-collectives", "auto"],
            "flat": ["--compression", "loco4_qwz", "--dp-collectives", "flat"],
            "hier": ["--compression", "loco4_qwz", "--dp-collectives", "auto"]}
"""variant -> this worker's flags (pretraining's, netns_nodes.VARIANTS, spelled alike; none keeps the default)."""
MODEL = dict(hidden_size=256, num_layers=4, num_attention_heads=4, max_seq_length=64, vocab_size=1024)
LR = 3e-3


def engine_argv(engine: str, variant: str, micro_batch_size: int, iters: int, seed: int, log_dir: str,
                extra: Sequence[str] = ()) -> list[str]:
    """The worker's arguments for one run (after ``torchrun ...``). KeyError for an unknown engine or variant."""
    if engine not in ENGINES:
        raise KeyError(f"unknown engine {engine!r}; pick from {ENGINES}")
    return ["-m", "benchmarks.netns_nodes_engines", "--engine", engine, "--train-iters", str(iters),
            "--micro-batch-size", str(micro_batch_size), "--seed", str(seed), "--log-dir", log_dir,
            *VARIANTS[variant], *extra]


# -- targets (pure) -----------------------------------------------------------------------------------------------
def model_numels(hidden: int = 256, layers: int = 4, vocab: int = 1024, seq: int = 64) -> dict:
    """Parameters of megacomp.models.gpt's GPT (4h MLP, tied output head): ``{"total", "layers"}``, ``layers`` the
    transformer blocks (FSDP's units resharded after forward): per block QKV and projection 4h^2 + 4h, MLP
    8h^2 + 5h, two norms 4h; besides them the word and position embeddings (V + s) h and the final norm 2h."""
    block = 12 * hidden * hidden + 13 * hidden
    return {"total": layers * block + (vocab + seq) * hidden + 2 * hidden, "layers": layers * block}


def target_bytes(engine: str, variant: str, m: int, numels: Optional[dict] = None, nodes: int = 2) -> Optional[float]:
    """Bytes leaving one node per iteration if every compressed collective crossed the slow link once per node
    (module docstring); None for variants other than hier (flat crosses once per local rank: m times that less the
    chunks that stay on the node; none is uncompressed and gloo's reduce-scatter is an all-reduce)."""
    if variant != "hier":
        return None
    from megacomp.compression import make_codec

    numels = numels or model_numels()
    grad = make_codec("int4", block_size=128).wire_bytes(numels["total"])
    share = (nodes - 1) / nodes
    if engine == "ddp_hook":
        return 2 * share * grad
    if engine == "fsdp2":
        param = make_codec("int8", block_size=256)
        return share * (grad + param.wire_bytes(numels["total"]) + param.wire_bytes(numels["layers"]))
    raise KeyError(f"no target for engine {engine!r}")


def table(records: list[dict]) -> list[str]:
    """The Markdown table of engine records (in run order): netns_nodes' columns, the target in place of the plan."""
    from benchmarks.netns_bench import median_spread

    numels = model_numels()
    lines = ["| engine | link | variant | ranks/node m | DP | MB leaving node A / B per iteration | "
             "target MB (A / target) | megacomp wire MB/iter, all ranks (of it intra-node hops) | crossing fraction | "
             "median iteration s (min-max), iterations 3.. | loss at last iteration | run s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        cross = f"{r['crossing_fraction']:.2f}" if r.get("crossing_fraction") is not None else "-"
        intra = f" ({r['megacomp_intra_node_per_iter'] / 1e6:.2f})" if r.get("megacomp_intra_node_per_iter") else ""
        target = target_bytes(r["engine"], r["variant"], r["m"], numels) if r.get("engine") in ENGINES else None
        tgt = f"{target / 1e6:.2f} ({r['tx_per_iter']['A'] / target:.3f})" if target else "-"
        lines.append(f"| {r['engine']} | {r['rate']} | {r['variant']} (seed {r['seed']}) | {r['m']} | {2 * r['m']} | "
                     f"{r['tx_per_iter']['A'] / 1e6:.2f} / {r['tx_per_iter']['B'] / 1e6:.2f} | {tgt} | "
                     f"{r['megacomp_wire_per_iter'] / 1e6:.2f}{intra} | {cross} | {median_spread(r['times_s'])} | "
                     f"{r['loss']:.4f} | {r['run_s']:.0f} |")
    return lines


# -- the worker (one rank, under torchrun) ---------------------------------------------------------------------
def build(engine: str, compression, topology, seed: int):
    """The model (DDP with the hook, or FSDP2 with FSDPCompression) and its optimizer."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from megacomp import parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.integrations.fsdp import FSDPCompression
    from megacomp.models.gpt import GPTConfig, GPTModel
    from megacomp.optimizer import CompressedHookState

    groups = parallel_state.initialize_model_parallel(1, 1)
    model = GPTModel(GPTConfig(**MODEL, seed=seed), ModelParallelConfig(process_groups=groups))
    if engine == "ddp_hook":
        model = DDP(model)
        CompressedHookState(codec=compression.dp_gradient, error_feedback=compression.dp_gradient_error_feedback,
                            min_compress_numel=compression.min_compress_numel, topology=topology).register(model)
    else:
        for block in model.layers:  # one FSDP unit per transformer layer, plus the root
            fully_shard(block)
        fully_shard(model)
        FSDPCompression(compression, topology=topology).apply(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def worker(argv: Optional[Sequence[str]] = None) -> None:
    """One rank: train ``--train-iters`` iterations, rank 0 writing ``<log-dir>/metrics.jsonl`` (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, required=True)
    p.add_argument("--compression", default="none", help="preset name (configs/compression/) or YAML file")
    p.add_argument("--dp-collectives", choices=("auto", "flat"), default="auto")
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", required=True)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from megacomp import comm, parallel_state
    from megacomp.data import DistributedBatchSampler, get_batch, prepare_data
    from megacomp.launch import init_distributed
    from megacomp.placement import detect_topology
    from megacomp.training.metrics_log import gather_traffic
    from megacomp.training.pretrain_config import load_compression

    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = detect_topology() if args.dp_collectives == "auto" else None
    _, data = prepare_data(None, MODEL["vocab_size"], MODEL["max_seq_length"])
    model, opt = build(args.engine, load_compression(args.compression), topology, args.seed)
    sampler = iter(DistributedBatchSampler(len(data), args.micro_batch_size, rank, world, seed=args.seed))
    out = None
    if rank == 0:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        out = open(Path(args.log_dir) / "metrics.jsonl", "w")
        params = sum(p.numel() for p in model.parameters())
        print(f"{args.engine}: {params:,} parameters, {world} ranks, {args.compression}, dp collectives "
              f"{args.dp_collectives}, topology {topology.describe() if topology else 'not used (flat)'}", flush=True)
    comm.reset_stats()  # set-up traffic is no iteration's
    for it in range(1, args.train_iters + 1):
        t0 = time.perf_counter()
        ids, labels = get_batch(data, next(sampler))
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - t0
        mean = loss.detach().reshape(1)
        dist.all_reduce(mean)
        traffic = gather_traffic()  # the iteration's last collective
        if out is not None:
            record = {"iteration": it, "loss": mean.item() / world, "iteration_time_s": elapsed,
                      "wire_bytes": sum(w for w, _ in traffic.values()),
                      "uncompressed_bytes": sum(u for _, u in traffic.values()), "traffic": traffic}
            out.write(json.dumps(record) + "\n")
            out.flush()
            print(f"iteration {it} loss {mean.item() / world:.4f} {elapsed:.3f} s", flush=True)
    if out is not None:
        out.close()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()

"""LGC as published (``lgc``, both instances) against top-k with local accumulation and the uncompressed
all-reduce: a small CNN on scikit-learn's digits (offline), 3 gloo ranks, 3 seeds.

    python -m benchmarks.lgc_published --seeds 1,2,3 --steps 400
    python -m benchmarks.lgc_published --from-results     # the table only, from results.json

The paper's headline (arXiv 2103.08870, abstract): ResNet101 on CIFAR-10 at 93.57%, 0.18% below the uncompressed
run, with LGC's compression. This is the same comparison at a scale that runs on two CPU cores: each rank trains on
its third of the 80% training split (batch 32 per rank, SGD with momentum 0.9 after the exchange, learning rate
0.05), the gradient travels as one bucket through the variant's channel (megacomp.comm), and the held-out 20% is
scored at the end. Variants (every one averages over the ranks):

  uncompressed     megacomp's plain Channel all-reduce;
  top-k            ``lgc``'s warm-up phase for the whole run: top-k (``density``) with the unsent entries
                   accumulated locally (DGC's sparsification without momentum correction);
  LGC ps / ring    ``{name: lgc, variant: ps | ring}``: ``warmup`` steps of top-k, ``train`` steps of autoencoder
                   training, then the compressed phase.

Density 0.01 rather than the paper's 0.001: the CNN has about 6,000 parameters, and 0.1% of it is 6 entries.
Bytes are the dp path's counted bytes (megacomp.comm.stats) per rank, over the run and per step of the last
quarter. Numbers are measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

OUT = Path("benchmarks/results/lgc_published")
VARIANTS = ("uncompressed", "top-k", "LGC ps", "LGC ring")


def _spec(variant: str, args) -> dict | None:
    """The channel setting of a variant (None: uncompressed)."""
    base = {"name": "lgc", "density": args.density, "innovation_density": args.density / 10,
            "warmup_steps": args.warmup, "train_steps": args.train, "train_iters": args.train_iters,
            "lr": args.ae_lr}
    if variant == "uncompressed":
        return None
    if variant == "top-k":
        return {**base, "warmup_steps": args.steps + 1}  # never leaves the warm-up: top-k with accumulation
    return {**base, "variant": variant.split()[1]}


def _rank(rank: int, world: int, init_file: str, variant: str, seed: int, args, queue) -> None:
    import os
    import traceback

    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch
        import torch.distributed as dist
        from sklearn.datasets import load_digits

        from megacomp.comm import Channel, LGCChannel, StatsTable

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16
        y = torch.tensor(digits.target)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))  # one split for every run
        cut = int(0.8 * len(y))
        train_idx, test_idx = order[:cut][rank::world], order[cut:]
        torch.manual_seed(seed)  # the same initial model on every rank
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(128, 10))
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        stats = StatsTable()
        spec = _spec(variant, args)
        ch = Channel("dp", None, stats=stats) if spec is None else LGCChannel("dp", spec, stats=stats)
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        tail_bytes, losses, start = 0, [], time.time()
        for step in range(args.steps):
            batch = train_idx[torch.randint(len(train_idx), (args.batch,), generator=g)]
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            opt.zero_grad()
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            before = stats.snapshot().get("dp")
            if spec is None:
                flat = torch.cat([t.reshape(-1) for t in grads])
                ch.all_reduce(flat, op=dist.ReduceOp.AVG)
                pos = 0
                for t in grads:
                    t.copy_(flat[pos:pos + t.numel()].view(t.shape))
                    pos += t.numel()
            else:
                ch.all_reduce_coalesced(grads, op=dist.ReduceOp.AVG, key="model")
            if step >= args.steps * 3 // 4:
                tail_bytes += stats.snapshot()["dp"].wire_bytes - (before.wire_bytes if before else 0)
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            acc = float((model(x[test_idx]).argmax(1) == y[test_idx]).float().mean())
        snap = stats.snapshot()["dp"]
        queue.put((rank, True, {"accuracy": acc, "bytes": snap.wire_bytes, "dense_bytes": snap.uncompressed_bytes,
                                "tail_bytes_per_step": tail_bytes / (args.steps - args.steps * 3 // 4),
                                "final_loss": statistics.mean(losses[-20:]), "seconds": time.time() - start,
                                "params": sum(p.numel() for p in model.parameters())}))
        dist.destroy_process_group()
    except Exception:
        queue.put((rank, False, traceback.format_exc()))


def _table(results: list[dict]) -> str:
    """The markdown table of the runs: mean ± std over seeds per variant."""
    lines = ["| variant | test accuracy (mean ± std) | per seed | vs uncompressed | MB per rank over the run | "
             "bytes per rank per step (last quarter) |", "|---|---|---|---|---|---|"]
    base = {r["seed"]: r["accuracy"] for r in results if r["variant"] == "uncompressed"}
    for v in VARIANTS:
        runs = [r for r in results if r["variant"] == v]
        if not runs:
            continue
        acc = [r["accuracy"] for r in runs]
        delta = [r["accuracy"] - base[r["seed"]] for r in runs if r["seed"] in base]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        lines.append(f"| {v} | {100 * statistics.mean(acc):.2f}% ± {100 * sd:.2f} | "
                     f"{', '.join(f'{100 * a:.2f}' for a in acc)} | "
                     f"{f'{100 * statistics.mean(delta):+.2f} pts' if delta else '-'} | "
                     f"{statistics.mean(r['bytes'] for r in runs) / 1e6:.3f} | "
                     f"{statistics.mean(r['tail_bytes_per_step'] for r in runs):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    """Run the variants over the seeds (or print the table from results.json)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--train", type=int, default=100)
    p.add_argument("--train-iters", type=int, default=10, help="Adam steps of the autoencoder per training step")
    p.add_argument("--ae-lr", type=float, default=3e-3, help="the autoencoder's Adam learning rate")
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--from-results", action="store_true")
    args = p.parse_args(argv)
    path = OUT / "results.json"
    if args.from_results:
        print(_table(json.loads(path.read_text())["runs"]))
        return
    from benchmarks.spawn_ranks import spawn_ranks

    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for variant in args.variants.split(","):
            if variant not in VARIANTS:
                raise ValueError(f"--variants: {variant!r} is not one of {VARIANTS}")
            per_rank = spawn_ranks(_rank, args.world, (variant, seed, args))
            r0 = per_rank[0]
            if any(r["accuracy"] != r0["accuracy"] for r in per_rank):
                raise RuntimeError(f"{variant}, seed {seed}: the ranks end with different models: {per_rank}")
            row = {"variant": variant, "seed": seed, **r0,
                   "bytes": statistics.mean(r["bytes"] for r in per_rank),
                   "tail_bytes_per_step": statistics.mean(r["tail_bytes_per_step"] for r in per_rank)}
            runs.append(row)
            print(json.dumps(row), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")
    print(_table(runs))


if __name__ == "__main__":
    main()

"""LoCoDL against compressed gradient descent on a strongly convex problem: bits to a small gradient norm.

    python -m benchmarks.locodl_logreg --out benchmarks/results/locodl_logreg

Problem: l2-regularised logistic regression over R = 4 gloo ranks (real process groups, one process per rank) with
heterogeneous data: rank i holds m samples a ~ N(c_i, I_d) whose mean c_i differs per rank and labels
b = sign(a^T x_true + noise), so the ranks' minimisers differ. F(x) = (1/R) sum_i f_i(x) + g(x) with
f_i(x) = (1/m) sum log(1 + exp(-b a^T x)) + (mu/2)||x||^2 and g(x) = (mu/2)||x||^2 (LoCoDL's g, known to all).

Methods (every one through megacomp: the encodings are all-gathered with ``Channel.all_gather_encoded``, so the bytes
are the codec's, counted in the channel's statistics; a replica's bits are what it sends):
  - GD: x <- x - gamma grad F(x), the gradients all-gathered uncompressed every step;
  - CGD (compressed gradient descent): x <- x - gamma ((1/R) sum_j C_j(grad f_j(x)) + grad g(x)), the same unbiased
    compressor as LoCoDL, every step;
  - LoCoDL (megacomp.outer.LoCoDL): one local gradient step x_i <- x_i - gamma grad f_i(x_i) per iteration, then
    LoCoDL's step (communication with probability p), identity or the compressor.
gamma = 1 / L with L the largest smoothness constant of the f_i and g; CGD with an unbiased compressor of variance
omega needs a smaller step to be stable (gamma / (1 + omega / R), its usual bound). The gradient norm is
||grad F(xbar)|| at the mean of the replicas' models (measured with an uncounted all-reduce).

Writes ``results.json`` (per method: gradient norm and cumulative bits per replica at each iteration),
``locodl_logreg.md`` (bits and rounds to reach the target) and ``locodl_logreg.png`` (gradient norm against bits).
Numbers are measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist


def make_problem(rank: int, world: int, d: int = 20, m: int = 200, mu: float = 0.3, seed: int = 0):
    """Rank ``rank``'s data (A [m, d], b [m]) and mu, in fp64; the shared x_true, the per-rank shift."""
    g = torch.Generator().manual_seed(seed)
    x_true = torch.randn(d, generator=g, dtype=torch.float64)
    shifts = 2.0 * torch.randn(world, d, generator=g, dtype=torch.float64)
    gi = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    a = torch.randn(m, d, generator=gi, dtype=torch.float64) + shifts[rank]
    b = torch.sign(a @ x_true + 0.5 * torch.randn(m, generator=gi, dtype=torch.float64))
    return a, b, mu


def local_grad(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mu: float) -> torch.Tensor:
    """grad f_i(x) = -(1/m) A^T (b * sigmoid(-b A x)) + mu x (in x's dtype)."""
    z = -b * (a @ x.double())
    return (-(a.T @ (b * torch.sigmoid(z))) / a.shape[0] + mu * x.double()).to(x.dtype)


def smoothness(a: torch.Tensor, mu: float) -> float:
    """L of f_i: lambda_max(A^T A) / (4 m) + mu."""
    return float(torch.linalg.eigvalsh(a.T @ a / a.shape[0]).max()) / 4 + mu


def _full_grad_norm(x: torch.Tensor, a, b, mu, world: int) -> float:
    """||grad F(xbar)||, xbar the mean of the replicas' x (uncounted all-reduces, fp64)."""
    xbar = x.double().clone()
    dist.all_reduce(xbar)
    xbar /= world
    gsum = local_grad(xbar, a, b, mu)
    dist.all_reduce(gsum)
    return float((gsum / world + mu * xbar).norm())


def run_rank(rank: int, world: int, method: str, codec=None, iters: int = 3000, probability: float = 0.2,
             target: float = 1e-6, seed: int = 0, d: int = 20, bit_budget: Optional[int] = None) -> dict:
    """One rank of one method (inside an initialised process group): returns {'grad_norm': [...], 'bits': [...]}
    per iteration (bits sent by this rank so far) and the settings used. Stops at ``target``, after ``iters``, or
    once this rank has sent ``bit_budget`` bits (to compare methods at equal bits without running the slower one
    to its iteration limit)."""
    from megacomp.comm import StatsTable, make_channel
    from megacomp.compression.unbiased import make_unbiased_codec, omega_of
    from megacomp.outer.locodl import LoCoDL, LoCoDLConfig

    a, b, mu = make_problem(rank, world, d=d, seed=seed)
    lmax = torch.tensor([smoothness(a, mu)], dtype=torch.float64)
    dist.all_reduce(lmax, op=dist.ReduceOp.MAX)
    gamma = 1.0 / float(lmax)
    stats = StatsTable()
    channel = make_channel("outer", None, stats=stats)
    c = make_unbiased_codec(codec)
    x = torch.nn.Parameter(torch.zeros(d, dtype=torch.float32), requires_grad=False)
    history = {"grad_norm": [], "bits": []}
    engine = None
    if method == "locodl":
        engine = LoCoDL([x], None, LoCoDLConfig(probability=probability, gamma=gamma, codec=codec, seed=seed),
                        channel=channel, grad_g=lambda y: mu * y)
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    omega = omega_of(c, d)
    step = gamma / (1 + omega / world) if method == "cgd" else gamma
    for _ in range(iters):
        with torch.no_grad():
            if engine is not None:
                x.sub_(local_grad(x.data, a, b, mu), alpha=gamma)
                engine.step()
            else:  # GD / CGD: all-gather the (compressed) local gradients every step
                grad = local_grad(x.data, a, b, mu)
                buf = c.encode_flat(grad, gen)
                out = torch.empty(world * buf.numel(), dtype=torch.uint8)
                channel.all_gather_encoded(out, buf, numel=d, dtype=torch.float32)
                slots = out.view(world, -1)
                mean = sum(c.decode_flat(slots[j], d, torch.float32) for j in range(world)) / world
                x.sub_(mean + mu * x.data, alpha=step)
        history["grad_norm"].append(_full_grad_norm(x.data, a, b, mu, world))
        history["bits"].append(8 * sum(w.wire_bytes for w in stats.snapshot().values()))
        if history["grad_norm"][-1] < target or (bit_budget is not None and history["bits"][-1] >= bit_budget):
            break
    history.update(method=method, codec=str(c), gamma=step, probability=probability if engine else 1.0,
                   chi=engine.chi if engine else None, rho=engine.rho if engine else None, omega=omega)
    return history


def bits_to(history: dict, target: float) -> Optional[int]:
    """Bits this rank sent until the gradient norm first fell below ``target`` (None: never)."""
    for gn, bits in zip(history["grad_norm"], history["bits"]):
        if gn < target:
            return bits
    return None


def _spawn_worker(rank: int, world: int, init: str, jobs: list, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    results = [run_rank(rank, world, **job) for job in jobs]
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


METHODS = [
    {"label": "GD (fp32)", "method": "gd", "codec": None},
    {"label": "CGD, usq4", "method": "cgd", "codec": "usq4"},
    {"label": "CGD, rand-k 4/20", "method": "cgd", "codec": {"name": "randk", "k": 4, "chunk": 20}},
    {"label": "LoCoDL p=0.2 (fp32)", "method": "locodl", "codec": None, "probability": 0.2},
    {"label": "LoCoDL p=0.2, usq4", "method": "locodl", "codec": "usq4", "probability": 0.2},
    {"label": "LoCoDL p=0.2, rand-k 4/20", "method": "locodl", "codec": {"name": "randk", "k": 4, "chunk": 20},
     "probability": 0.2},
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/locodl_logreg")
    p.add_argument("--iters", type=int, default=4000)
    p.add_argument("--target", type=float, default=1e-6)
    p.add_argument("--world", type=int, default=4)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [{k: v for k, v in m.items() if k != "label"} | {"iters": args.iters, "target": args.target}
            for m in METHODS]
    with tempfile.TemporaryDirectory() as tmp:
        res = os.path.join(tmp, "res.json")
        torch.multiprocessing.spawn(_spawn_worker, args=(args.world, os.path.join(tmp, "init"), jobs, res),
                                    nprocs=args.world)
        results = json.loads(Path(res).read_text())
    for m, r in zip(METHODS, results):
        r["label"] = m["label"]
    (out / "results.json").write_text(json.dumps({"world": args.world, "target": args.target, "iters": args.iters,
                                                  "runs": results}, indent=1))
    lines = [f"| method | step gamma | p | omega | iterations run | final grad norm | bits per replica to "
             f"{args.target:g} | x fewer than CGD (same codec) |", "|---|---|---|---|---|---|---|---|"]
    cgd = {r["codec"]: bits_to(r, args.target) for r in results if r["method"] == "cgd"}
    for r in results:
        bits = bits_to(r, args.target)
        ref = cgd.get(r["codec"]) if r["method"] == "locodl" else None
        ratio = "-" if r["method"] != "locodl" or r["codec"] not in cgd else \
            ("CGD never reached it" if ref is None and bits is not None else
             f"{ref / bits:.1f}x" if ref and bits else "-")
        lines.append(f"| {r['label']} | {r['gamma']:.4g} | {r['probability']:g} | {r['omega']:.3g} | "
                     f"{len(r['grad_norm'])} | {r['grad_norm'][-1]:.2e} | "
                     f"{'not reached' if bits is None else f'{bits:,}'} | {ratio} |")
    table = "\n".join(lines)
    (out / "locodl_logreg.md").write_text(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ax.semilogy([b / 8e3 for b in r["bits"]], r["grad_norm"], label=r["label"],
                    linestyle="-" if r["method"] == "locodl" else "--")
    ax.axhline(args.target, color="grey", linewidth=0.5)
    ax.set_xlabel("kilobytes sent per replica")
    ax.set_ylabel("||grad F(mean x)||")
    ax.set_xscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"l2-logistic regression, {args.world} ranks, heterogeneous data")
    fig.tight_layout()
    fig.savefig(out / "locodl_logreg.png", dpi=120)


if __name__ == "__main__":
    main()

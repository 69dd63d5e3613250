"""LoDAdaC's sweep as its paper measures it: local steps K, top-k, ring and grid of 4, 9 and 16 agents, against
SQuARM-SGD, in one process.

    python -m benchmarks.lodadac_sweep --out benchmarks/results/lodadac_sweep

The paper (Liu et al., TMLR 2026, arXiv 2604.09970, Section 4) trains LeNet5 / Fixup-ResNet-20 / a nanoGPT on 4
agents of a ring with K in {1, 2, 5, 10, 20, 50} and top-k 30-60%, all runs to the same number of epochs, and
reports (4.2) K = 50 within 1% of K = 1 in maximum test accuracy, (4.3) K = 50 with top-k 30% at about 0.6% of the
communication volume of K = 1 uncompressed (1/50 x 0.3: the values only), and (4.4) 4, 9 and 16 agents on rings and
3 x 3 / 4 x 4 grids. This driver asks the same questions of a task this machine runs in minutes: a 64-32-10 ReLU MLP
(2,410 parameters) on scikit-learn's bundled digits (1,797 8x8 images, 10 classes; a fixed 80/20 split, features
scaled to [0, 1]), the training samples dealt at random to the n agents (homogeneous, as the paper), batch 32 per
agent, T iterations for every K (the paper's "same number of epochs").

Methods, all with the same compressed gossip (what megacomp.outer.lodadac does, restated per agent on stacked
tensors, in fp32 as megacomp keeps x-hat, y and the messages): every K iterations
q_i = Q[x_i - xh_i], xh_i += q_i, y_i += sum_j W_ji q_j (self first, then the neighbours in order), x_i += gamma
(y_i - xh_i); Q the identity sums y_i = sum_j W_ji x_j directly (gamma 1: x <- W x). W = 1 / (d + 1) on the
diagonal and each edge (megacomp.outer.topology: ``ring``, ``torus`` for the grid, with wrap-around):
  - LoDAdaC (Algorithm 1): megacomp.outer.lodadac.LoDAdaCAdam as the local update (Adam rule, alpha 1e-3, betas
    (0.9, 0.999), delta 1e-4, no bias correction, no clipping); gamma 1 uncompressed, 0.5 with top-k (megacomp's
    defaults, the release's 0.5). The agents' parameters are stacked ([n, ...] tensors), and LoDAdaCAdam is
    elementwise, so one optimizer over them is n independent ones;
  - SQuARM-SGD (Singh et al., 2021, Algorithm 1): Nesterov momentum SGD as the local update (v = beta v + g,
    x -= eta (beta v + g): torch.optim.SGD with nesterov), eta 0.01 and beta 0.9 (the LoDAdaC paper's tuning), the
    same CHOCO gossip every K steps with gamma 0.5 (the release's), the event trigger's threshold 0 (every
    exchange sends, as the LoDAdaC release runs it).
Q is megacomp's top-k (``{name: none, k: 30 or 60, chunk: 100}``: per chunk of 100, the 30 / 60 largest, fp32
values, one-byte indices). Bytes are the encodings' lengths, each counted once per neighbour, at every iteration;
"values" bytes count only the kept fp32 values (the paper's 0.6% is 1/50 x 0.3).

Measured per run, at every ``eval_every`` iterations and the last: each agent's own model on the whole training set
(loss) and test set (accuracy), averaged over the agents (the release's tracker evaluates each agent's model), and
the consensus distance (1/n) sum_i ||x_i - x_bar||^2. ``tests/test_benchmarks_lodadac_sweep.py`` checks that this
simulation equals megacomp's distributed LoDAdaC (gloo ranks) at a small setting.

Writes ``results.json`` (every run's curves, cumulative bytes and bytes sent at each iteration),
``lodadac_sweep.md`` (tables: mean +- std over the seeds) and ``lodadac_sweep.png`` (accuracy against volume). Numbers are measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from megacomp.compression import make_codec
from megacomp.compression.sparse import kept
from megacomp.outer.lodadac import LoDAdaCAdam
from megacomp.outer.topology import check_topology, mixing_rho, neighbours

HIDDEN = 32
METHODS = ("lodadac", "squarm")


@dataclass
class RunConfig:
    """One run of the simulation."""

    method: str = "lodadac"
    """lodadac (LoDAdaCAdam local update) or squarm (SQuARM-SGD's Nesterov momentum SGD)."""
    agents: int = 4
    """n, the number of agents."""
    topology: str = "ring"
    """ring or torus (the paper's 2D grid, with wrap-around), megacomp.outer.topology."""
    k: int = 1
    """K: local steps per communication round."""
    topk: Optional[int] = None
    """Percent of each chunk of 100 the top-k codec keeps (30, 60), or None: uncompressed."""
    iters: int = 600
    """T: iterations (the same for every K)."""
    seed: int = 1
    """Initialisation, the dealing of the samples to the agents and the batch order."""
    batch: int = 32
    """Samples per agent per iteration."""
    lr: Optional[float] = None
    """alpha (LoDAdaC, default 1e-3) or eta (SQuARM-SGD, default 0.01)."""
    gamma: Optional[float] = None
    """Consensus step; default 1 for LoDAdaC uncompressed, else 0.5."""
    eval_every: int = 50
    """Iterations between evaluations (the last iteration is always evaluated)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        check_topology(self.topology, self.agents)
        if self.k < 1 or self.iters < 1 or self.batch < 1 or self.eval_every < 1:
            raise ValueError(f"k, iters, batch and eval_every must be >= 1, got {self.k}, {self.iters}, {self.batch}, "
                             f"{self.eval_every}")
        if self.topk is not None and not 1 <= self.topk <= 100:
            raise ValueError(f"topk is a percent in [1, 100] or None, got {self.topk}")
        if self.lr is None:
            self.lr = 1e-3 if self.method == "lodadac" else 0.01
        if self.gamma is None:
            self.gamma = 1.0 if self.method == "lodadac" and self.topk is None else 0.5

    def codec(self):
        """Q: megacomp's top-k per chunk of 100 (fp32 values), or the identity."""
        return make_codec(None if self.topk is None else {"name": "none", "k": self.topk, "chunk": 100})


def digits(seed: int = 0):
    """scikit-learn's digits as fp32 tensors: (train x, train y, test x, test y), a fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=0.2, random_state=seed, stratify=y)
    t = lambda a, dt: torch.tensor(a, dtype=dt)  # noqa: E731
    return t(xtr, torch.float32), t(ytr, torch.long), t(xte, torch.float32), t(yte, torch.long)


def init_model(seed: int) -> list[torch.Tensor]:
    """x^0: the MLP's weights [W1 (64 x H), b1, W2 (H x 10), b2], torch.nn.Linear's uniform initialisation."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for fan_in, fan_out in ((64, HIDDEN), (HIDDEN, 10)):
        bound = 1 / math.sqrt(fan_in)
        out.append((torch.rand(fan_in, fan_out, generator=g) * 2 - 1) * bound)
        out.append((torch.rand(fan_out, generator=g) * 2 - 1) * bound)
    return out


def forward(params, x: torch.Tensor) -> torch.Tensor:
    """Logits of the MLP: params stacked over agents ([n, ...], x [n, B, 64]) or one model ([...], x [B, 64])."""
    w1, b1, w2, b2 = params
    if w1.dim() == 3:
        h = torch.relu(torch.bmm(x, w1) + b1[:, None])
        return torch.bmm(h, w2) + b2[:, None]
    return torch.relu(x @ w1 + b1) @ w2 + b2


def deal(n_train: int, agents: int, seed: int) -> list[torch.Tensor]:
    """The training indices of each agent: a random permutation cut into n near-equal parts."""
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(1000 + seed))
    return list(perm.tensor_split(agents))


class Batches:
    """Agent i's batches: its samples in a random order per pass (epochs of its own shard), ``batch`` at a time."""

    def __init__(self, shard: torch.Tensor, batch: int, seed: int) -> None:
        self.shard, self.batch, self.gen, self.order, self.pos = shard, batch, torch.Generator().manual_seed(seed), None, 0

    def next(self) -> torch.Tensor:
        """The next ``batch`` indices (a pass that runs out continues in a fresh order)."""
        out = []
        while len(out) < self.batch:
            if self.order is None or self.pos == len(self.order):
                self.order, self.pos = self.shard[torch.randperm(len(self.shard), generator=self.gen)], 0
            take = min(self.batch - len(out), len(self.order) - self.pos)
            out.extend(self.order[self.pos:self.pos + take].tolist())
            self.pos += take
        return torch.tensor(out)


class Gossip:
    """megacomp.outer.lodadac.LoDAdaC.sync for n agents on stacked flat vectors (the same operations in the same
    order, fp32): the identity codec sums y = sum_j W_ji x_j; a lossy one keeps xh and y per agent (started at x^0).
    Counts the bytes of every message once per neighbour."""

    def __init__(self, x0: torch.Tensor, agents: int, topology: str, codec, gamma: float) -> None:
        self.codec, self.gamma, self.n, self.numel = codec, gamma, agents, x0.numel()
        self.peers = [neighbours(topology, agents, i) for i in range(agents)]
        self.exact = codec.is_identity
        self.xhat = None if self.exact else x0.repeat(agents, 1)
        self.y = None if self.exact else x0.repeat(agents, 1)
        self.values_bytes = 4 * (self.numel if self.exact else kept(codec, self.numel))

    @torch.no_grad()
    def sync(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """x [n, numel] (x^{t+1/2}) -> (x^{t+1}, wire bytes sent by all agents, values-only bytes)."""
        out = torch.empty_like(x)
        sends = sum(len(p) for p in self.peers)
        if self.exact:
            for i, peers in enumerate(self.peers):
                w = 1.0 / (len(peers) + 1)
                y = x[i] * w
                for j in peers:
                    y.add_(x[j], alpha=w)
                out[i] = y if self.gamma == 1 else x[i].clone().add_(y - x[i], alpha=self.gamma)
            return out, sends * 4 * self.numel, sends * self.values_bytes
        q, wire = [], 0
        for i in range(self.n):
            buf = self.codec.encode_flat(x[i] - self.xhat[i])
            q.append(self.codec.decode_flat(buf, self.numel, torch.float32))
            self.xhat[i].add_(q[i])
            wire += buf.numel() * len(self.peers[i])
        for i, peers in enumerate(self.peers):
            w = 1.0 / (len(peers) + 1)
            self.y[i].add_(q[i], alpha=w)
            for j in peers:
                self.y[i].add_(q[j], alpha=w)
            out[i] = x[i].clone().add_(self.y[i] - self.xhat[i], alpha=self.gamma)
        return out, wire, sends * self.values_bytes


def flat(params) -> torch.Tensor:
    """[n, numel]: each agent's parameters in order, as megacomp's _flat."""
    return torch.cat([p.detach().reshape(p.shape[0], -1) for p in params], dim=1)


def write(params, x: torch.Tensor) -> None:
    """Put [n, numel] back into the stacked parameters."""
    off = 0
    with torch.no_grad():
        for p in params:
            k = p[0].numel()
            p.copy_(x[:, off:off + k].view_as(p))
            off += k


@torch.no_grad()
def evaluate(params, data) -> dict:
    """Each agent's own model on the whole training set (loss) and the test set (accuracy), averaged over the
    agents, and the consensus distance (1/n) sum_i ||x_i - x_bar||^2."""
    xtr, ytr, xte, yte = data
    n = params[0].shape[0]
    logits_tr = forward(params, xtr.expand(n, -1, -1))
    logits_te = forward(params, xte.expand(n, -1, -1))
    loss = float(F.cross_entropy(logits_tr.reshape(-1, 10), ytr.repeat(n)))
    acc = float((logits_te.argmax(-1) == yte).float().mean())
    x = flat(params).double()
    cons = float((x - x.mean(0)).pow(2).sum(1).mean())
    return {"train_loss": loss, "test_acc": acc, "consensus": cons}


def run(cfg: RunConfig, data=None, trace: bool = False) -> dict:
    """One run; returns its curve (iteration, train loss, test accuracy, consensus, cumulative wire and values
    bytes) and, with ``trace``, each agent's flat weights after every iteration (for the equality test)."""
    torch.manual_seed(cfg.seed)
    data = data if data is not None else digits()
    xtr, ytr = data[0], data[1]
    x0 = init_model(cfg.seed)
    params = [torch.nn.Parameter(p.unsqueeze(0).repeat(cfg.agents, *([1] * p.dim())).contiguous()) for p in x0]
    if cfg.method == "lodadac":
        opt = LoDAdaCAdam(params, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-4)
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True)
    gossip = Gossip(flat(params)[0].clone(), cfg.agents, cfg.topology, cfg.codec(), cfg.gamma)
    batches = [Batches(s, cfg.batch, 100 * cfg.seed + i) for i, s in enumerate(deal(len(xtr), cfg.agents, cfg.seed))]
    wire = values = 0
    curve, traced, bytes_per_iter = [], [], []
    for t in range(cfg.iters):
        idx = torch.stack([b.next() for b in batches])  # [n, B]
        logits = forward(params, xtr[idx])
        # the sum of the agents' mean losses: agent i's gradient is that of its own loss
        loss = F.cross_entropy(logits.reshape(-1, 10), ytr[idx].reshape(-1), reduction="sum") / cfg.batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sent = 0
        if (t + 1) % cfg.k == 0:
            x, sent, vals = gossip.sync(flat(params))
            write(params, x)
            wire, values = wire + sent, values + vals
        bytes_per_iter.append(sent)
        if trace:
            traced.append(flat(params).clone())
        if (t + 1) % cfg.eval_every == 0 or t + 1 == cfg.iters:
            curve.append({"iter": t + 1, **evaluate(params, data), "wire_bytes": wire, "values_bytes": values})
    out = {"config": asdict(cfg), "curve": curve, "final": curve[-1], "best_test_acc": max(c["test_acc"] for c in curve),
           "wire_bytes": wire, "values_bytes": values, "bytes_per_iter": bytes_per_iter}
    if trace:
        out["trace"] = traced
    return out


@dataclass
class Sweep:
    """The grid of runs (every combination)."""

    graphs: list = field(default_factory=lambda: [("ring", 4), ("ring", 9), ("torus", 9), ("ring", 16), ("torus", 16)])
    """(topology, agents); at 4 the grid is the ring (the paper says so), so it is not repeated."""
    ks: list = field(default_factory=lambda: [1, 5, 10, 20, 50])
    """K values, each with every top-k."""
    topks: list = field(default_factory=lambda: [30, 60])
    """Top-k percents; K = 1 uncompressed (the paper's volume baseline) is added to each graph."""
    methods: list = field(default_factory=lambda: list(METHODS))
    """Methods to run."""
    seeds: list = field(default_factory=lambda: [1, 2, 3])
    """Seeds."""
    iters: int = 600
    """T, the same for every K."""

    def configs(self) -> list[RunConfig]:
        """Every RunConfig of the grid."""
        out = []
        for topo, n in self.graphs:
            for method in self.methods:
                settings = [(1, None)] + [(k, p) for k in self.ks for p in self.topks]
                for k, p in settings:
                    for seed in self.seeds:
                        out.append(RunConfig(method=method, agents=n, topology=topo, k=k, topk=p, iters=self.iters,
                                             seed=seed))
        return out


def _stat(xs: list) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def report(results: list[dict]) -> str:
    """The markdown tables: per graph and method, each (K, top-k) with mean +- std over the seeds."""
    groups: dict = {}
    for r in results:
        c = r["config"]
        groups.setdefault((c["topology"], c["agents"], c["method"]), {}).setdefault((c["k"], c["topk"]), []).append(r)
    lines = ["# LoDAdaC sweep (digits MLP, in-process simulation)", "",
             "Mean ± sample std over the seeds. Loss and accuracy: each agent's own model, averaged over the agents. "
             "Volume: bytes sent over the run by all agents against K = 1 uncompressed of the same method and graph "
             "(wire: megacomp's top-k encoding with its one-byte indices; values: the kept fp32 values only, the "
             "paper's accounting). Δ best acc: the maximum test accuracy over the run minus K = 1 uncompressed's, "
             "in points.", ""]
    for (topo, n, method), rows in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        base = rows.get((1, None))
        name = {"lodadac": "LoDAdaC (Adam)", "squarm": "SQuARM-SGD"}[method]
        graph = "ring" if topo == "ring" else "grid (torus)"
        lines += [f"## {name}, {graph} of {n} (rho {mixing_rho(topo, n):.3f})", "",
                  "| K | top-k | final train loss | final test acc % | best test acc % | Δ best acc (pts) | consensus "
                  "| wire MB | wire volume | values volume |", "|---|---|---|---|---|---|---|---|---|---|"]
        for (k, p), runs in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1] or 101)):
            loss, sl = _stat([r["final"]["train_loss"] for r in runs])
            acc, sa = _stat([100 * r["final"]["test_acc"] for r in runs])
            best, sb = _stat([100 * r["best_test_acc"] for r in runs])
            cons, _ = _stat([r["final"]["consensus"] for r in runs])
            wire = runs[0]["wire_bytes"]
            if base:
                by_seed = {r["config"]["seed"]: r for r in base}
                delta, sd = _stat([100 * (r["best_test_acc"] - by_seed[r["config"]["seed"]]["best_test_acc"])
                                   for r in runs])
                dtext = f"{delta:+.2f} ± {sd:.2f}"
                wv = f"{100 * wire / base[0]['wire_bytes']:.2f}%"
                vv = f"{100 * runs[0]['values_bytes'] / base[0]['values_bytes']:.2f}%"
            else:
                dtext = wv = vv = "—"
            lines.append(f"| {k} | {'none' if p is None else f'{p}%'} | {loss:.4f} ± {sl:.4f} | {acc:.2f} ± {sa:.2f} | "
                         f"{best:.2f} ± {sb:.2f} | {dtext} | {cons:.2e} | {wire / 1e6:.2f} | {wv} | {vv} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Final test accuracy (mean over the seeds) against the wire volume of K = 1 uncompressed, one panel per graph,
    one line per method and top-k (K grows to the left); the uncompressed K = 1 run as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graphs = sorted({(r["config"]["agents"], r["config"]["topology"]) for r in results})
    fig, axes = plt.subplots(1, len(graphs), figsize=(3.6 * len(graphs), 3.4), sharey=True, squeeze=False)
    for ax, (n, topo) in zip(axes[0], graphs):
        for method, color in (("lodadac", "C0"), ("squarm", "C3")):
            runs = [r for r in results if (r["config"]["agents"], r["config"]["topology"], r["config"]["method"]) ==
                    (n, topo, method)]
            base = [r["wire_bytes"] for r in runs if r["config"]["k"] == 1 and r["config"]["topk"] is None]
            if not base:
                continue
            for topk, style in ((30, "-o"), (60, "--s")):
                pts = {}
                for r in runs:
                    if r["config"]["topk"] == topk:
                        pts.setdefault(r["config"]["k"], []).append(r)
                xs = [100 * v[0]["wire_bytes"] / base[0] for _, v in sorted(pts.items())]
                ys = [100 * _stat([r["final"]["test_acc"] for r in v])[0] for _, v in sorted(pts.items())]
                if xs:
                    ax.plot(xs, ys, style, color=color, ms=3, label=f"{method} top-{topk}%")
            ys = [100 * r["final"]["test_acc"] for r in runs if r["config"]["k"] == 1 and r["config"]["topk"] is None]
            ax.plot([100], [_stat(ys)[0]], "*", color=color, ms=9, label=f"{method} K=1 none")
        ax.set_xscale("log")
        ax.set_title(f"{'ring' if topo == 'ring' else 'grid'} of {n}")
        ax.set_xlabel("wire volume, % of K=1 none")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final test accuracy %")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    """Run the sweep (or re-render the page from results.json with --from-results)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/lodadac_sweep")
    ap.add_argument("--iters", type=int, default=600)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--graphs", default="ring:4,ring:9,torus:9,ring:16,torus:16",
                    help="topology:agents list (torus is the grid)")
    ap.add_argument("--ks", default="1,5,10,20,50", help="K values (each with every top-k)")
    ap.add_argument("--topks", default="30,60", help="top-k percents (K = 1 uncompressed is always run)")
    ap.add_argument("--from-results", action="store_true", help="re-render the page from results.json only")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.from_results:
        torch.set_num_threads(1)
        graphs = [(g.split(":")[0], int(g.split(":")[1])) for g in args.graphs.split(",")]
        ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
        sweep = Sweep(graphs=graphs, ks=ints(args.ks), topks=ints(args.topks), methods=args.methods.split(","),
                      seeds=ints(args.seeds), iters=args.iters)
        data, results, start = digits(), [], time.time()
        for i, cfg in enumerate(sweep.configs()):
            r = run(cfg, data)
            results.append(r)
            print(f"[{i + 1}/{len(sweep.configs())} {time.time() - start:.0f}s] {cfg.method} {cfg.topology}{cfg.agents} "
                  f"K={cfg.k} topk={cfg.topk} seed={cfg.seed}: loss {r['final']['train_loss']:.4f} acc "
                  f"{r['final']['test_acc']:.4f} wire {r['wire_bytes']}", flush=True)
        command = "python -m benchmarks.lodadac_sweep " + " ".join(sys.argv[1:] if argv is None else argv)
        (out / "results.json").write_text(json.dumps({"command": command, "runs": results}) + "\n")
    results = json.loads((out / "results.json").read_text())["runs"]
    (out / "lodadac_sweep.md").write_text(report(results) + "\n")
    plot(results, out / "lodadac_sweep.png")


if __name__ == "__main__":
    main()

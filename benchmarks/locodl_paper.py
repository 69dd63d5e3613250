"""LoCoDL measured as its paper measures it: f - f* against uplink bits per client, next to GD, DIANA and ADIANA.

    python -m benchmarks.locodl_paper --out benchmarks/results/locodl_paper

Problem (the paper's: l2-regularised logistic regression on a LibSVM binary data set split over n clients; a5a is
not available offline, so scikit-learn's bundled Wisconsin breast-cancer set stands in: 569 samples, d = 30, a real
binary classification set that LibSVM also distributes in another version, features scaled to [-1, 1] per column
as LibSVM's ``*_scale`` sets are): client i holds the i-th contiguous block of m = floor(569 / n) samples in the
set's order, f_i(x) = (1/m) sum log(1 + exp(-b a^T x)) + (mu/2)||x||^2, g(x) = (mu/2)||x||^2, and
F = (1/n) sum f_i + g. f* comes from Newton's method in fp64.

Methods (fp64 simulation of the n clients in one process; a client's uplink bits are counted as the paper counts
them: 32 bits a float, ceil(log2 d) bits an index, 9 bits a natural-compressed float; megacomp's wire bytes, which
send a rand-k key instead of indices, are recorded beside them):
  - GD: x <- x - (1 / L_F) grad F(x); every client sends its gradient (32 d bits) every iteration.
  - DIANA (Mishchenko et al. 2019; Horvath et al. 2019): client i sends Delta_i = C_i(grad f_i(x) - h_i), the
    server steps with g = h + mean Delta + grad g(x), h_i <- h_i + alpha Delta_i; alpha = 1 / (1 + omega),
    gamma = 1 / (L_F (1 + 6 omega / n)).
  - ADIANA (Li, Kovalev, Qian and Richtarik 2020, Algorithm 1 and its strongly convex parameters): the accelerated
    DIANA, two compressed messages per client and iteration (at x^k and at w^k).
  - LoCoDL (Algorithm 1, megacomp.outer.locodl written out for all clients at once) with the paper's parameters
    (megacomp.outer.locodl_params.paper_parameters) and natural compression, rand-k at k = ceil(d / n), or rand-1
    + natural.
The compressors are megacomp.compression.unbiased's, batched over the clients (``compress_all``), with the
generators the distributed engine uses (seeded per client): with natural compression the simulation at n = 4
equals a run of megacomp.outer.locodl on 4 gloo ranks (tests/test_benchmarks_locodl_paper.py). Three seeds where
the compressor is random.

Writes ``results.json`` (per run: f - f* and bits per client at each recorded point, parameters), ``results.md``
(bits per client to reach each accuracy) and ``locodl_paper.png``. Numbers are measured, never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

import torch

from megacomp.compression.unbiased import make_unbiased_codec, natural_round_with, omega_of
from megacomp.outer.locodl import coin
from megacomp.outer.locodl_params import paper_k, paper_parameters


def load_problem(n: int, mu: float, dataset: str = "breast_cancer"):
    """(A [n, m, d], b [n, m]) in fp64 and mu: the data set's rows in order, split into n blocks of m rows."""
    if dataset != "breast_cancer":
        raise ValueError(f"unknown data set {dataset!r}; use breast_cancer (scikit-learn's bundled copy)")
    try:
        from sklearn.datasets import load_breast_cancer
    except ImportError as e:
        raise ValueError("benchmarks.locodl_paper needs scikit-learn (pip install scikit-learn, or the test extra)") from e
    X, y = load_breast_cancer(return_X_y=True)
    a = torch.tensor(X, dtype=torch.float64)
    lo, hi = a.min(0).values, a.max(0).values
    a = 2 * (a - lo) / (hi - lo) - 1
    b = torch.tensor(y, dtype=torch.float64) * 2 - 1
    m = a.shape[0] // n
    if m < 1:
        raise ValueError(f"{n} clients for {a.shape[0]} samples: use n <= {a.shape[0]}")
    return a[:n * m].reshape(n, m, -1), b[:n * m].reshape(n, m), mu


class Problem:
    """The clients' f_i and g in fp64 (module docstring): gradients of all clients at once."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, mu: float) -> None:
        self.a, self.b, self.mu = a, b, mu
        self.n, self.m, self.d = a.shape
        hess = torch.einsum("imd,ime->ide", a, a) / self.m
        self.L_i = torch.linalg.eigvalsh(hess)[:, -1] / 4 + mu  # L of each f_i
        self.L = float(self.L_i.max())  # the f_i's common smoothness constant (g's is mu <= L)
        self.L_F = float(torch.linalg.eigvalsh(hess.mean(0))[-1] / 4 + 2 * mu)  # F's
        self.f_star = self.value(self.minimiser())

    def grads(self, X: torch.Tensor) -> torch.Tensor:
        """[n, d]: grad f_i(X[i]) for every client (X [n, d]), or at one point x [d] for all clients."""
        X = X.expand(self.n, self.d) if X.dim() == 1 else X
        z = -self.b * torch.einsum("imd,id->im", self.a, X)
        return -torch.einsum("imd,im->id", self.a, self.b * torch.sigmoid(z)) / self.m + self.mu * X

    def value(self, x: torch.Tensor) -> float:
        """F(x) = (1/n) sum f_i(x) + g(x)."""
        z = -self.b * torch.einsum("imd,d->im", self.a, x)
        return float(torch.nn.functional.softplus(z).mean() + self.mu * x.dot(x))

    def minimiser(self) -> torch.Tensor:
        """x* by Newton's method (fp64, to a gradient norm of 1e-15)."""
        x = torch.zeros(self.d, dtype=torch.float64)
        for _ in range(100):
            z = self.b * torch.einsum("imd,d->im", self.a, x)
            s = torch.sigmoid(-z)
            grad = -torch.einsum("imd,im->d", self.a, self.b * s) / (self.n * self.m) + 2 * self.mu * x
            w = s * (1 - s)
            hess = torch.einsum("imd,im,ime->de", self.a, w, self.a) / (self.n * self.m) + 2 * self.mu * torch.eye(self.d, dtype=torch.float64)
            x = x - torch.linalg.solve(hess, grad)
            if float(grad.norm()) < 1e-15:
                break
        return x

    def gap(self, x: torch.Tensor) -> float:
        """F(x) - f*."""
        return self.value(x) - self.f_star


def paper_bits(codec, d: int) -> int:
    """Uplink bits of one compressed d-vector as the paper counts them (module docstring)."""
    if codec.is_identity:
        return 32 * d
    index = math.ceil(math.log2(d))
    if codec.name == "natural":
        return 9 * d
    if codec.name == "randk":
        return codec.kept(d) * (32 + index)
    if codec.name == "randk_natural":
        return codec.kept(d) * (9 + index)
    raise ValueError(f"no paper bit count for codec {codec}; use none, natural, randk or randk_natural")


def client_generators(seed: int, n: int) -> list:
    """The compressors' generators: the ones megacomp.outer.locodl.LoCoDL seeds for replicas 0..n-1."""
    return [torch.Generator().manual_seed(seed * 7919 + 104729 * (i + 1)) for i in range(n)]


def compress_all(codec, M: torch.Tensor, gens: list) -> torch.Tensor:
    """[n, d]: every client's C_i(M[i]) (fp64), client i's random draws from ``gens[i]``, the arithmetic batched.
    Natural compression draws exactly what megacomp's codec draws (one float64 uniform an entry), so it equals
    ``codec.roundtrip`` entry for entry; rand-k here picks client i's k positions as the k largest of d uniforms
    from its generator (the same law as megacomp's rand-k, which derives them from a key it sends instead)."""
    if codec.is_identity:
        return M.clone()
    n, d = M.shape
    if codec.name == "natural":
        return natural_round_with(M, torch.stack([torch.rand(d, generator=g, dtype=torch.float64) for g in gens]))
    if codec.name not in ("randk", "randk_natural") or codec.chunk < d:
        raise ValueError(f"the simulation compresses with natural, randk or randk_natural over one chunk of d, got "
                         f"{codec}; set chunk >= d")
    k = codec.k
    pos = torch.stack([torch.rand(d, generator=g, dtype=torch.float64).topk(k).indices for g in gens])
    kept = M.gather(1, pos)
    if codec.name == "randk_natural":
        kept = natural_round_with(kept, torch.stack([torch.rand(k, generator=g, dtype=torch.float64) for g in gens]))
    return torch.zeros_like(M).scatter_(1, pos, kept * (d / k))


def _record(history: dict, gap: float, bits: float, wire: float) -> None:
    history["gap"].append(gap)
    history["bits"].append(bits)
    history["wire_bits"].append(wire)


def run_locodl(prob: Problem, codec, seed: int, iters: int, target: float, x0: Optional[torch.Tensor] = None,
               params=None, trace: bool = False) -> dict:
    """LoCoDL's Algorithm 1 for all clients in fp64; records F(mean x_i) - f* after every communication.
    ``trace``: also return the final X, U, y, v (the equality test)."""
    n, d = prob.n, prob.d
    omega = omega_of(codec, d)
    par = params or paper_parameters(prob.L, prob.mu, omega, n)
    gamma, chi, rho, p = par.gamma, par.chi, par.rho, par.probability
    c = p * chi / (gamma * (1 + 2 * omega))
    x0 = torch.zeros(d, dtype=torch.float64) if x0 is None else x0.double()
    X, U = x0.expand(n, d).clone(), torch.zeros(n, d, dtype=torch.float64)
    y, v = x0.clone(), torch.zeros(d, dtype=torch.float64)
    gens = client_generators(seed, n)
    msg_bits, msg_wire = paper_bits(codec, d), 8 * codec.wire_bytes(d, torch.float32)
    h = {"gap": [], "bits": [], "wire_bits": []}
    _record(h, prob.gap(X.mean(0)), 0, 0)
    comms = 0
    for t in range(iters):
        Xh = X - gamma * prob.grads(X) + gamma * U
        yh = y - gamma * prob.mu * y + gamma * v
        if coin(seed, t, p):
            D = compress_all(codec, Xh - yh, gens)
            dbar = D.sum(0) / (2 * n)
            X = (1 - rho) * Xh + rho * (yh + dbar)
            U = U + c * (dbar - D)
            y, v = yh + rho * dbar, v + c * dbar
            comms += 1
            _record(h, prob.gap(X.mean(0)), comms * msg_bits, comms * msg_wire)
            if h["gap"][-1] < target:
                break
        else:
            X, y = Xh, yh
    h.update(iterations=t + 1, communications=comms, parameters=par.to_dict())
    if trace:
        h.update(X=X, U=U, y=y, v=v)
    return h


def run_gd(prob: Problem, iters: int, target: float) -> dict:
    """Gradient descent on F with stepsize 1 / L_F; each client sends its full gradient every iteration."""
    x = torch.zeros(prob.d, dtype=torch.float64)
    gamma, bits = 1.0 / prob.L_F, 32 * prob.d
    h = {"gap": [], "bits": [], "wire_bits": []}
    _record(h, prob.gap(x), 0, 0)
    for t in range(iters):
        x = x - gamma * (prob.grads(x).mean(0) + prob.mu * x)
        _record(h, prob.gap(x), (t + 1) * bits, (t + 1) * bits)
        if h["gap"][-1] < target:
            break
    h.update(iterations=t + 1, communications=t + 1, parameters={"gamma": gamma})
    return h


def run_diana(prob: Problem, codec, seed: int, iters: int, target: float) -> dict:
    """DIANA (module docstring): alpha = 1 / (1 + omega), gamma = 1 / (L_F (1 + 6 omega / n)), h_i^0 = 0."""
    n, d = prob.n, prob.d
    omega = omega_of(codec, d)
    alpha, gamma = 1.0 / (1 + omega), 1.0 / (prob.L_F * (1 + 6 * omega / n))
    x, H = torch.zeros(d, dtype=torch.float64), torch.zeros(n, d, dtype=torch.float64)
    gens = client_generators(seed, n)
    bits, wire = paper_bits(codec, d), 8 * codec.wire_bytes(d, torch.float32)
    h = {"gap": [], "bits": [], "wire_bits": []}
    _record(h, prob.gap(x), 0, 0)
    for t in range(iters):
        delta = compress_all(codec, prob.grads(x) - H, gens)
        x = x - gamma * ((H + delta).mean(0) + prob.mu * x)
        H = H + alpha * delta
        _record(h, prob.gap(x), (t + 1) * bits, (t + 1) * wire)
        if h["gap"][-1] < target:
            break
    h.update(iterations=t + 1, communications=t + 1, parameters={"alpha": alpha, "gamma": gamma})
    return h


def adiana_parameters(L: float, mu: float, omega: float, n: int) -> dict:
    """ADIANA's strongly convex parameters (Li et al. 2020): alpha = 1 / (1 + omega), theta2 = 1/2,
    p = min(1, max(1, sqrt(n / (32 omega)) - 1) / (2 (1 + omega))), eta = min(1 / (2L),
    n / (64 omega (2 p (omega + 1) + 1)^2 L)), theta1 = min(1/4, sqrt(eta mu / p)), gamma = eta / (2 (theta1 +
    eta mu)), beta = 1 - gamma mu (omega = 0: the accelerated method's eta = 1 / (2L), p = 1)."""
    alpha = 1.0 / (1 + omega)
    if omega == 0:
        p, eta = 1.0, 1.0 / (2 * L)
    else:
        p = min(1.0, max(1.0, math.sqrt(n / (32 * omega)) - 1) / (2 * (1 + omega)))
        eta = min(1.0 / (2 * L), n / (64 * omega * (2 * p * (omega + 1) + 1) ** 2 * L))
    theta1 = min(0.25, math.sqrt(eta * mu / p))
    gamma = eta / (2 * (theta1 + eta * mu))
    return {"alpha": alpha, "p": p, "eta": eta, "theta1": theta1, "theta2": 0.5, "gamma": gamma,
            "beta": 1 - gamma * mu}


def run_adiana(prob: Problem, codec, seed: int, iters: int, target: float) -> dict:
    """ADIANA (module docstring): records F(y^k) - f*; two compressed messages per client and iteration."""
    n, d = prob.n, prob.d
    omega = omega_of(codec, d)
    par = adiana_parameters(prob.L_F, 2 * prob.mu, omega, n)
    a, p, eta, t1, t2, gam, beta = (par[k] for k in ("alpha", "p", "eta", "theta1", "theta2", "gamma", "beta"))
    zero = torch.zeros(d, dtype=torch.float64)
    y, z, w, H = zero.clone(), zero.clone(), zero.clone(), torch.zeros(n, d, dtype=torch.float64)
    gens = client_generators(seed, n)
    wgen = torch.Generator().manual_seed(seed * 7919 + 1)  # w's coin
    bits, wire = 2 * paper_bits(codec, d), 2 * 8 * codec.wire_bytes(d, torch.float32)
    h = {"gap": [], "bits": [], "wire_bits": []}
    _record(h, prob.gap(y), 0, 0)
    for t in range(iters):
        x = t1 * z + t2 * w + (1 - t1 - t2) * y
        gx = compress_all(codec, prob.grads(x) - H, gens)
        gw = compress_all(codec, prob.grads(w) - H, gens)
        g = (H + gx).mean(0) + prob.mu * x
        H = H + a * gw
        y_new = x - eta * g
        z = beta * z + (1 - beta) * x + (gam / eta) * (y_new - x)
        if float(torch.rand(1, generator=wgen, dtype=torch.float64)) < p:
            w = y.clone()
        y = y_new
        _record(h, prob.gap(y), (t + 1) * bits, (t + 1) * wire)
        if h["gap"][-1] < target or not math.isfinite(h["gap"][-1]):
            break
    h.update(iterations=t + 1, communications=t + 1, parameters=par)
    return h


def method_grid(d: int, n: int) -> list[dict]:
    """The runs: GD, then DIANA, ADIANA and LoCoDL with natural, rand-k (k = ceil(d / n)) and rand-1 + natural."""
    k = paper_k(d, n)
    codecs = [("natural", "natural"), (f"rand-{k}", {"name": "randk", "k": k, "chunk": d}),
              ("rand-1+natural", {"name": "randk_natural", "k": 1, "chunk": d})]
    grid = [{"label": "GD", "method": "gd", "codec": None}]
    for method in ("diana", "adiana", "locodl"):
        for name, spec in codecs:
            grid.append({"label": f"{method.upper() if method != 'locodl' else 'LoCoDL'}, {name}", "method": method,
                         "codec": spec})
    return grid


def run_one(prob: Problem, job: dict, seed: int, iters: int, target: float) -> dict:
    """One run of the grid (module docstring)."""
    codec = make_unbiased_codec(job["codec"])
    if job["method"] == "gd":
        h = run_gd(prob, iters, target)
    elif job["method"] == "diana":
        h = run_diana(prob, codec, seed, iters, target)
    elif job["method"] == "adiana":
        h = run_adiana(prob, codec, seed, iters, target)
    else:
        h = run_locodl(prob, codec, seed, iters, target)
    h.update(label=job["label"], method=job["method"], codec=str(codec), seed=seed, omega=omega_of(codec, prob.d))
    return h


def thin(h: dict, per_decade: int = 10) -> dict:
    """The recorded points that a plot and the table need: every first crossing below 10^(-j / per_decade) (so
    :func:`bits_to` at a power of ten is exact), the first and the last point, and about 200 log-spaced others."""
    n = len(h["gap"])
    keep = {0, n - 1} | {int(round(n ** (i / 200))) - 1 for i in range(201)}
    level = math.inf
    for i, gap in enumerate(h["gap"]):
        if gap > 0:
            j = math.ceil(-math.log10(gap) * per_decade) - 1  # thresholds 10^(-k / per_decade) it is below
            if level == math.inf or j > level:
                keep.add(i)
                level = j
    idx = sorted(i for i in keep if 0 <= i < n)
    out = dict(h)
    for key in ("gap", "bits", "wire_bits"):
        out[key] = [h[key][i] for i in idx]
    return out


def bits_to(h: dict, eps: float) -> Optional[float]:
    """Paper-convention bits per client until f - f* first fell below ``eps`` (None: never)."""
    for gap, bits in zip(h["gap"], h["bits"]):
        if gap < eps:
            return bits
    return None


def table(runs: list[dict], eps_list: list[float]) -> str:
    """Markdown: per method, mean (min-max over seeds) kbit per client to each accuracy."""
    labels = list(dict.fromkeys(r["label"] for r in runs))
    head = "| method | omega | seeds | " + " | ".join(f"kbit to f-f* < {e:g}" for e in eps_list) + \
        " | iterations (mean) | communications (mean) |"
    lines = [head, "|" + "---|" * (5 + len(eps_list))]
    for lab in labels:
        rs = [r for r in runs if r["label"] == lab]
        cells = []
        for e in eps_list:
            vals = [bits_to(r, e) for r in rs]
            if any(v is None for v in vals):
                cells.append(f"not reached ({sum(v is None for v in vals)}/{len(vals)})")
            else:
                kb = [v / 1e3 for v in vals]
                cells.append(f"{sum(kb) / len(kb):,.1f}" + (f" ({min(kb):,.1f}-{max(kb):,.1f})" if len(kb) > 1 else ""))
        it = sum(r["iterations"] for r in rs) / len(rs)
        cm = sum(r["communications"] for r in rs) / len(rs)
        lines.append(f"| {lab} | {rs[0]['omega']:.3g} | {len(rs)} | " + " | ".join(cells) + f" | {it:,.0f} | {cm:,.0f} |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path, title: str) -> None:
    """f - f* against kbit per client, one line per run (seeds share a colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {}
    styles = {"gd": ":", "diana": "--", "adiana": "-.", "locodl": "-"}
    for r in runs:
        col = colours.setdefault(r["label"], f"C{len(colours)}")
        gaps = [max(g, 1e-16) for g in r["gap"]]
        ax.semilogy([b / 1e3 for b in r["bits"]], gaps, color=col, linestyle=styles[r["method"]], linewidth=1,
                    label=r["label"] if r["seed"] == runs[0]["seed"] or r["method"] == "gd" else None)
    ax.set_xlabel("uplink kbit per client (32 bits a float, log2 d an index, 9 a natural float)")
    ax.set_ylabel("f(x) - f*")
    ax.set_xscale("log")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/locodl_paper")
    ap.add_argument("--clients", type=int, default=10, help="n")
    ap.add_argument("--mu", type=float, default=1e-3, help="l2 regularisation of each f_i and of g")
    ap.add_argument("--seeds", default="1,2,3", help="seeds of the random compressors and coins")
    ap.add_argument("--iters", type=int, default=200_000, help="iteration cap per run")
    ap.add_argument("--target", type=float, default=1e-10, help="stop a run once f - f* falls below this")
    ap.add_argument("--methods", default="", help="semicolon-separated labels to run (default: all), e.g. \"GD;LoCoDL, natural\"")
    ap.add_argument("--from-results", action="store_true", help="rewrite the table and plot from results.json")
    ap.add_argument("--merge", default="", help="comma-separated result folders whose runs form --out's results")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_results or args.merge:
        folders = [Path(f) for f in args.merge.split(",")] if args.merge else [out]
        saved = [json.loads((f / "results.json").read_text()) for f in folders]
        # merged studies may cap iterations differently: each run's cap is kept with it
        runs = [dict(r, iters=r.get("iters", s["meta"]["iters"])) for s in saved for r in s["runs"]]
        runs = [thin(r) for r in runs]
        meta = dict(saved[0]["meta"], iters=sorted({r["iters"] for r in runs}))
        (out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}))
        write_report(runs, meta, out)
        return
    prob = Problem(*load_problem(args.clients, args.mu))
    seeds = [int(s) for s in args.seeds.split(",")]
    grid = method_grid(prob.d, prob.n)
    if args.methods:
        keep = {m.strip() for m in args.methods.split(";")}
        unknown = keep - {j["label"] for j in grid}
        if unknown:
            labels = [j["label"] for j in grid]
            raise SystemExit(f"unknown method labels {sorted(unknown)}; use some of {labels}")
        grid = [j for j in grid if j["label"] in keep]
    meta = {"data": "breast_cancer (scikit-learn), scaled to [-1, 1]", "n": prob.n, "m": prob.m, "d": prob.d,
            "mu": prob.mu, "L": prob.L, "L_F": prob.L_F, "kappa": prob.L / prob.mu, "f_star": prob.f_star,
            "seeds": seeds, "iters": args.iters, "target": args.target}
    runs = []
    for job in grid:
        for seed in (seeds[:1] if job["method"] == "gd" else seeds):
            r = run_one(prob, job, seed, args.iters, args.target)
            print(f"{r['label']:28s} seed {seed}: {r['iterations']:7d} it, {r['communications']:7d} comms, "
                  f"final gap {r['gap'][-1]:.2e}, {r['bits'][-1] / 1e3:,.1f} kbit", flush=True)
            runs.append(thin(r))
            # written after every run, so a long study interrupted keeps what it measured
            (out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    write_report(runs, meta, out)


def write_report(runs: list[dict], meta: dict, out: Path) -> None:
    """results.md and locodl_paper.png from the (thinned) runs."""
    eps = sorted({1e-4, 1e-6, 1e-8, meta["target"]}, reverse=True)
    md = table(runs, eps)
    (out / "results.md").write_text(md + "\n")
    print(md)
    plot(runs, out / "locodl_paper.png", f"l2-logistic regression, breast_cancer, n = {meta['n']}, d = {meta['d']}, "
                                         f"kappa = {meta['kappa']:.0f}")


if __name__ == "__main__":
    main()

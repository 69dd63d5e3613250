"""benchmarks.locodl_paper (LoCoDL as its paper measures it) and megacomp.outer.locodl_params (its parameter rule).

- The rule: without compression it is Scaffnew's (gamma = 1 / L, chi = rho = 1, p = 1 / sqrt(kappa)); p balances
  the two contraction terms whenever p < 1, never exceeds 1, grows with omega and falls with kappa; with rand-k at
  k = ceil(d / n) the uplink floats per factor e stay within a constant of the paper's
  (sqrt(d) + d / sqrt(n)) sqrt(kappa) + d over a grid of d, n and kappa; bad constants raise one line.
- The fp64 simulation at n = 4 with natural compression equals megacomp.outer.locodl run on 4 gloo ranks (same coin,
  same per-replica compressor streams) to fp32 rounding, and communicates on the same steps.
- The batched compressors are megacomp's natural compression entry for entry, and rand-k / rand-k + natural keep
  k entries scaled by d / k, unbiased.
- On a well-conditioned instance every method of the grid (GD, DIANA, ADIANA, LoCoDL; natural and rand-k) reaches
  f - f* < 1e-8, the thinned record keeps the bits at which each power of ten is crossed, and the results table
  reads them.
"""
import dataclasses
import math

import pytest
import torch

from benchmarks import locodl_paper as lp
from distributed import run_ranks
from megacomp.compression.unbiased import make_unbiased_codec
from megacomp.outer.locodl_params import paper_k, paper_parameters

pytest.importorskip("sklearn", reason="the benchmark's data set is scikit-learn's bundled copy (test extra)")


def test_rule_is_scaffnews_without_compression_and_balances_the_rates():
    par = paper_parameters(4.0, 0.01, 0.0, 10)
    assert (par.gamma, par.chi, par.rho) == (0.25, 1.0, 1.0)
    assert par.probability == pytest.approx(1 / math.sqrt(400))
    for omega in (0.125, 2.0, 9.0, 35.0):
        for kappa in (30.0, 1e3, 1e5):
            q = paper_parameters(kappa, 1.0, omega, 10)
            assert 0 < q.probability <= 1 and q.chi == pytest.approx(1 / (1 + omega / 10)) and q.rho == q.chi
            if q.probability < 1:  # the local step's and the control variates' contractions are equal
                assert 1 - q.gamma * 1.0 == pytest.approx(1 - q.probability ** 2 * q.chi / (1 + 2 * omega))
            assert q.rate == pytest.approx(1 - min(1 / kappa, q.probability ** 2 * q.chi / (1 + 2 * omega)))
    ps = [paper_parameters(1e4, 1.0, w, 4).probability for w in (0, 1, 4, 16)]
    assert ps == sorted(ps) and ps[0] < ps[-1]
    ps = [paper_parameters(k, 1.0, 2.0, 4).probability for k in (10.0, 1e2, 1e4)]
    assert ps == sorted(ps, reverse=True)


def test_randk_at_d_over_n_gives_the_doubly_accelerated_uplink_complexity():
    ratios = []
    for d in (30, 123, 1000):
        for n in (2, 10, 100):
            for kappa in (10.0, 1e3, 1e6):
                k = paper_k(d, n)
                par = paper_parameters(kappa, 1.0, d / k - 1, n)
                floats = k * par.communications_per_e
                ratios.append(floats / ((math.sqrt(d) + d / math.sqrt(n)) * math.sqrt(kappa) + d))
    # Theta(1): bounded above by a constant (4 from the rule's 2 omega + 1 <= 2 (omega + 1) twice, ceil aside)
    assert max(ratios) <= 4 and min(ratios) > 0.05, (min(ratios), max(ratios))


def test_bad_constants_raise_one_line_naming_the_fix():
    with pytest.raises(ValueError, match="mu=2 is larger than L=1"):
        paper_parameters(1, 2, 0, 4)
    with pytest.raises(ValueError, match="omega must be >= 0"):
        paper_parameters(1, 0.1, -1, 4)
    with pytest.raises(ValueError, match="n \\(clients\\) must be an int >= 1"):
        paper_parameters(1, 0.1, 0, 0)
    with pytest.raises(ValueError, match="L and mu must be > 0"):
        paper_parameters(0, 0.1, 0, 4)
    with pytest.raises(ValueError, match="set chunk >= d"):
        lp.compress_all(make_unbiased_codec({"name": "randk", "k": 1, "chunk": 4}), torch.zeros(2, 8), [None, None])


def _distributed_locodl(rank, world, a, b, mu, par, steps, seed):
    from megacomp.outer.locodl import LoCoDL, LoCoDLConfig

    x = torch.nn.Parameter(torch.zeros(a.shape[-1]), requires_grad=False)
    cfg = LoCoDLConfig(probability=par.probability, gamma=par.gamma, chi=par.chi, rho=par.rho, codec="natural",
                       seed=seed)
    engine = LoCoDL([x], None, cfg, grad_g=lambda y: mu * y)
    prob_rows, labels = a[rank], b[rank]
    talked = []
    for _ in range(steps):
        with torch.no_grad():  # the local step: x - gamma grad f_i(x), f_i's gradient in fp64
            z = -labels * (prob_rows @ x.double())
            g = -(prob_rows.T @ (labels * torch.sigmoid(z))) / prob_rows.shape[0] + mu * x.double()
            x.sub_(g.float(), alpha=par.gamma)
        talked.append(engine.step())
    return x.detach().double(), engine.y.double(), engine.u.double(), engine.v.double(), talked


def test_simulation_at_n4_equals_locodl_on_4_gloo_ranks():
    a, b, mu = lp.load_problem(4, 1e-2)
    prob = lp.Problem(a, b, mu)
    codec = make_unbiased_codec("natural")
    par = dataclasses.replace(paper_parameters(prob.L, prob.mu, 0.125, 4), probability=0.5)  # more exchanges
    steps, seed = 30, 2
    sim = lp.run_locodl(prob, codec, seed, steps, target=-1.0, params=par, trace=True)
    assert sim["iterations"] == steps and sim["communications"] >= 10
    out = run_ranks(_distributed_locodl, 4, a, b, mu, par, steps, seed)
    from megacomp.outer.locodl import coin
    scale = float(sim["X"].abs().max())
    for rank, (x, y, u, v, talked) in enumerate(out):
        assert talked == [coin(seed, t, par.probability) for t in range(steps)]
        assert sum(talked) == sim["communications"]
        # fp32 engine against the fp64 simulation: ~30 steps of a few fp32 roundings each
        assert float((x - sim["X"][rank]).abs().max()) <= 1e-5 * scale
        assert float((y - sim["y"]).abs().max()) <= 1e-5 * scale
        assert par.gamma * float((u - sim["U"][rank]).abs().max()) <= 1e-5 * scale
        assert par.gamma * float((v - sim["v"]).abs().max()) <= 1e-5 * scale


def test_batched_compressors_match_megacomps_and_are_unbiased():
    n, d = 3, 12
    M = torch.randn(n, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    nat = make_unbiased_codec("natural")
    got = lp.compress_all(nat, M, lp.client_generators(5, n))
    want = torch.stack([nat.roundtrip(M[i], g) for i, g in enumerate(lp.client_generators(5, n))])
    assert torch.equal(got, want)
    for spec in ({"name": "randk", "k": 3, "chunk": d}, {"name": "randk_natural", "k": 1, "chunk": d}):
        c = make_unbiased_codec(spec)
        gens = lp.client_generators(1, n)
        draws = torch.stack([lp.compress_all(c, M, gens) for _ in range(3000)])
        assert ((draws != 0).sum(2) == c.k).all()
        # entry (i, j) is 0 or (d/k) times (a natural rounding of) M_ij, at most (d/k) 2 |M_ij|: Hoeffding, union
        width = d / c.k * 2 * M.abs()
        assert ((draws.mean(0) - M).abs() <= width * math.sqrt(math.log(2 * n * d / 1e-6) / (2 * 3000))).all()


def test_every_method_converges_on_a_well_conditioned_instance():
    prob = lp.Problem(*lp.load_problem(4, 0.3))  # kappa about 10: a few hundred iterations each
    jobs = [j for j in lp.method_grid(prob.d, prob.n) if "rand-1" not in j["label"]]  # omega 33: thousands
    runs = [lp.run_one(prob, job, 1, 3000, 1e-8) for job in jobs]
    for r in runs:
        assert r["gap"][-1] < 1e-8 and r["gap"][0] > 1e-2, (r["label"], r["gap"][-1])
        assert r["bits"] == sorted(r["bits"])
        small = lp.thin(r)  # what results.json keeps: the table's crossings exactly
        assert len(small["gap"]) <= len(r["gap"]) and all(lp.bits_to(small, e) == lp.bits_to(r, e)
                                                          for e in (1e-2, 1e-4, 1e-6, 1e-8))
    md = lp.table(runs, [1e-4, 1e-8])
    assert md.count("\n") == len(runs) + 1 and "not reached" not in md
    gd = next(r for r in runs if r["method"] == "gd")
    assert lp.bits_to(gd, 1e-8) == gd["bits"][-1] == gd["iterations"] * 32 * prob.d

"""benchmarks.lodadac_sweep: the in-process simulation of n agents is megacomp's distributed LoDAdaC.

- Four gloo ranks run megacomp.outer.lodadac (LoDAdaCAdam + the LoDAdaC engine, point-to-point gossip) on the
  sweep's MLP, data shards and batches, on a ring: K = 2 with top-k 30%, and K = 1 uncompressed; after every
  iteration each rank's weights equal the simulation's agent within fp32 rounding (bit for bit where this was
  written: bmm and mm round alike there, but need not on every BLAS), and the bytes megacomp's
  channel counted equal the simulation's.
- The driver writes its page: one row per (K, top-k) with the volumes against K = 1 uncompressed, counted
  at every iteration (bytes only at the exchanges).
"""
import json

import torch
import torch.nn.functional as F

from benchmarks.lodadac_sweep import Batches, RunConfig, deal, digits, forward, init_model, main, run
from distributed import run_ranks

STEPS = 6


def _megacomp_body(rank, world, settings, data):
    from megacomp import comm
    from megacomp.outer.lodadac import LoDAdaC, LoDAdaCAdam, LoDAdaCConfig

    xtr, ytr = data[0], data[1]
    out = []
    for k, topk, gamma in settings:
        comm.reset_stats()
        cfg = RunConfig(agents=world, topology="ring", k=k, topk=topk, iters=STEPS, seed=1)
        params = [torch.nn.Parameter(p.clone()) for p in init_model(cfg.seed)]
        opt = LoDAdaCAdam(params, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-4)
        engine = LoDAdaC(params, None, LoDAdaCConfig(outer_steps=k, topology="ring", gossip_lr=gamma,
                                                     codec=cfg.codec().to_dict() if topk else None))
        batches = Batches(deal(len(xtr), world, cfg.seed)[rank], cfg.batch, 100 * cfg.seed + rank)
        trace = []
        for _ in range(STEPS):
            idx = batches.next()
            loss = F.cross_entropy(forward(params, xtr[idx]), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            engine.step()
            trace.append(torch.cat([p.detach().reshape(-1) for p in params]))
        stats = comm.stats()
        out.append((trace, stats["outer"].wire_bytes if "outer" in stats else 0))
    return out


def test_simulation_is_megacomps_distributed_lodadac():
    settings = [(2, 30, 0.5), (1, None, 1.0)]
    data = digits()  # loaded (scikit-learn imported) once, here, not in each forked rank
    sims = [run(RunConfig(agents=4, topology="ring", k=k, topk=topk, gamma=gamma, iters=STEPS, seed=1), data,
                trace=True) for k, topk, gamma in settings]  # also imports what torch.optim's first step needs
    ranks = run_ranks(_megacomp_body, 4, settings, data)
    for s, (k, topk, gamma) in enumerate(settings):
        sim = sims[s]
        for t in range(STEPS):
            for i in range(4):
                mine, theirs = ranks[i][s][0][t], sim["trace"][t][i]
                scale = max(float(theirs.abs().max()), 1.0)
                # the same operations, but bmm over the stacked agents vs one mm per rank and a summed vs a mean
                # loss: a few fp32 roundings per iteration, carried through the (1-Lipschitz here, at these sizes)
                # steps; top-k picks the same entries (a near tie flipping would be a whole entry: loud, not hidden)
                err = float((mine - theirs).abs().max())
                assert err <= 64 * (t + 1) * 2.0 ** -24 * scale, (k, topk, t, i, err)
        assert sum(r[s][1] for r in ranks) == sim["wire_bytes"] > 0


def test_driver_writes_the_page_with_volumes_against_k1_uncompressed(tmp_path):
    main(["--out", str(tmp_path), "--graphs", "ring:4", "--seeds", "1", "--iters", "10", "--ks", "1,5",
          "--topks", "30", "--methods", "lodadac"])
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["config"]["k"], r["config"]["topk"]) for r in runs] == [(1, None), (1, 30), (5, 30)]
    numel = 64 * 32 + 32 + 32 * 10 + 10
    base, k5 = runs[0], runs[2]
    assert base["wire_bytes"] == 10 * 4 * 2 * numel * 4  # every iteration, 4 agents, 2 neighbours, fp32
    assert k5["bytes_per_iter"][:5] == [0, 0, 0, 0, k5["bytes_per_iter"][4]] and k5["bytes_per_iter"][4] > 0
    kept = 24 * 30 + 10  # 24 full chunks of 100 keep 30 each, the last 10 entries are kept whole
    assert k5["values_bytes"] == 2 * 4 * 2 * kept * 4  # 2 exchanges
    page = (tmp_path / "lodadac_sweep.md").read_text()
    assert "| 5 | 30% |" in page and f"{100 * kept / numel / 5:.2f}%" in page

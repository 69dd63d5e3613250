"""megacomp.outer.mt_dao (MT-DAO: parameters and every optimizer moment averaged every H steps).

- average_optimizer_state replaces each moment by the replicas' mean (fp32: x / R summed, bound derived in
  the test) and leaves the step counters alone.
- Pretraining with --outer-algorithm mt_dao on 4 replicas: the loss falls, after a synchronisation every
  replica holds the same parameters and the same optimizer state (bit for bit: the all-reduce hands every
  rank the same sum), the outer traffic carries the parameters and 3 moments (fast, second, one slow), and
  resume is bit-identical.
- Bad settings raise naming the fix.
"""
import hashlib

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp.comm import Channel
from megacomp.optimizer import MultiTimescaleAdamW
from megacomp.outer.mt_dao import average_optimizer_state

EPS32 = 2.0 ** -24


def _average_body(rank, world):
    p = torch.nn.Parameter(torch.zeros(9, 4))
    opt = MultiTimescaleAdamW([p], lr=1e-2)
    p.grad = torch.randn(9, 4, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    opt.step()
    before = {k: v.double().clone() for k, v in opt.state[p].items()}
    gathered = {}
    for k, v in opt.state[p].items():
        xs = [torch.empty_like(v) for _ in range(world)]
        dist.all_gather(xs, v)
        gathered[k] = torch.stack([x.double() for x in xs])
    count = average_optimizer_state(opt, Channel("outer", None))
    out = {}
    for k, v in opt.state[p].items():
        if k == "step":
            out[k] = torch.equal(v.double(), before[k])
            continue
        want = gathered[k].mean(0)
        # x / R rounds once per member, the sum of R terms R - 1 times: R + (R - 1) roundings of at most max|x|
        bound = (2 * world - 1) * EPS32 * gathered[k].abs().max(0).values
        out[k] = bool(((v.double() - want).abs() <= bound).all())
    return count, out


@pytest.mark.parametrize("world", [2, 3])
def test_average_optimizer_state_is_the_mean_and_keeps_the_step(world):
    for count, out in run_ranks(_average_body, world):
        assert count == 3 and all(out.values()), out  # exp_avg, exp_avg_sq, slow_avg_0; step unchanged


def _paper_body(rank, world, rounds, k):
    """megacomp (MultiTimescaleAdamW with betas[0] = 0, the parameters averaged, average_optimizer_state) against the
    paper's MT-DAO-Adam in its quasi-hyperbolic form, restated in fp64 for every replica here:
        g = grad f_r(x);  x <- x (1 - lr wd);  u <- b u + (1 - b) g;  v <- b2 v + (1 - b2) g^2
        x <- x - lr ((1 - w) g + w u / (1 - b^t)) / (sqrt(v / (1 - b2^t)) + eps)
    for K steps on replica r's own f_r(x) = sum(a_r (x - c_r)^2) / 2, then x, u and v replaced by their means."""
    lr, b2, eps, wd, b, w = 0.05, 0.95, 1e-8, 0.1, 0.9, 0.9
    data = [(torch.rand(6, 3, generator=torch.Generator().manual_seed(r), dtype=torch.float64) + 0.5,
             torch.randn(6, 3, generator=torch.Generator().manual_seed(50 + r), dtype=torch.float64))
            for r in range(world)]
    x0 = torch.randn(6, 3, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    p = torch.nn.Parameter(x0.clone())
    opt = MultiTimescaleAdamW([p], lr=lr, betas=(0.0, b2), eps=eps, weight_decay=wd, slow_betas=(b,), slow_weights=(w,))
    xs, us, vs = [x0.clone() for _ in data], [torch.zeros_like(x0) for _ in data], [torch.zeros_like(x0) for _ in data]
    worst, counts, t = 0.0, [], 0
    for _ in range(rounds):
        for _ in range(k):
            t += 1
            a, c = data[rank]
            p.grad = a * (p.detach() - c)
            opt.step()
            for r, (a, c) in enumerate(data):
                g = a * (xs[r] - c)
                xs[r] = xs[r] * (1 - lr * wd)
                us[r] = b * us[r] + (1 - b) * g
                vs[r] = b2 * vs[r] + (1 - b2) * g * g
                xs[r] = xs[r] - lr * ((1 - w) * g + w * us[r] / (1 - b ** t)) / ((vs[r] / (1 - b2 ** t)).sqrt() + eps)
        with torch.no_grad():
            dist.all_reduce(p.data)
            p.data.div_(world)
        counts.append(average_optimizer_state(opt, Channel("outer", None)))
        xs, us, vs = ([torch.stack(z).mean(0)] * world for z in (xs, us, vs))
        state = opt.state[p]
        for got, want in ((p.detach(), xs[0]), (state["slow_avg_0"], us[0]), (state["exp_avg_sq"], vs[0])):
            worst = max(worst, ((got - want).abs() / want.abs().clamp_min(1e-3)).max().item())
    return worst, counts


def test_beta1_zero_is_the_papers_quasi_hyperbolic_mt_dao():
    """Two replicas, 2 rounds of K = 3 steps: parameters, slow momentum and second moment equal the restatement to
    fp64 rounding, and each synchronisation sends the slow momentum and v only (exp_avg is the gradient)."""
    for worst, counts in run_ranks(_paper_body, 2, 2, 3):
        assert worst < 1e-12 and counts == [2, 2]


def _pretrain_body(rank, world, cfg):
    from megacomp.training import Trainer

    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        h = hashlib.sha256()
        for p in trainer.model.parameters():
            h.update(p.detach().numpy().tobytes())
        for state in trainer.optimizer.optimizer.state.values():
            for k in sorted(state):
                h.update(state[k].numpy().tobytes())
        kinds = sorted(next(iter(trainer.optimizer.optimizer.state.values())))
    finally:
        trainer.close()
    return [(x["loss"], x["traffic"]) for x in history], h.hexdigest(), kinds


def _cfg(tiny_config, **kw):
    from dataclasses import replace

    return replace(tiny_config, train_iters=6, outer_algorithm="mt_dao", num_replicas=4, outer_steps=2, **kw)


def test_pretraining_with_mt_dao_synchronises_parameters_and_moments_and_resumes(tiny_config, tmp_path):
    from dataclasses import replace

    cfg = _cfg(tiny_config)
    results = run_ranks(_pretrain_body, 4, cfg)
    history, digest, kinds = results[0]
    assert kinds == ["exp_avg", "exp_avg_sq", "slow_avg_0", "step"]
    assert all(r[1] == digest for r in results)  # step 6 synchronised: every replica identical
    losses = [loss for loss, _ in history]
    assert losses[-1] < losses[0]
    outer = [t.get("outer", [0, 0]) for _, t in history]
    assert [w > 0 for w, _ in outer] == [False, True] * 3
    per_sync = {w for w, _ in outer if w}
    diloco = run_ranks(_pretrain_body, 4, replace(cfg, outer_algorithm="diloco"))[0][0]
    params_only = {t["outer"][0] for _, t in diloco if t.get("outer", [0])[0]}
    assert len(per_sync) == 1 and len(params_only) == 1
    assert per_sync.pop() == 4 * params_only.pop()  # the parameters' exchange + 3 moments of the same size
    ck = str(tmp_path / "ck")
    first = run_ranks(_pretrain_body, 4, replace(cfg, save=ck, exit_interval=3))[0][0]
    rest = run_ranks(_pretrain_body, 4, replace(cfg, load=ck))[0][0]
    assert [loss for loss, _ in first + rest] == losses


def test_mt_dao_flags_are_checked(tiny_config):
    from megacomp.training.arguments import check

    for kw, words in [(dict(mt_dao_slow_betas="0.999,0.99"), "one weight per beta"),
                      (dict(mt_dao_slow_weights="0.9,x", mt_dao_slow_betas="0.9,0.99"), "comma list of numbers"),
                      (dict(mt_dao_slow_weights="1.5"), "summing to at most 1"),
                      (dict(adam_freeze_variance_step=5), "both replace the inner optimizer"),
                      (dict(outer_fragments=2), "Streaming DiLoCo")]:
        with pytest.raises(ValueError, match=words):
            check(_cfg(tiny_config, **kw))

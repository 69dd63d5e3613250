"""megacomp.optimizer.loco_reference against the LoCo authors' steps restated in plain torch (their Megatron-LM fork,
commit 429a18dc: ``megatron/model/distributed.py`` param hook, ``megatron/optimizer/compressed_optimizer4.py``
reduce and step), on 2 gloo ranks: the exchange itself, and as a DDP hook on a tiny model."""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from megacomp.optimizer.loco_reference import LoCoReference, loco_reference_hook

S, BETA, WORLD = 64.0, 0.8, 2  # a small scale, so that the tensors below hit the clamp at -8 and 7


def _fork_steps(per_rank_grads, reset_interval):
    """The fork, every rank simulated: per step, each rank's h = g + e, codes trunc(clamp(h S, -8, 7)), error
    e = 0.8 e + 0.2 (h - q / S); rank r's chunk 0 + sum_j q_j / (S N) in rank order; after the step the counter, and
    past reset_interval every error zeroed. Returns the averages (whole tensors) per step."""
    n = per_rank_grads[0][0].numel()
    errors = [torch.zeros(n) for _ in range(WORLD)]
    gap, out = 0, []
    for grads in per_rank_grads:
        codes = []
        for r in range(WORLD):
            main = grads[r].clone().add_(errors[r])
            q = main.clone().mul_(S).clamp_(min=-8, max=7).to(torch.int8)
            main.add_(q, alpha=-1.0 / S)
            errors[r].mul_(BETA).add_(main, alpha=1.0 - BETA)
            codes.append(q)
        c = n // WORLD
        shards = []
        for r in range(WORLD):
            shard = torch.zeros(c)
            for j in range(WORLD):
                shard.add_(codes[j][r * c:(r + 1) * c], alpha=1.0 / (S * WORLD))
            shards.append(shard)
        out.append(torch.cat(shards))
        gap += 1
        if gap > reset_interval:
            gap = 0
            for e in errors:
                e.zero_()
    return out


def _grads(rank, step, n=24):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, generator=g) * 0.1


def _exchange_case(rank, world):
    ref = LoCoReference(scale=S, beta=BETA, reset_interval=2)
    got = []
    for t in range(6):
        g = _grads(rank, t)
        ref.all_reduce("x", g)
        ref.step()
        got.append(g)
    return got


def test_exchange_is_the_forks_step_bit_for_bit():
    per_rank = run_ranks(_exchange_case, WORLD)
    want = _fork_steps([[_grads(r, t) for r in range(WORLD)] for t in range(6)], reset_interval=2)
    for got in per_rank:
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any((w * S * WORLD).abs().max() >= 14 for w in want)  # the clamp was reached


def _ddp_case(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)  # 16 parameters: one bucket, whole bytes per rank
    twin = torch.nn.Linear(3, 4)
    twin.load_state_dict(model.state_dict())
    ddp = DDP(model)
    state = LoCoReference(scale=S, beta=BETA, reset_interval=1, start_iter=1)
    ddp.register_comm_hook(state, loco_reference_hook)
    local, averaged = [], []
    for t in range(4):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(10 * t + rank))
        ddp.zero_grad()
        ddp(x).square().sum().backward()
        averaged.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.01)
    return averaged, state.gap


def test_ddp_hook_averages_like_the_fork():
    """Everything is element-wise with one fixed scale, so the fork's per-parameter buffers and DDP's bucket give the
    same numbers: the restatement runs per parameter, on every rank's local gradient."""
    per_rank = run_ranks(_ddp_case, WORLD)
    torch.manual_seed(0)
    models = [torch.nn.Linear(3, 4) for _ in range(WORLD)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    errors = [[torch.zeros(p.numel()) for p in models[0].parameters()] for _ in range(WORLD)]
    gap = 0
    for t in range(4):
        grads = []
        for r, m in enumerate(models):
            x = torch.randn(5, 3, generator=torch.Generator().manual_seed(10 * t + r))
            m.zero_grad()
            m(x).square().sum().backward()
            grads.append([p.grad.reshape(-1).clone() for p in m.parameters()])
        if t == 0:  # start_iter: plain average
            avg = [sum(grads[r][i] for r in range(WORLD)) / WORLD for i in range(2)]
        else:
            avg = []
            for i in range(2):
                total = torch.zeros_like(grads[0][i])
                for r in range(WORLD):
                    main = grads[r][i] + errors[r][i]
                    q = (main * S).clamp_(min=-8, max=7).to(torch.int8)
                    main.add_(q, alpha=-1.0 / S)
                    errors[r][i].mul_(BETA).add_(main, alpha=1.0 - BETA)
                    total.add_(q, alpha=1.0 / (S * WORLD))
                avg.append(total)
            gap += 1
            if gap > 1:
                gap = 0
                for es in errors:
                    for e in es:
                        e.zero_()
        for r in range(WORLD):
            for p, a in zip(per_rank[r][0][t], avg):
                assert torch.allclose(p.reshape(-1), a, rtol=0, atol=1e-7), (t, r)
        for m in models:
            with torch.no_grad():
                for p, a in zip(m.parameters(), avg):
                    p.add_(a.reshape(p.shape), alpha=-0.01)
    assert per_rank[0][1] == gap


def test_bad_settings_name_the_problem():
    with pytest.raises(ValueError, match="scale > 0"):
        LoCoReference(scale=0.0)

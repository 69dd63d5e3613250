"""megacomp.optimizer.MultiTimescaleAdamW: without slow momenta it is torch's AdamW bit for bit; with them
each step equals an fp64 restatement of the module docstring's rule within fp32 rounding; bad settings raise."""
import math

import pytest
import torch

from megacomp.optimizer import MultiTimescaleAdamW

EPS32 = 2.0 ** -24


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(17, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * (1 + step % 3)


def test_without_slow_momenta_it_is_adamw_bit_for_bit():
    a, b = _params(), _params()
    oa = MultiTimescaleAdamW(a, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, slow_betas=(), slow_weights=())
    ob = torch.optim.AdamW(b, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    for step in range(7):
        _grads(step, a)
        _grads(step, b)
        oa.step()
        ob.step()
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert all(torch.equal(oa.state[x]["exp_avg_sq"], ob.state[y]["exp_avg_sq"]) for x, y in zip(a, b))


@pytest.mark.parametrize("beta1,slow", [(0.9, [(0.999, 0.5)]), (0.0, [(0.999, 0.9)]), (0.8, [(0.99, 0.3), (0.999, 0.4)])])
def test_each_step_equals_the_rule_in_fp64(beta1, slow):
    params = _params()
    lr, beta2, eps, wd = 1e-2, 0.95, 1e-8, 0.1
    opt = MultiTimescaleAdamW(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd,
                              slow_betas=[b for b, _ in slow], slow_weights=[w for _, w in slow])
    ref = [{"p": p.detach().double().clone(), "m": 0, "v": 0, "s": [0] * len(slow)} for p in params]
    for t in range(1, 9):
        _grads(t, params)
        opt.step()
        for p, r in zip(params, ref):
            g = p.grad.double()
            r["m"] = beta1 * r["m"] + (1 - beta1) * g
            r["v"] = beta2 * r["v"] + (1 - beta2) * g * g
            r["s"] = [b * s + (1 - b) * g for (b, _), s in zip(slow, r["s"])]
            u = (1 - sum(w for _, w in slow)) * r["m"] / (1 - beta1 ** t)
            for (b, w), s in zip(slow, r["s"]):
                u = u + w * s / (1 - b ** t)
            denom = r["v"].sqrt() / math.sqrt(1 - beta2 ** t) + eps
            step = lr * u / denom
            r["p"] = r["p"] * (1 - lr * wd) - step
            # the engine starts each step from its own fp32 p: compare the step it took, not drifted values.
            # Per step, each fp32 operation rounds once: about 12 + 3 N roundings relative to |step| (the update
            # ratio), plus the decay's rounding relative to |p|
            got = p.detach().double()
            k = 12 + 3 * len(slow)
            bound = k * EPS32 * (step.abs() + r["p"].abs()) * t  # errors of earlier steps carry over, once each
            assert ((got - r["p"]).abs() <= bound).all(), ((got - r["p"]).abs() - bound).max()


def test_bad_settings():
    p = _params()
    with pytest.raises(ValueError, match="one weight per slow momentum"):
        MultiTimescaleAdamW(p, slow_betas=(0.9, 0.99), slow_weights=(0.5,))
    with pytest.raises(ValueError, match="sum to at most 1"):
        MultiTimescaleAdamW(p, slow_betas=(0.9, 0.99), slow_weights=(0.6, 0.5))
    with pytest.raises(ValueError, match=r"slow betas must be in \[0, 1\)"):
        MultiTimescaleAdamW(p, slow_betas=(1.0,), slow_weights=(0.5,))

"""FrozenVarianceAdamW (megacomp.optimizer.frozen_adam): AdamW until freeze_step, then v fixed."""
import pytest
import torch

from megacomp.optimizer import FrozenVarianceAdamW


def _run(opt_factory, steps, seed=0):
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(257))
    opt = opt_factory([p])
    g = torch.Generator().manual_seed(seed + 1)
    history = []
    for _ in range(steps):
        p.grad = torch.randn(257, generator=g) * torch.exp2(torch.randint(-8, 3, (257,), generator=g).float())
        opt.step()
        history.append((p.detach().clone(), opt.state[p]["exp_avg_sq"].clone()))
    return history


@pytest.mark.parametrize("freeze", [None, 7])
def test_bit_identical_to_adamw_until_the_freeze(freeze):
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = _run(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw), 12)
    got = _run(lambda ps: FrozenVarianceAdamW(ps, freeze_step=freeze, **kw), 12)
    same = 12 if freeze is None else freeze
    for (p, v), (q, w) in zip(ref[:same], got[:same]):
        assert torch.equal(p, q) and torch.equal(v, w)
    if freeze is not None:
        assert not torch.equal(ref[-1][0], got[-1][0])
        for _, v in got[freeze:]:  # frozen from there on
            assert torch.equal(v, got[freeze - 1][1])


def test_frozen_update_is_linear_in_the_gradients():
    """After the freeze, m and the update are linear: error feedback's telescoping sum of the transmitted
    gradients reaches the parameters (with lr, wd and beta1 fixed, the sum of two runs' gradient
    streams gives the sum of their parameter moves from the same frozen state)."""
    kw = dict(lr=1e-2, betas=(0.0, 0.95), eps=0.0, weight_decay=0.0, freeze_step=1)
    p = torch.nn.Parameter(torch.zeros(64))
    opt = FrozenVarianceAdamW([p], **kw)
    p.grad = torch.ones(64)
    opt.step()  # v = (1 - beta2) after bias correction: the update divides by 1
    start = p.detach().clone()
    g = torch.randn(64, generator=torch.Generator().manual_seed(3))
    p.grad = g
    opt.step()
    # fp32 round-off of p (|p| < 0.05) in the step and the subtraction
    torch.testing.assert_close(p.detach() - start, -1e-2 * g, rtol=1e-6, atol=2 * 0.05 * 2.0 ** -24)


@pytest.mark.parametrize("kwargs,match", [({"freeze_step": 0}, "freeze_step"), ({"freeze_step": 2.5}, "freeze_step"),
                                          ({"betas": (0.9, 1.0)}, "betas"), ({"lr": -1.0}, "lr")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FrozenVarianceAdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_state_dict_round_trip():
    kw = dict(lr=1e-3, freeze_step=3)
    a = _run(lambda ps: FrozenVarianceAdamW(ps, **kw), 5)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(257))
    opt = FrozenVarianceAdamW([p], **kw)
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        p.grad = torch.randn(257, generator=g) * torch.exp2(torch.randint(-8, 3, (257,), generator=g).float())
        opt.step()
        if i == 2:  # save, rebuild, load after the freeze step
            state, params = opt.state_dict(), p.detach().clone()
            p = torch.nn.Parameter(params)
            opt = FrozenVarianceAdamW([p], **kw)
            opt.load_state_dict(state)
    assert torch.equal(p.detach(), a[-1][0])

"""1-bit Adam, 0/1 Adam and 1-bit LAMB with ``momentum_scaling="deepspeed"`` against DeepSpeed's steps restated in
plain torch (deepspeed/runtime/fp16/onebit/{adam,zoadam,lamb}.py and runtime/comm/nccl.py ``compressed_allreduce``,
DeepSpeed commit edaa7221), on 2 gloo ranks.

The restatement simulates every rank in each process (each rank's gradient is a known function of rank and step,
as in tests/test_optimizer_onebit.py), with DeepSpeed's buffers: one flat buffer per param group (Adam, 0/1 Adam)
or for the whole model (LAMB), padded to a multiple of ``N * lcm(N, 8)``, worker and server errors. It follows
DeepSpeed's arithmetic (``update = m / (sqrt(v) + eps) + wd p``; no bias correction, which DeepSpeed ignores:
megacomp runs with ``bias_correction=False``) and skips DeepSpeed's first step that only allocates buffers;
0/1 Adam's local steps start at ``var_freeze_step + 1`` (megacomp's documented choice; DeepSpeed one step later).
The two sides round differently (megacomp's AdamW operation order), so parameters agree to fp32 round-off.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distributed import run_ranks
from megacomp.optimizer import OneBitAdam, OneBitLamb, ZeroOneAdam

SHAPES = [(6, 5), (5,), (4, 7)]
GROUPS = [[0, 1], [2]]  # two param groups: DeepSpeed's Adam exchanges each group's flat buffer on its own
WORLD = 2
KW = dict(lr=0.05, betas=(0.75, 0.875), eps=1e-6, weight_decay=0.1, bias_correction=False, bucket_size=20,
          momentum_scaling="deepspeed")


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-8, 9, s, generator=g).float() / 16 for s in SHAPES]


def _param_groups(params):
    return [{"params": [params[i] for i in g]} for g in GROUPS]


def _backward(params, rank, t):
    sum((p * c).sum() for p, c in zip(params, _grads(rank, t))).backward()


# -- DeepSpeed's compressed_allreduce, every rank simulated ---------------------------------------------------
def _pm1(x):
    return x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)


def _corrected(numel: int) -> int:
    unit = WORLD * int(WORLD * 8 / np.gcd(WORLD, 8))
    return numel + (unit - numel % unit) % unit


def ds_compressed_allreduce(buffers, worker_errors, server_errors):
    """nccl.py compressed_allreduce on every rank at once: ``buffers[i]`` rank i's flat tensor (unpadded), errors
    per rank; returns the result (the same on every rank), unpadded."""
    n = buffers[0].numel()
    size = worker_errors[0].numel()
    chunk = size // WORLD
    signs, scales = [], []
    for i in range(WORLD):
        m = torch.cat([buffers[i].flatten(), torch.zeros(size - n)])
        m.add_(worker_errors[i])
        worker_scale = torch.linalg.norm(m) / np.sqrt(m.numel())
        worker_errors[i].set_(m - worker_scale * _pm1(m))
        signs.append(m.sign_().add_(1).bool())
        scales.append(worker_scale.reshape(1))
    server_signs, server_scales = [], []
    for j in range(WORLD):  # rank j, the server of chunk j
        recv = torch.stack([signs[i][j * chunk:(j + 1) * chunk] for i in range(WORLD)])
        compensated = recv.float().add_(-0.5).mul_(2.0).mul_(torch.stack(scales).mul_(1 / WORLD)).sum(0)
        compensated.add_(server_errors[j])
        server_scale = torch.linalg.norm(compensated) / np.sqrt(compensated.numel())
        server_errors[j].set_(compensated - server_scale * _pm1(compensated))
        server_signs.append(compensated.sign_().add_(1).bool())
        server_scales.append(server_scale.reshape(1))
    out = torch.stack(server_signs).float().add_(-0.5).mul_(2.0).mul_(torch.stack(server_scales)).flatten()
    return out[:n]


class _Buffers:
    """One DeepSpeed flat buffer: its parameters' indices and every rank's worker / server errors."""

    def __init__(self, indices):
        self.indices = indices
        size = _corrected(sum(int(np.prod(SHAPES[i])) for i in indices))
        self.worker = [torch.zeros(size) for _ in range(WORLD)]
        self.server = [torch.zeros(size // WORLD) for _ in range(WORLD)]

    def flat(self, tensors):
        return torch.cat([tensors[i].flatten() for i in self.indices])

    def split(self, flat):
        out, pos = {}, 0
        for i in self.indices:
            k = int(np.prod(SHAPES[i]))
            out[i] = flat[pos:pos + k].reshape(SHAPES[i])
            pos += k
        return out

    def average(self, per_rank):
        """``per_rank[r]``: rank r's tensors (index -> tensor) of this buffer -> the exchanged ones."""
        return self.split(ds_compressed_allreduce([self.flat(t) for t in per_rank], self.worker, self.server))

    def reset(self):
        for e in self.worker + self.server:
            e.zero_()


def _mean_grad(t):
    return [sum(_grads(r, t)[i] for r in range(WORLD)).mul_(1.0 / WORLD) for i in range(len(SHAPES))]  # exact


def _clip(grads, max_norm):
    """The engine's gradient clipping (DeepSpeed's FP16_Optimizer): scale by max_norm / (norm + 1e-6) when below 1."""
    norm = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().item()
    coef = max_norm / (norm + 1e-6)
    return [g * coef for g in grads] if coef < 1 else grads


def _close(params, ref, what):
    for a, b in zip(params, ref):
        assert torch.allclose(a.detach(), b, rtol=1e-5, atol=1e-6), (what, (a.detach() - b).abs().max())


# -- 1-bit Adam ---------------------------------------------------------------------------------------------
def _adam_case(rank, world):
    params = _params()
    opt = OneBitAdam(_param_groups(params), freeze_step=2, **KW)
    lr, (b1, b2), eps, wd = KW["lr"], KW["betas"], KW["eps"], KW["weight_decay"]
    p = [q.detach().clone() for q in _params()]
    m = [torch.zeros(s) for s in SHAPES]
    v = [torch.zeros(s) for s in SHAPES]
    bufs = [_Buffers(g) for g in GROUPS]
    for t in range(1, 7):
        _backward(params, rank, t)
        assert opt.step()
        if t <= 2:  # warm-up: the engine's all-reduced gradient
            for i, g in enumerate(_mean_grad(t)):
                m[i].mul_(b1).add_(g, alpha=1 - b1)
                v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
        else:  # every rank's local momentum, compressed_allreduce per param group
            local = [{i: m[i] * b1 + _grads(r, t)[i] * (1 - b1) for i in range(len(SHAPES))} for r in range(WORLD)]
            for buf in bufs:
                for i, avg in buf.average([{i: x[i] for i in buf.indices} for x in local]).items():
                    m[i] = avg.clone()
        for i in range(len(SHAPES)):
            update = m[i] / (v[i].sqrt() + eps) + wd * p[i]
            p[i].add_(-lr * update)
        _close(params, p, ("1-bit Adam", t))
    return True


def test_onebit_adam_deepspeed_scaling_is_deepspeeds_step():
    assert all(run_ranks(_adam_case, WORLD))


# -- 0/1 Adam -----------------------------------------------------------------------------------------------
def _zero_one_case(rank, world):
    params = _params()
    var_freeze, scaler, local_scaler, clipper = 4, 1, 2, 4
    clip = 1.0  # below every local gradient's norm here: DeepSpeed clips each rank's local gradient on the 1-bit
    # and local steps (its engine skips the all-reduce there), the averaged one on the variance-update steps
    opt = ZeroOneAdam(_param_groups(params), var_freeze_step=var_freeze, var_update_scaler=scaler,
                      local_step_scaler=local_scaler, local_step_clipper=clipper, max_grad_norm=clip, **KW)
    lr, (b1, b2), eps, wd = KW["lr"], KW["betas"], KW["eps"], KW["weight_decay"]
    n = len(SHAPES)
    p = [[q.detach().clone() for q in _params()] for _ in range(WORLD)]  # local steps: every rank its own
    m = [[torch.zeros(s) for s in SHAPES] for _ in range(WORLD)]
    v = [torch.zeros(s) for s in SHAPES]
    acc = [[torch.zeros(s) for s in SHAPES] for _ in range(WORLD)]  # DeepSpeed's momentum_accumulator
    bufs = [_Buffers(g) for g in GROUPS]
    var_interval, var_counter, local_interval, local_counter, lrs = 1, 0, 1, 0, 0.0
    for t in range(1, 11):
        _backward(params, rank, t)
        assert opt.step()
        assert abs(opt.last_grad_norm - math.sqrt(sum(float(g.square().sum()) for g in _grads(rank, t)))) < 1e-5 \
            or t <= var_freeze and t % var_interval == 0  # the local gradient's norm on 1-bit and local steps
        if t == var_freeze + 1:  # DeepSpeed zeroes both errors once the variance is frozen
            for buf in bufs:
                buf.reset()
        local_grads = [_clip(_grads(r, t), clip) for r in range(WORLD)]
        if t <= var_freeze and t % var_interval == 0:  # variance update with the all-reduced gradient
            for i, g in enumerate(_clip(_mean_grad(t), clip)):
                v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
                for r in range(WORLD):
                    m[r][i].mul_(b1).add_(g, alpha=1 - b1)
        elif t <= var_freeze:  # the 1-bit gradient (each rank's local gradient, compressed_allreduce)
            for buf in bufs:
                avg = buf.average([{i: local_grads[r][i] for i in buf.indices} for r in range(WORLD)])
                for i, g in avg.items():
                    for r in range(WORLD):
                        m[r][i].mul_(b1).add_(g, alpha=1 - b1)
        else:
            for r in range(WORLD):
                for i in range(n):
                    m[r][i].mul_(b1).add_(local_grads[r][i], alpha=1 - b1)
            lrs += lr
        for r in range(WORLD):
            for i in range(n):
                update = m[r][i] / (v[i].sqrt() + eps) + wd * p[r][i]
                p[r][i].add_(-lr * update)
                if t > var_freeze:
                    acc[r][i].add_(-lr * update)
        if t > var_freeze and t % local_interval == 0:  # synchronise: the accumulated update, 1-bit
            for r in range(WORLD):
                for i in range(n):
                    p[r][i].add_(-1 * acc[r][i])
                    acc[r][i].mul_(v[i].sqrt() + eps)
            for buf in bufs:
                avg = buf.average([{i: acc[r][i] for i in buf.indices} for r in range(WORLD)])
                for i, a in avg.items():
                    for r in range(WORLD):
                        m[r][i] = -a / lrs
                        p[r][i].add_(a / (v[i].sqrt() + eps))
                        acc[r][i].zero_()
            lrs = 0.0
        if t <= var_freeze:
            if t % var_interval == 0:
                var_counter += 1
                if var_counter == scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, local_interval * 2)
        _close(params, p[rank], ("0/1 Adam", t))
    return True


def test_zero_one_adam_deepspeed_scaling_is_deepspeeds_step():
    assert all(run_ranks(_zero_one_case, WORLD))


# -- 1-bit LAMB ---------------------------------------------------------------------------------------------
def _lamb_case(rank, world):
    params = _params()
    freeze = 3
    opt = OneBitLamb(_param_groups(params), freeze_step=freeze, **KW)
    lr, (b1, b2), eps, wd = KW["lr"], KW["betas"], KW["eps"], KW["weight_decay"]
    max_coeff, min_coeff, coeff_beta, factor_max, factor_min, threshold = 10.0, 0.01, 0.9, 4.0, 0.5, 0.1
    n = len(SHAPES)
    p = [q.detach().clone() for q in _params()]
    m, v, v_fresh = [torch.zeros(s) for s in SHAPES], [torch.zeros(s) for s in SHAPES], [None] * n
    coeff_freeze, last_factor, scaling = [0.0] * n, [1.0] * n, None
    whole = _Buffers([i for g in GROUPS for i in g])  # DeepSpeed's 1-bit LAMB: the whole model in one buffer
    for t in range(1, 8):
        _backward(params, rank, t)
        assert opt.step()
        if t <= freeze:
            for i, g in enumerate(_mean_grad(t)):
                m[i].mul_(b1).add_(g, alpha=1 - b1)
                v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
                if t == freeze:
                    v_fresh[i] = v[i].clone()
                weight_norm = p[i].pow(2).sum().sqrt()
                update = m[i] / (v[i].sqrt() + eps) + wd * p[i]
                update_norm = update.pow(2).sum().sqrt()
                coeff = 1.0
                if weight_norm != 0 and update_norm != 0:
                    coeff = min(max((weight_norm / update_norm).item(), min_coeff), max_coeff)
                if coeff != 1.0:
                    coeff_freeze[i] = coeff_beta * coeff_freeze[i] + (1 - coeff_beta) * coeff
                p[i].add_(-lr * coeff * update)
        else:
            last = [x.clone() for x in m]
            if scaling is None:  # fixed at the first compressed step, from the warm-up momentum
                rms = [(torch.linalg.vector_norm(x) / np.sqrt(x.numel())).item() for x in m]
                scaling = [sum(rms) / n / r for r in rms]
            local = [{i: (m[i] * b1 + _grads(r, t)[i] * (1 - b1)) * scaling[i] for i in range(n)}
                     for r in range(WORLD)]
            for i, avg in whole.average(local).items():
                m[i] = avg / scaling[i]
            for i in range(n):
                g_rec = (m[i] - last[i] * b1) / (1 - b1)
                v_fresh[i].mul_(b2).addcmul_(g_rec, g_rec, value=1 - b2)
                denom = v[i].sqrt() + eps
                prelim = m[i] / denom
                update = prelim + wd * p[i]
                update_norm = update.pow(2).sum().sqrt()
                factor = (denom / (v_fresh[i].sqrt() + eps)).max().item()
                ratio = min(1.0, (prelim.pow(2).sum().sqrt() / update_norm).item())
                factor = factor * ratio + (1.0 - ratio)
                factor = min(max(factor, factor_min), factor_max)
                factor = min(max(factor, last_factor[i] * (1 - threshold)), last_factor[i] * (1 + threshold))
                last_factor[i] = factor
                p[i].add_(-lr * coeff_freeze[i] * factor * update)
        _close(params, p, ("1-bit LAMB", t))
    return True


def test_onebit_lamb_deepspeed_scaling_is_deepspeeds_step():
    assert all(run_ranks(_lamb_case, WORLD))


def test_deepspeed_padding_and_bad_settings():
    from megacomp.optimizer.onebit.deepspeed_exchange import padded_numel

    assert [padded_numel(n, 2) for n in (1, 16, 35)] == [16, 16, 48]  # N * lcm(N, 8) = 16
    assert padded_numel(10, 3) == 72 and padded_numel(100, 4) == 128
    with pytest.raises(ValueError, match="momentum_scaling must be one of chunk, deepspeed"):
        OneBitAdam(_params(), momentum_scaling="rms")
    with pytest.raises(ValueError, match="drop shard=True"):
        OneBitLamb(_params(), momentum_scaling="deepspeed", shard=True)
    with pytest.raises(ValueError, match="drop shard=True, momentum_channel, momentum_codec"):
        ZeroOneAdam(_params(), momentum_scaling="deepspeed", momentum_codec="int4")

"""The autoencoder of LGC as published (megacomp.compression.lgc): a lightweight 1-D convolutional network over a
bucket's top-k values, its losses and its training. Plain functions over a dict of weight tensors, so every rank
holds the same bits and a checkpoint is a dict of tensors.

Input: ``U`` (``nodes x k``), each node's top-k values at the common indices, normalised to unit RMS.

  encoder ``E``: ``downsample`` convolutions (kernel 3, stride 2, padding 1: a length ``L`` becomes ``ceil(L / 2)``)
      from 1 to ``channels`` channels, each followed by a leaky ReLU (slope 0.01), then a 1x1 convolution to
      ``code_channels``: the code, ``code_channels x ceil(k / 2**downsample)`` numbers, not bounded;
  decoder ``D_d`` (``ps``: one per node, ``d`` = the node; ``ring``: one): a 1x1 convolution to ``channels``, then
      ``downsample`` transposed convolutions (kernel 4, stride 2, padding 1: a length doubles), each followed by a
      leaky ReLU, cut to ``k``; ``ps`` concatenates the node's innovation (its ``k_inno`` largest normalised values
      at their positions, zeros elsewhere) as one more channel; a 1x1 convolution gives the ``k`` values.

Loss (``reconstruction_weight * rec + similarity_weight * sim``): ``sim`` is the mean over ordered pairs of
distinct nodes of the mean squared difference of their codes (the paper's similarity term: it pulls the nodes'
codes together so one node's code can stand for the common information). ``rec``:
  ``ps``:   the mean over nodes i of ``mse(D_i(E(U_c), inno(U_i)), U_i)``, with ``c = call mod nodes``: every node's
            code takes its turn as the common one (at use it is the leader's);
  ``ring``: the mean of ``mse(D(z), sum_i s_i U_i / S)`` for the scale-weighted mean code ``z = sum_i s_i E(U_i) / S``
            (what the all-reduce delivers) and of the nodes' own ``mse(D(E(U_i)), U_i)``.

Training: ``train_iters`` Adam steps (betas 0.9 / 0.999, eps 1e-8) per call, deterministic on one device.
Failure behaviour: a call whose values are all zero (``S = 0``) trains nothing (there is nothing to learn from).
"""
from __future__ import annotations

import math
import zlib
from typing import Mapping, Optional

import torch
import torch.nn.functional as F

from .lgc import LGC, normalised, rms

SLOPE = 0.01
"""Negative slope of the leaky ReLUs."""


def init_autoencoder(lgc: LGC, key: str, world: int, device=None) -> dict[str, torch.Tensor]:
    """Seeded start weights of key ``key``'s autoencoder for ``world`` nodes (drawn on the CPU: the same on every
    rank and device): uniform in ``+-1/sqrt(fan_in)`` (torch's convolution default), zero biases."""
    g = torch.Generator().manual_seed((lgc.seed * 1_000_003 + zlib.crc32(key.encode())) % (1 << 63))
    ch, code = lgc.channels, lgc.code_channels

    def conv(shape, fan_in):
        return (torch.rand(*shape, generator=g) * 2 - 1) / math.sqrt(fan_in)

    w: dict[str, torch.Tensor] = {}
    c_in = 1
    for j in range(lgc.downsample):
        w[f"enc{j}.w"], w[f"enc{j}.b"] = conv((ch, c_in, 3), 3 * c_in), torch.zeros(ch)
        c_in = ch
    w["code.w"], w["code.b"] = conv((code, ch, 1), ch), torch.zeros(code)
    extra = 1 if lgc.variant == "ps" else 0  # the innovation channel
    for d in range(lgc.decoders(world)):
        w[f"dec{d}.in.w"], w[f"dec{d}.in.b"] = conv((ch, code, 1), code), torch.zeros(ch)
        for j in range(lgc.downsample):
            w[f"dec{d}.up{j}.w"], w[f"dec{d}.up{j}.b"] = conv((ch, ch, 4), 4 * ch), torch.zeros(ch)
        w[f"dec{d}.out.w"], w[f"dec{d}.out.b"] = conv((1, ch + extra, 1), ch + extra), torch.zeros(1)
    return {n: v.to(device) if device is not None else v for n, v in w.items()}


def encode(lgc: LGC, w: Mapping[str, torch.Tensor], u: torch.Tensor) -> torch.Tensor:
    """Codes of the rows of ``u`` (``rows x k``): ``rows x code_channels x ceil(k / 2**downsample)``."""
    x = u.unsqueeze(1)
    for j in range(lgc.downsample):
        x = F.leaky_relu(F.conv1d(x, w[f"enc{j}.w"], w[f"enc{j}.b"], stride=2, padding=1), SLOPE)
    return F.conv1d(x, w["code.w"], w["code.b"])


def decode(lgc: LGC, w: Mapping[str, torch.Tensor], d: int, z: torch.Tensor, k: int,
           innovation: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decoder ``d``'s values (``rows x k``) from codes ``z`` and (``ps``) the innovations (``rows x k``)."""
    x = F.leaky_relu(F.conv1d(z, w[f"dec{d}.in.w"], w[f"dec{d}.in.b"]), SLOPE)
    for j in range(lgc.downsample):
        x = F.leaky_relu(F.conv_transpose1d(x, w[f"dec{d}.up{j}.w"], w[f"dec{d}.up{j}.b"], stride=2, padding=1),
                         SLOPE)
    x = x[..., :k]  # 2**downsample * ceil-halved length >= k: cut the padding
    if lgc.variant == "ps":
        x = torch.cat([x, innovation.unsqueeze(1)], dim=1)
    return F.conv1d(x, w[f"dec{d}.out.w"], w[f"dec{d}.out.b"]).squeeze(1)


def innovation_positions(u: torch.Tensor, k_inno: int) -> torch.Tensor:
    """Per row of ``u``: positions of its ``k_inno`` entries of largest magnitude, ascending."""
    return torch.topk(u.abs(), k_inno, dim=-1, sorted=False).indices.sort(dim=-1).values


def innovation_dense(k: int, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The decoder's innovation input: ``values`` at ``positions`` per row, zeros elsewhere (``rows x k``)."""
    return values.new_zeros(values.shape[0], k).scatter(1, positions, values)


def losses(lgc: LGC, w: Mapping[str, torch.Tensor], v: torch.Tensor, common: int,
           k_inno: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rec, sim)`` of the module docstring for the raw gathered values ``v`` (``nodes x k``); ``common`` is the
    node whose code stands for the common one and ``k_inno`` the innovation's size (``ps``)."""
    nodes, k = v.shape
    s = rms(v)
    u = normalised(v, s)
    z = encode(lgc, w, u)
    if nodes > 1:
        diff = (z.unsqueeze(0) - z.unsqueeze(1)).pow(2).flatten(2).mean(-1)  # nodes x nodes, zero diagonal
        sim = diff.sum() / (nodes * (nodes - 1))
    else:
        sim = z.new_zeros(())
    if lgc.variant == "ps":
        pos = innovation_positions(u, k_inno)
        inno = innovation_dense(k, pos, u.gather(1, pos))
        rec = sum(F.mse_loss(decode(lgc, w, i, z[common:common + 1], k, inno[i:i + 1]), u[i:i + 1])
                  for i in range(nodes)) / nodes
    else:
        total = s.sum()
        zbar = (s.view(-1, 1, 1) * z).sum(0, keepdim=True) / total
        target = (s.unsqueeze(1) * u).sum(0, keepdim=True) / total
        rec = (F.mse_loss(decode(lgc, w, 0, zbar, k), target) + F.mse_loss(decode(lgc, w, 0, z, k), u)) / 2
    return rec, sim


def train_state(w: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adam's zero first and second moments (``m.<name>``, ``v.<name>``) and its step count ``t``."""
    out = {f"m.{n}": torch.zeros_like(t) for n, t in w.items()}
    out.update({f"v.{n}": torch.zeros_like(t) for n, t in w.items()})
    out["t"] = torch.zeros((), dtype=torch.int64)
    return out


def train(lgc: LGC, w: dict[str, torch.Tensor], state: dict[str, torch.Tensor], v: torch.Tensor, call: int,
          k_inno: int) -> tuple[float, float]:
    """One training call (number ``call`` of the phase) on the gathered values ``v`` (``nodes x k``, raw) with
    innovations of ``k_inno`` entries, updating ``w`` and ``state`` in place;
    returns ``(rec, sim)`` after it (NaN, NaN when the values are all zero: nothing is trained)."""
    if not bool((rms(v) > 0).any()) or not bool(torch.isfinite(v).all()):
        return float("nan"), float("nan")
    common = call % v.shape[0]
    for _ in range(lgc.train_iters):
        params = {n: t.detach().requires_grad_(True) for n, t in w.items()}
        with torch.enable_grad():
            rec, sim = losses(lgc, params, v, common, k_inno)
            loss = lgc.reconstruction_weight * rec + lgc.similarity_weight * sim
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        state["t"] += 1
        t = int(state["t"])
        with torch.no_grad():
            for (n, p), gr in zip(params.items(), grads):
                if gr is None:  # a decoder no node used this call
                    continue
                m, sq = state[f"m.{n}"], state[f"v.{n}"]
                m.mul_(0.9).add_(gr, alpha=0.1)
                sq.mul_(0.999).addcmul_(gr, gr, value=0.001)
                denom = (sq / (1 - 0.999 ** t)).sqrt_().add_(1e-8)
                w[n] = p.detach().addcdiv(m, denom, value=-lgc.lr / (1 - 0.9 ** t))
    with torch.no_grad():
        rec, sim = losses(lgc, w, v, common, k_inno)
    return float(rec), float(sim)

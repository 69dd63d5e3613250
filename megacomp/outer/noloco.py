"""NoLoCo's outer step: no all-reduce; each replica mixes with the few peers of a random group.

Algorithm (Kolehmainen et al., "NoLoCo", 2025, arXiv 2506.10911; the rule as the authors' released code
computes it, ``gensyn-ai/noloco``), per outer step n, on replica i with slow weights phi_i, fast (local)
weights theta_i after H inner steps and outer momentum m_i:

    groups  = a permutation of the R replicas drawn from a generator seeded with (seed, n), identical on
              every rank without communication; replica perm[k] joins group k mod (R / n_g)
    Delta_i = phi_i - theta_i                                   the pseudo-gradient
    send Delta_i (through the outer codec, with its error feedback) and phi_i (uncompressed: it is a weight,
    not a difference, and a quantised weight would carry an error proportional to the weight) to every
    other member of the group; receive theirs                    point-to-point only, no collective
    m_i   <- beta * m_i - alpha * mean_G(Delta) + alpha * (mean_G(phi) - phi_i)
    phi_i <- phi_i + m_i
    theta_i <- phi_i (or lerp(phi_i, theta_i, mixing), as Streaming DiLoCo merges)

alpha is the outer learning rate (0.7 in every configuration of the reference), beta the outer momentum
(0.5 there), n_g the group size (2 there). The pull alpha * (mean_G(phi) - phi_i) is what keeps replicas
that never meet all at once from drifting apart. With n_g = R, beta = 0 and alpha = 1 the step is
phi_i <- mean(theta): DiLoCo's parameter averaging.

Not implemented: NoLoCo's random routing of activations between pipeline stages of different replicas
(it changes the pipeline schedule, not the outer step); the pipeline here keeps each replica's stages.

Error feedback needs groups of two (each replica sends its pseudo-gradient once per outer step); with
larger groups one encoding would have to reach several peers, which the channel's point-to-point path does
not do, so that combination is refused.
"""
from __future__ import annotations

import torch

from ..comm import Channel

DEFAULT_LR, DEFAULT_MOMENTUM = 0.7, 0.5
"""alpha and beta of every gossip configuration (``sparse_optimizer_c``, groups of 2) the reference code ships: the
outer_lr and outer_momentum of megacomp.outer.DiLoCoConfig(algorithm='noloco') left unset, and of the CLI."""

DELTA_TAG, PHI_TAG = 71, 72  # point-to-point tags of the two messages (distinct from the pipeline's)


def gossip_groups(replicas: int, group_size: int, seed: int, step: int) -> list[list[int]]:
    """The groups of outer step ``step``: replica ``perm[k]`` joins group ``k mod (replicas // group_size)``,
    ``perm`` a permutation from a generator seeded with ``(seed, step)`` (same on every rank).

    Raises:
        ValueError: ``group_size`` < 2 or not dividing ``replicas``."""
    if group_size < 2 or replicas % group_size:
        raise ValueError(f"NoLoCo group size {group_size} must be >= 2 and divide the replica count {replicas}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    perm = torch.randperm(replicas, generator=g).tolist()
    count = replicas // group_size
    groups = [[] for _ in range(count)]
    for k, r in enumerate(perm):
        groups[k % count].append(r)
    return [sorted(x) for x in groups]


def start_exchange(channel: Channel, plain: Channel, outer_ranks: list, peers: list, delta: torch.Tensor,
                   phi: torch.Tensor, key: str) -> tuple[list, list, list]:
    """Send ``delta`` (``channel``: codec, error feedback under ``key``) and ``phi`` (``plain``) to every peer
    replica and post the receives; returns (works, peer deltas, peer phis), filled when the works complete."""
    works, deltas, phis = [], [], []
    for peer in peers:
        dst = outer_ranks[peer]
        works.append(channel.isend(delta, dst, tag=DELTA_TAG, key=key, label=channel.name))
        works.append(plain.isend(phi, dst, tag=PHI_TAG, label=channel.name))
        d, p = torch.empty_like(delta), torch.empty_like(phi)
        works.append(channel.irecv(d, dst, tag=DELTA_TAG))
        works.append(plain.irecv(p, dst, tag=PHI_TAG))
        deltas.append(d)
        phis.append(p)
    return works, deltas, phis


@torch.no_grad()
def outer_update(phi: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, peer_deltas: list,
                 peer_phis: list, lr: float, beta: float) -> None:
    """m <- beta m - lr mean(Delta) + lr (mean(phi) - phi);  phi <- phi + m  (in place, fp32)."""
    n = 1 + len(peer_deltas)
    mean_delta = torch.stack([delta, *peer_deltas]).sum(0).div_(n)
    mean_phi = torch.stack([phi, *peer_phis]).sum(0).div_(n)
    momentum.mul_(beta).sub_(mean_delta, alpha=lr).add_(mean_phi.sub_(phi), alpha=lr)
    phi.add_(momentum)

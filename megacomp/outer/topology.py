"""Gossip topologies over R replicas: who exchanges with whom, and the mixing weights.

Every topology here is a regular undirected graph (for ``random_peer``: at each exchange), and the mixing
matrix gives each replica and each of its d neighbours the weight 1 / (d + 1), so W is symmetric and doubly
stochastic (a regular graph's uniform weights; the weights of LoDAdaC's released code for its ring, whose
Assumption 2 asks W doubly stochastic with rho = ||W - J||_2 < 1, J the all-1/R matrix):

    ring          i - 1 and i + 1 (mod R); R = 2 gives one neighbour
    torus         a rows x cols grid with wrap-around (rows <= cols, the most square factorisation with both >= 2):
                  up, down, left, right, duplicates merged (a side of 2 gives one neighbour along it)
    exponential   i +- 2^k (mod R) for every 2^k < R (the undirected exponential graph; circulant, so regular)
    random_peer   NoLoCo's draw (megacomp.outer.noloco.gossip_groups with groups of 2): a random perfect
                  matching per exchange, from a generator seeded with (seed, exchange), the same on every rank;
                  each matching is disconnected (rho = 1), so it is outside LoDAdaC's Assumption 2

Failure behaviour: :func:`check_topology` raises ValueError with one line naming the fix for an unknown
topology, fewer than 2 replicas, a torus over a replica count with no factorisation rows x cols with both >= 2
(a prime), or random_peer over an odd replica count.
"""
from __future__ import annotations

import torch

from .noloco import gossip_groups

TOPOLOGIES = ("ring", "torus", "exponential", "random_peer")


def torus_shape(replicas: int) -> tuple[int, int]:
    """(rows, cols) of the torus: rows the largest divisor <= sqrt(R) with rows >= 2; (0, 0) when none exists."""
    rows = int(replicas ** 0.5)
    while rows >= 2 and replicas % rows:
        rows -= 1
    return (rows, replicas // rows) if rows >= 2 else (0, 0)


def check_topology(topology: str, replicas: int) -> None:
    """Raises ValueError (one line, naming the fix) when ``topology`` cannot connect ``replicas`` replicas."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"gossip topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
    if replicas < 2:
        raise ValueError(f"gossip topology {topology} needs at least 2 replicas, got {replicas}")
    if topology == "torus" and torus_shape(replicas) == (0, 0):
        raise ValueError(f"gossip topology torus needs a replica count that factors as rows x cols with both >= 2, "
                         f"got {replicas}; use ring or exponential, or a replica count such as {replicas + 1}")
    if topology == "random_peer" and replicas % 2:
        raise ValueError(f"gossip topology random_peer pairs the replicas, so it needs an even replica count, got "
                         f"{replicas}; use ring or exponential, or an even num_replicas")


def neighbours(topology: str, replicas: int, replica: int, seed: int = 0, exchange: int = 0) -> list[int]:
    """The sorted, distinct neighbours of ``replica`` at exchange ``exchange`` (itself excluded).

    Raises:
        ValueError: as :func:`check_topology`."""
    check_topology(topology, replicas)
    i, r = replica, replicas
    if topology == "ring":
        out = {(i - 1) % r, (i + 1) % r}
    elif topology == "torus":
        rows, cols = torus_shape(r)
        row, col = divmod(i, cols)
        out = {((row - 1) % rows) * cols + col, ((row + 1) % rows) * cols + col,
               row * cols + (col - 1) % cols, row * cols + (col + 1) % cols}
    elif topology == "exponential":
        out, step = set(), 1
        while step < r:
            out |= {(i + step) % r, (i - step) % r}
            step *= 2
    else:
        group = next(g for g in gossip_groups(r, 2, seed, exchange) if i in g)
        out = set(group)
    out.discard(i)
    return sorted(out)


def is_static(topology: str) -> bool:
    """Whether the neighbours are the same at every exchange (all but random_peer)."""
    return topology != "random_peer"


def mixing_matrix(topology: str, replicas: int, seed: int = 0, exchange: int = 0) -> list[list[float]]:
    """W (R x R, rows sum to 1, symmetric) of exchange ``exchange``: 1 / (d + 1) on the diagonal and each edge."""
    rows = []
    for i in range(replicas):
        peers = neighbours(topology, replicas, i, seed, exchange)
        w = 1.0 / (len(peers) + 1)
        rows.append([w if j == i or j in peers else 0.0 for j in range(replicas)])
    return rows


def mixing_rho(topology: str, replicas: int) -> float:
    """rho = ||W - J||_2 (J = 11^T / R), the quantity of LoDAdaC's Assumption 2 and Lemma 3.1: < 1 for the connected
    static graphs here (information spreads), 1 for one random_peer matching. Computed in fp64 (eigenvalues of the
    symmetric W - J; exact to ~1e-15)."""
    w = torch.tensor(mixing_matrix(topology, replicas), dtype=torch.float64)
    return float(torch.linalg.eigvalsh(w - 1.0 / replicas).abs().max())

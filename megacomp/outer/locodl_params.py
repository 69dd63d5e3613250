"""LoCoDL's parameters from the problem's constants: gamma, chi, rho and p from L, mu, omega and n.

The rule (Condat, Maranjyan and Richtarik, "LoCoDL", ICLR 2025, arXiv 2403.04348, the theorem on linear
convergence and its corollary), for n clients whose f_i are L-smooth and mu-strongly convex (g too), each
compressing with an unbiased compressor of variance factor omega, independently:

    omega_av = omega / n                    (independent compressors: the average of n errors)
    kappa    = L / mu
    gamma    = 1 / L                        (the theorem asks 0 < gamma < 2 / L)
    chi      = 1 / (1 + omega_av)           (the theorem asks chi <= 1 / (1 + omega_av))
    rho      = chi                          (megacomp.outer.locodl's default; rho = chi = 1 without compression)
    p        = min(1, sqrt((1 + 2 omega)(1 + omega_av) / kappa))

The contraction factor is taken as tau = max(1 - gamma mu, 1 - p^2 chi / (1 + 2 omega)): the first term is the
local gradient step's, the second the control variates' (whose step is p chi / (gamma (1 + 2 omega))); p
balances the two, so with omega = 0 it is Scaffnew / ProxSkip's p = 1 / sqrt(kappa). Expected iterations to shrink
the Lyapunov function by e: 1 / (1 - tau); expected communications: p / (1 - tau) =
max(p kappa, (1 + 2 omega)(1 + omega_av) / p). With rand-k at k = ceil(d / n) (omega_av <= 1) the uplink floats per
factor e are O((sqrt(d) + d / sqrt(n)) sqrt(kappa) + d): the paper's doubly accelerated complexity.

Provenance of the constants: the paper's Algorithm 1 and the orders of gamma, chi and p in its corollary
(Theta(1 / L), Theta(1 / (1 + omega_av)), Theta(min(1, sqrt((1 + omega)(1 + omega_av) / kappa)))) are as published;
the text of the theorem could not be read here (only the paper's introduction was searchable), so the constants
in the rate tau and in p are a reconstruction, chosen so omega = 0 gives Scaffnew's rule. They are the defaults
of benchmarks/locodl_paper.py, which measures them.

Failure behaviour: ValueError (one line naming the fix) for L <= 0, mu <= 0, mu > L, omega < 0 or n < 1.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LoCoDLParameters:
    """LoCoDL's parameters for one problem (see the module docstring)."""

    gamma: float
    """gamma: the local stepsize, 1 / L."""
    chi: float
    """chi: the control variates' stepsize, 1 / (1 + omega_av)."""
    rho: float
    """rho: how far x_i and y move to the consensus point (chi)."""
    probability: float
    """p: the probability of communicating after a local step."""
    omega: float
    """omega: the compressor's variance factor."""
    omega_av: float
    """omega_av = omega / n (independent compressors)."""
    kappa: float
    """kappa = L / mu."""
    rate: float
    """tau: the expected contraction per iteration, max(1 - gamma mu, 1 - p^2 chi / (1 + 2 omega))."""

    @property
    def iterations_per_e(self) -> float:
        """Expected iterations per factor e of the Lyapunov function: 1 / (1 - tau)."""
        return 1.0 / (1.0 - self.rate)

    @property
    def communications_per_e(self) -> float:
        """Expected communication rounds per factor e: p / (1 - tau)."""
        return self.probability * self.iterations_per_e

    def to_dict(self) -> dict:
        """Plain data (results files record it)."""
        return asdict(self)


def paper_parameters(L: float, mu: float, omega: float, n: int) -> LoCoDLParameters:
    """LoCoDL's gamma, chi, rho and p for L-smooth, mu-strongly convex functions on ``n`` clients with independent
    unbiased compressors of variance factor ``omega`` (module docstring). Raises ValueError for bad constants."""
    if not L > 0 or not mu > 0:
        raise ValueError(f"LoCoDL parameters: L and mu must be > 0, got L={L}, mu={mu}; pass the smoothness and "
                         f"strong convexity constants")
    if mu > L:
        raise ValueError(f"LoCoDL parameters: mu={mu} is larger than L={L}; strong convexity cannot exceed smoothness")
    if not omega >= 0:
        raise ValueError(f"LoCoDL parameters: omega must be >= 0 (0 without compression), got {omega}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"LoCoDL parameters: n (clients) must be an int >= 1, got {n!r}")
    omega_av = omega / n
    kappa = L / mu
    gamma = 1.0 / L
    chi = 1.0 / (1.0 + omega_av)
    p = min(1.0, math.sqrt((1 + 2 * omega) * (1 + omega_av) / kappa))
    rate = max(1.0 - gamma * mu, 1.0 - p * p * chi / (1 + 2 * omega))
    return LoCoDLParameters(gamma=gamma, chi=chi, rho=chi, probability=p, omega=omega, omega_av=omega_av,
                            kappa=kappa, rate=rate)


def paper_k(d: int, n: int) -> int:
    """The corollary's rand-k: k = ceil(d / n) entries of d, so omega = d / k - 1 <= n (omega_av <= 1)."""
    if d < 1 or n < 1:
        raise ValueError(f"LoCoDL rand-k: d and n must be >= 1, got d={d}, n={n}")
    return max(1, math.ceil(d / n))

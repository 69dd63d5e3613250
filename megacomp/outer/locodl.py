"""LoCoDL: local training and unbiased compression of differences to a shared copy (a randomised primal-dual method).

Algorithm (Condat, Maranjyan and Richtarik, "LoCoDL", ICLR 2025, arXiv 2403.04348, Algorithm 1), for
min_x (1/n) sum_i f_i(x) + g(x) over n replicas, with stepsizes gamma, chi, rho, probability p and the
compressor's variance factor omega. Every replica i keeps its model x_i, its control variate u_i, and an identical
copy of the second model y and its control variate v (g is known to everyone, so y needs no communication):

    after every local step, on every replica:
        x^_i = x_i - gamma grad f_i(x_i) + gamma u_i            the local step (here: the inner optimizer's step,
                                                                 then + gamma u_i)
        y^   = y   - gamma grad g(y)     + gamma v              (g = 0 in pretraining: y^ = y + gamma v)
        theta = 1 with probability p (one coin for all replicas: a generator seeded with (seed, step))
        if theta = 1:
            d_i  = C_i(x^_i - y^)                                unbiased compressor, independent across replicas
            dbar = (1 / 2n) sum_j d_j                            here: an all-gather of the encodings, each decoded
                                                                 and summed in replica order (the same on all)
            x_i = (1 - rho) x^_i + rho (y^ + dbar)
            u_i = u_i + p chi / (gamma (1 + 2 omega)) (dbar - d_i)
            y   = y^ + rho dbar
            v   = v   + p chi / (gamma (1 + 2 omega)) dbar
        else:
            x_i = x^_i,  y = y^                                  (u_i, v unchanged)

with u_i = v = 0 and y = x_1 at the start (replica 0's weights, broadcast once when the engine is built; uncounted
setup, like the identical initial weights every outer loop assumes), so (1/n) sum_i u_i + v = 0 holds throughout (the update adds
-c dbar to the mean of the u_i and +c dbar to v). y^ + dbar is the midpoint of mean_i x^_i and y^ (up to the
compression error): the lifted problem asks x_1 = ... = x_n = y. The paper's theorem (linear convergence for
strongly convex f_i) takes gamma < 2 / L and chi <= 1 / (1 + omega_av), with omega_av = omega / n for
independent compressors; the defaults here are chi = 1 / (1 + omega / n) and rho = chi (with the identity
compressor chi = rho = 1, where the step is Scaffnew / ProxSkip's). The paper's Algorithm 1 was
restated from its publication; the stored copy of the paper we could search shows its introduction only.

Deep-learning use (the training feature): the local step is the inner optimizer's (AdamW), gamma is the peak
learning rate, g = 0, and p = 1 / outer_steps. Compressors: megacomp.compression.unbiased (rand-k with the d/k
scaling, usq2/4/8) or the identity (``none``). Bytes: every replica all-gathers its encoding, so it sends
(R - 1) x wire_bytes per communication, counted under the channel's tag (``outer``). The paper's server sends
dbar back uncompressed; the all-gather needs no server and sends no dbar.

Error bound: with the identity compressor the update is the paper's in fp32 (tests compare it with an fp64
restatement); with an unbiased compressor dbar is unbiased and the decoded d_i is exactly what the others
decoded (the same bytes), so the invariant (1/n) sum u_i + v = 0 holds up to fp32 rounding.

State (checkpointed): y, v, u_i (fp32, flat over this rank's parameters), the step counter (the coin's
position) and the compressor's random stream.

Failure behaviour: ValueError for p outside (0, 1], gamma, chi or rho <= 0, rho > 1, a biased codec, or a
rand-k k larger than this rank's parameter count (each naming the fix); a lost replica raises ReplicaLost
through the watch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..comm import Channel, make_channel
from ..compression.unbiased import make_unbiased_codec, omega_of
from .diloco import _flat
from .liveness import ReplicaWatch


@dataclass
class LoCoDLConfig:
    """Settings of LoCoDL (see the module docstring)."""

    probability: float = 0.02
    """p: probability of communicating after a local step (1 / expected local steps per round)."""
    gamma: float = 1e-3
    """gamma: the local stepsize (the inner learning rate) that scales the control variates."""
    chi: Optional[float] = None
    """chi: the control variates' stepsize; None: 1 / (1 + omega / R)."""
    rho: Optional[float] = None
    """rho in (0, 1]: how far x_i and y move to the consensus point; None: chi."""
    codec: Any = None
    """Unbiased compressor of d_i (megacomp.compression.unbiased: randk, usq2, usq4, usq8) or None (identity)."""
    seed: int = 0
    """Seed of the shared coin (the same on every replica) and of the compressors (offset by the replica)."""

    def __post_init__(self) -> None:
        if not 0 < self.probability <= 1:
            raise ValueError(f"LoCoDL probability p must be in (0, 1], got {self.probability}; use 1 / outer_steps")
        if not self.gamma > 0:
            raise ValueError(f"LoCoDL gamma must be > 0 (the local stepsize, e.g. the learning rate), got {self.gamma}")
        if self.chi is not None and not self.chi > 0:
            raise ValueError(f"LoCoDL chi must be > 0, got {self.chi}")
        if self.rho is not None and not 0 < self.rho <= 1:
            raise ValueError(f"LoCoDL rho must be in (0, 1], got {self.rho}")
        self.codec = make_unbiased_codec(self.codec)

    def to_dict(self) -> dict:
        """Plain data (checkpoints record it)."""
        return {"probability": self.probability, "gamma": self.gamma, "chi": self.chi, "rho": self.rho,
                "codec": None if self.codec.is_identity else self.codec.to_dict(), "seed": self.seed}


def coin(seed: int, step: int, p: float) -> bool:
    """The shared coin theta of local step ``step``: the same on every replica, no communication."""
    if p >= 1:
        return True
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return bool(torch.rand(1, generator=g, dtype=torch.float64).item() < p)


class LoCoDL:
    """LoCoDL over ``params`` across ``outer_group`` (one rank per replica). Call :meth:`step` after every local
    step.

    Args:
        params: this rank's parameters (any float dtype; LoCoDL's state is fp32).
        outer_group: one rank per replica.
        config: LoCoDLConfig.
        channel: counts the all-gathered bytes (its name is the traffic tag); default: an uncompressed ``outer``
            channel (the compressor is LoCoDL's own, applied before the bytes reach it).
        grad_g: grad g(y) on the flat fp32 y (None: g = 0).
        after_sync: called after the parameters were changed (the trainer reloads the optimizer's masters).
        watch: arrival checks before each communication (megacomp.outer.ReplicaWatch) or None.

    Raises:
        ValueError: bad config values, no parameters, rand-k k larger than the parameter count.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], outer_group, config: LoCoDLConfig, *,
                 channel: Optional[Channel] = None, grad_g: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 after_sync: Optional[Callable[[], None]] = None, watch: Optional[ReplicaWatch] = None) -> None:
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("LoCoDL: no parameters")
        self.config, self.group, self.grad_g, self.after_sync, self.watch = config, outer_group, grad_g, after_sync, watch
        self.replicas = dist.get_world_size(outer_group)
        self.replica = dist.get_rank(outer_group)
        self.channel = channel if channel is not None else make_channel("outer", None, group=outer_group)
        self.codec = config.codec
        with torch.no_grad():
            x = _flat(self.params)
        self.numel = x.numel()
        if not self.codec.is_identity:
            self.codec.check_numel(self.numel, "LoCoDL codec randk")
        self.omega = omega_of(self.codec, self.numel)
        self.chi = config.chi if config.chi is not None else 1.0 / (1.0 + self.omega / self.replicas)
        self.rho = config.rho if config.rho is not None else min(self.chi, 1.0)
        self.y = x.clone()  # y^0: replica 0's x^0, so every replica holds the same y (one broadcast, at setup only)
        if self.replicas > 1:
            src = dist.get_process_group_ranks(outer_group)[0] if outer_group is not None else 0
            dist.broadcast(self.y, src, group=outer_group)
        self.v = torch.zeros_like(x)
        self.u = torch.zeros_like(x)
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed * 7919 + 104729 * (self.replica + 1))
        self.inner_steps = 0
        self.syncs = 0

    @property
    def control_step(self) -> float:
        """c = p chi / (gamma (1 + 2 omega)), the control variates' step."""
        cfg = self.config
        return cfg.probability * self.chi / (cfg.gamma * (1 + 2 * self.omega))

    @torch.no_grad()
    def step(self) -> bool:
        """One LoCoDL step after a local step (module docstring); returns whether this step communicated."""
        cfg = self.config
        t, self.inner_steps = self.inner_steps, self.inner_steps + 1
        x = _flat(self.params)
        touched = bool(self.u.any())
        x.add_(self.u, alpha=cfg.gamma)  # x^_i
        if self.grad_g is not None:
            self.y.sub_(self.grad_g(self.y), alpha=cfg.gamma)
        self.y.add_(self.v, alpha=cfg.gamma)  # y^
        talk = coin(cfg.seed, t, cfg.probability)
        if talk:
            d_own, dbar = self._exchange(x - self.y)
            c = self.control_step
            x.mul_(1 - self.rho).add_(self.y + dbar, alpha=self.rho)
            self.u.add_(dbar - d_own, alpha=c)
            self.y.add_(dbar, alpha=self.rho)
            self.v.add_(dbar, alpha=c)
            self.syncs += 1
        if talk or touched:
            self._write(x)
            if self.after_sync is not None:
                self.after_sync()
        return talk

    def _exchange(self, message: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d_i, dbar): this replica's decoded C_i(message) and (1 / 2R) sum_j d_j from the all-gather."""
        n = self.syncs
        if self.watch is not None:
            self.watch.announce(n)
            self.watch.await_all(n)
        buf = self.codec.encode_flat(message, self.generator)
        gathered = torch.empty(self.replicas * buf.numel(), dtype=torch.uint8, device=buf.device)
        self.channel.all_gather_encoded(gathered, buf, numel=self.numel, dtype=torch.float32)
        slots = gathered.view(self.replicas, -1)
        decoded = [self.codec.decode_flat(slots[j], self.numel, torch.float32) for j in range(self.replicas)]
        total = decoded[0].clone()
        for d in decoded[1:]:
            total.add_(d)
        return decoded[self.replica], total.div_(2 * self.replicas)

    def _write(self, x: torch.Tensor) -> None:
        off = 0
        for p in self.params:
            n = p.numel()
            p.copy_(x[off:off + n].view_as(p))
            off += n

    def finish(self) -> None:
        """Nothing in flight (every exchange completes inside :meth:`step`)."""

    def state_dict(self) -> dict[str, Any]:
        """y, v, u, the step counter and the compressor's stream (see the module docstring)."""
        return {"config": self.config.to_dict(), "y": self.y.clone(), "v": self.v.clone(), "u": self.u.clone(),
                "inner_steps": self.inner_steps, "syncs": self.syncs, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError for another configuration or parameter count."""
        if state["config"] != self.config.to_dict():
            raise ValueError(f"LoCoDL state was saved with {state['config']}, this run uses {self.config.to_dict()}; "
                             f"resume with the same outer configuration")
        if state["y"].numel() != self.numel:
            raise ValueError(f"LoCoDL state holds {state['y'].numel()} parameters, this rank has {self.numel}; resume "
                             f"with the same model and layout")
        self.y.copy_(state["y"])
        self.v.copy_(state["v"])
        self.u.copy_(state["u"])
        self.inner_steps, self.syncs = int(state["inner_steps"]), int(state["syncs"])
        self.generator.set_state(state["generator"])

"""LoDAdaC: K local Adam-type steps, then compressed gossip over a graph (Liu et al., TMLR 2026, arXiv 2604.09970).

This is the paper's Algorithm 1 (Section 3.1), split the way a trainer runs it: :class:`LoDAdaCAdam` is lines 5-8
(the local update, one call per iteration t, ``r_t`` from Table 2) and :class:`LoDAdaC` is lines 9-12 (every K-th
iteration the compressed gossip, with the y_i of Section 3.1 so that only compressed messages travel). Per agent
(replica) i, iteration t, with W the mixing matrix of megacomp.outer.topology (doubly stochastic, W_ij = 1 / (d + 1)
on the diagonal and each edge of a d-regular graph) and Q the codec:

    g_i = stochastic gradient at x_i^t
    m_i^t = b1 m_i^{t-1} + (1 - b1) g_i                    (no bias correction)
    u_i^t = r_t(g_i^0 .. g_i^t)                            Adam: b2 u_i^{t-1} + (1 - b2) g_i * g_i; AMSGrad: the
                                                           running max of that EMA; AdaGrad: the mean of g_i * g_i
    x_i^{t+1/2} = x_i^t - alpha m_i^t / (sqrt(u_i^{t-1}) + delta)       the PREVIOUS u (u^{-1} = 0)
    if (t + 1) mod K == 0:
        q_i = Q[x_i^{t+1/2} - xh_i^t];  xh_i^{t+1} = xh_i^t + q_i     q_i is the only message, sent to each neighbour
        y_i^{t+1} = y_i^t + sum_j W_ji q_j                           (j = i included), so y_i = sum_j W_ji xh_j
        x_i^{t+1} = x_i^{t+1/2} + gamma (y_i^{t+1} - xh_i^{t+1})
    else: x_i^{t+1} = x_i^{t+1/2}; xh, y unchanged

Initialisation (line 2): x_i^0 = xh_i^0 = y_i^0 = x^0, replica 0's weights (one broadcast when the engine is built,
uncounted setup, as for LoCoDL), m^{-1} = u^{-1} = 0. With the identity codec (compression off) xh_i = x_i^{t+1/2}
exactly, so the message is x_i^{t+1/2} itself and y_i = sum_j W_ji x_j^{t+1/2} is summed directly (self first, then
the neighbours in replica order, fp32): x <- x + gamma (y - x), and with gamma = 1 x <- y, decentralised averaging with
W bit for bit. Defaults: gamma = 1 uncompressed, 0.5 with a lossy codec (the authors' release); Lemma 3.1 asks
gamma <= (1 - rho)(1 - eta^2) / 100, rho = ||W - J||_2 (topology.mixing_rho), eta the codec's contraction.
delta defaults to 1e-4: Algorithm 1's first step is alpha m^0 / delta (u^{-1} = 0), and the authors' release adds
1e-8 under the square root, sqrt(u + 1e-8), which is 1e-4 at u = 0.

Options that leave Algorithm 1 (off by default, named in the training banner): ``bias_correction`` (Adam's
1 / (1 - b^t) factors on m and on the previous u) and ``apply_weight_decay`` (AdamW's decoupled x -= alpha lambda x
with each parameter group's ``weight_decay``). ``random_peer`` is outside the paper too (its W changes at every
exchange; a perfect matching has rho = 1): each pair keeps its own (xh_i, xh_j) copies, started at x^0, and
x_i += gamma / 2 (xh_j - xh_i) with the pair's copies (CHOCO per edge). Neither Algorithm 1 nor the authors' release
clips g; the trainer turns its global-norm clip off for LoDAdaC unless --clip-grad is typed, and names it when it is.

Bytes: each exchange sends q_i once per neighbour, |N_i| x wire_bytes, recorded per neighbour under the channel's
tag (``outer``) against the fp32 size.

Error bound: the delivered q_i is the sender's own bytes decoded the same way, so xh_i - x^0 is exactly the fp32 sum
of the messages i sent (it telescopes) and y_i = sum_j W_ji xh_j up to the fp32 rounding of the additions; what Q
drops stays in x_i - xh_i and is sent later. Sum_i x_i is preserved by the gossip (W doubly stochastic; to fp32
rounding). Lemma 3.1 bounds the consensus error by alpha^2 n K^2 C for gamma as above.

Failure behaviour: ValueError (one line, naming the fix) for a topology that does not fit the replica count
(megacomp.outer.topology.check_topology), K < 1, gamma outside (0, 1], a structured compressor (PowerSGD) or error
feedback on the codec (xh is the error feedback), bad optimizer settings (betas, delta, rule), or a state saved by
another configuration; a lost replica raises ReplicaLost through the watch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..comm import Channel, make_channel
from ..compression import Codec, make_codec, parse_codec_arg
from .diloco import _flat
from .liveness import ReplicaWatch
from .topology import check_topology, is_static, neighbours

GOSSIP_TAG = 73  # point-to-point tag of the gossip message (distinct from NoLoCo's and the pipeline's)
RULES = ("adam", "amsgrad", "adagrad")  # Table 2's r_t
DEFAULT_DELTA = 1e-4


class LoDAdaCAdam(torch.optim.Optimizer):
    """Algorithm 1, lines 5-8: x -= lr m^t / (sqrt(u^{t-1}) + delta), u^t = r_t (Table 2), no bias correction.

    Args:
        params: parameters or parameter groups (a group's ``lr`` is alpha; its ``weight_decay`` is read only with
            ``apply_weight_decay``).
        lr: alpha. betas: (b1, b2); b2 is unused by ``adagrad``. eps: delta, added outside the square root.
        rule: ``adam`` (u = b2 u + (1 - b2) g^2), ``amsgrad`` (uh = that EMA, u = max(u, uh)) or ``adagrad``
            (u = mean of g^2 over the steps so far).
        bias_correction: divide m^t by 1 - b1^(t+1) and u^{t-1} by 1 - b2^t (Adam's; not Algorithm 1).
        apply_weight_decay: AdamW's decoupled decay x -= lr wd x before the step (not Algorithm 1).
        weight_decay: the default of the groups' ``weight_decay``.

    Error bound: each step is a handful of fp32 operations on the parameter's dtype (the state is the parameter's
    dtype), about 10 roundings; the division amplifies them by at most lr / delta.

    Raises:
        ValueError: lr < 0, a beta outside [0, 1), delta <= 0, an unknown rule.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = DEFAULT_DELTA,
                 weight_decay: float = 0.0, rule: str = "adam", bias_correction: bool = False,
                 apply_weight_decay: bool = False) -> None:
        if lr < 0:
            raise ValueError(f"LoDAdaC alpha (lr) must be >= 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"LoDAdaC betas must be in [0, 1), got {tuple(betas)}")
        if not eps > 0:
            raise ValueError(f"LoDAdaC delta (eps) must be > 0 (the first step divides by it), got {eps}")
        if rule not in RULES:
            raise ValueError(f"LoDAdaC local rule must be one of {', '.join(RULES)} (Table 2), got {rule!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, rule=rule,
                        bias_correction=bias_correction, apply_weight_decay=apply_weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        """One iteration t of lines 6-8 for every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, delta, rule = group["lr"], group["eps"], group["rule"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)  # a 0-d CPU tensor, as torch's AdamW (checkpoints reshard it)
                    state["exp_avg"] = torch.zeros_like(p)  # m
                    state["u"] = torch.zeros_like(p)  # u^{t-1}
                    if rule == "amsgrad":
                        state["u_ema"] = torch.zeros_like(p)  # AMSGrad's u-hat
                    elif rule == "adagrad":
                        state["grad_sq_sum"] = torch.zeros_like(p)
                t = int(state["step"])
                m, u = state["exp_avg"], state["u"]
                if group["apply_weight_decay"] and group["weight_decay"]:
                    p.mul_(1 - lr * group["weight_decay"])
                m.mul_(b1).add_(g, alpha=1 - b1)
                # the denominator reads u^{t-1} before it becomes u^t (line 8)
                if group["bias_correction"] and rule != "adagrad" and t > 0:
                    denom = (u / (1 - b2 ** t)).sqrt_().add_(delta)
                else:
                    denom = u.sqrt().add_(delta)
                step_m = m / (1 - b1 ** (t + 1)) if group["bias_correction"] else m
                if rule == "adam":
                    u.mul_(b2).addcmul_(g, g, value=1 - b2)
                elif rule == "amsgrad":
                    state["u_ema"].mul_(b2).addcmul_(g, g, value=1 - b2)
                    torch.maximum(u, state["u_ema"], out=u)
                else:
                    s = state["grad_sq_sum"].addcmul_(g, g)
                    torch.div(s, t + 1, out=u)
                p.addcdiv_(step_m, denom, value=-lr)
                state["step"] += 1
        return loss


@dataclass
class LoDAdaCConfig:
    """Settings of LoDAdaC's communication (Algorithm 1, lines 9-12; see the module docstring)."""

    outer_steps: int = 10
    """K: local steps per communication round (gossip when (t + 1) mod K == 0)."""
    topology: str = "ring"
    """ring, torus, exponential (Algorithm 1's fixed W) or random_peer (a new matching each round; not in the paper)."""
    gossip_lr: Optional[float] = None
    """gamma, the consensus step in (0, 1]; None: 1 with the identity codec, 0.5 with a lossy one."""
    codec: Any = None
    """Q: value codec of the gossip messages (int4, int2, top-k, ...; biased is fine) or None (uncompressed)."""
    seed: int = 0
    """Seed of random_peer's draws (the same on every rank)."""

    def __post_init__(self) -> None:
        if not isinstance(self.outer_steps, int) or self.outer_steps < 1:
            raise ValueError(f"LoDAdaC outer_steps (K) must be an int >= 1, got {self.outer_steps!r}")
        if self.topology not in ("ring", "torus", "exponential", "random_peer"):
            raise ValueError(f"LoDAdaC topology must be ring, torus, exponential or random_peer, got {self.topology!r}")
        codec = parse_codec_arg(self.codec)
        if codec is not None and not isinstance(codec, (str, dict, Codec)):
            raise ValueError(f"LoDAdaC gossips a value codec (int4, int2, top-k), got {codec}; PowerSGD / Accordion "
                             f"do not apply")
        self.codec = make_codec(codec)
        if self.gossip_lr is None:
            self.gossip_lr = 1.0 if self.codec.is_identity else 0.5
        if not 0 < self.gossip_lr <= 1:
            raise ValueError(f"LoDAdaC gossip step (outer lr) must be in (0, 1], got {self.gossip_lr}")

    def to_dict(self) -> dict:
        """Plain data (checkpoints record it)."""
        return {"outer_steps": self.outer_steps, "topology": self.topology, "gossip_lr": self.gossip_lr,
                "codec": None if self.codec.is_identity else self.codec.to_dict(), "seed": self.seed}


class LoDAdaC:
    """Algorithm 1's communication over ``outer_group`` (one rank per replica). Call :meth:`step` after every local
    optimizer step (:class:`LoDAdaCAdam` for Algorithm 1's own update).

    Args:
        params: this rank's parameters (any float dtype; xh and y are fp32). Set to replica 0's values (line 2).
        outer_group: one rank per replica (megacomp.outer.build_replica_groups' ``outer``).
        config: LoDAdaCConfig.
        channel: counts the bytes (its name is the traffic tag); default: an uncompressed ``outer`` channel (Q is
            applied here, once per message).
        after_sync: called after the parameters were replaced (the trainer reloads the optimizer's masters).
        watch: arrival checks before each exchange (megacomp.outer.ReplicaWatch) or None.

    Raises:
        ValueError: bad config values, a topology that does not fit the replica count, no parameters.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], outer_group, config: LoDAdaCConfig, *,
                 channel: Optional[Channel] = None, after_sync: Optional[Callable[[], None]] = None,
                 watch: Optional[ReplicaWatch] = None) -> None:
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("LoDAdaC: no parameters")
        self.config, self.group, self.after_sync, self.watch = config, outer_group, after_sync, watch
        self.replicas = dist.get_world_size(outer_group)
        self.replica = dist.get_rank(outer_group)
        check_topology(config.topology, self.replicas)
        self.outer_ranks = dist.get_process_group_ranks(outer_group) if outer_group is not None else \
            list(range(dist.get_world_size()))
        self.channel = channel if channel is not None else make_channel("outer", None, group=outer_group)
        self.codec = config.codec
        self.exact = self.codec.is_identity  # Q = I: xh = x^{t+1/2}, the message is x itself
        self.numel = sum(p.numel() for p in self.params)
        with torch.no_grad():
            x0 = _flat(self.params)
            dist.broadcast(x0, self.outer_ranks[0], group=outer_group)  # line 2: x_i^0 = x^0 (replica 0's)
            self._write(x0)
        # xh_i and y_i = sum_j W_ji xh_j (fixed W); random_peer: "mine/<j>", "peer/<j>" per pair, from x0
        self.xhat = x0.clone() if not self.exact and is_static(config.topology) else None
        self.y = x0.clone() if self.xhat is not None else None
        self.x0 = x0 if not self.exact and not is_static(config.topology) else None
        self.copies: dict[str, torch.Tensor] = {}
        self.inner_steps = 0
        self.exchanges = 0

    @property
    def peers(self) -> list[int]:
        """This replica's neighbours at the next exchange."""
        c = self.config
        return neighbours(c.topology, self.replicas, self.replica, c.seed, self.exchanges)

    def step(self) -> bool:
        """Count iteration t (the parameters hold x^{t+1/2}); gossip when (t + 1) mod K == 0. Returns whether the
        parameters were replaced."""
        self.inner_steps += 1
        if self.inner_steps % self.config.outer_steps:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """Line 10 now (module docstring); point-to-point with the neighbours only."""
        n, peers, gamma = self.exchanges, self.peers, self.config.gossip_lr
        if self.watch is not None:
            self.watch.announce(n)
            self.watch.await_all(n, [self.replica, *peers])
        x = _flat(self.params)  # x^{t+1/2}
        w = 1.0 / (len(peers) + 1)
        if self.exact:
            received = self._swap({j: x for j in peers})
            y = x * w
            for j in peers:
                y.add_(received[j], alpha=w)
            x = y if gamma == 1 else x.add_(y - x, alpha=gamma)
        elif self.xhat is not None:
            buf = self.codec.encode_flat(x - self.xhat)  # Q[x^{t+1/2} - xh^t], encoded once for every neighbour
            q = self.codec.decode_flat(buf, self.numel, torch.float32)
            self.xhat.add_(q)
            received = self._swap({j: buf for j in peers}, encoded=True)
            self.y.add_(q, alpha=w)
            for j in peers:
                self.y.add_(received[j], alpha=w)
            x.add_(self.y - self.xhat, alpha=gamma)
        else:  # random_peer: the pair's own copies
            sends = {}
            for j in peers:
                mine = self._copy(f"mine/{j}")
                sends[j] = self.codec.encode_flat(x - mine)
                mine.add_(self.codec.decode_flat(sends[j], self.numel, torch.float32))
            received = self._swap(sends, encoded=True)
            mix = torch.zeros_like(x)
            for j in peers:
                theirs = self._copy(f"peer/{j}").add_(received[j])
                mix.add_(theirs - self._copy(f"mine/{j}"), alpha=w)
            x.add_(mix, alpha=gamma)
        self.exchanges += 1
        self._write(x)
        if self.after_sync is not None:
            self.after_sync()

    def _write(self, x: torch.Tensor) -> None:
        off = 0
        for p in self.params:
            k = p.numel()
            p.copy_(x[off:off + k].view_as(p))
            off += k

    def _copy(self, key: str) -> torch.Tensor:
        if key not in self.copies:
            self.copies[key] = self.x0.clone()
        return self.copies[key]

    def _swap(self, outgoing: dict, encoded: bool = False) -> dict:
        """Send ``outgoing[j]`` to each neighbour j and receive theirs: the decoded q_j (encoded) or x_j (fp32)."""
        codec = self.codec if encoded else make_codec("none")
        nbytes = codec.wire_bytes(self.numel)
        works, bufs = [], {}
        for j, msg in outgoing.items():
            data = msg if encoded else msg.contiguous().view(torch.uint8)
            dst = self.outer_ranks[j]
            works.append(dist.isend(data, dst, tag=GOSSIP_TAG))
            self.channel.stats.record(self.channel.name, nbytes, self.numel * 4)
            bufs[j] = torch.empty(nbytes, dtype=torch.uint8, device=data.device)
            works.append(dist.irecv(bufs[j], dst, tag=GOSSIP_TAG))
        for work in works:
            work.wait()
        return {j: codec.decode_flat(b, self.numel, torch.float32) for j, b in bufs.items()}

    def finish(self) -> None:
        """Nothing in flight (every exchange completes inside :meth:`sync`)."""

    def state_dict(self) -> dict[str, Any]:
        """xh, y (or random_peer's pair copies and x^0), the iteration and exchange counters; m and u are the local
        optimizer's state."""
        def keep(t):
            return None if t is None else t.clone()
        return {"config": self.config.to_dict(), "algorithm": "lodadac-algorithm-1", "xhat": keep(self.xhat),
                "y": keep(self.y), "x0": keep(self.x0), "copies": {k: v.clone() for k, v in self.copies.items()},
                "inner_steps": self.inner_steps, "exchanges": self.exchanges}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError for another configuration, parameter count or format."""
        if state.get("algorithm") != "lodadac-algorithm-1":
            raise ValueError("LoDAdaC state was saved by the earlier CHOCO-style engine, not Algorithm 1; start this "
                             "run from the weights alone (load without the outer state) or from scratch")
        if state["config"] != self.config.to_dict():
            raise ValueError(f"LoDAdaC state was saved with {state['config']}, this run uses {self.config.to_dict()}; "
                             f"resume with the same outer configuration")
        tensors = [t for t in (state["xhat"], state["y"], state["x0"], *state["copies"].values()) if t is not None]
        if any(t.numel() != self.numel for t in tensors):
            raise ValueError(f"LoDAdaC state holds vectors of {tensors[0].numel()} parameters, this rank has "
                             f"{self.numel}; resume with the same model and layout")
        for name in ("xhat", "y", "x0"):
            setattr(self, name, None if state[name] is None else state[name].clone())
        self.copies = {k: v.clone() for k, v in state["copies"].items()}
        self.inner_steps, self.exchanges = int(state["inner_steps"]), int(state["exchanges"])

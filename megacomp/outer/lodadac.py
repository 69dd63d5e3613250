"""LoDAdaC-style decentralised training: local Adam(W) steps, then compressed gossip with error feedback.

LoDAdaC (Liu et al., TMLR 2026, arXiv 2604.09970) combines several local Adam-type steps between exchanges,
decentralised gossip over a graph and (possibly biased) compressors. The paper's exact update was not
available to us (only its abstract), so this is the CHOCO-style compressed gossip (Koloskova et al., 2019)
with error feedback, after H local steps of the inner optimizer (AdamW, its moments local to each replica);
it is a reconstruction, not the authors' code. Per exchange n, on replica i with weights x_i, neighbours N_i(n)
(megacomp.outer.topology) and mixing weight w = 1 / (|N_i| + 1):

    compression off (identity codec, gossip step 1):
        x_i <- w x_i + sum_{j in N_i} w x_j                decentralised averaging with W (self first, then
                                                           the neighbours in replica order, in fp32)
    compressed (any value codec, biased ones included; gossip step gamma):
        for every neighbour j:   q_i = C(x_i - xh_i)       xh_i: the copy of x_i that j holds (CHOCO's public
                                 xh_i <- xh_i + q_i        copy); what C drops stays in x_i - xh_i and is
                                 send q_i to j             sent later: that difference is the error feedback
                                 receive q_j; xh_j <- xh_j + q_j
        x_i <- x_i + gamma sum_{j in N_i} w (xh_j - xh_i)

On a static graph (ring, torus, exponential) every neighbour holds the same xh_i, so q_i is encoded once
and sent to each neighbour; with ``random_peer`` a replica keeps one (xh_i, xh_j) pair per peer it has met,
so the copies of a pair stay consistent however the draws go (memory: 2 x parameters per peer met, at most
R - 1). xh starts at 0. With the identity codec and gamma = 1 the compressed rule is the averaging rule in
exact arithmetic; the averaging form is used then, so compression off is decentralised Adam with W exactly
(a test restates it). Sum over i of x_i is preserved by both rules (W symmetric; up to fp32 rounding).

Bytes: each replica sends one encoding to each neighbour per exchange: |N_i| x wire_bytes, recorded per
neighbour under the channel's tag (``outer``), against the fp32 size as the uncompressed figure.

Error bound: the message delivered to j is exactly q_i (the same bytes, decoded the same way on both ends),
so xh_i on i and on j are bit-identical, and over any run sum_n q_i(n) = xh_i (final) - xh_i (initial): the
residual x_i - xh_i carries everything the codec dropped (it telescopes). Consensus contracts with W's
spectral gap when the codec is exact; with a contractive codec (||C(v) - v|| <= (1 - delta) ||v||) CHOCO
contracts for gamma small enough (gamma ~ delta; the default for a lossy codec is 0.5).

Failure behaviour: ValueError (one line, naming the fix) for a topology that does not fit the replica count
(megacomp.outer.topology.check_topology), H < 1, gamma outside (0, 1], a structured compressor (PowerSGD)
or error feedback on the codec (the copies are the error feedback); a lost replica raises ReplicaLost
through the watch.
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


@dataclass
class LoDAdaCConfig:
    """Settings of LoDAdaC-style gossip (see the module docstring)."""

    outer_steps: int = 10
    """H: local optimizer steps between two gossip exchanges."""
    topology: str = "ring"
    """ring, torus, exponential or random_peer (megacomp.outer.topology)."""
    gossip_lr: Optional[float] = None
    """gamma, the consensus step in (0, 1]; None: 1 with the identity codec, 0.5 with a lossy one."""
    codec: Any = None
    """Value codec of the gossip messages (int4, int2, top-k, ...; biased is fine) or None (uncompressed)."""
    seed: int = 0
    """Seed of random_peer's draws (the same on every rank)."""

    def __post_init__(self) -> None:
        if not isinstance(self.outer_steps, int) or self.outer_steps < 1:
            raise ValueError(f"LoDAdaC outer_steps (H) must be an int >= 1, got {self.outer_steps!r}")
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
    """Local steps plus compressed gossip over ``outer_group`` (one rank per replica). Call :meth:`step` after every
    local optimizer step.

    Args:
        params: this rank's parameters (any float dtype; the gossip state is fp32).
        outer_group: one rank per replica (megacomp.outer.build_replica_groups' ``outer``).
        config: LoDAdaCConfig.
        channel: counts the bytes (its name is the traffic tag); default: an uncompressed ``outer`` channel (the
            codec is applied here, once per message).
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
        self.averaging = self.codec.is_identity and config.gossip_lr == 1
        self.numel = sum(p.numel() for p in self.params)
        # CHOCO's copies: "mine/<key>" = xh_i as the peer(s) of <key> hold it, "peer/<j>" = xh_j (fp32, flat)
        self.copies: dict[str, torch.Tensor] = {}
        self.inner_steps = 0
        self.exchanges = 0

    @property
    def peers(self) -> list[int]:
        """This replica's neighbours at the next exchange."""
        c = self.config
        return neighbours(c.topology, self.replicas, self.replica, c.seed, self.exchanges)

    def step(self) -> bool:
        """Count one local step; gossip every H of them. Returns whether the parameters were replaced."""
        self.inner_steps += 1
        if self.inner_steps % self.config.outer_steps:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """One gossip exchange now (module docstring); point-to-point with the neighbours only."""
        n, peers = self.exchanges, self.peers
        if self.watch is not None:
            self.watch.announce(n)
            self.watch.await_all(n, [self.replica, *peers])
        x = _flat(self.params)
        w = 1.0 / (len(peers) + 1)
        if self.averaging:
            received = self._swap({j: x for j in peers})
            out = x * w
            for j in peers:
                out.add_(received[j], alpha=w)
            x = out
        else:
            sends = {}
            for j in peers:
                key = "mine/all" if is_static(self.config.topology) else f"mine/{j}"
                if key not in sends:
                    mine = self._copy(key)
                    buf = self.codec.encode_flat(x - mine)
                    mine.add_(self.codec.decode_flat(buf, self.numel, torch.float32))  # xh_i += q_i
                    sends[key] = buf
                sends[j] = sends[key]
            received = self._swap({j: sends[j] for j in peers}, encoded=True)
            mix = torch.zeros_like(x)
            for j in peers:
                theirs = self._copy(f"peer/{j}").add_(received[j])  # xh_j += q_j
                mine = self._copy("mine/all" if is_static(self.config.topology) else f"mine/{j}")
                mix.add_(theirs - mine, alpha=w)
            x.add_(mix, alpha=self.config.gossip_lr)
        self.exchanges += 1
        off = 0
        for p in self.params:
            k = p.numel()
            p.copy_(x[off:off + k].view_as(p))
            off += k
        if self.after_sync is not None:
            self.after_sync()

    def _copy(self, key: str) -> torch.Tensor:
        if key not in self.copies:
            self.copies[key] = torch.zeros(self.numel, dtype=torch.float32, device=self.params[0].device)
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
        """The copies, the step and exchange counters (see the module docstring)."""
        return {"config": self.config.to_dict(), "copies": {k: v.clone() for k, v in self.copies.items()},
                "inner_steps": self.inner_steps, "exchanges": self.exchanges}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError for another configuration or parameter count."""
        if state["config"] != self.config.to_dict():
            raise ValueError(f"LoDAdaC state was saved with {state['config']}, this run uses {self.config.to_dict()}; "
                             f"resume with the same outer configuration")
        for k, v in state["copies"].items():
            if v.numel() != self.numel:
                raise ValueError(f"LoDAdaC state holds copies of {v.numel()} parameters, this rank has {self.numel}; "
                                 f"resume with the same model and layout")
        self.copies = {k: v.clone() for k, v in state["copies"].items()}
        self.inner_steps, self.exchanges = int(state["inner_steps"]), int(state["exchanges"])

"""megacomp's compressed channels on torchft's quorum: training across replica groups that come and go.

torchft (PyPI ``torchft``) is the fault-tolerance engine: a Lighthouse forms a quorum of the live replica groups,
each group's ``Manager`` joins it at every step (or every outer step) and reconfigures a ``ProcessGroupGloo``
over the members, and a replica that (re)joins behind the others receives the current state from a live peer
through torchft's checkpoint transport (HTTP). megacomp adds what torchft's own collectives lack: its codecs,
error feedback and wire statistics on the replica dimension.

    ft = ReplicaQuorum(TorchFTConfig(lighthouse="http://host:29510", replica_id="2"),
                       state_dict=lambda: {...}, load_state_dict=lambda s: ..., fingerprint={"model": ..., "codec": ...})
    ch = ft.channel("dp_replicas", "int8", error_feedback="ef")   # a megacomp Channel over the quorum's group
    while training:
        ft.start_step()                        # quorum; a joining replica receives the state here (synchronously)
        loss.backward()
        ft.all_reduce_mean(ch, flat_grads)     # mean over the live replicas, compressed; errors are reported
        if ft.should_commit():                 # every live replica agrees the step is good
            optimizer.step()

Layout: each replica group keeps its own TP x PP (x inner DP) process groups, made by ``init_process_group`` in
its own job; torchft's group connects rank k of every live replica group (group rank k: one ``Manager`` per rank,
as torchft's HSDP does). The channel's group is that object (megacomp.comm.group_ops serves it).

Algorithm per step: ``Manager.start_quorum`` (synchronous: ``use_async_quorum=False``, so every member of the
reconfigured group participates and a joiner has its state before its forward pass); the collectives of the step
over the quorum's group; ``Manager.should_commit``: the step is applied only when no member saw an error. The
mean is ``x / n`` then a SUM all-reduce over the n live replicas (gloo has no AVG; the codec sees the scaled
values, as megacomp's DiLoCo does).

Error feedback across membership changes (the state this class keeps right):
  - an uncommitted step leaves no trace: the registered channels' error feedback is restored to its state at
    :meth:`start_step` (a failed step's gradients are discarded, so the error of encoding them must be too);
  - when the quorum's membership changes, residuals keyed ``.../server`` are dropped: they belong to this rank's
    shard of the old partition (megacomp.comm.collectives: more than two replicas), which no longer exists;
  - a replica that joins (a restarted process, or one that fell behind and is healed) starts with ZERO error
    feedback, by construction: the healing state carries no residuals and a healed replica's are reset. This is
    the correct value, not a shortcut: with classic EF, ``sum_t deq(q_t) + e_T = sum_t g_t`` per replica, so
    ``e`` is exactly what this replica computed and has not yet delivered; a joiner has delivered and withheld
    nothing, so its ``e`` is 0. Copying a peer's residual would deliver that peer's withheld error twice (the
    peer keeps and sends its own). What is lost with a dead replica is its own undelivered ``e_T`` (at most one
    step's codec error of its gradient for classic EF) together with its in-flight gradient.

Data position: the step consumes replica-batch indices ``batches_committed + rank`` (torchft counts committed
replica-batches and transfers the count to a joiner), so across losses and rejoins no replica-batch is trained
twice and none is skipped; an uncommitted step's batches are drawn again by the next step.

The Lighthouse holds only the membership. One that goes away while the replicas train is waited for: the quorum
is tried again about once a second until ``quorum_timeout_s`` (:func:`quorum_retries`; torchft alone makes one try,
then leaves its clients waiting out the timeout), so a Lighthouse restarted on the same address within that time
forms the next quorum and training goes on (:class:`QuorumClient`: the new Lighthouse's quorum numbers start again
from 1, which torchft's group reconfiguration does not expect).

Failure behaviour (one line each, naming the fix): an unreachable Lighthouse at start (:class:`LighthouseUnreachable`);
a quorum that did not form within ``quorum_timeout_s`` (:class:`LighthouseLost` when the Lighthouse does not answer
then, :class:`QuorumTimedOut` when it does: too few replica groups asked; both megacomp.outer.ReplicaLost);
a replica whose fingerprint (model, optimizer, compression) differs from the live peer it heals from
(:class:`ReplicaMismatch`: raised in the joining replica only, the others continue without it). A peer that dies
inside a collective makes it fail within ``timeout_s`` (gloo's timeout; a closed connection fails at once); the
step is not committed and the next quorum is formed without the dead replica after the Lighthouse's heartbeat
timeout. Codec or shape mismatches inside one quorum raise megacomp's validation error on every member.

The Lighthouse: ``python -m megacomp.integrations.torchft --bind [::]:29510 --min-replicas 1`` (scripts/
torchft_lighthouse.sh) runs torchft's ``LighthouseServer`` (megacomp.integrations.torchft_lighthouse). torchft's own
INFO lines (its Rust side logs every heartbeat that fails while the Lighthouse is down) are off unless ``RUST_LOG``
is set (``RUST_LOG=info``).

Across nodes: traffic between replica groups runs over torchft's process group, flat (each rank of a group
exchanges with the ranks at its position in the other groups, as the outer groups of megacomp.outer do).
"""
from __future__ import annotations

import copy
import math
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from ..comm import Channel
from ..comm.group_ops import ObjectGroup
from ..compression import CodecLike
from ..outer.diloco import _split  # Streaming DiLoCo's fragment partition, shared with megacomp's own outer loop
from ..outer.liveness import ReplicaLost
from .torchft_lighthouse import (QuorumClient, import_torchft, lighthouse_answers, lighthouse_main,  # noqa: F401
                                 local_lighthouse)

QUORUM_RETRY_S = 1.0
"""Seconds between two tries of a quorum whose Lighthouse call failed (torchft's ManagerServer sleeps
quorum_timeout / (retries + 1) between tries, then reconnects)."""
PROBE_S = 1.0
"""Seconds the Lighthouse is given to accept a connection when a quorum timed out (which line to print)."""


class LighthouseUnreachable(ConnectionError):
    """The torchft Lighthouse did not answer within the connect timeout."""


class LighthouseLost(ReplicaLost):
    """The Lighthouse stopped answering and did not come back within the quorum timeout (a replica group waiting for
    a quorum ends with it: ``address``, ``waited_s``)."""

    def __init__(self, message: str, address: str, waited_s: float) -> None:
        super().__init__(message)
        self.address, self.waited_s = address, waited_s


class QuorumTimedOut(ReplicaLost):
    """The Lighthouse answers, but no quorum of ``min_replicas`` replica groups formed within the quorum timeout."""


class ReplicaMismatch(ValueError):
    """A joining replica's configuration or compression differs from the quorum's."""


@dataclass
class TorchFTConfig:
    """How a replica group joins torchft's quorum (one per rank of the replica group)."""

    lighthouse: Optional[str] = None
    """The Lighthouse's address, ``http://host:port``; None: the ``TORCHFT_LIGHTHOUSE`` environment variable."""
    replica_id: str = "0"
    """This replica group's name (the same on every rank of the group; a restarted group reuses it)."""
    min_replicas: int = 1
    """Steps commit only with at least this many live replica groups."""
    timeout_s: float = 30.0
    """Bound on one collective, ``should_commit`` and the state transfer to a joiner (gloo's timeout)."""
    quorum_timeout_s: float = 120.0
    """Bound on waiting for a quorum (must exceed the time between two quorums: an outer step under DiLoCo)."""
    connect_timeout_s: float = 10.0
    """Bound on reaching the Lighthouse and the managers."""
    heartbeat_ms: int = 100
    """How often the replica's manager tells the Lighthouse it is alive."""
    store_addr: Optional[str] = None
    """This replica group's TCPStore host (None: ``MASTER_ADDR``, or a store of our own for a one-rank group)."""
    store_port: Optional[int] = None
    """This replica group's TCPStore port (None: ``MASTER_PORT``)."""
    group_rank: int = 0
    """This rank within its replica group."""
    group_world_size: int = 1
    """The replica group's size (its TP x PP x inner-DP ranks)."""
    init_sync: bool = True
    """torchft's ``init_sync``: at step 0 every replica but one heals from it (identical starting states). torchft
    picks the source per group rank, so at step 0 some ranks of a group heal and others do not; set False when the
    replica group has several ranks whose ``load_state_dict`` runs collectives among them (they would mismatch) and
    the replicas start from the same state anyway (same seed). Later heals (a replica behind the others) are
    decided per replica group and concern all of its ranks either way."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TorchFTConfig.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.min_replicas < 1:
            raise ValueError(f"TorchFTConfig.min_replicas must be >= 1, got {self.min_replicas}")
        if not 0 <= self.group_rank < self.group_world_size:
            raise ValueError(f"TorchFTConfig.group_rank {self.group_rank} must be in [0, {self.group_world_size})")


@dataclass
class QuorumStep:
    """What :meth:`ReplicaQuorum.start_step` found."""

    replicas: int
    """Live replica groups in this step's quorum."""
    rank: int
    """This replica group's rank among them."""
    quorum_id: int
    """torchft's quorum number (changes with the membership)."""
    step: int
    """Committed steps so far (the same on every live replica)."""
    batches_committed: int
    """Replica-batches committed so far (the data position)."""
    healed: bool
    """This replica received the state from a live peer at this quorum."""
    changed: bool
    """The membership changed since the previous step."""
    error: Optional[str]
    """An error of the quorum itself (reconfiguration, recovery): the step will not commit."""


class ReplicaGroup(ObjectGroup):
    """torchft's reconfigurable group as a megacomp channel group: rank and size of the current quorum."""


class ReplicaQuorum:
    """One rank's membership in torchft's quorum of replica groups (see the module docstring).

    Args:
        config: TorchFTConfig.
        state_dict: returns this rank's state a joining replica receives (model, optimizer, outer state, ...:
            anything torch.save can hold); called by torchft's transport thread while the state is readable.
        load_state_dict: installs a received state.
        fingerprint: settings every replica must share (model shape, optimizer, compression preset): compared on
            every state transfer; a difference raises :class:`ReplicaMismatch` in the receiving replica.

    A Lighthouse that stops answering (killed, its host restarted) is waited for: torchft's ManagerServer tries
    the quorum again about every :data:`QUORUM_RETRY_S` seconds with a new connection (:func:`quorum_retries`),
    and the heartbeats reconnect on their own, so a Lighthouse restarted on the same address within
    ``quorum_timeout_s`` forms the next quorum and training continues (its quorum numbers start again from 1:
    :class:`QuorumClient` keeps torchft's group reconfiguration right across that); one that does not come back
    ends :meth:`start_step` with :class:`LighthouseLost` at the timeout.

    Raises:
        LighthouseUnreachable: the Lighthouse did not answer within ``connect_timeout_s``.
        ImportError: torchft is not installed.
    """

    def __init__(self, config: TorchFTConfig, *, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                 fingerprint: dict) -> None:
        Manager, ProcessGroupGloo = import_torchft()
        self.config = config
        self.fingerprint = dict(fingerprint)
        self._user_state, self._user_load = state_dict, load_state_dict
        self.channels: list[Channel] = []
        self._healed = False
        self._members: Optional[tuple] = None
        self._snapshots: list = []
        self._store = None
        self.lighthouse = lighthouse = config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError("torchft: no Lighthouse address: pass --ft-lighthouse http://host:port (or set "
                             "TORCHFT_LIGHTHOUSE); start one with scripts/torchft_lighthouse.sh")
        addr, port = config.store_addr, config.store_port
        if addr is None and port is None and "MASTER_PORT" not in os.environ:
            if config.group_world_size != 1:
                raise ValueError("torchft: a replica group of several ranks needs its TCPStore: run it under torchrun "
                                 "(MASTER_ADDR/MASTER_PORT) or pass store_addr and store_port")
            import torch.distributed as dist
            self._store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # our own group's
            addr, port = "localhost", self._store.port
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=config.timeout_s))
        self.group = ReplicaGroup(self.pg)
        try:
            self.manager = Manager(
                pg=self.pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=config.min_replicas,
                use_async_quorum=False, init_sync=config.init_sync, timeout=timedelta(seconds=config.timeout_s),
                quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
                connect_timeout=timedelta(seconds=config.connect_timeout_s), rank=config.group_rank,
                world_size=config.group_world_size, store_addr=addr, store_port=port, lighthouse_addr=lighthouse,
                replica_id=config.replica_id, heartbeat_interval=timedelta(milliseconds=config.heartbeat_ms),
                quorum_retries=quorum_retries(config.quorum_timeout_s))
        except RuntimeError as e:
            if "failed to connect" in str(e):
                raise LighthouseUnreachable(
                    f"torchft: the Lighthouse at {lighthouse} cannot be reached within {config.connect_timeout_s:g} s: "
                    f"start it first (scripts/torchft_lighthouse.sh) and pass its http://host:port") from None
            raise
        self.quorum_client = QuorumClient(self.manager._client, self.manager)  # a restarted Lighthouse: its docstring
        self.manager._client = self.quorum_client

    # -- state a joiner receives -------------------------------------------------------------------
    def _state(self) -> dict:
        return {"fingerprint": self.fingerprint, "state": self._user_state()}

    def _load(self, received: dict) -> None:
        theirs = received.get("fingerprint", {})
        if theirs != self.fingerprint:
            diff = sorted(k for k in set(theirs) | set(self.fingerprint) if theirs.get(k) != self.fingerprint.get(k))
            shown = "; ".join(f"{k}: {self.fingerprint.get(k)!r} here, {theirs.get(k)!r} in the quorum" for k in diff)
            raise ReplicaMismatch(f"torchft replica {self.config.replica_id}: its settings differ from the quorum's "
                                  f"({shown}); restart it with the quorum's settings")
        self._user_load(received["state"])
        self._healed = True

    # -- channels ----------------------------------------------------------------------------------
    def channel(self, name: str, codec: CodecLike = None, **kwargs) -> Channel:
        """A megacomp Channel over the quorum's group whose error feedback this object keeps consistent across
        failed steps and membership changes (see the module docstring); ``kwargs`` as :class:`Channel`'s."""
        ch = Channel(name, codec, group=self.group, **kwargs)
        self.channels.append(ch)
        return ch

    # -- one step ----------------------------------------------------------------------------------
    def start_step(self) -> QuorumStep:
        """Join this step's quorum (blocks until it forms; a joiner receives the state first).

        Raises:
            ReplicaMismatch: this replica's fingerprint differs from the peer it healed from.
            LighthouseLost: no quorum within ``quorum_timeout_s`` and the Lighthouse does not answer.
            QuorumTimedOut: no quorum within ``quorum_timeout_s`` although the Lighthouse answers (fewer than
                ``min_replicas`` replica groups asked).
        """
        self._healed = False
        try:
            self.manager.start_quorum()
        except TimeoutError:  # torchft's client gave up at the quorum timeout ("status: Cancelled ... Timeout expired")
            raise self._timed_out() from None
        err = self.manager.errored()
        if err is not None and isinstance(err.original_exception, ReplicaMismatch):
            raise err.original_exception
        n = self.manager.num_participants()
        rank = self.manager.participating_rank()
        members = (self.quorum_client.configured, n, rank)  # torchft exposes no public quorum id or members
        # a new quorum (number or members) is a new membership even at the same size and rank: a replica replaced by
        # its restart (the others must validate with the joiner and drop the residuals of the old partition)
        changed = self._members is not None and members != self._members
        if changed or self._healed:
            for ch in self.channels:
                ef = ch.error_feedback
                if ef is None:
                    continue
                if self._healed:  # a joiner has delivered and withheld nothing: zero residuals
                    ef.reset()
                else:  # the server residuals belong to the old partition of the reduced tensor
                    for key in [k for k in ef.keys() if k.endswith("/server")]:
                        ef.reset(key)
        for ch in self.channels:  # arguments are checked across replicas once per membership (a joiner's first step)
            ch.set_validate(self._members is None or changed or self._healed)
        self._members = members
        self._snapshots = [ch.error_feedback.state_dict() if ch.error_feedback is not None else None
                           for ch in self.channels]
        return QuorumStep(replicas=n, rank=rank if rank is not None else -1, quorum_id=self.manager._quorum_id,
                          step=self.manager.current_step(), batches_committed=self.manager.batches_committed(),
                          healed=self._healed, changed=changed, error=None if err is None else str(err.original_exception))

    def _timed_out(self) -> ReplicaLost:
        """The one-line error for a quorum that did not form within the quorum timeout: whose fault it is."""
        c = self.config
        if not lighthouse_answers(self.lighthouse, min(PROBE_S, c.connect_timeout_s)):
            return LighthouseLost(f"torchft: the Lighthouse at {self.lighthouse} did not answer for {c.quorum_timeout_s:g} "
                                  f"s (the quorum timeout); restart it on the same address "
                                  f"(scripts/torchft_lighthouse.sh): replica groups that wait for a quorum continue "
                                  f"when it answers within that time", self.lighthouse, c.quorum_timeout_s)
        return QuorumTimedOut(f"torchft: no quorum of at least {c.min_replicas} replica group(s) formed within "
                              f"{c.quorum_timeout_s:g} s (the quorum timeout) at the Lighthouse {self.lighthouse}, which "
                              f"answers; start the missing replica groups, or lower the minimum (min_replicas)")

    def all_reduce(self, channel: Channel, tensor: torch.Tensor, key: Optional[str] = None) -> bool:
        """``tensor`` := its SUM over the live replicas through ``channel`` (in place). A collective error (a peer
        died, the timeout) is reported to the manager, so the step will not commit; returns whether it went
        through. megacomp's validation errors (mismatched codecs or shapes across replicas) are raised."""
        if self.manager.errored() is not None:
            return False
        try:
            channel.all_reduce(tensor, torch.distributed.ReduceOp.SUM, key=key)
        except ValueError:
            raise
        except Exception as e:  # gloo: a closed connection or the timeout; torchft decides at should_commit
            self.manager.report_error(e)
            return False
        return True

    def all_reduce_mean(self, channel: Channel, tensor: torch.Tensor, key: Optional[str] = None) -> bool:
        """``tensor`` := its mean over the live replicas: ``/ n`` then :meth:`all_reduce` (the codec sees the
        scaled values)."""
        tensor.div_(self.manager.num_participants())
        return self.all_reduce(channel, tensor, key)

    def should_commit(self) -> bool:
        """Whether every live replica finished the step without an error (apply the update only then). On False
        the registered channels' error feedback returns to its state at :meth:`start_step`."""
        ok = self.manager.should_commit()
        if not ok:
            for ch, saved in zip(self.channels, self._snapshots):
                if saved is not None:
                    ch.error_feedback.load_state_dict(saved)
        return ok

    def current_step(self) -> int:
        """Committed steps (the same on every live replica)."""
        return self.manager.current_step()

    def state_dict(self) -> dict:
        """The quorum's counters for a checkpoint: committed steps and replica-batches (torchft's Manager state)."""
        return self.manager.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue the counters of :meth:`state_dict` (a run resumed from a checkpoint: every group resumed from
        the same committed step meets the others there; one behind heals from them)."""
        self.manager.load_state_dict({"step": int(state["step"]), "batches_committed": int(state["batches_committed"])})

    def shutdown(self) -> None:
        """Leave the quorum (the others notice after the Lighthouse's heartbeat timeout)."""
        self.manager.shutdown(wait=False)


class OuterSync:
    """DiLoCo and Streaming DiLoCo across replica groups on the quorum: at an outer step, the replicas that trained
    from the anchor average their pseudo-gradients ``anchor - theta_local`` and every live replica applies the same
    outer SGD step (Nesterov momentum; torch.optim.SGD's rule, as megacomp.outer.DiLoCo) to the anchor and takes it
    as its parameters.

    Streaming (``fragments`` F > 1; Douillard et al., 2025): the parameters are cut into F contiguous fragments of
    about equal size by megacomp.outer.diloco's partition (the same fragments as megacomp's own Streaming DiLoCo),
    each with its own anchor and outer momentum; fragment f is synchronised after the inner steps t with
    ``(t + f * H // F) % H == 0`` (:meth:`due`, megacomp.outer.DiLoCo's schedule), so one outer step moves 1/F of the
    model. Each synchronisation is its own quorum (``sync(..., fragments=[f])``). F = 1 is DiLoCo and runs exactly
    the operations it ran before fragments existed. Not covered: the exchange overlapping later inner steps
    (megacomp's ``delay``) and merging local and outer weights (``mixing``): each fragment is applied at once and
    replaces the local weights.

    A replica that joined and has not yet met a fragment since (``contributes`` False for it: it received that
    fragment's anchor and its local weights came from a peer) sends zeros for it and is not counted: the mean is
    over the contributors, whose numbers (one per fragment) travel first in an uncompressed all-reduce. After a
    committed synchronisation every live replica holds the same anchor, outer momentum and parameters of the
    fragments it covered, bit for bit (all decode the same bytes). An uncommitted one changes nothing: the replicas
    keep their local parameters and the fragment's next synchronisation covers both rounds.

    Args:
        params: this rank's parameters (any float dtype; the anchors are fp32, flat).
        lr: the outer SGD's learning rate.
        momentum: the outer SGD's momentum (Nesterov when > 0).
        fragments: F, the number of fragments (1: DiLoCo).

    Raises:
        ValueError: F < 1 or more fragments than parameter tensors.
    """

    def __init__(self, params: list, lr: float, momentum: float, fragments: int = 1) -> None:
        self.params = list(params)
        if not isinstance(fragments, int) or not 1 <= fragments <= len(self.params):
            raise ValueError(f"OuterSync: fragments must be an int in [1, {len(self.params)}] (this rank's parameter "
                             f"tensors), got {fragments!r}")
        self.fragments = _split(self.params, fragments)
        with torch.no_grad():
            self.anchors = [torch.nn.Parameter(_flat(f), requires_grad=False) for f in self.fragments]
        self.optimizers = [torch.optim.SGD([a], lr=lr, momentum=momentum, nesterov=momentum > 0) for a in self.anchors]
        self.syncs = 0

    def due(self, t: int, outer_steps: int) -> list:
        """The fragments whose synchronisation falls after inner step ``t`` (1-based count of inner steps done;
        t = 0: the start): ``(t + f * H // F) % H == 0``, megacomp.outer.DiLoCo's staggering."""
        n = len(self.fragments)
        return [f for f in range(n) if (t + f * outer_steps // n) % outer_steps == 0]

    def _key(self, frag: int) -> str:
        return "pseudo_gradient" if len(self.fragments) == 1 else f"pseudo_gradient/f{frag}"

    @torch.no_grad()
    def sync(self, quorum: "ReplicaQuorum", channel: Channel, contributes, fragments=None) -> bool:
        """One outer step of ``fragments`` (default: all) in this quorum (a collective over it); ``contributes``: a
        bool, or one bool per fragment of ``fragments``. Returns whether it was committed."""
        frags = list(range(len(self.fragments))) if fragments is None else list(fragments)
        gives = [bool(contributes)] * len(frags) if isinstance(contributes, bool) else [bool(c) for c in contributes]
        deltas = [self.anchors[f].detach() - _flat(self.fragments[f]) if c else torch.zeros_like(self.anchors[f])
                  for f, c in zip(frags, gives)]
        counts = [0] * len(frags)
        if frags:
            count = torch.tensor([1.0 if c else 0.0 for c in gives], dtype=torch.float64, device=self.anchors[0].device)
            if quorum.all_reduce(channel.uncompressed(), count):
                counts = [int(c) for c in count.tolist()]
        for f, delta, n in zip(frags, deltas, counts):
            if n:
                delta.div_(n)  # the mean over the contributors: the codec sees the scaled values
                quorum.all_reduce(channel, delta, key=self._key(f))
        if not quorum.should_commit():
            return False
        for f, delta, n in zip(frags, deltas, counts):
            anchor = self.anchors[f]
            if n:
                anchor.grad = delta
                self.optimizers[f].step()
                anchor.grad = None
            off = 0
            for p in self.fragments[f]:
                p.copy_(anchor[off:off + p.numel()].view_as(p))
                off += p.numel()
        self.syncs += 1
        return True

    def state_dict(self) -> dict:
        """The anchors, the outer optimizers' momenta (one per fragment) and the count of outer steps."""
        return {"anchors": [a.detach().clone() for a in self.anchors],
                "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers], "syncs": self.syncs}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (ValueError for other fragment sizes)."""
        theirs, ours = [a.numel() for a in state["anchors"]], [a.numel() for a in self.anchors]
        if theirs != ours:
            raise ValueError(f"OuterSync: state of fragments of {theirs} parameters, this rank has {ours}; join with "
                             f"the same model, layout and fragments")
        with torch.no_grad():
            for a, saved in zip(self.anchors, state["anchors"]):
                a.copy_(saved)
        for o, saved in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(saved)
        self.syncs = int(state["syncs"])


def quorum_retries(quorum_timeout_s: float) -> int:
    """torchft's ``quorum_retries`` that keeps a quorum trying until ``quorum_timeout_s``: the ManagerServer makes
    one Lighthouse call per quorum by default, and when that call fails (the Lighthouse gone) it stops trying and
    never answers its clients, which then wait out the quorum timeout even if the Lighthouse is back after a moment.
    With R retries it sleeps ``quorum_timeout_s / (R + 1)`` (at least 0.1 s) after each failed call, reconnects and
    calls again; R = ceil(timeout / QUORUM_RETRY_S) tries about once a second and keeps trying until the clients'
    own deadline, the quorum timeout, ends the wait (a retry that would run past it is never awaited)."""
    return max(1, math.ceil(quorum_timeout_s / QUORUM_RETRY_S))


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])


if __name__ == "__main__":
    lighthouse_main(sys.argv[1:])

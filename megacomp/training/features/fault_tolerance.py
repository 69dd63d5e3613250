"""Training across replica groups that come and go (``--fault-tolerance torchft``; megacomp.integrations.torchft).

Each replica group is its own job (``megacomp-pretrain`` under torchrun, or one process) with its own TP x PP x DP
layout; the groups meet in torchft's quorum, formed by a Lighthouse (scripts/torchft_lighthouse.sh), and their
traffic goes through a megacomp channel on torchft's group (traffic kind ``replicas``), compressed with the
``--ft-codec``, else the compression config's ``replicas`` path (YAML ``replicas:`` / ``replicas_error_feedback:``),
else its ``dp_gradient`` codec and error feedback (under ``--ft-outer-steps`` its ``outer`` ones); the banner says
which (replica_channel_settings).

Schedules:
  per step (``--ft-outer-steps 0``, the default: data parallelism across replicas): every iteration joins the
      quorum before its forward pass; after backward, each rank's reduced ZeRO-1 gradient shard (the sum over its
      replica's DP ranks) is averaged over the rank of the same shard in every live replica (torchft connects
      group rank k of every replica group), and the sharded optimizer steps only when every replica committed
      the step (``Manager.should_commit``); otherwise the gradients and their residuals are dropped and the
      iteration is retried with the same data position.
  DiLoCo (``--ft-outer-steps H``): replicas train alone for H steps; at every H-th step they join the quorum and
      average the pseudo-gradient theta_anchor - theta_local (outer SGD, ``--ft-outer-lr``, Nesterov
      ``--ft-outer-momentum``; megacomp.integrations.torchft.OuterSync). A replica that joins at an outer step
      contributes no pseudo-gradient (it has trained nothing from the anchor) and leaves the mean to the others.
  Streaming DiLoCo (``--ft-outer-steps H --ft-fragments F``): the parameters are cut into F fragments by megacomp's
      own Streaming DiLoCo partition (megacomp.outer.diloco); fragment f is synchronised after the steps t with
      (t + f x H // F) % H == 0, each synchronisation a quorum of its own, so a quorum moves 1/F of the model and
      a replica joins (and heals) at whichever fragment comes next. A joiner contributes to no fragment until it
      has met it once (its weights there came from a peer mid-round); after a committed synchronisation of a
      fragment every live replica holds the same weights there. F = 1 is DiLoCo, operation for operation. With
      compression off and no faults, R replica groups of one rank run the same operations as megacomp's own
      ``--outer-algorithm streaming_diloco`` over R replicas (delay 0, mixing 0): the mean of the pseudo-gradient is
      a SUM all-reduce over R then the same SGD step, so with R = 2 (a two-term sum is order-free) the result is
      the same bit for bit, and with R > 2 it differs only by the summation order of gloo's all-reduce, at most
      about R x 2^-24 x sum_r |Delta_r| per element of the mean pseudo-gradient before the outer step (tested at
      R = 2: bit for bit). Not covered: Streaming DiLoCo's delay (overlap) and mixing.

Replica groups of several ranks: torchft picks a heal source per group rank; the quorum is built with torchft's
``init_sync`` off (every group starts from the same seed, so the same weights), because at step 0 it heals only
some ranks of a group, whose state load (an all-gather in the group) would then not match the others' ranks.

Survivors continue: a replica that dies fails the step it is in (within ``--ft-timeout`` seconds), the step is
not committed, and the next quorum (formed after the Lighthouse's heartbeat timeout) holds the live replicas; the
mean is over them. A restarted replica (same ``--ft-replica-id``) joins the next quorum and receives from a live
peer, through torchft's checkpoint transport: the model, the optimizer shard (masters, moments, counters), the
iteration, the RNG state and the outer state; it starts with zero error feedback (why that is exact:
megacomp.integrations.torchft). It must run the same configuration: model, optimizer, schedule and compression
are compared at the transfer and a difference stops the joiner with one line.

Data: each committed step trains replica-batch ``batches_committed + rank`` (one global batch of this replica
group's layout, drawn from the run's sampler at that position): across losses and rejoins no replica-batch is
trained twice and none is skipped. The record of every iteration carries ``ft_replicas`` (the quorum size),
``ft_quorum_id``, ``ft_healed``, ``ft_committed`` and ``ft_time`` (wall clock, for fault timelines).

Compression off and no faults: one replica group is bit-identical to the same run without torchft (a mean over
one member is the identity). R groups of D data-parallel ranks compute the same mean as one job of R x D ranks,
in another summation order: the difference is fp32 round-off of the sums, at most about (R + D) x 2^-24 x the sum
of the gradients' magnitudes per element.

The Lighthouse gone (killed, its host lost): every group waits in its quorum while torchft retries the
Lighthouse about once a second; restarted on the same address within ``--ft-quorum-timeout``, it forms the next
quorum and training goes on (megacomp.integrations.torchft.QuorumClient keeps torchft's group right when the new
Lighthouse numbers its quorums from 1 again). Not back by then: every group saves its last good iteration boundary
under ``--save`` (per step, the last committed step; under DiLoCo the inner step just taken, its outer step skipped)
and ends with exit status 4 and one line naming the Lighthouse's address, the flag and the fix (restart it, then
every group with ``--load``); a quorum that timed out with the Lighthouse answering (too few groups for
``--ft-min-replicas``) ends the same way with its own line.

Failure behaviour: ValueError naming the flag for a schedule or optimizer this does not cover (an optimizer other
than ``adamw``, ZeRO-2, PP > 1 with DiLoCo is fine, megacomp's own ``--outer-algorithm``, ``--ft-outer-steps``
< 0, ``--ft-fragments`` < 1, above the layer count or without ``--ft-outer-steps``); the Lighthouse unreachable, a
mismatched joiner (another ``--ft-fragments`` included): megacomp.integrations.torchft's one-line errors.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...comm import CompressedWork
from ...compression import parse_codec_arg
from ...data import get_batch
from .base import Feature

MODES = ("none", "torchft")
FINGERPRINT_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size",
                    "params_dtype", "tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                    "global_batch_size", "train_iters", "lr", "min_lr", "lr_warmup_iters", "optimizer", "seed",
                    "zero_stage", "shard_optimizer", "world_size", "compression_resolved")


@dataclass
class FaultToleranceConfig:
    """Replica groups on torchft's quorum (megacomp.integrations.torchft)."""

    FLAT_PREFIX = "ft_"
    mode: str = field(default="none", metadata={"flag": "fault_tolerance"})
    """none, or torchft: this job is one replica group of a fault-tolerant run; survivors continue when a replica
    group dies and a restarted one rejoins with the live state."""
    lighthouse: Optional[str] = None
    """The torchft Lighthouse, http://host:port (default: $TORCHFT_LIGHTHOUSE); scripts/torchft_lighthouse.sh starts one.
    ``local``: this job's rank 0 hosts one of its own (a single replica group: a try-out; several groups need one
    shared Lighthouse)."""
    replica_id: Optional[str] = None
    """This replica group's name (default: $REPLICA_ID, else 0); a restarted group keeps its name."""
    min_replicas: int = 1
    """Steps commit only with at least this many live replica groups."""
    timeout: float = 30.0
    """Seconds one cross-replica collective, the commit vote and the state transfer to a joiner may take: the bound
    on how long a replica that died inside a collective holds the others."""
    quorum_timeout: float = 300.0
    """Seconds to wait for a quorum (must exceed the time between quorums: ft_outer_steps iterations); also how long
    the Lighthouse may be gone: restarted on its address within this time, the groups continue; otherwise each group
    saves its last committed iteration (with --save) and stops, naming the Lighthouse."""
    codec: Any = None
    """Codec of the cross-replica traffic (a name or mapping); overrides the compression config's ``replicas`` path;
    default: that path when set, else the config's dp_gradient codec (per step) or outer codec (DiLoCo)."""
    error_feedback: Any = None
    """Error feedback on the cross-replica traffic ('ef', 'loco'); default: the compression config's
    replicas_error_feedback when its replicas path is set, else its dp_gradient_error_feedback (per step) or
    outer_error_feedback (DiLoCo)."""
    outer_steps: int = 0
    """0: join the quorum every step (data parallelism across replicas); H > 0: DiLoCo, quorum every H steps."""
    fragments: int = 1
    """Streaming DiLoCo (ft_outer_steps H > 0): F parameter fragments (megacomp's Streaming DiLoCo partition), fragment
    f synchronised at the steps t with (t + f x H // F) % H == 0, each synchronisation a quorum of its own (at most
    num_layers; 1 = DiLoCo)."""
    replica_slots: int = 8
    """DiLoCo: replica ids are 0 .. slots-1 and replica k trains data positions iteration x slots + k (positions
    of a replica that is down are not trained: the quorum size in the log says when)."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (ft_outer_steps > 0)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (ft_outer_steps > 0; 0 = plain SGD)."""


def replica_channel_settings(f: FaultToleranceConfig, compression) -> tuple[Any, Any, str]:
    """The cross-replica channel's codec, its error feedback, and where the codec came from (for the banner).

    Codec, first that is set: ``--ft-codec``; the compression config's ``replicas`` path (YAML key ``replicas:``);
    its ``dp_gradient`` codec (per step) or ``outer`` codec (``--ft-outer-steps``), today's default. Error feedback,
    first that is set: ``--ft-error-feedback``; ``replicas_error_feedback`` when the ``replicas`` path is set (off
    when only its codec is: the entry is one unit); the error feedback of the default path. The channel checks the
    pair (error feedback needs a lossy codec) and refuses a bad one in one line."""
    path = "outer" if f.outer_steps > 0 else "dp_gradient"
    own = compression.replicas is not None or compression.replicas_error_feedback is not None
    if f.codec is not None:
        codec, source = parse_codec_arg(f.codec), "--ft-codec"
    elif compression.replicas is not None:
        codec, source = compression.replicas, "the compression config's replicas"
    else:
        codec, source = getattr(compression, path), f"the compression config's {path} (replicas not set)"
    if f.error_feedback is not None:
        ef = f.error_feedback
    elif own:
        ef = compression.replicas_error_feedback
    else:
        ef = getattr(compression, f"{path}_error_feedback")
    return codec, ef, source


class FaultTolerance(Feature):
    """Replica groups on torchft's quorum (see the module docstring)."""

    name = "fault_tolerance"
    CONFIG = FaultToleranceConfig
    config_key = "ft"
    state_key = "torchft"  # the quorum's counters: a run resumed with --load continues its iterations and data

    @classmethod
    def selected(cls, cfg) -> bool:
        return cfg.ft.mode != "none"

    @classmethod
    def check(cls, cfg, world) -> None:
        f = cfg.ft
        if f.mode not in MODES:
            raise ValueError(f"fault_tolerance must be one of {', '.join(MODES)}, got {f.mode!r}")
        if f.mode == "none":
            return
        if cfg.training.optimizer != "adamw":
            raise ValueError(f"fault_tolerance torchft averages the sharded AdamW's gradient buckets; --optimizer "
                             f"{cfg.training.optimizer} is not covered: use --optimizer adamw")
        if cfg.zero.stage != 1:
            raise ValueError("fault_tolerance torchft needs the whole gradient buckets at the step: use --zero-stage 1")
        if cfg.outer.algorithm != "none":
            raise ValueError("fault_tolerance torchft runs its own DiLoCo across replica groups (--ft-outer-steps H); "
                             "drop --outer-algorithm")
        if f.outer_steps < 0 or f.min_replicas < 1 or not f.timeout > 0 or not f.quorum_timeout > 0:
            raise ValueError("ft_outer_steps must be >= 0, ft_min_replicas >= 1, ft_timeout and ft_quorum_timeout > 0")
        if not isinstance(f.fragments, int) or f.fragments < 1:
            raise ValueError(f"ft_fragments must be an integer >= 1, got {f.fragments!r}")
        if f.fragments > 1 and f.outer_steps == 0:
            raise ValueError(f"ft_fragments {f.fragments} is Streaming DiLoCo: set --ft-outer-steps H > 0 (fragments are "
                             f"synchronised every H steps, staggered)")
        if f.fragments > cfg.model.num_layers:
            raise ValueError(f"ft_fragments {f.fragments} is larger than the {cfg.model.num_layers} layers; use at most "
                             f"one fragment per layer")
        if f.codec is not None:
            parse_codec_arg(f.codec)  # raises on a bad codec

    def build(self, run) -> None:
        from ...integrations.torchft import OuterSync, ReplicaQuorum, TorchFTConfig, local_lighthouse
        f = self.cfg.ft
        comp = run.compression
        diloco = f.outer_steps > 0
        codec, ef, self.codec_source = replica_channel_settings(f, comp)
        self.start = run.iteration
        info = run.run_info()
        fingerprint = {k: info.get(k) for k in FINGERPRINT_KEYS}
        fingerprint.update(ft_codec=repr(codec), ft_error_feedback=repr(ef), ft_outer_steps=f.outer_steps,
                           ft_outer_lr=f.outer_lr, ft_outer_momentum=f.outer_momentum, ft_fragments=f.fragments)
        addr, port = self._replica_store()
        self.lighthouse = None
        lighthouse = f.lighthouse
        if lighthouse == "local":  # rank 0 hosts one (a single machine); its address goes to the replica's ranks
            self.lighthouse = local_lighthouse(f.min_replicas) if dist.get_rank() == 0 else None
            where = [self.lighthouse.address() if self.lighthouse is not None else None]
            dist.broadcast_object_list(where, src=0)
            lighthouse = where[0]
        self.ft = ReplicaQuorum(
            TorchFTConfig(lighthouse=lighthouse, replica_id=f.replica_id or os.environ.get("REPLICA_ID", "0"),
                          min_replicas=f.min_replicas, timeout_s=f.timeout, quorum_timeout_s=f.quorum_timeout,
                          group_rank=dist.get_rank(), group_world_size=dist.get_world_size(), store_addr=addr,
                          store_port=port, init_sync=False),  # same seed: same start; see TorchFTConfig.init_sync
            state_dict=lambda: self._state(run), load_state_dict=lambda s: self._load(run, s), fingerprint=fingerprint)
        self.channel = self.ft.channel("replicas", codec, error_feedback=ef)
        self.outer = OuterSync(list(run.model.parameters()), f.outer_lr, f.outer_momentum, f.fragments) if diloco else None
        self.fresh: set = set()  # DiLoCo: fragments this replica has not met since it healed (it contributes no
        # pseudo-gradient for them: its weights there came from a peer mid-round)
        self.quorum = None
        self.committed = True
        self.joined = False  # DiLoCo: this process met the others once (at its first iteration)
        self.at_outer_step = False  # DiLoCo: inside the quorum at the end of an iteration
        self.slot = 0
        if diloco:
            rid = self.ft.config.replica_id
            if not rid.isdigit() or int(rid) >= f.replica_slots:
                raise ValueError(f"ft_outer_steps: the replica id {rid!r} must be an integer in [0, ft_replica_slots "
                                 f"{f.replica_slots}): replica k trains data positions iteration x slots + k")
            self.slot = int(rid)

    def _replica_store(self):
        """The replica group's TCPStore for torchft's managers: torchrun's (MASTER_ADDR/MASTER_PORT), else one that
        rank 0 starts and announces over the replica's own group (mpirun, file rendezvous, one process)."""
        if "MASTER_PORT" in os.environ or dist.get_world_size() == 1:
            return None, None
        import socket
        self._store = dist.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False) \
            if dist.get_rank() == 0 else None
        where = [(socket.gethostname(), self._store.port) if self._store is not None else None]
        dist.broadcast_object_list(where, src=0)
        return where[0]

    def banner(self, run) -> list[str]:
        f = self.cfg.ft
        stream = (f"Streaming DiLoCo in {f.fragments} fragments (fragment k at the steps t with (t + k x "
                  f"{f.outer_steps} // {f.fragments}) % {f.outer_steps} == 0, a quorum each)" if f.fragments > 1 else
                  f"DiLoCo, quorum every {f.outer_steps} steps")
        when = (f"{stream} across replica groups (outer lr {f.outer_lr:g}, Nesterov momentum {f.outer_momentum:g})"
                if self.outer else "data parallel across replica groups, quorum every step")
        ef = self.channel.error_feedback
        return [f"fault tolerance: torchft, replica group {self.ft.config.replica_id}, {when}; traffic kind 'replicas' "
                f"codec {self.channel.codec}{' + error feedback' if ef is not None else ''} (from {self.codec_source}); "
                f"a lost group fails its step "
                f"within {f.timeout:g} s and the others continue; a restarted group receives the live state"]

    # -- the state a joining replica receives ---------------------------------------------------------
    def _state(self, run) -> dict:
        # iterations completed: under DiLoCo the quorum is joined at the end of an iteration (in its step)
        done = run.iteration + (1 if self.at_outer_step else 0)
        return {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "iteration": done,
                "rng": torch.get_rng_state(), "outer": self.outer.state_dict() if self.outer else None}

    def _load(self, run, state: dict) -> None:
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])  # masters, moments, counters; all-gathers the parameters
        run.iteration = int(state["iteration"])
        self.start = run.iteration - self.ft.current_step() if self.outer is None else self.start
        torch.set_rng_state(state["rng"])
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])

    # -- one iteration --------------------------------------------------------------------------------
    def _join(self, run):
        """Join the quorum. A joiner receives the live state; its learning rate comes with the optimizer state: the
        peer's for this iteration (per step), or the peer's last iteration's for the one inner step after an outer
        step under DiLoCo (the trainer sets every later one from the received iteration)."""
        from ...integrations.torchft import LighthouseLost, QuorumTimedOut
        try:
            self.quorum = self.ft.start_step()
        except (LighthouseLost, QuorumTimedOut) as e:
            raise self._stop(run, e) from None
        return self.quorum

    def _stop(self, run, error) -> Exception:
        """The error that ends this replica group when no quorum formed within --ft-quorum-timeout, after saving the
        last good iteration boundary under --save (a collective of the group: every rank's quorum times out alike).
        The boundary: per step, the last committed step (the quorum comes before the forward pass); under DiLoCo,
        the inner step just taken (its outer step is what failed; the local weights are a state DiLoCo passes
        through, as if that outer step had been skipped)."""
        from ...integrations.torchft import LighthouseLost, QuorumTimedOut
        from ..checkpoint import latest_iteration
        from ..checkpoint_paths import last_checkpoint_clause
        f, save = self.cfg.ft, self.cfg.checkpoint.save
        if self.at_outer_step:  # the trainer counts the iteration after this hook: it is complete
            run.iteration += 1
        failed = ""
        if save:
            try:
                if latest_iteration(save) != run.iteration:
                    run.save()
            except (OSError, ValueError) as e:  # the line about the quorum stays first
                failed = f"this iteration could not be saved ({e}); "
        tail = failed + last_checkpoint_clause(save)  # after the save: the iteration just saved
        resume = f" with --load {save}" if save else ""
        if isinstance(error, LighthouseLost):
            return LighthouseLost(f"the torchft Lighthouse at {error.address} did not answer for {error.waited_s:g} s "
                                  f"(--ft-quorum-timeout); restart it (scripts/torchft_lighthouse.sh), then every "
                                  f"replica group{resume}; {tail}", error.address, error.waited_s)
        return QuorumTimedOut(f"no quorum of at least {f.min_replicas} replica group(s) formed within "
                              f"{f.quorum_timeout:g} s (--ft-quorum-timeout) at the torchft Lighthouse "
                              f"{self.ft.lighthouse}, which answers: too few replica groups asked; start them all "
                              f"again{resume} (or lower --ft-min-replicas); {tail}")

    def _outer_sync(self, run, t: int) -> None:
        """DiLoCo's quorum point after ``t`` inner steps: the fragments due then (all of them for DiLoCo) average the
        pseudo-gradients of the replicas that trained from their anchor. A replica that healed in this quorum
        contributes to no fragment until it has met that fragment once."""
        if self.quorum.healed:
            self.fresh = set(range(self.cfg.ft.fragments))
        frags = self.outer.due(t, self.cfg.ft.outer_steps)
        self.committed = self.outer.sync(self.ft, self.channel, contributes=[k not in self.fresh for k in frags],
                                         fragments=frags)
        if self.committed:
            self.fresh -= set(frags)
            run.optimizer.load_params_from_model()  # the model holds the new anchors: refresh the fp32 masters

    def iteration(self, run, batches, inner):
        f = self.cfg.ft
        if self.outer is None:  # per step: quorum, then this step's replica-batch
            q = self._join(run)
            b = q.batches_committed + q.rank
        else:
            if not self.joined:  # this process's first iteration: meet the others at their next outer step
                self._join(run)  # a joiner receives the iteration the others completed: their due fragments follow
                self._outer_sync(run, run.iteration)
                self.joined = True
            b = run.iteration * f.replica_slots + self.slot
        sampler = iter(run.sampler_at(b * run.num_microbatches))
        batches = [get_batch(run.dataset, next(sampler)) for _ in range(run.num_microbatches)]
        return inner([(ids.to(run.device), labels.to(run.device)) for ids, labels in batches])

    def step(self, run, inner) -> bool:
        if self.outer is not None:  # DiLoCo: local steps; the replicas meet after every H-th
            stepped = inner()
            if self.outer.due(run.iteration + 1, self.cfg.ft.outer_steps):
                self.at_outer_step = True
                self._join(run)
                self._outer_sync(run, run.iteration + 1)
                self.at_outer_step = False
            return stepped
        opt = run.optimizer
        saved_ef = opt.ef.state_dict() if opt.ef is not None else None  # the replica's own dp_gradient residuals
        for b in opt.buckets:  # this rank's shard of each bucket, summed over the replica's DP ranks by backward's
            if b.work is None:  # reduce-scatter; a bucket no gradient reached is reduced (zeros) by the step
                continue
            b.work.wait()
            b.work = CompressedWork(lambda: None)  # done: the step finds the shard where it expects it
            self.ft.all_reduce_mean(self.channel, b.reduced, key=f"replicas/b{b.index}")
        self.committed = self.ft.should_commit()
        if not self.committed:  # a peer died or erred: drop the gradients (and their residuals); the data is retried
            opt.zero_grad()
            if saved_ef is not None:
                opt.ef.load_state_dict(saved_ef)
            return False
        return inner()

    def record(self, run, record: dict) -> None:
        q = self.quorum
        if self.outer is None:
            run.iteration = self.start + self.ft.current_step()  # committed steps only: a dropped step is retried
            record["iteration"] = run.iteration
        record.update(ft_time=time.time(), ft_replicas=q.replicas if q else None, ft_quorum_id=q.quorum_id if q else None,
                      ft_healed=bool(q.healed) if q else False, ft_committed=self.committed)
        if not self.committed and record["skipped"]:
            # a replica group lost or joining: the step is retried, it says nothing about the gradients' health
            record["skip_reason"] = "not committed: the torchft quorum changed during the step; it is retried"

    def state_dict(self) -> dict:
        """The quorum's committed steps and replica-batches, and the iteration they count from (per step: the
        iteration is ``start + committed steps`` and the data position ``batches_committed + rank``)."""
        return {**self.ft.state_dict(), "start": self.start}

    def load_state_dict(self, state: dict) -> None:
        self.start = int(state["start"])
        self.ft.load_state_dict(state)

    def close(self, run) -> None:
        self.ft.shutdown()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()

"""DiLoCo: replicas train locally for H steps, then exchange one pseudo-gradient through a compressed channel.

Algorithm (Douillard et al., "DiLoCo", 2023), per outer step t, on every
rank of a replica (a TP x PP [x inner-DP] model), for this rank's parameter shards:

    after H inner optimizer steps from theta_{t-1}:      theta_local
    Delta   = theta_{t-1} - theta_local                   the pseudo-gradient
    Delta   = mean over the outer group of Delta          one all-reduce every H steps (``outer`` channel:
                                                          divide by R, then SUM; codec and error feedback
                                                          as configured, counted in comm.stats())
    theta_t = SGD(theta_{t-1}, grad=Delta, lr, momentum, nesterov)   torch.optim.SGD's rule:
              m = momentum * m + Delta;  step = Delta + momentum * m (Nesterov) or m;  theta -= lr * step
    the model's parameters (and the inner optimizer's fp32 masters) are set to theta_t

Streaming DiLoCo (Douillard et al., 2025; torchft's ``fragment_sync_delay`` / ``fragment_update_alpha``) is
the same loop with three more settings: the parameters are cut into ``fragments`` contiguous groups of
about equal size, fragment p starts its exchange at the inner steps t with (t + p * H // P) % H == 0
(staggered, so the peak traffic is one fragment), the exchange runs in the background for ``delay``
inner steps (tau < H) and is applied then, and the fragment's local weights are merged with the new outer
weights as ``local = lerp(outer, local, mixing)`` (mixing 0: take the outer weights). DiLoCo is fragments
1, delay 0, mixing 0, and runs exactly the same operations. ``schedule='torchft'`` moves the exchanges to
torchft 0.2.0's timing instead (fragment p prepared tau steps before (p + 1) * H / P and applied there, fragments
in order 0, 1, ...); with two replicas the iterates then equal torchft's DiLoCo bit for bit (tested against a
plain-torch restatement of its local_sgd.py). OpenDiLoCo's train_pure_fsdp.py (PrimeIntellect-ai/OpenDiloco
04dd585) computes the same step, Delta / R then a SUM all-reduce. Against torchft otherwise: the mean is
sum(Delta / R) rather than sum(Delta) / R (a rounding apart for R not a power of two; the codecs need the scaled
values), the outer state is
fp32 whatever the parameter dtype, and fragments are contiguous element-balanced groups of this rank's tensors
(torchft takes the user's modules; the Streaming DiLoCo paper strides transformer blocks across fragments).

NoLoCo (``algorithm='noloco'``) keeps this schedule and state but replaces the all-reduce and the SGD step
by megacomp.outer.noloco's point-to-point exchange inside a seeded random group and its outer rule.
SparseLoCo (``algorithm='sparseloco'``; with a 1-D DCT codec it is megacomp's SparseLoCo-DCT) keeps the schedule too
and replaces the outer momentum by megacomp.outer.sparseloco's error-feedback accumulator and all-gather exchange.
DCT-DiLoCo (``algorithm='dct_diloco'``, Nedelkoski et al. 2025) keeps it as well and replaces the all-reduce and the
SGD step by megacomp.outer.dct_diloco's: Nesterov momentum whose largest 2-D DCT components per tile are all-gathered
and averaged, the rest kept locally, and a step with the replica's own pseudo-gradient.
MT-DAO is this loop as parameter averaging plus the trainer averaging the optimizer moments after each
synchronisation (megacomp.outer.mt_dao). Every exchange can be guarded by a ReplicaWatch (liveness.py).

The inner optimizer keeps its own state across outer steps (as in the paper). With lr = 1, no momentum, no
mixing and no codec, theta_t = theta_{t-1} - mean(theta_{t-1} - theta_i) = mean(theta_i): parameter
averaging. The engine then averages the local weights directly (sum of theta_i / R, one all-reduce), which is
bit-identical to torch.distributed.algorithms.model_averaging's ``average_parameters`` (tested at 2 and 3
replicas) instead of carrying the two extra fp32 roundings of the pseudo-gradient form.

Error bound with a lossy outer codec: the averaged pseudo-gradient carries the compressed all-reduce's
error (megacomp.comm.collectives, applied to Delta / R); error feedback (``error_feedback``) carries the
residual into the next outer step.

State (checkpointed by :meth:`DiLoCo.state_dict`): theta_{t-1} per fragment (fp32, flat), the outer SGD's
(or NoLoCo's) momentum per fragment, the inner-step and exchange counters (position in the cycle; NoLoCo's
group draws), exchanges in flight (completed and kept with the step they apply at), and the outer
channel's error feedback and stream.

Across nodes and sites: the outer exchange runs flat over the outer groups (the ranks at one position in every
replica); each rank exchanges the pseudo-gradient of the parameters it holds, so ranks of a replica that hold the same
parameters (inner data parallelism) each send theirs across the slow link: not hop by hop (megacomp.comm.hierarchical).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..comm import AnyChannel, Channel, make_channel
from ..compression import (CodecLike, check_error_feedback_codec, make_codec, make_error_feedback_config,
                           parse_codec_arg)
from .liveness import ReplicaLost, ReplicaWatch
from . import dct_diloco, noloco, sparseloco
from .noloco import gossip_groups, outer_update, start_exchange

# (algorithm, (outer lr, outer momentum)) when the config leaves them unset: the published values (a tuple: constant)
PUBLISHED_DEFAULTS = (("diloco", (0.7, 0.9)), ("noloco", (noloco.DEFAULT_LR, noloco.DEFAULT_MOMENTUM)),
                      ("sparseloco", (sparseloco.DEFAULT_LR, sparseloco.DEFAULT_DECAY)),
                      ("dct_diloco", (dct_diloco.DEFAULT_LR, dct_diloco.DEFAULT_DECAY)))


@dataclass
class DiLoCoConfig:
    """Settings of the DiLoCo outer loop (paper defaults for lr and momentum)."""

    outer_steps: int = 50
    """H: inner optimizer steps between two synchronisations."""
    outer_lr: Optional[float] = None
    """Outer SGD learning rate. None: the algorithm's published value (DiLoCo 0.7, NoLoCo 0.7, SparseLoCo 1,
    DCT-DiLoCo 0.7)."""
    outer_momentum: Optional[float] = None
    """Outer SGD momentum (0 = plain SGD). None: the algorithm's published value (DiLoCo 0.9, NoLoCo 0.5,
    SparseLoCo's accumulator decay 0.95, DCT-DiLoCo's Nesterov beta 0.95)."""
    nesterov: bool = True
    """Nesterov momentum (ignored without momentum)."""
    codec: CodecLike = None
    """Codec of the pseudo-gradient all-reduce (None: uncompressed)."""
    error_feedback: Any = None
    """Error feedback on the pseudo-gradient ('ef', 'loco' or a mapping); needs a lossy codec."""
    fragments: int = 1
    """Streaming DiLoCo: contiguous parameter fragments synchronised at staggered steps (1 = DiLoCo)."""
    delay: int = 0
    """Streaming DiLoCo: inner steps an exchange overlaps before it is applied (tau, < outer_steps)."""
    mixing: float = 0.0
    """Streaming DiLoCo: alpha in local = lerp(outer, local, alpha) when a fragment is applied (0: outer)."""
    schedule: str = "megacomp"
    """Streaming DiLoCo: when each fragment's exchange runs. 'megacomp': fragment p starts at the inner steps t with
    (t + p * H // P) % H == 0 and is applied delay steps later. 'torchft': torchft 0.2.0's DiLoCo, step for step:
    fragment p starts at the inner steps t with (t + delay) % H == (p + 1) * H // P % H and is applied at
    (p + 1) * H // P (mod H); needs outer_steps divisible by fragments and delay < outer_steps // fragments. The
    two are the same with fragments 1 and delay 0 (plain DiLoCo)."""
    algorithm: str = "diloco"
    """'diloco' (all-reduce of the pseudo-gradient, outer SGD), 'noloco' (gossip in random groups,
    megacomp.outer.noloco; outer_lr is alpha, outer_momentum beta, nesterov is not used), 'sparseloco'
    (error-feedback accumulator and all-gather, megacomp.outer.sparseloco; outer_lr is alpha, outer_momentum
    the accumulator's decay beta; the accumulator is the error feedback, so error_feedback must be None) or
    'dct_diloco' (megacomp.outer.dct_diloco: outer_momentum is the Nesterov beta, codec the format of the kept
    DCT coefficients; the momentum is the error feedback, so error_feedback must be None)."""
    group_size: int = 2
    """NoLoCo: replicas per gossip group (must divide the replica count)."""
    seed: int = 0
    """NoLoCo: seed of the group draws (the same on every rank)."""
    dct_topk: int = dct_diloco.DEFAULT_TOPK
    """DCT-DiLoCo: DCT coefficients of largest magnitude shared per tile (all of a smaller tile)."""
    dct_chunk: int = dct_diloco.DEFAULT_CHUNK
    """DCT-DiLoCo: largest DCT tile side (tiles of up to dct_chunk x dct_chunk, at most 256)."""
    sparseloco_tiles: str = "flat"
    """SparseLoCo: 'flat' (top-k over chunk-entry runs of the flat parameters) or 'reference' (per tensor, tiles of
    up to sqrt(chunk) x sqrt(chunk) as the reference code; megacomp.outer.sparseloco.Tiles)."""
    sparseloco_quantizer: str = "codec"
    """SparseLoCo: the kept values in the codec's format ('codec') or the reference's statistical 2-bit code
    ('stat2', megacomp.compression.stat2; needs sparseloco_tiles 'reference')."""

    def __post_init__(self) -> None:
        lr, momentum = dict(PUBLISHED_DEFAULTS).get(self.algorithm, (0.7, 0.9))
        self.outer_lr = lr if self.outer_lr is None else self.outer_lr
        self.outer_momentum = momentum if self.outer_momentum is None else self.outer_momentum
        if not isinstance(self.outer_steps, int) or self.outer_steps < 1:
            raise ValueError(f"outer_steps (H) must be an int >= 1, got {self.outer_steps!r}")
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"fragments must be an int >= 1, got {self.fragments!r}")
        if not isinstance(self.delay, int) or not 0 <= self.delay < self.outer_steps:
            raise ValueError(f"delay (tau) must be an int in [0, outer_steps={self.outer_steps}), got {self.delay!r}: "
                             f"an exchange must be applied before its fragment's next one starts")
        if self.schedule not in ("megacomp", "torchft"):
            raise ValueError(f"schedule must be 'megacomp' or 'torchft', got {self.schedule!r}")
        if self.schedule == "torchft" and (self.outer_steps % self.fragments
                                           or self.delay >= self.outer_steps // self.fragments):
            raise ValueError(f"schedule 'torchft' syncs one fragment every outer_steps // fragments inner steps: it "
                             f"needs outer_steps ({self.outer_steps}) divisible by fragments ({self.fragments}) and "
                             f"delay ({self.delay}) < {self.outer_steps // self.fragments}; change one of them")
        if not 0 <= self.mixing < 1:
            raise ValueError(f"mixing (alpha) must be in [0, 1), got {self.mixing}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if self.algorithm == "sparseloco":  # beta = 1: the accumulator keeps every unsent part (classic EF)
            if not 0 <= self.outer_momentum <= 1:
                raise ValueError(f"SparseLoCo's accumulator decay (outer_momentum) must be in [0, 1], got "
                                 f"{self.outer_momentum}")
        elif not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.algorithm not in ("diloco", "noloco", "sparseloco", "dct_diloco"):
            raise ValueError(f"outer algorithm must be 'diloco', 'noloco', 'sparseloco' or 'dct_diloco', got "
                             f"{self.algorithm!r}")
        if self.algorithm == "dct_diloco":
            if self.error_feedback is not None:
                raise ValueError("DCT-DiLoCo's momentum is its error feedback (what is not sent stays in it); drop "
                                 "error_feedback")
            for name in ("dct_topk", "dct_chunk"):
                v = getattr(self, name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"DCT-DiLoCo {name} must be an int >= 1, got {v!r}")
        if self.algorithm == "sparseloco" and self.error_feedback is not None:
            raise ValueError("SparseLoCo's accumulator is its error feedback; drop error_feedback (outer_momentum "
                             "sets the accumulator's decay)")
        if self.algorithm == "noloco" and (not isinstance(self.group_size, int) or self.group_size < 2):
            raise ValueError(f"NoLoCo group_size must be an int >= 2, got {self.group_size!r}")
        self.codec = make_codec(parse_codec_arg(self.codec))
        if self.algorithm == "dct_diloco":
            dct_diloco.check_value_codec(self.codec)
        if (self.sparseloco_tiles, self.sparseloco_quantizer) != ("flat", "codec"):
            sparseloco.check_options(self.algorithm, self.sparseloco_tiles, self.sparseloco_quantizer, self.codec)
        if self.error_feedback is not None:
            self.error_feedback = make_error_feedback_config(self.error_feedback)
        check_error_feedback_codec(self.codec, self.error_feedback, "DiLoCo error_feedback")
        if self.algorithm == "noloco" and self.error_feedback is not None and self.group_size != 2:
            raise ValueError(f"NoLoCo error feedback needs groups of 2 (one encoding per peer), got group_size "
                             f"{self.group_size}; use group_size 2 or no error feedback")

    def to_dict(self) -> dict:
        """Plain data (for checkpoints and the compatibility check)."""
        d = asdict(self)
        d["codec"] = None if self.codec.is_identity else self.codec.to_dict()
        d["error_feedback"] = asdict(self.error_feedback) if self.error_feedback is not None else None
        if self.algorithm != "dct_diloco":  # checkpoints of the other algorithms keep their saved form
            del d["dct_topk"], d["dct_chunk"]
        if self.schedule == "megacomp":  # likewise: checkpoints from before the option load unchanged
            del d["schedule"]
        if (self.sparseloco_tiles, self.sparseloco_quantizer) == ("flat", "codec"):  # likewise
            del d["sparseloco_tiles"], d["sparseloco_quantizer"]
        return d


class DiLoCo:
    """The outer loop over ``params`` (this rank's parameter shards) across ``outer_group`` (see the module
    docstring). Call :meth:`step` after every inner optimizer step.

    Args:
        params: the model parameters this rank holds (any float dtype; the outer state is fp32).
        outer_group: one rank per replica (megacomp.outer.build_replica_groups' ``outer``).
        config: DiLoCoConfig.
        channel: the pseudo-gradient channel, a value codec (e.g. built by megacomp.comm.make_channel from the
            ``outer`` path of a CommCompressionConfig); default: built from the config's codec and error feedback,
            stats tag ``outer``. When both are given, a lossy codec or error feedback in the config must equal the
            channel's (the config is what a checkpoint records).
        after_sync: called after the parameters were replaced (the trainer reloads the sharded optimizer's
            masters from the model here).
        watch: arrival checks at every exchange (megacomp.outer.liveness.ReplicaWatch): a replica that died
            is named after the watch's timeout instead of hanging the others. None: no checks (the collective waits up to the process group's timeout).

    Raises:
        ValueError: bad config values (DiLoCoConfig), an empty parameter list, a PowerSGD / Accordion channel, a
            channel whose codec or error feedback differs from the config's.
        ReplicaLost: (from step/sync) a replica did not reach an exchange within the watch's timeout.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], outer_group, config: DiLoCoConfig, *,
                 channel: Optional[Channel] = None, after_sync: Optional[Callable[[], None]] = None,
                 watch: Optional[ReplicaWatch] = None) -> None:
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("DiLoCo: no parameters")
        if config.fragments > len(self.params):
            raise ValueError(f"DiLoCo: {config.fragments} fragments for {len(self.params)} parameter tensors on this "
                             f"rank; use at most that many fragments")
        self.config, self.group, self.after_sync, self.watch = config, outer_group, after_sync, watch
        self.replicas = dist.get_world_size(outer_group)
        self.replica = dist.get_rank(outer_group)
        self.outer_ranks = dist.get_process_group_ranks(outer_group) if outer_group is not None else \
            list(range(dist.get_world_size()))
        if config.algorithm == "noloco" and self.replicas % config.group_size:
            raise ValueError(f"NoLoCo group_size {config.group_size} does not divide the replica count {self.replicas}; "
                             f"use a divisor of {self.replicas}")
        tiled = config.algorithm == "sparseloco" and config.sparseloco_tiles == "reference"
        dct = config.algorithm == "dct_diloco" or tiled  # encodes its messages itself: the channel carries them
        if channel is not None:
            self.channel = channel if dct else _check_channel(channel, config)
        else:
            self.channel = make_channel("outer", None if dct else config.codec, group=outer_group,
                                        error_feedback=config.error_feedback)
        self.plain = self.channel.uncompressed()  # NoLoCo's slow weights: same traffic kind, never quantised
        # DiLoCo with lr 1, no momentum, no mixing and no codec is parameter averaging: the weights themselves
        # are averaged (sum of theta_i / R), which is the same value as theta - mean(theta - theta_i) without
        # that form's two extra roundings, and bit-identical to torch's average_parameters
        self.averaging = (config.algorithm == "diloco" and config.outer_lr == 1 and config.outer_momentum == 0
                          and config.mixing == 0 and self.channel.codec.is_identity)
        self.fragments = _split(self.params, config.fragments)
        # DCT-DiLoCo: each fragment's tensor shapes and their per-tile top-k codecs
        self.shapes = [[p.shape for p in f] for f in self.fragments]
        self.dct_codecs = [dct_diloco.codecs_for(s, config.dct_topk, config.dct_chunk, config.codec)
                           for s in self.shapes] if config.algorithm == "dct_diloco" else []
        self.tiles = [sparseloco.Tiles(s, config.codec, config.sparseloco_quantizer) if tiled else None
                      for s in self.shapes]  # SparseLoCo's reference top-k layout, per fragment
        with torch.no_grad():  # theta_{t-1}, one flat fp32 tensor per fragment
            self.outer = [torch.nn.Parameter(_flat(f), requires_grad=False) for f in self.fragments]
        nesterov = config.nesterov and config.outer_momentum > 0
        self.optimizers = [torch.optim.SGD([o], lr=config.outer_lr, momentum=config.outer_momentum, nesterov=nesterov)
                           for o in self.outer] if config.algorithm == "diloco" else []
        # NoLoCo's outer momentum m_i or SparseLoCo's accumulator e_r, one flat fp32 tensor per fragment
        self.momenta = [torch.zeros_like(o) for o in self.outer] if config.algorithm != "diloco" else []
        self.inner_steps = 0
        self.syncs = 0
        self.exchanges = 0  # exchanges started by this object (the watch's numbering)
        self.lost = False  # the watch found a replica missing: nothing pending completes any more
        # fragment -> [apply at inner step, tensors (DiLoCo: [mean Delta]; NoLoCo: [Delta, peers' Delta...,
        # peers' phi...]), work or None, exchange number or None (awaited), gossip group or None (everyone)]
        self.pending: dict[int, list] = {}

    def _key(self, frag: int) -> str:
        return "pseudo_gradient" if self.config.fragments == 1 else f"pseudo_gradient/f{frag}"

    def step(self) -> bool:
        """Count one inner step; apply the exchanges due now, start the ones scheduled now (see the module
        docstring). Returns whether any fragment's weights were replaced."""
        self.inner_steps += 1
        t, cfg, changed = self.inner_steps, self.config, False
        for frag in sorted(self.pending):
            if self.pending[frag][0] == t:
                self._apply(frag)
                changed = True
        for frag in range(cfg.fragments):
            if self._starts(frag, t):
                self._start(frag)
                if cfg.delay == 0:
                    self._apply(frag)
                    changed = True
        if changed and self.after_sync is not None:
            self.after_sync()
        return changed

    def _starts(self, frag: int, t: int) -> bool:
        """Whether fragment ``frag``'s exchange starts after inner step ``t`` (DiLoCoConfig.schedule)."""
        h, parts = self.config.outer_steps, self.config.fragments
        if self.config.schedule == "torchft":  # torchft syncs fragment p at (p + 1) * H / P, prepared tau earlier
            return (t + self.config.delay) % h == (frag + 1) * (h // parts) % h
        return (t + frag * h // parts) % h == 0

    @torch.no_grad()
    def sync(self) -> None:
        """An outer step of every fragment now, without delay (a collective over the outer group)."""
        for frag in range(self.config.fragments):
            self._start(frag, background=False)
            self._apply(frag)
        if self.after_sync is not None:
            self.after_sync()

    @torch.no_grad()
    def _start(self, frag: int, background: Optional[bool] = None) -> None:
        delta = self.outer[frag].detach() - _flat(self.fragments[frag])  # Delta = theta_{t-1} - theta_local
        background = self.config.delay > 0 if background is None else background
        n, self.exchanges = self.exchanges, self.exchanges + 1
        members = None
        if self.config.algorithm == "noloco":
            members = next(g for g in gossip_groups(self.replicas, self.config.group_size, self.config.seed, n)
                           if self.replica in g)
        if self.watch is not None:
            self.watch.announce(n)
            if not background:
                self._await(n, members)  # before entering a blocking exchange a dead replica would hang
        at = self.inner_steps + (self.config.delay if background else 0)
        if self.config.algorithm == "dct_diloco":
            work, gathered = dct_diloco.start_exchange(self.channel, self.momenta[frag], delta, self.shapes[frag],
                                                       self.dct_codecs[frag], self.config.dct_chunk,
                                                       self.config.outer_momentum, self.replicas, background, None)
            tensors = [gathered, delta]
        elif self.config.algorithm == "sparseloco":
            work, gathered = sparseloco.start_exchange(self.channel, self.momenta[frag], delta, self.config.outer_momentum,
                                                       self.replicas, background, self.tiles[frag])
            tensors = [gathered]
            if work is not None and not background:
                work.wait()
                work = None
        elif members is None:
            if self.averaging:  # theta_t = mean(theta_i) exactly: torch's average_parameters, operation for operation
                delta = _flat(self.fragments[frag])
            delta.div_(self.replicas)  # mean = sum / R: gloo has no AVG, and the codecs see the scaled values
            work = self.channel.all_reduce(delta, dist.ReduceOp.SUM, key=self._key(frag), async_op=background)
            tensors = [delta]
        else:
            peers = [r for r in members if r != self.replica]
            works, deltas, phis = start_exchange(self.channel, self.plain, self.outer_ranks, peers, delta,
                                                 self.outer[frag].detach(), self._key(frag))
            work, tensors = _Works(works), [delta, *deltas, *phis]
            if not background:
                work.wait()
                work = None
        self.pending[frag] = [at, tensors, work, n if background else None, members]

    @torch.no_grad()
    def _apply(self, frag: int) -> None:
        _, tensors, work, n, members = self.pending.pop(frag)
        if n is not None:
            self._await(n, members)
        if work is not None:
            work.wait()
        outer = self.outer[frag]
        if self.config.algorithm == "dct_diloco":
            dct_diloco.outer_update(outer.data, self.momenta[frag], tensors[1], tensors[0], self.shapes[frag],
                                    self.dct_codecs[frag], self.config.dct_chunk, self.replicas, self.config.outer_lr,
                                    self.config.outer_momentum)
        elif self.config.algorithm == "sparseloco":
            sparseloco.outer_update(outer.data, self.momenta[frag], tensors[0], self.replica, self.replicas,
                                    self.config.outer_lr, self.tiles[frag])
        elif self.config.algorithm == "noloco":
            peers = (len(tensors) - 1) // 2
            outer_update(outer.data, self.momenta[frag], tensors[0], tensors[1:1 + peers], tensors[1 + peers:],
                         self.config.outer_lr, self.config.outer_momentum)
        elif self.averaging:
            outer.data.copy_(tensors[0])
        else:
            outer.grad = tensors[0]
            self.optimizers[frag].step()
            outer.grad = None
        off, alpha = 0, self.config.mixing
        for p in self.fragments[frag]:
            n = p.numel()
            new = outer[off:off + n].view_as(p)
            p.copy_(new if alpha == 0 else torch.lerp(new, p.detach().to(torch.float32), alpha))
            off += n
        self.syncs += 1

    def _await(self, n: int, members=None) -> None:
        """The watch's arrival check of exchange ``n`` (nothing without a watch); remembers a lost replica."""
        if self.watch is None:
            return
        try:
            self.watch.await_all(n, members)
        except ReplicaLost:
            self.lost = True
            raise

    def finish(self) -> None:
        """Complete the exchanges in flight (not applied): call before tearing down the process groups."""
        if self.lost:  # a replica is gone: its side of these exchanges never comes, and the run stops anyway
            self.pending = {}
            return
        for frag in sorted(self.pending):
            work, n, members = self.pending[frag][2], self.pending[frag][3], self.pending[frag][4]
            if n is not None:
                self._await(n, members)
                self.pending[frag][3] = None
            if work is not None:
                work.wait()
                self.pending[frag][2] = None

    def state_dict(self) -> dict[str, Any]:
        """theta_{t-1}, the outer optimizer, the cycle position and the channel (see the module docstring)."""
        self.finish()  # exchanges in flight complete now and are kept with the step they apply at
        return {"config": self.config.to_dict(), "outer": [o.detach().clone() for o in self.outer],
                "optimizers": [copy.deepcopy(o.state_dict()) for o in self.optimizers],  # torch returns live buffers
                "momenta": [m.clone() for m in self.momenta], "exchanges": self.exchanges,
                "inner_steps": self.inner_steps, "syncs": self.syncs, "channel": self.channel.state_dict(),
                "pending": {f: [at, [t.clone() for t in ts], members] for f, (at, ts, _, _, members)
                            in self.pending.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError when it was saved with another outer configuration or
        another parameter count."""
        if state["config"] != self.config.to_dict():
            raise ValueError(f"DiLoCo state was saved with {state['config']}, this run uses {self.config.to_dict()}; "
                             f"resume with the same outer configuration")
        if [o.numel() for o in state["outer"]] != [o.numel() for o in self.outer]:
            raise ValueError(f"DiLoCo state holds fragments of {[o.numel() for o in state['outer']]} parameters, this "
                             f"rank has {[o.numel() for o in self.outer]}; resume with the same model and layout")
        with torch.no_grad():
            for o, saved in zip(self.outer, state["outer"]):
                o.copy_(saved)
        for opt, saved in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(saved)
        self.inner_steps, self.syncs = int(state["inner_steps"]), int(state["syncs"])
        self.channel.load_state_dict(state["channel"])
        for m, saved in zip(self.momenta, state.get("momenta", [])):
            m.copy_(saved)
        self.exchanges = int(state.get("exchanges", 0))
        self.pending = {int(f): [int(at), [t.clone() for t in ts], None, None, members]
                        for f, (at, ts, members) in state["pending"].items()}


def _check_channel(channel: AnyChannel, config: DiLoCoConfig) -> Channel:
    """A pseudo-gradient channel handed in, checked against ``config`` (see :class:`DiLoCo`'s Raises)."""
    if channel.reduces_whole_buckets:
        raise ValueError(f"DiLoCo: channel {channel!r} compresses by structure (PowerSGD / Accordion); the outer "
                         f"exchange needs a value codec (int4, or top-k codecs for SparseLoCo)")
    if not config.codec.is_identity and config.codec != channel.codec:
        raise ValueError(f"DiLoCo: the config's codec {config.codec} differs from the channel's {channel.codec}; set "
                         f"the codec in one place (leave DiLoCoConfig.codec at None, or pass the same codec)")
    ef = channel.error_feedback.config if channel.error_feedback is not None else None
    if config.error_feedback is not None and config.error_feedback != ef:
        raise ValueError(f"DiLoCo: the config's error feedback {config.error_feedback} differs from the channel's {ef}; "
                         f"set it in one place")
    return channel


class _Works:
    """Several point-to-point works waited on as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])


def _split(params: list, parts: int) -> list[list]:
    """``params`` cut into ``parts`` contiguous, non-empty groups of about equal element count."""
    total = sum(p.numel() for p in params)
    groups, current, acc = [], [], 0
    for i, p in enumerate(params):
        current.append(p)
        acc += p.numel()
        left_params, left_groups = len(params) - i - 1, parts - len(groups) - 1
        if left_groups and (acc >= total * (len(groups) + 1) / parts or left_params == left_groups):
            groups.append(current)
            current = []
    groups.append(current)
    return groups

"""A traffic path as one object: :class:`Channel` holds everything that decides what goes on the wire.

A channel is built once (by ``CommCompressionConfig.build_channels`` for a training run, or by hand) and
handed to the layer, pipeline communicator, optimizer or DDP hook that moves that traffic. It holds:

  codec                the resolved ``Codec`` (never None; identity is ``Codec("none")``)
  error_feedback       the ``ErrorFeedback`` state it owns (keyed per tensor by the caller: a layer, a
                       bucket, a micro-batch slot), or None; checkpointed by :meth:`state_dict`
  min_compress_numel   the small-tensor rule: messages below it travel uncompressed (:meth:`codec_for`)
  options              ``CommOptions``: argument validation, duplex transport, pipelining segment size
  generator            the stochastic-rounding stream of a seeded codec (checkpointed)
  stats, name          the wire-statistics table and the tag the traffic is counted under
  probe                an optional ``ErrorProbe`` (megacomp.comm.probe): when armed, compressed calls are also
                       measured against the exact collective (diagnostics; never changes results)
  meter                an optional ``MeterTap`` (megacomp.comm.link_meter): every collective's bytes, link and wire
                       time are recorded for ``--compression auto`` (never changes results)

:meth:`set_codec` switches the codec in place (``--compression auto``, at an iteration boundary on every rank): the
error-feedback state is the channel's, keyed by tensor and independent of the codec, so it is kept exactly.

Its methods mirror torch.distributed (``all_reduce``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``,
``all_to_all_single``, ``isend``/``irecv``/``send``/``recv``) with the group defaulting to the channel's
own and a ``key`` naming the error-feedback state of that tensor. The algorithms and their error
bounds are in megacomp.comm.collectives and megacomp.comm.p2p.

Failure behaviour: building a channel raises ValueError for error feedback without a lossy codec, an
unknown codec, or bad options. Calls raise as the collectives do (mismatched arguments across ranks,
non-finite inputs with ``check_finite=True``, unsupported dtypes or ops for a lossy codec).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

import torch
from torch.distributed import ReduceOp

from ..compression import CodecLike, ErrorFeedback, as_error_feedback, check_error_feedback_codec, make_codec
from . import collectives, group_ops, p2p
from .common import CompressedWork
from .options import CommOptions
from .probe import ErrorProbe, optional_probe
from .stats import PROCESS_STATS, StatsTable

log = logging.getLogger("megacomp")

_NONE = make_codec("none")


class Channel:
    """One traffic path (see the module docstring).

    Args:
        name: the tag its traffic is counted under in ``comm.stats()`` and the default error-feedback key.
        codec: a ``Codec``, a name, a mapping, or None (identity).
        group: the process group of its collectives (None: the default group); calls may override it.
        error_feedback: an ``ErrorFeedback`` to own, a spec ('ef', 'loco', a mapping, a config) to build
            one from, or None. Needs a lossy codec.
        min_compress_numel: messages with fewer elements travel uncompressed (said once in the log).
        options: ``CommOptions`` (default: ``CommOptions.from_env()``, read now).
        generator: the stochastic-rounding stream; default: a fresh one at the codec's seed for a
            seeded stochastic codec, else None (torch's default generator).
        stats: the wire-statistics table (default: the process's, read by ``comm.stats()``).
        probe: an ``ErrorProbe`` measuring this path's compression error when armed (default: none).

    Raises:
        ValueError: error feedback without a lossy codec; ``min_compress_numel`` < 0; bad codec options.
    """

    def __init__(self, name: str, codec: CodecLike = None, *, group=None, error_feedback: Any = None,
                 min_compress_numel: int = 0, options: Optional[CommOptions] = None,
                 generator: Optional[torch.Generator] = None, stats: Optional[StatsTable] = None,
                 probe: Optional[ErrorProbe] = None) -> None:
        self.name = name
        self.codec = make_codec(codec)
        check_error_feedback_codec(self.codec, error_feedback, f"megacomp channel {name!r}")
        if not isinstance(min_compress_numel, int) or min_compress_numel < 0:
            raise ValueError(f"megacomp channel {name!r}: min_compress_numel must be an int >= 0, "
                             f"got {min_compress_numel!r}")
        self.group = group_ops.as_group(group)  # a torchft process-group object is served by its own methods
        self.error_feedback: Optional[ErrorFeedback] = as_error_feedback(error_feedback)
        self.min_compress_numel = min_compress_numel
        self.options = options if options is not None else CommOptions.from_env()
        self.generator = self.codec.stream(generator)
        self.stats = stats if stats is not None else PROCESS_STATS
        self.probe: Optional[ErrorProbe] = probe
        self.meter = None  # a megacomp.comm.link_meter.MeterTap while --compression auto measures this path
        self._said_small = False
        self._keys = 0

    def __repr__(self) -> str:
        ef = f", error_feedback={self.error_feedback.config}" if self.error_feedback is not None else ""
        return f"Channel({self.name!r}, codec={self.codec}{ef}, min_compress_numel={self.min_compress_numel})"

    # -- policy ------------------------------------------------------------------------------------
    def codec_for(self, numel: int):
        """The codec a message of ``numel`` elements travels with: the channel's codec, or the identity below
        ``min_compress_numel`` (the one implementation of the small-tensor rule; logged once per channel)."""
        if self.codec.is_identity or numel >= self.min_compress_numel:
            return self.codec
        if not self._said_small:
            self._said_small = True
            log.info("megacomp: %s messages of %d elements (< min_compress_numel=%d) travel uncompressed",
                     self.name, numel, self.min_compress_numel)
        return _NONE

    def set_codec(self, codec: CodecLike) -> None:
        """Send later calls with ``codec`` (a value codec). The error-feedback residuals stay as they are (they are
        the codec-independent remainder of what was sent; while the codec is the identity they are neither applied
        nor changed); a seeded stochastic codec gets its stream if the channel has none. Call it on every rank of the
        path's groups at the same point between collectives. Raises ValueError for a setting that is not a value
        codec."""
        self.codec = make_codec(codec)
        if self.generator is None:
            self.generator = self.codec.stream(None)

    def attach_meter(self, meter, link: str, switchable: bool = True) -> None:
        """Record this path's calls in ``meter`` (a megacomp.comm.link_meter.LinkMeter; None detaches) as crossing
        link kind ``link`` (``switchable``: whether the path's codec switches reach them)."""
        self.meter = meter.tap(self.name, link, switchable) if meter is not None else None

    def compresses(self, numel: int) -> bool:
        """Whether a message of ``numel`` elements is compressed (lossy codec and not below the threshold)."""
        return not self.codec_for(numel).is_identity

    @property
    def lossy(self) -> bool:
        """Whether the channel's codec loses information (everything but the identity)."""
        return not self.codec.is_identity

    # -- what owners ask instead of testing the class (LowRankChannel and AccordionChannel answer too) ----------
    keeps_own_error_feedback = False
    """Whether the compressor brings its own error feedback (PowerSGD), so an owner adds none: never for a codec."""
    reduces_whole_buckets = False
    """Whether the path must see each bucket whole, once per optimizer step, and keeps state beyond error
    feedback that its owner checkpoints (``state_dict(error_feedback=False)``): PowerSGD's warm-start Q,
    Accordion's regimes. Such a path cannot be split across nodes, per micro-batch or unsharded. Not a codec's."""
    low_rank = False
    """Whether the path reduces matrices in low rank (``all_reduce_coalesced`` of a bucket's tensors): PowerSGD."""
    adaptive = False
    """Whether the path picks a level per key and interval from the reduced gradients (Accordion's
    ``observe``/``end_step``/``discard_step``/``init_key``)."""

    @property
    def levels(self) -> tuple:
        """The channels that carry this path's bytes: itself (Accordion: its two levels)."""
        return (self,)

    def level_for(self, key: str) -> "Channel":
        """The channel that reduces tensor ``key`` now: itself (Accordion: the level of the key's regime)."""
        return self

    def validates(self, validate: Optional[bool] = None) -> bool:
        """A call's ``validate`` argument, or the channel's ``options.validate`` when it is None."""
        return self.options.validate if validate is None else validate

    def set_validate(self, enabled: bool) -> None:
        """Turn the cross-rank argument check of later calls on or off (on every rank alike)."""
        self.options = replace(self.options, validate=bool(enabled))

    def new_key(self, prefix: str) -> str:
        """A fresh error-feedback key ``prefix/<n>`` (n counts the keys handed out): a layer asks once at
        construction, so keys follow construction order, which is the same on every rank and every run."""
        key = f"{prefix}/{self._keys}"
        self._keys += 1
        return key

    def uncompressed(self) -> "Channel":
        """A sibling channel with the identity codec: same name, group, options and stats table (for traffic
        of this path that a policy keeps uncompressed, e.g. the optimizer's 1-D parameter buckets)."""
        return Channel(self.name, None, group=self.group, options=self.options, stats=self.stats, probe=self.probe)

    def without_error_feedback(self) -> "Channel":
        """A sibling channel with the same codec, group, small-tensor rule, options and stats table but no error
        feedback (for traffic of this path that has no stable per-tensor key, or must not advance the residuals)."""
        return Channel(self.name, self.codec, group=self.group, options=self.options, stats=self.stats,
                       min_compress_numel=self.min_compress_numel, probe=self.probe)

    def init_residuals(self, key: str, numel: int, all_reduce: bool = False) -> None:
        """Zero error-feedback residuals for a tensor of ``numel`` elements under ``key`` where none exist yet (so a
        fresh owner's state_dict has every key a trained one has): ``key + '/worker'`` of the whole tensor and, for
        ``all_reduce`` over more than two ranks (two with ``options.two_rank_server``), ``key + '/server'`` of this
        rank's chunk. Nothing without error feedback."""
        if self.error_feedback is None:
            return
        self.error_feedback.init_key(f"{key}/worker", (numel,))
        world = group_ops.get_world_size(self.group)
        if all_reduce and (world > 2 or world == 2 and self.options.two_rank_server):
            self.error_feedback.init_key(f"{key}/server", (collectives.server_numel(
                numel, world, group_ops.get_rank(self.group), self),))

    # -- collectives ---------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, *,
                   key: Optional[str] = None, check_finite: bool = False, tag: Optional[str] = None,
                   validate: Optional[bool] = None):
        """``torch.distributed.all_reduce`` (SUM/AVG for lossy codecs), in place; error-feedback keys
        ``key + '/worker'`` and ``+ '/server'`` (``key`` defaults to the channel name)."""
        g = self._group(group)
        probe = self._probe_for(tensor.numel(), g)
        compare = probe and probe.reference("all_reduce", self.name, tag or self.name, key or self.name, tensor, g,
                                            op, tensor.numel())
        work = self._metered("all_reduce", tensor.numel(), g, tensor, lambda: collectives.run_all_reduce(
            self, tensor, op, g, async_op, key or self.name, check_finite, tag or self.name, validate))
        return self._probed(work, compare, tensor)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                              async_op: bool = False, *, key: Optional[str] = None, check_finite: bool = False,
                              tag: Optional[str] = None, validate: Optional[bool] = None):
        """``torch.distributed.reduce_scatter_tensor``; error-feedback key ``key + '/worker'``."""
        g = self._group(group)
        probe = self._probe_for(input.numel(), g)
        compare = probe and probe.reference("reduce_scatter", self.name, tag or self.name, key or self.name, input, g,
                                            op, output.numel())
        work = self._metered("reduce_scatter", output.numel(), g, input, lambda: collectives.run_reduce_scatter_tensor(
            self, output, input, op, g, async_op, key or self.name, check_finite, tag or self.name, validate),
            codec_numel=input.numel())
        return self._probed(work, compare, output)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                               async_op: bool = False, *, check_finite: bool = False, tag: Optional[str] = None,
                               validate: Optional[bool] = None):
        """``torch.distributed.all_gather_into_tensor`` (no error feedback: nothing is summed)."""
        g = self._group(group)
        probe = self._probe_for(input_tensor.numel(), g)
        compare = probe and probe.reference("all_gather", self.name, tag or self.name, self.name, input_tensor, g,
                                            None, output_tensor.numel())
        work = self._metered("all_gather", input_tensor.numel(), g, input_tensor,
                             lambda: collectives.run_all_gather_into_tensor(self, output_tensor, input_tensor, g,
                                                                           async_op, check_finite, tag or self.name,
                                                                           validate))
        return self._probed(work, compare, output_tensor)

    def all_gather_encoded(self, output: torch.Tensor, input: torch.Tensor, *, numel: int,
                           dtype: torch.dtype = torch.float32, group=None, async_op: bool = False,
                           tag: Optional[str] = None, validate: Optional[bool] = None):
        """All-gather byte messages encoded by the caller (uint8, the same size on every rank) into the uint8
        ``output`` (``world * input.numel()`` bytes, rank order); counted as ``numel`` elements of ``dtype``
        uncompressed. For algorithms that must see each rank's encoding (DeMo's top-k indices)."""
        return collectives.run_all_gather_encoded(self, output, input, numel, dtype, self._group(group), async_op,
                                                  tag or self.name, validate)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None, group=None, async_op: bool = False, *, check_finite: bool = False,
                          tag: Optional[str] = None, validate: Optional[bool] = None):
        """``torch.distributed.all_to_all_single`` (split sizes count rows of dim 0)."""
        return collectives.run_all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,
                                                 self._group(group), async_op, check_finite, tag or self.name,
                                                 validate)

    # -- point to point ------------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, key: Optional[str] = None,
              check_finite: bool = False, label: Optional[str] = None, validate: Optional[bool] = None):
        """``torch.distributed.isend`` (``dst`` a global rank); error-feedback key ``key`` (default: name)."""
        g = self._p2p_group(group, "isend")
        return self._metered("send", tensor.numel(), g, tensor, lambda: p2p.run_isend(
            self, tensor, dst, g, tag, key or self.name, check_finite, label or self.name, validate))

    def irecv(self, tensor: torch.Tensor, src: int, group=None, tag: int = 0, *, check_finite: bool = False,
              label: Optional[str] = None, validate: Optional[bool] = None):
        """``torch.distributed.irecv``; ``wait()`` decodes into ``tensor``."""
        return p2p.run_irecv(self, tensor, src, self._p2p_group(group, "irecv"), tag, check_finite, label or self.name + "_recv",
                             validate)

    def send(self, tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, key: Optional[str] = None,
             check_finite: bool = False, label: Optional[str] = None, validate: Optional[bool] = None) -> None:
        """Blocking :meth:`isend`."""
        self.isend(tensor, dst, group, tag, key=key, check_finite=check_finite, label=label, validate=validate).wait()

    def recv(self, tensor: torch.Tensor, src: int, group=None, tag: int = 0, *, check_finite: bool = False,
             label: Optional[str] = None, validate: Optional[bool] = None) -> int:
        """Blocking receive (drains a mismatched message so the pair stays usable); returns ``src``."""
        return p2p.run_recv(self, tensor, src, self._p2p_group(group, "recv"), tag, check_finite, label or self.name + "_recv",
                            validate)

    def _group(self, group):
        return self.group if group is None else group_ops.as_group(group)

    def _metered(self, op: str, numel: int, group, tensor: torch.Tensor, run, codec_numel: Optional[int] = None):
        """``run()`` (the collective), recorded by the channel's meter tap when it has one."""
        tap = self.meter
        if tap is None:
            return run()
        n = numel if codec_numel is None else codec_numel
        return tap.call(op, numel, group_ops.get_world_size(group), tensor, self.codec_for(n),
                        n >= self.min_compress_numel, run)

    def _p2p_group(self, group, what: str):
        g = self._group(group)
        group_ops.require_registered(g, what)  # point to point needs a torch.distributed group
        return g

    def _probe_for(self, numel: int, group):
        """The armed probe when this call is compressed (the identity, and any collective of one rank, have no
        error to measure), else None."""
        probe = optional_probe(self.probe)
        if probe is None or not self.compresses(numel) or group_ops.is_object_group(group) \
                or group_ops.get_world_size(group) == 1:  # the probe's reference needs a torch.distributed group
            return None
        return probe

    @staticmethod
    def _probed(work, compare, delivered: torch.Tensor):
        """Compare ``delivered`` with the probe's exact result once the call finished (now, or at ``wait()``)."""
        if not compare:
            return work
        if work is None:  # synchronous: already delivered
            compare(delivered)
            return None
        return CompressedWork(lambda: (work.wait(), compare(delivered)))  # finishes once, then compares

    # -- checkpointing -------------------------------------------------------------------------------
    def state_dict(self, error_feedback: bool = True) -> dict[str, Any]:
        """Codec spec (for the compatibility check), error-feedback state (unless ``error_feedback=False``:
        an owner that saves it itself, as the sharded optimizer does) and the stochastic stream."""
        out = {"codec": self.codec.to_dict(),
               "generator": self.generator.get_state() if self.generator is not None else None}
        if error_feedback:
            out["error_feedback"] = self.error_feedback.state_dict() if self.error_feedback is not None else None
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError when the codec spec (seed aside) or the presence of
        error feedback differs: resuming with another compression setting must be a decision, not an accident."""
        saved = {k: v for k, v in state["codec"].items() if k != "seed"}
        mine = {k: v for k, v in self.codec.to_dict().items() if k != "seed"}
        if saved != mine:
            raise ValueError(f"channel {self.name!r}: state saved with codec {state['codec']}, this channel uses "
                             f"{self.codec.to_dict()}; resume with the same compression config")
        if "error_feedback" not in state:  # saved by its owner (state_dict(error_feedback=False))
            pass
        elif (state["error_feedback"] is None) != (self.error_feedback is None):
            raise ValueError(f"channel {self.name!r}: error feedback was {'off' if state['error_feedback'] is None else 'on'} "
                             f"when saved and is {'off' if self.error_feedback is None else 'on'} now")
        elif self.error_feedback is not None:
            self.error_feedback.load_state_dict(state["error_feedback"])
        if state.get("generator") is not None and self.generator is not None:
            self.generator.set_state(state["generator"])

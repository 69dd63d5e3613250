"""A traffic path over a group that spans nodes: each hop its own codec and error feedback (compress the slow hop).

A flat compressed reduce-scatter is an all-to-all of encoded chunks across every rank of the group, so a node of
m ranks sends its data across its slow link m times over. :class:`HierarchicalChannel` runs the same collectives as
plain stages on the hops of a megacomp.comm.hop_groups.HierarchicalGroup (fastest first), each stage an ordinary
:class:`Channel` on its subgroup with the hop's codec:

  reduce_scatter   reduce-scatter over each hop in turn, fastest first; the input's chunks are permuted first so
                   rank g still receives the reduction of chunk g (torch's order)
  all_gather       all-gather over the slowest hop (the codec: each rank's shard encoded once), then over each
                   faster hop (usually uncompressed), then chunks back into torch's order
  all_reduce       reduce-scatter over every hop but the slowest, all-reduce (compressed) over the slowest, then
                   all-gather back over the faster hops (the tensor padded to a multiple of their sizes)

Bytes leaving a node: for a reduce-scatter or all-gather of S bytes over N nodes, (N - 1) / N x S / r, where r is
the slow hop's compression ratio, whatever the ranks per node (the flat form: m times that, less the chunks that
stay on the node). Every stage is counted in ``comm.stats()`` under its own link kind: the slowest hop under the
call's tag (as a flat call over that link would be), each faster hop under ``tag@<link>``
(e.g. ``dp_gradient@intra_node``).

Error: only lossy hops add error. With an uncompressed fast hop, the slow hop quantizes each node's partial sum
(once per node) instead of each rank's tensor (once per rank): per element, the error of a reduce-scatter is at
most the sum over nodes of the codec's bound on that node's sum, e.g. block max |s_n| / (2 qmax) for int
codecs; all-reduce adds the bound of the reduced shard's re-encoding (more than two nodes), as the flat form
does. A node's sum has a larger scale than one rank's tensor (up to m times), but there are m times fewer of them.
Error feedback is per hop: the slowest hop keeps the keys a flat call would (``key + '/worker'``, ``'/server'``),
on the chunk it sends (1/P of the tensor, P = the faster hops' sizes multiplied); a lossy faster hop keeps
``key + '@<link>/worker'``. All hops share the channel's one ``ErrorFeedback`` object (one config; a residual per
hop and tensor), so whoever checkpoints it checkpoints every hop.

Compression off: a call whose message no hop compresses (identity codecs, or below ``min_compress_numel``) is the
torch.distributed collective on the whole group: bit-identical to it.

Failure behaviour: as :class:`Channel`; plus ValueError for a call on another group than the channel's, and for
per-hop settings that name a hop the group does not cross (megacomp.comm.hop_groups.hop_codecs).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed import ReduceOp

from .channel import Channel
from . import collectives
from .common import op_name
from .hop_groups import HierarchicalGroup, hop_codecs, residual_chunks
from .options import CommOptions
from .probe import ErrorProbe
from .stats import StatsTable


class HierarchicalChannel(Channel):
    """One traffic path over a :class:`HierarchicalGroup` (see the module docstring).

    Args:
        name: the stats tag (its slowest hop; faster hops add ``@<link>``) and default error-feedback key.
        codec: the path's setting: a codec (for the slowest hop; the faster ones travel uncompressed), a per-hop
            mapping (``{"inter_node": "int4", "intra_node": "bf16"}``) or a ``HopCodecs``.
        group: the ``HierarchicalGroup`` (megacomp.comm.hop_groups.new_hierarchical_group).
        error_feedback: as :class:`Channel`; it applies on every lossy hop, a residual per hop.
        min_compress_numel: as :class:`Channel` (the whole message decides; the stages then compress regardless).
        options: as :class:`Channel`.
        generator: as :class:`Channel` (one stream for every hop).
        stats: as :class:`Channel` (every hop records into it, under its link's tag).
        probe: as :class:`Channel`.

    ``codec`` (what owners read) is the slowest hop's codec; ``hop_codecs`` has every hop's.
    """

    def __init__(self, name: str, codec: Any = None, *, group: HierarchicalGroup, error_feedback: Any = None,
                 min_compress_numel: int = 0, options: Optional[CommOptions] = None,
                 generator: Optional[torch.Generator] = None, stats: Optional[StatsTable] = None,
                 probe: Optional[ErrorProbe] = None) -> None:
        if not isinstance(group, HierarchicalGroup):
            raise TypeError(f"megacomp channel {name!r}: HierarchicalChannel needs a HierarchicalGroup "
                            f"(megacomp.comm.new_hierarchical_group), got {type(group).__name__}")
        self.hierarchy = group
        self.hop_codecs = hop_codecs(codec, group.links, f"megacomp channel {name!r}")
        lossy = [c for c in self.hop_codecs.values() if not c.is_identity]
        slow = self.hop_codecs[group.slowest]
        # the error-feedback check of Channel.__init__ looks at a lossy hop when the slowest one is not
        super().__init__(name, slow if not slow.is_identity or not lossy else lossy[-1], group=group.group,
                         error_feedback=error_feedback, min_compress_numel=min_compress_numel, options=options,
                         generator=generator, stats=stats, probe=probe)
        self.codec = slow
        self._stages = [Channel(name, self.hop_codecs[h.link], group=h.group, options=self.options,
                                error_feedback=None if self.hop_codecs[h.link].is_identity else self.error_feedback,
                                generator=self.generator, stats=self.stats)
                        for h in group.hops]
        self._plain = self.uncompressed()

    def __repr__(self) -> str:
        ef = f", error_feedback={self.error_feedback.config}" if self.error_feedback is not None else ""
        hops = ", ".join(f"{link}: {c}" for link, c in self.hop_codecs.items())
        return f"HierarchicalChannel({self.name!r}, {{{hops}}}{ef}, min_compress_numel={self.min_compress_numel})"

    # -- policy -------------------------------------------------------------------------------------------
    @property
    def lossy(self) -> bool:
        """Whether some hop's codec loses information."""
        return any(not c.is_identity for c in self.hop_codecs.values())

    def compresses(self, numel: int) -> bool:
        """Whether a message of ``numel`` elements is compressed on some hop (not below the small-tensor rule)."""
        return self.lossy and numel >= self.min_compress_numel

    def set_codec(self, codec: Any) -> None:
        """The slowest hop sends later calls with ``codec`` (the faster hops keep theirs); residuals are kept
        (:meth:`Channel.set_codec`)."""
        self._stages[-1].set_codec(codec)
        self.codec = self._stages[-1].codec
        self.hop_codecs = {**self.hop_codecs, self.hierarchy.slowest: self.codec}

    def attach_meter(self, meter, link: str = "", switchable: bool = True) -> None:
        """Record every hop's stage under its own link kind (the slowest hop's calls follow the path's switches when
        ``switchable``), and the whole-group call of an uncompressed message under the slowest (``link`` is ignored:
        the hops name theirs)."""
        for h, stage in zip(self.hierarchy.hops, self._stages):
            stage.attach_meter(meter, h.link, switchable=switchable and h.link == self.hierarchy.slowest)
        self._plain.attach_meter(meter, self.hierarchy.slowest, switchable)

    def uncompressed(self) -> Channel:
        """The identity channel over the whole group (torch's collectives: bit-identical)."""
        return Channel(self.name, None, group=self.group, options=self.options, stats=self.stats, probe=self.probe)

    def without_error_feedback(self) -> "HierarchicalChannel":
        """The same hops and codecs without error feedback."""
        return HierarchicalChannel(self.name, dict(self.hop_codecs), group=self.hierarchy,
                                   min_compress_numel=self.min_compress_numel, options=self.options, stats=self.stats)

    def worker_numel(self, numel: int) -> int:
        """Elements of the slowest hop's worker residual for a reduce-scatter of ``numel`` elements (error feedback
        sits on the chunk that hop sends: 1/P of the tensor)."""
        return numel // self._faster_size()

    def init_residuals(self, key: str, numel: int, all_reduce: bool = False) -> None:
        """Zero residuals where none exist yet, per lossy hop: the slowest hop's ``key + '/worker'`` (and
        ``'/server'`` for an all-reduce over more than two nodes) on the chunk it sends, each lossy faster hop's
        ``key + '@<link>/worker'`` on the tensor that hop reduces."""
        if self.error_feedback is None:
            return
        faster = self._faster_size()
        size = -(-numel // faster) * faster if all_reduce else numel
        hops = self.hierarchy.hops
        for i, (h, ch) in enumerate(zip(hops, self._stages)):
            last = i == len(hops) - 1
            if not ch.codec.is_identity:
                ch.init_residuals(self._hop_key(key, h.link, last), size, all_reduce and last)
            size //= len(h.ranks)

    def residual_chunks(self, link: str) -> tuple[list[int], int]:
        """For a reduce-scatter, where this rank's residual of hop ``link`` sits: (the chunks, as group ranks in
        torch's order, its successive chunks cover; how many group ranks hold a residual over each). See
        megacomp.comm.hop_groups.residual_chunks; the keys are :meth:`residual_key`'s."""
        links = self.hierarchy.links
        if link not in links:
            raise ValueError(f"megacomp channel {self.name!r}: no {link} hop (its hops: {', '.join(links)})")
        return residual_chunks(self.hierarchy.positions, [len(h.ranks) for h in self.hierarchy.hops],
                               links.index(link), self.hierarchy.ranks.index(torch.distributed.get_rank()))

    def residual_key(self, key: str, link: str) -> str:
        """The error-feedback key of hop ``link``'s worker residual for messages keyed ``key``."""
        return self._hop_key(key, link, link == self.hierarchy.slowest) + "/worker"

    def _faster_size(self) -> int:
        size = 1
        for h in self.hierarchy.hops[:-1]:
            size *= len(h.ranks)
        return size

    def _check_group(self, group, what: str) -> None:
        if group is not None and group is not self.group:
            raise ValueError(f"megacomp channel {self.name!r} runs {what} over its hierarchical group "
                             f"{self.hierarchy}; it was called with another group: build a channel for that group")

    def _check_op(self, op) -> None:
        """Compressed stages sum (AVG divides at the end): any other op is refused, as the flat collectives do."""
        if op_name(op) not in ("SUM", "AVG"):
            raise ValueError(f"megacomp channel {self.name!r}: a compressed exchange supports ReduceOp SUM and AVG, got "
                             f"{op_name(op)}; use SUM or AVG, or an uncompressed codec")

    def _reduce_up(self, x: torch.Tensor, key: str, tag: str, check_finite: bool, validate) -> list:
        """``x`` reduce-scattered over every hop but the slowest, fastest first: [x, after hop 0, ...] (the last is
        what the slowest hop exchanges)."""
        chain = [x]
        for i, (h, ch) in enumerate(zip(self.hierarchy.hops[:-1], self._stages[:-1])):
            out = torch.empty(chain[-1].numel() // len(h.ranks), dtype=x.dtype, device=x.device)
            ch.reduce_scatter_tensor(out, chain[-1], key=self._hop_key(key, h.link, False),
                                     check_finite=check_finite and i == 0, tag=self._hop_tag(tag, h.link, False),
                                     validate=validate)
            chain.append(out)
        return chain

    @staticmethod
    def _hop_tag(tag: str, link: str, last: bool) -> str:
        return tag if last else f"{tag}@{link}"

    @staticmethod
    def _hop_key(key: str, link: str, last: bool) -> str:
        return key if last else f"{key}@{link}"

    # -- collectives --------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, *,
                   key: Optional[str] = None, check_finite: bool = False, tag: Optional[str] = None,
                   validate: Optional[bool] = None):
        """``torch.distributed.all_reduce`` (SUM/AVG), in place, over the hops (module docstring)."""
        self._check_group(group, "all_reduce")
        key, tag = key or self.name, tag or self.name
        if not self.compresses(tensor.numel()):
            return self._plain.all_reduce(tensor, op, async_op=async_op, key=key, check_finite=check_finite, tag=tag,
                                          validate=validate)
        self._check_op(op)
        hops, stages = self.hierarchy.hops, self._stages
        faster = self._faster_size()
        n = tensor.numel()
        flat = tensor.reshape(-1)
        x = torch.zeros(-(-n // faster) * faster, dtype=tensor.dtype, device=tensor.device)
        x[:n] = flat
        chain = self._reduce_up(x, key, tag, check_finite, validate)  # chain[i]: the input of hop i's stage
        work = stages[-1].all_reduce(chain[-1], key=key, tag=tag, validate=validate, async_op=True,
                                     check_finite=check_finite and len(hops) == 1)
        world = len(self.hierarchy.ranks)

        def finish() -> None:
            if work is not None:
                work.wait()
            with torch.no_grad():
                if op_name(op) == "AVG":
                    chain[-1].div_(world)
                for i in range(len(hops) - 2, -1, -1):  # back up, slowest-but-one hop first
                    stages[i].all_gather_into_tensor(chain[i], chain[i + 1],
                                                     tag=self._hop_tag(tag, hops[i].link, False), validate=validate)
                if chain[0].data_ptr() != flat.data_ptr():
                    tensor.copy_(chain[0][:n].view(tensor.shape))

        return collectives._handle(finish, async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                              async_op: bool = False, *, key: Optional[str] = None, check_finite: bool = False,
                              tag: Optional[str] = None, validate: Optional[bool] = None):
        """``torch.distributed.reduce_scatter_tensor`` over the hops: rank g receives the reduction of chunk g."""
        self._check_group(group, "reduce_scatter_tensor")
        key, tag = key or self.name, tag or self.name
        world, m = len(self.hierarchy.ranks), output.numel()
        if input.numel() != world * m or not self.compresses(input.numel()):
            return self._plain.reduce_scatter_tensor(output, input, op, async_op=async_op, key=key,
                                                     check_finite=check_finite, tag=tag, validate=validate)
        self._check_op(op)
        # chunks in hop order: position p holds the chunk of the rank the hops leave at p
        x = input.reshape(world, m).index_select(0, self.hierarchy.order(input.device)).reshape(-1)
        x = self._reduce_up(x, key, tag, check_finite, validate)[-1]
        dst = output if output.is_contiguous() else torch.empty(m, dtype=output.dtype, device=output.device)
        work = self._stages[-1].reduce_scatter_tensor(dst.view(-1), x, key=key, tag=tag, validate=validate, async_op=True)

        def finish() -> None:
            if work is not None:
                work.wait()
            with torch.no_grad():
                if op_name(op) == "AVG":
                    dst.div_(world)
                if dst is not output:
                    output.copy_(dst.view(output.shape))

        return collectives._handle(finish, async_op)

    def all_gather_into_tensor(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                               async_op: bool = False, *, check_finite: bool = False, tag: Optional[str] = None,
                               validate: Optional[bool] = None):
        """``torch.distributed.all_gather_into_tensor`` over the hops, slowest first (each shard encoded once)."""
        self._check_group(group, "all_gather_into_tensor")
        tag = tag or self.name
        world, m = len(self.hierarchy.ranks), input_tensor.numel()
        if output_tensor.numel() != world * m or not self.compresses(m):
            return self._plain.all_gather_into_tensor(output_tensor, input_tensor, async_op=async_op,
                                                      check_finite=check_finite, tag=tag, validate=validate)
        hops, stages = self.hierarchy.hops, self._stages
        sizes = [len(h.ranks) for h in hops]
        bufs = [input_tensor.reshape(-1)]
        for s in reversed(sizes):  # bufs[k]: after k stages, slowest first
            bufs.append(torch.empty(bufs[-1].numel() * s, dtype=input_tensor.dtype, device=input_tensor.device))
        work = stages[-1].all_gather_into_tensor(bufs[1], bufs[0], check_finite=check_finite, tag=tag,
                                                 validate=validate, async_op=True)

        def finish() -> None:
            if work is not None:
                work.wait()
            for k, i in enumerate(range(len(hops) - 2, -1, -1), start=1):
                stages[i].all_gather_into_tensor(bufs[k + 1], bufs[k], tag=self._hop_tag(tag, hops[i].link, False),
                                                 validate=validate)
            with torch.no_grad():
                out = output_tensor.view(world, m) if output_tensor.is_contiguous() else torch.empty(
                    world, m, dtype=output_tensor.dtype, device=output_tensor.device)
                out.index_copy_(0, self.hierarchy.order(out.device), bufs[-1].view(world, m))
                if out.data_ptr() != output_tensor.data_ptr() or not output_tensor.is_contiguous():
                    output_tensor.copy_(out.view(output_tensor.shape))

        return collectives._handle(finish, async_op)

    # -- checkpointing -------------------------------------------------------------------------------------
    def state_dict(self, error_feedback: bool = True) -> dict[str, Any]:
        """As :meth:`Channel.state_dict`, plus every hop's codec (for the compatibility check)."""
        out = super().state_dict(error_feedback)
        out["hop_codecs"] = {link: c.to_dict() for link, c in self.hop_codecs.items()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ValueError when a hop's codec differs from the saved one."""
        saved = state.get("hop_codecs")
        mine = {link: c.to_dict() for link, c in self.hop_codecs.items()}
        strip = lambda d: {k: {f: v for f, v in c.items() if f != "seed"} for k, c in d.items()}  # noqa: E731
        if saved is not None and strip(saved) != strip(mine):
            raise ValueError(f"channel {self.name!r}: state saved with per-hop codecs {saved}, this channel uses {mine}; "
                             f"resume with the same compression config")
        super().load_state_dict(state)


"""megacomp's codecs inside PyTorch FSDP2 (``fully_shard``): compressed gradient reduce-scatter and
parameter all-gather, with error feedback per FSDP unit, flat or hop by hop across nodes.

    from torch.distributed.fsdp import fully_shard
    from megacomp.integrations.fsdp import FSDPCompression
    from megacomp.placement import detect_topology
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    comp = FSDPCompression({"dp_gradient": "int4", "dp_gradient_error_feedback": "loco",
                            "dp_parameter": "int8"}, topology=detect_topology()).apply(model)
    ...                                                  # train as usual
    dcp.save({"model": ..., "optim": ..., "megacomp": comp}, checkpoint_id=path)   # comp is a Stateful

How: FSDP2 (torch 2.13) lets a module replace its collectives (``FSDPModule.set_custom_reduce_scatter`` /
``set_custom_all_gather`` taking a ``ReduceScatter`` / ``AllGather`` from
``torch.distributed.fsdp._fully_shard._fsdp_api``). :meth:`FSDPCompression.apply` gives every FSDP unit
under the model (each module ``fully_shard`` was called on) its own :class:`CompressedReduceScatter` on
the ``dp_gradient`` channel and :class:`CompressedAllGather` on the ``dp_parameter`` channel:

- reduce-scatter: FSDP's flat, padded gradient buffer of the unit goes through megacomp's compressed
  reduce-scatter (encode each destination chunk, all-to-all, fp32 sum of the decoded chunks; ``op`` AVG
  or SUM as FSDP asks); error feedback (EF or LoCo) keyed by the unit's module name, one residual of the
  whole buffer per rank (the buffer's layout is fixed for a unit, so the residual meets the same
  elements every step). Error bound per element: the sum over ranks of the codec's bound on each rank's
  compensated chunk (megacomp.comm.collectives).
- all-gather: each rank's flat parameter shard is encoded once and every rank decodes all shards, so the
  unsharded parameters used in forward/backward are the codec's reconstruction (bound: the codec's, per
  shard); the sharded fp32 parameters the optimizer updates stay exact (the qwZ idea of ZeRO++).
- Messages below ``min_compress_numel`` and identity codecs call exactly the torch.distributed functions
  FSDP's defaults call, so with compression off training is bit-identical to stock FSDP2 (tested).
- A lossy all-gather completes inside the call (FSDP only waits on a ``dist.Work``), so it does not
  overlap the previous unit's compute; an uncompressed one keeps FSDP's async behaviour.

Across nodes (``topology``, a megacomp.placement.Topology): a flat compressed reduce-scatter over a shard group
of m ranks on each of N nodes sends each node's gradients across its slow link m times over. Given the topology,
:meth:`FSDPCompression.apply` builds, once per FSDP shard group that has several of its ranks on each of several
nodes, a megacomp.comm.HierarchicalGroup over that very ProcessGroup (megacomp.comm.new_hierarchical_group: a
collective over the default group, so every rank calls ``apply`` on the same model) and runs that group's units
on megacomp.comm.HierarchicalChannel objects: reduce-scatter inside the node uncompressed, then across nodes with the
codec (each node's partial sum quantized once); all-gather across nodes with the codec (each shard encoded once),
then inside the node; rank g still receives chunk g. The slow link then carries (N - 1) / N of a buffer's
encoded bytes per node, whatever m (the flat form: m times that, less the chunks that stay on the node). A codec
per link kind (``{"inter_node": "int4", "intra_node": "bf16"}``) is accepted with a topology. Stats: the slow hop
under ``dp_gradient`` / ``dp_parameter``, the fast hop under ``dp_gradient@intra_node`` /
``dp_parameter@intra_node``. Error feedback is per unit and hop: the slow hop's residual ``fsdp/<unit>/worker``
sits on the chunk it sends (1/m of the buffer; ``fsdp/<unit>@intra_node/worker`` for a lossy fast hop). Shard
groups inside one node, or of one rank per node, stay flat (their one link's codec). A collective FSDP calls on
another group than the one ``apply`` saw (``reshard_after_forward=<int>``'s post-forward group,
``set_separate_reduce_scatter_group``) runs flat on that group.

Traffic is counted under ``dp_gradient`` and ``dp_parameter`` in ``megacomp.comm.stats()``.

Checkpointing: an ``FSDPCompression`` is a DCP ``Stateful``; its state (each rank's error-feedback
residuals and stochastic-rounding streams, per hop) is one entry per rank (``rank<r>``), so DCP keeps every rank's
own copy, and resuming continues bit for bit (tested, flat and hop by hop). Loading refuses another world size,
codec or exchange layout (flat against hop by hop, other hops).

HSDP (replicate across nodes, shard within) is not what this compresses. torch 2.13's ``foreach_reduce``
(``_fsdp_collectives.py``) issues HSDP's replicate-dim all-reduce with ``dist.all_reduce`` directly;
``FSDPModule.set_all_reduce_hook`` exists but runs *after* that all-reduce under HSDP (on a 1-D FSDP unit it runs
after the reduce-scatter), and ``set_requires_all_reduce(False)`` skips the all-reduce and the hook together, so the
replicate all-reduce cannot be replaced. Hence: a lossy ``dp_gradient`` on an HSDP unit raises ValueError (its
shard-group all-gather may be lossy). Also not covered: FSDP units with several parameter groups
(``shard_placement_fn`` with per-parameter meshes: torch refuses custom comms there; re-raised as ValueError
naming the unit), and ``ReduceOp.PREMUL_SUM`` (``set_gradient_divide_factor``) under a lossy codec (ValueError).
"""
from __future__ import annotations

import io
from dataclasses import replace
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

from ..comm import Channel, HierarchicalChannel, HierarchicalGroup, HopCodecs, hop_codecs, new_hierarchical_group
from ..comm.common import op_name
from ..compression import Codec
from ..config import TRAFFIC_PATHS, CommCompressionConfig
from ..placement import LINKS, Topology, check_topology

_DP_PATHS = ("dp_gradient", "dp_parameter")


class _PlainAlloc:
    """FSDP's ``Comm.allocate`` as its default: a plain temporary buffer per call."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain temporary buffer (as FSDP's default)."""
        return torch.empty(*size, dtype=dtype, device=device)


def _route(channel: Channel, fallback: Any, group, tag: str) -> tuple[Channel, str]:
    """The channel and stats tag of a call on ``group``: a hierarchical channel runs only on its own group; FSDP's
    calls on another one (a post-forward reshard group, a separate reduce-scatter group) go to the flat
    ``fallback`` (a channel, or a function of the group returning the channel and the tag)."""
    if isinstance(channel, HierarchicalChannel) and fallback is not None and group is not channel.group:
        return (fallback, tag) if isinstance(fallback, Channel) else fallback(group)
    return channel, tag


class CompressedReduceScatter(_PlainAlloc, ReduceScatter):
    """FSDP2's gradient reduce-scatter on a megacomp channel; error feedback under key ``key``.

    Args:
        channel: the ``dp_gradient`` channel (a ``Channel``, or a ``HierarchicalChannel`` over FSDP's shard group).
        key: the error-feedback key (``fsdp/<unit>``).
        fallback: for a hierarchical ``channel``, the flat channel of calls on another group, or a function of
            that group returning (channel, stats tag) (None: such calls raise the channel's ValueError).
    """

    def __init__(self, channel: Channel, key: str, fallback: Any = None) -> None:
        self.channel, self.key, self.fallback = channel, key, fallback

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        ch, tag = _route(self.channel, self.fallback, group, "dp_gradient")
        if (isinstance(ch, HierarchicalChannel) and ch.compresses(input_tensor.numel())
                and op_name(op) not in ("SUM", "AVG")):  # the flat channel refuses these itself
            raise ValueError(f"megacomp FSDP reduce-scatter: codec {ch.codec} supports ReduceOp SUM and AVG, got "
                             f"{op_name(op)} (set_gradient_divide_factor?); drop the factor or set dp_gradient to none")
        return ch.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op,
                                        key=self.key, tag=tag)


class CompressedAllGather(_PlainAlloc, AllGather):
    """FSDP2's parameter all-gather on a megacomp channel (no error feedback: nothing is summed).

    Args:
        channel: the ``dp_parameter`` channel (a ``Channel``, or a ``HierarchicalChannel`` over FSDP's shard group).
        fallback: for a hierarchical ``channel``, the flat channel of calls on another group, or a function of
            that group returning (channel, stats tag) (None: such calls raise the channel's ValueError).
    """

    def __init__(self, channel: Channel, fallback: Any = None) -> None:
        self.channel, self.fallback = channel, fallback

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        ch, tag = _route(self.channel, self.fallback, group, "dp_parameter")
        # FSDP waits only on a dist.Work: a compressed gather (whose handle decodes on wait) finishes here
        async_op = async_op and not ch.compresses(input_tensor.numel())
        return ch.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op, tag=tag)


def _is_hsdp(module: FSDPModule) -> bool:
    state = module._get_fsdp_state()
    # HSDP / replicate units carry a DDPMeshInfo (HSDPMeshInfo subclasses it): FSDP all-reduces their shards
    return any(isinstance(g.mesh_info, DDPMeshInfo) for g in state._fsdp_param_groups)


def _shard_groups(module: FSDPModule) -> tuple[Any, Any]:
    """The process groups FSDP passes to a unit's reduce-scatter and all-gather (None, None: no sharded group)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) != 1 or not isinstance(groups[0].mesh_info, FSDPMeshInfo):
        return None, None
    info = groups[0].mesh_info
    return info.reduce_scatter_process_group or info.shard_process_group, info.shard_process_group


def _check_topology(topology: Any) -> Optional[Topology]:
    if topology is None:
        return None
    return check_topology(topology, dist.get_world_size() if dist.is_initialized() else topology.world
                          if isinstance(topology, Topology) else 0, "FSDPCompression")


def _describe(h: HierarchicalGroup) -> str:
    return f"hop by hop over ranks {list(h.ranks)}: " + " -> ".join(f"{x.link} {list(x.ranks)}" for x in h.hops)


class FSDPCompression:
    """Compressed FSDP2 communication from a ``CommCompressionConfig`` (see the module docstring).

    Args:
        config: a ``CommCompressionConfig`` or its mapping; ``dp_gradient`` (+ ``dp_gradient_error_feedback``),
            ``dp_parameter`` and ``min_compress_numel`` apply (PowerSGD/Accordion are not FSDP codecs). With a
            ``topology``, ``dp_gradient`` / ``dp_parameter`` may set a codec per link kind.
        topology: where every rank sits (megacomp.placement.Topology: ``detect_topology()``, or
            ``Topology.uniform(world, ranks_per_node)`` by hand), or None (flat collectives on every unit). With it,
            the units whose FSDP shard group has several ranks on each of several nodes exchange hop by hop (module
            docstring); others stay flat.

    Raises:
        ValueError: lossy codecs on TP/PP paths (FSDP has none), PowerSGD or Accordion settings,
            ``dp_gradient_warmup_steps`` (FSDP has no step counter to switch on), a codec per link kind without a
            topology, or a topology that is not a ``Topology`` or places another number of ranks than the job's.
    """

    def __init__(self, config: Union[CommCompressionConfig, Mapping[str, Any], None] = None,
                 topology: Optional[Topology] = None) -> None:
        if not isinstance(config, CommCompressionConfig):
            config = CommCompressionConfig.from_dict(config)
        other = [p for p in TRAFFIC_PATHS if p not in _DP_PATHS and not getattr(config, p).is_identity]
        if other:
            raise ValueError(f"FSDP integration: {other} are not FSDP traffic (FSDP has a gradient reduce-scatter "
                             f"and a parameter all-gather); set them to none")
        self.topology = _check_topology(topology)
        per_hop = [p for p in _DP_PATHS if isinstance(getattr(config, p), HopCodecs)]
        if per_hop and self.topology is None:
            raise ValueError(f"FSDP integration: {', '.join(per_hop)} sets a codec per link kind, which needs the "
                             f"cluster's topology; pass FSDPCompression(config, topology=detect_topology()) or give "
                             f"the path one codec")
        if not isinstance(config.dp_gradient, (Codec, HopCodecs)):
            raise ValueError("FSDP integration: dp_gradient must be an element-wise codec (PowerSGD and Accordion "
                             "work in megacomp's DDP hook and sharded optimizer, not in FSDP's flat buffers)")
        if config.dp_gradient_warmup_steps:
            raise ValueError("FSDP integration: dp_gradient_warmup_steps is not supported (FSDP has no step "
                             "counter); set it to 0")
        self.config = config
        self._ranked = config.for_rank(dist.get_rank()) if dist.is_initialized() else config
        # the flat channels (group given per call); a per-hop setting puts its slowest lossy codec here and builds
        # the flat channel of each link a shard group crosses in apply()
        flat = replace(self._ranked, **{p: ([c for _, c in getattr(self._ranked, p).codecs if not c.is_identity]
                                            or [getattr(self._ranked, p).slowest])[-1] for p in per_hop})
        self.channels = flat.build_channels()
        self.units: dict[str, FSDPModule] = {}
        self.unit_channels: dict[str, tuple[Channel, Channel]] = {}
        """Per unit, the (dp_gradient, dp_parameter) channels its collectives run on (after :meth:`apply`)."""
        self.hierarchies: list[HierarchicalGroup] = []
        """The hop-by-hop groups built by :meth:`apply` (this rank's view), one per FSDP shard group spanning nodes."""
        self._exchanges: dict[str, dict[str, Channel]] = {}  # layout description -> channel per path (checkpointed)

    # -- building ----------------------------------------------------------------------------------------
    def _per_hop(self) -> list[str]:
        return [p for p in _DP_PATHS if isinstance(getattr(self._ranked, p), HopCodecs)]

    def _link(self, pg) -> Optional[str]:
        """The one link kind a flat exchange over ``pg`` crosses (None: no topology)."""
        if self.topology is None or pg is None:
            return None
        return self.topology.slowest_link(dist.get_process_group_ranks(pg))

    def _flat(self, link: Optional[str]) -> dict[str, Channel]:
        """The flat channels of a group crossing ``link``: the default ones, or under a per-hop setting that link's
        codec (built once per link, checkpointed)."""
        if link is None or not self._per_hop():
            return {p: getattr(self.channels, p) for p in _DP_PATHS}
        name = f"flat over {link}"
        if name not in self._exchanges:
            opts = self._ranked.options()
            chans = {}
            for p in _DP_PATHS:
                spec = getattr(self._ranked, p)
                codec = spec.get(link) if isinstance(spec, HopCodecs) else spec
                ef = getattr(self._ranked, p + "_error_feedback", None)  # on lossy hops only, as hop by hop
                chans[p] = self._ranked.channel(p, codec, options=opts, error_feedback=ef if (
                    not isinstance(spec, HopCodecs) or not codec.is_identity) else None)
            self._exchanges[name] = chans
        return self._exchanges[name]

    def _fallback(self, path: str, channel: Channel):
        """What ``channel``'s calls on another group than its own run on, for a hierarchical one (module docstring):
        that group's flat channel, tagged ``path@<link>`` when its link is faster than ``channel``'s slowest hop."""
        if not isinstance(channel, HierarchicalChannel):
            return None
        slowest = channel.hierarchy.slowest

        def flat(group) -> tuple[Channel, str]:
            link = self._link(group)
            return self._flat(link)[path], path if link in (None, slowest) else f"{path}@{link}"

        return flat

    def _hierarchies(self, pgs: list) -> dict[int, HierarchicalGroup]:
        """A HierarchicalGroup per process group of ``pgs`` (this rank's distinct shard groups, in the units' order)
        that spans nodes with several ranks on each; a collective over the default group."""
        mine = [dist.get_process_group_ranks(pg) for pg in pgs]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if len({len(x) for x in everyone}) != 1:
            raise ValueError(f"FSDPCompression.apply: the ranks' FSDP units use different numbers of shard groups "
                             f"({[len(x) for x in everyone]} by rank); call fully_shard alike on every rank")
        out = {}
        for i, pg in enumerate(pgs):
            groups: list[list[int]] = []
            for lists in everyone:
                if lists[i] not in groups:
                    groups.append(lists[i])
            for ranks in groups:  # every group checked before any subgroup is created (same error on every rank)
                try:
                    self.topology.hops(ranks)
                except ValueError as e:
                    raise ValueError(f"FSDPCompression: FSDP shard group {ranks} cannot exchange hop by hop over "
                                     f"{self.topology.describe()}: {e} (for FSDP: topology=None)") from None
            h = new_hierarchical_group(self.topology, groups, group=pg)
            if h is not None and list(h.ranks) != mine[i]:
                raise ValueError(f"FSDPCompression.apply: FSDP shard groups overlap across ranks ({groups}); a "
                                 f"hop-by-hop exchange needs the ranks split into disjoint shard groups")
            if h is not None:
                out[id(pg)] = h
        return out

    def _channels_for(self, pg, hier: dict[int, HierarchicalGroup]) -> dict[str, Channel]:
        """The channels of the units whose collectives run on ``pg``."""
        h = hier.get(id(pg))
        if h is None:
            link = self._link(pg)
            for p in self._per_hop() if link is not None else ():  # a flat group: the setting may name only its link
                hop_codecs(getattr(self._ranked, p), (link,), f"{p} (FSDP shard group "
                                                               f"{dist.get_process_group_ranks(pg)})")
            return self._flat(link)
        name = _describe(h)
        while name in self._exchanges and self._exchanges[name]["dp_gradient"].group is not pg:
            name += " (another process group)"  # e.g. a separate reduce-scatter group over the same ranks
        if name not in self._exchanges:
            opts = self._ranked.options()
            self._exchanges[name] = {p: self._ranked.channel(p, getattr(self._ranked, p), group=h, options=opts,
                                                             error_feedback=getattr(self._ranked, p + "_error_feedback",
                                                                                    None))
                                     for p in _DP_PATHS}
            self.hierarchies.append(h)
        return self._exchanges[name]

    def apply(self, model: torch.nn.Module) -> "FSDPCompression":
        """Install the compressed collectives on every FSDP unit of ``model`` (including ``model`` itself). With a
        topology, a collective over the default group (every rank calls it on the same model, in the same order
        as its other group creations).

        Raises:
            ValueError: no FSDP unit (call ``fully_shard`` first), a unit with several parameter groups, a lossy
                dp_gradient on an HSDP unit, a shard group that sits unevenly over the topology's nodes, or a
                per-hop setting naming a hop a shard group does not cross.
        """
        found = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        if not found:
            raise ValueError("FSDPCompression.apply: the model has no FSDP unit; call fully_shard on its blocks and "
                             "on the model first")
        for name, module in found:
            if len(module._get_fsdp_state()._fsdp_param_groups) > 1:
                raise ValueError(f"FSDP unit {name!r}: torch refuses custom collectives with several parameter groups; "
                                 f"megacomp's FSDP compression needs one parameter group per unit (no per-parameter "
                                 f"meshes from shard_placement_fn)")
        groups = {name: _shard_groups(m) for name, m in found}
        hier: dict[int, HierarchicalGroup] = {}
        if self.topology is not None:
            pgs: list = []
            for pair in groups.values():
                for pg in pair:
                    if pg is not None and all(pg is not q for q in pgs):
                        pgs.append(pg)
            hier = self._hierarchies(pgs)
            if hier and self._per_hop():  # every link's flat channel, for calls on other groups (checkpointed)
                world = self.topology.slowest_link(range(self.topology.world))
                for link in LINKS[:LINKS.index(world) + 1]:
                    self._flat(link)
        for name, module in found:
            rs_pg, ag_pg = groups[name]
            g = self._channels_for(rs_pg, hier)["dp_gradient"]
            p = self._channels_for(ag_pg, hier)["dp_parameter"]
            if (g.lossy or self.channels.dp_gradient.lossy) and _is_hsdp(module):
                raise ValueError(f"FSDP unit {name!r} is HSDP: its replicate-dim all-reduce is not compressible "
                                 f"here (torch 2.13 calls dist.all_reduce directly); use 1-D FSDP or set dp_gradient "
                                 f"to none")
            try:
                module.set_custom_reduce_scatter(CompressedReduceScatter(g, f"fsdp/{name}",
                                                                         self._fallback("dp_gradient", g)))
                module.set_custom_all_gather(CompressedAllGather(p, self._fallback("dp_parameter", p)))
            except ValueError as e:
                raise ValueError(f"FSDP unit {name!r}: torch refuses custom collectives here ({e}); megacomp's "
                                 f"FSDP compression needs one parameter group per unit (no per-parameter "
                                 f"meshes from shard_placement_fn)") from e
            self.units[name] = module
            self.unit_channels[name] = (g, p)
        return self

    # -- checkpointing (DCP Stateful) ------------------------------------------------------------------
    def _mine(self) -> dict[str, Any]:
        return {"world": dist.get_world_size(), "units": sorted(self.units),
                "channels": {p: getattr(self.channels, p).state_dict() for p in _DP_PATHS},
                "exchanges": {name: {p: ch.state_dict() for p, ch in chans.items()}
                              for name, chans in self._exchanges.items()}}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as one opaque entry ``rank<r>`` (DCP would deduplicate a plain tensor entry that
        every rank holds under the same name, keeping one rank's residuals only)."""
        buf = io.BytesIO()
        torch.save(self._mine(), buf)
        return {f"rank{dist.get_rank()}": buf.getvalue()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's entry. ValueError: no entry for this rank, another world size, other FSDP
        units, another codec, or another exchange layout (flat against hop by hop, other hops)."""
        key = f"rank{dist.get_rank()}"
        if key not in state:
            raise ValueError(f"FSDPCompression: the checkpoint has no state for {key} (saved with another world size?)")
        blob = state[key]
        saved = torch.load(io.BytesIO(blob), weights_only=True) if isinstance(blob, (bytes, bytearray)) else blob
        if saved["world"] != dist.get_world_size():
            raise ValueError(f"FSDPCompression: saved with {saved['world']} ranks, running with "
                             f"{dist.get_world_size()}; error-feedback residuals do not reshard")
        if saved["units"] != sorted(self.units):
            raise ValueError(f"FSDPCompression: saved for FSDP units {saved['units']}, this model has "
                             f"{sorted(self.units)}; call apply(model) on the same model before loading")
        exchanges = saved.get("exchanges", {})
        if sorted(exchanges) != sorted(self._exchanges):
            said = lambda names: "; ".join(sorted(names)) or "flat collectives only"  # noqa: E731
            raise ValueError(f"FSDPCompression: saved with {said(exchanges)}, this run has {said(self._exchanges)}; "
                             f"resume with the same topology (error-feedback residuals sit on what each hop sends)")
        for p in _DP_PATHS:
            getattr(self.channels, p).load_state_dict(saved["channels"][p])
        for name, chans in self._exchanges.items():
            for p, ch in chans.items():
                ch.load_state_dict(exchanges[name][p])

    def __repr__(self) -> str:
        hops = f", hop by hop: {self.hierarchies}" if self.hierarchies else ""
        return (f"FSDPCompression(dp_gradient={self.channels.dp_gradient.codec}, "
                f"dp_parameter={self.channels.dp_parameter.codec}, units={len(self.units)}{hops})")

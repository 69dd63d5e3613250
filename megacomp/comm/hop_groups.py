"""The hops of a group that spans nodes (or sites), as process groups, and a codec per hop.

:class:`HierarchicalGroup` is what a hierarchical channel (megacomp.comm.hierarchical) runs on: the whole group
(for uncompressed, bit-identical calls) and, fastest link first, this rank's subgroup on each hop (from
megacomp.placement.Topology.hops): e.g. its node's ranks (``intra_node``) and the ranks with its local index on the
other nodes (``inter_node``). :func:`new_hierarchical_group` builds them; like torch's ``new_group`` it is a
collective over the default group (every rank creates every subgroup, in the same order).

:class:`HopCodecs` is a codec per link kind (``{inter_node: {name: int4, block_size: 128}, intra_node: bf16}``);
:func:`hop_codecs` reads a path's setting into one for the hops a group has: a plain codec means "on the slowest
hop the group crosses, nothing on the faster ones".

Failure behaviour: ValueError (one line) for a per-hop setting naming a link kind that is not one, or a hop the
group does not cross (naming the hops it has), and as megacomp.placement.Topology.hops for uneven groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..compression import Codec, make_codec, parse_codec_arg
from ..placement import LINKS, Topology


@dataclass(frozen=True)
class Hop:
    """One hop of a hierarchical exchange, as seen by this rank."""

    link: str
    """Its link kind (megacomp.placement.LINKS)."""
    group: Any
    """This rank's subgroup on it (a torch.distributed process group)."""
    ranks: tuple[int, ...]
    """The subgroup's global ranks, in its rank order."""


@dataclass
class HierarchicalGroup:
    """A group whose traffic crosses several link kinds, with this rank's subgroup per hop (fastest first).

    A hierarchical reduce-scatter leaves rank ``g`` (its index in ``ranks``) with the chunk at ``positions[g]`` of
    the hop order (reduce-scatter over the fastest hop first, then each slower one); the channel permutes chunks so
    callers see torch's order (rank g receives chunk g)."""

    group: Any
    """The whole group (torch.distributed process group; None: the default group)."""
    ranks: tuple[int, ...]
    """Its global ranks, in group-rank order."""
    hops: tuple[Hop, ...]
    """This rank's subgroup per hop, fastest link first (at least two)."""
    positions: tuple[int, ...] = field(default=())
    """Per group rank, the index of the chunk a hierarchical reduce-scatter leaves it (see the class docstring)."""

    @property
    def links(self) -> tuple[str, ...]:
        """The hops' link kinds, fastest first."""
        return tuple(h.link for h in self.hops)

    @property
    def slowest(self) -> str:
        """The slowest link kind the group crosses."""
        return self.hops[-1].link

    def order(self, device=None) -> torch.Tensor:
        """Group ranks in hop order: ``order[p]`` is the group rank whose chunk sits at position ``p``."""
        out = [0] * len(self.positions)
        for g, p in enumerate(self.positions):
            out[p] = g
        return torch.tensor(out, dtype=torch.long, device=device)

    def __repr__(self) -> str:
        return (f"HierarchicalGroup({len(self.ranks)} ranks: "
                + " -> ".join(f"{h.link} x{len(h.ranks)}" for h in self.hops) + ")")


def hop_positions(layout: list[tuple[str, list[list[int]]]], ranks: Sequence[int]) -> tuple[int, ...]:
    """Per group rank (index into ``ranks``), the chunk a hierarchical reduce-scatter over ``layout``
    (Topology.hops) leaves it: sum over hops of (index in that hop's subgroup) x (product of the slower hops' sizes)."""
    index = [{r: i for sub in subs for i, r in enumerate(sub)} for _, subs in layout]
    sizes = [len(subs[0]) for _, subs in layout]
    out = []
    for r in ranks:
        pos = 0
        for idx, size in zip(index, sizes):
            pos = pos * size + idx[r]
        out.append(pos)
    return tuple(out)


def residual_chunks(positions: Sequence[int], sizes: Sequence[int], hop: int, rank: int) -> tuple[list[int], int]:
    """Where a hop's error-feedback residual sits: for group rank ``rank`` of a hierarchical reduce-scatter over hops
    of ``sizes`` (fastest first) with chunk ``positions`` (:attr:`HierarchicalGroup.positions`), the residual of hop
    ``hop`` lies on that hop's input: after the faster hops, the run of hop-order positions that share the rank's
    digits on those hops. Returns (the group ranks' chunk indices, in torch's order, that the residual's successive
    chunks cover; how many group ranks hold a residual over each of them). A flat exchange is ``sizes = [D]``,
    ``positions = range(D)``: every chunk, held by all D ranks."""
    span = 1
    for s in sizes[hop:]:
        span *= s
    order = [0] * len(positions)
    for g, p in enumerate(positions):
        order[p] = g
    start = positions[rank] // span * span
    return order[start:start + span], span


def new_hierarchical_group(topology: Topology, groups: Sequence[Sequence[int]], group=None,
                           timeout=None) -> Optional[HierarchicalGroup]:
    """This rank's :class:`HierarchicalGroup` for the one of ``groups`` (lists of global ranks, e.g. every DP
    group of the layout) it belongs to; ``group`` is that group's existing process group (None: the default group).

    A collective over the default group: every rank calls it with the same ``groups`` and creates every hop's
    subgroups of every group, in the same order (torch.distributed requires it). Returns None when this rank's
    group crosses a single link kind (all its ranks on one node, or one rank per node): flat collectives are right
    there. Subgroups take ``timeout`` (None: torch's default for new groups).

    Raises:
        ValueError: a group that sits unevenly over nodes or sites (megacomp.placement.Topology.hops)."""
    me = dist.get_rank()
    mine = None
    layouts = [topology.hops(list(ranks)) for ranks in groups]  # every group checked before any subgroup exists
    for ranks, layout in zip(groups, layouts):
        found = []
        for link, subs in layout if len(layout) > 1 else ():
            for sub in subs:
                kw = {"timeout": timeout} if timeout is not None else {}
                pg = dist.new_group(list(sub), **kw)
                if me in sub:
                    found.append(Hop(link, pg, tuple(sub)))
        if me in ranks and len(layout) > 1:
            mine = HierarchicalGroup(group, tuple(ranks), tuple(found), hop_positions(layout, ranks))
    return mine


# -- a codec per hop -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HopCodecs:
    """A codec per link kind for one traffic path (links not named travel uncompressed)."""

    codecs: tuple[tuple[str, Codec], ...]
    """(link kind, codec) pairs in LINKS order."""

    def get(self, link: str) -> Codec:
        """The codec of ``link`` (the identity when not named)."""
        return dict(self.codecs).get(link, make_codec(None))

    @property
    def is_identity(self) -> bool:
        """Whether every hop travels uncompressed."""
        return all(c.is_identity for _, c in self.codecs)

    @property
    def slowest(self) -> Codec:
        """The codec of the slowest link kind named (what a flat exchange over that link would use)."""
        return self.codecs[-1][1] if self.codecs else make_codec(None)

    def to_dict(self) -> dict:
        """``{link: codec dict or None}``: what YAML writes."""
        return {link: (None if c.is_identity else c.to_dict()) for link, c in self.codecs}

    def __str__(self) -> str:
        return ", ".join(f"{link.replace('_', '-')} {c}" for link, c in self.codecs)


def is_hop_mapping(spec: Any) -> bool:
    """Whether a path's setting is a per-hop mapping (a mapping whose keys are all link kinds)."""
    return isinstance(spec, Mapping) and bool(spec) and all(k in LINKS for k in spec)


def make_hop_codecs(spec: Any, path: str = "codec") -> HopCodecs:
    """A :class:`HopCodecs` from ``{link: codec setting}`` (or a HopCodecs). Raises ValueError for keys that are not
    link kinds, naming them."""
    if isinstance(spec, HopCodecs):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"{path}: a per-hop setting is a mapping from link kind ({', '.join(LINKS)}) to codec, "
                         f"got {spec!r}")
    bad = [k for k in spec if k not in LINKS]
    if bad:
        raise ValueError(f"{path}: {bad} are not link kinds; a per-hop setting maps {', '.join(LINKS)} to codecs "
                         f"(e.g. {{inter_node: int4, intra_node: none}})")
    return HopCodecs(tuple((link, make_codec(parse_codec_arg(spec[link]))) for link in LINKS if link in spec))


def hop_codecs(spec: Any, links: Sequence[str], path: str = "codec") -> dict[str, Codec]:
    """The codec of each of ``links`` (a group's hops, fastest first) for a path's setting ``spec``: a plain codec
    (or None) goes on the slowest hop, the identity on the others; a per-hop setting gives each named hop its codec.

    Raises:
        ValueError: a per-hop setting naming a link the group does not cross (one line naming the hops it has)."""
    if isinstance(spec, HopCodecs) or is_hop_mapping(spec):
        per = make_hop_codecs(spec, path)
        extra = [link for link, c in per.codecs if link not in links and not c.is_identity]
        if extra:
            raise ValueError(f"{path}: a codec is set for the {', '.join(extra)} hop, which this group does not cross "
                             f"(its hops: {', '.join(links) or 'none'}); drop that entry or set the path's codec for "
                             f"{links[-1] if links else 'its link'}")
        return {link: per.get(link) for link in links}
    codec = make_codec(spec)
    return {link: (codec if i == len(links) - 1 else make_codec(None)) for i, link in enumerate(links)}

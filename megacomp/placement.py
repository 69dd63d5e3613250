"""Where every rank sits: its node and its site (:class:`Topology`), and the hops a group's traffic takes.

A cluster has tiers of links: ranks of one node share a fast one (NVLink, PCIe; loopback inside a network
namespace), nodes of one site share a slower one (the node's NIC), sites share the slowest (a WAN). The link
kinds, fastest first, are ``intra_node``, ``inter_node`` and ``inter_site`` (megacomp.plan.cluster.TIERS).

Found once per job (:func:`detect_topology`, a collective over the default group) from what the launcher says,
in this order, per rank:

  torchrun          ``GROUP_RANK`` (the node's index) and ``LOCAL_WORLD_SIZE``
  Slurm             ``SLURM_NODEID`` and ``SLURM_NTASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` (first entry)
  Open MPI, MPICH   the host name, with ``OMPI_COMM_WORLD_LOCAL_SIZE`` / ``MPI_LOCALNRANKS`` as the ranks per node
  nothing           the host name

``ranks_per_node`` overrides it (ranks r * k ... r * k + k - 1 on node r): for launchers that say nothing useful,
or network-namespace clusters whose namespaces share one host name. An override that contradicts what a
launcher said (not a host name) is refused. Launchers do not know sites: ``nodes_per_site`` sets them (nodes
n * s ... n * s + s - 1 in site n; 0 = one site).

:meth:`Topology.hops` turns a group's ranks into the hops of a hierarchical exchange (megacomp.comm.hop_groups):
per link kind, fastest first, the subgroups of ranks that exchange over it. It needs every node the group touches
to hold the same number of its ranks (and every site the same number of its nodes): a group that is uneven is
refused in one line naming the fix.

Failure behaviour: ValueError (one line, naming the setting and the fix) for a ``ranks_per_node`` that does not
divide the world or contradicts the launcher, a launcher whose ranks-per-node claim disagrees with the ranks it
placed, a ``nodes_per_site`` that does not divide the nodes, and uneven groups in :meth:`Topology.hops`.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

LINKS = ("intra_node", "inter_node", "inter_site")
"""Link kinds, fastest first."""


@dataclass(frozen=True)
class Topology:
    """Node and site of every global rank (built once per job, passed explicitly like the process groups)."""

    node_of_rank: tuple[int, ...]
    """Node index of each global rank (nodes numbered 0.. in order of their lowest rank)."""
    site_of_node: tuple[int, ...] = ()
    """Site index of each node; empty: every node in one site."""
    source: str = "set by hand"
    """Where the placement came from, for the banner (e.g. ``torchrun GROUP_RANK``)."""

    @classmethod
    def uniform(cls, world: int, ranks_per_node: int, nodes_per_site: int = 0,
                source: str = "set by hand") -> "Topology":
        """``world`` ranks filling nodes of ``ranks_per_node`` in rank order, nodes filling sites of
        ``nodes_per_site`` (0: one site). Raises ValueError for sizes that do not divide."""
        if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"ranks_per_node must be a positive int dividing the {world} ranks, got "
                             f"{ranks_per_node!r}; every node must hold the same number of ranks")
        return cls(tuple(r // ranks_per_node for r in range(world)), (), source).with_sites(nodes_per_site)

    def with_sites(self, nodes_per_site: int) -> "Topology":
        """This placement with nodes filling sites of ``nodes_per_site`` in node order (0: one site)."""
        if not isinstance(nodes_per_site, int) or nodes_per_site < 0 or (
                nodes_per_site and self.num_nodes % nodes_per_site):
            raise ValueError(f"nodes_per_site must be 0 (one site) or a positive int dividing the {self.num_nodes} "
                             f"nodes, got {nodes_per_site!r}")
        sites = tuple(n // nodes_per_site for n in range(self.num_nodes)) if nodes_per_site else ()
        return Topology(self.node_of_rank, sites, self.source)

    # -- questions ------------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        """Number of ranks."""
        return len(self.node_of_rank)

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return max(self.node_of_rank) + 1 if self.node_of_rank else 0

    @property
    def num_sites(self) -> int:
        """Number of sites."""
        return max(self.site_of_node) + 1 if self.site_of_node else 1

    def node(self, rank: int) -> int:
        """The node of global rank ``rank``."""
        return self.node_of_rank[rank]

    def site(self, rank: int) -> int:
        """The site of global rank ``rank``."""
        return self.site_of_node[self.node_of_rank[rank]] if self.site_of_node else 0

    def ranks_per_node(self) -> list[int]:
        """How many ranks each node holds."""
        counts = [0] * self.num_nodes
        for n in self.node_of_rank:
            counts[n] += 1
        return counts

    def slowest_link(self, ranks: Sequence[int]) -> str:
        """The slowest link kind a group of global ranks spans (``intra_node`` for a single rank)."""
        if len({self.site(r) for r in ranks}) > 1:
            return "inter_site"
        return "inter_node" if len({self.node(r) for r in ranks}) > 1 else "intra_node"

    def describe(self) -> str:
        """One line for the banner, e.g. ``2 nodes x 4 ranks, one site (from torchrun GROUP_RANK)``."""
        counts = self.ranks_per_node()
        per = f"{counts[0]} ranks" if len(set(counts)) == 1 else "ranks " + "/".join(map(str, counts))
        sites = "one site" if self.num_sites == 1 else f"{self.num_sites} sites of {self.num_nodes // self.num_sites} nodes"
        return f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''} x {per}, {sites} ({self.source})"

    def hops(self, ranks: Sequence[int]) -> list[tuple[str, list[list[int]]]]:
        """The hops of a hierarchical exchange over the group ``ranks`` (global ranks in group order): per link
        kind that the group crosses, fastest first, its subgroups (global ranks, each in group order):

          intra_node   the group's ranks on one node
          inter_node   the ranks with the same index among the group's ranks on their node, one per node of a site
          inter_site   the ranks with the same (index on the node, index of the node in its site), one per site

        A hop whose subgroups hold one rank each is left out, so a group inside one node has one hop
        (``intra_node``) and a group of one rank per node one hop (the slowest link): such a group is flat.

        Raises:
            ValueError: the group holds different numbers of ranks on the nodes it touches (or of nodes in the
                sites it touches): one line naming the counts and the fix."""
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(self.node(r), []).append(r)
        _check_even(by_node, "node", f"the same number of the group's ranks on every node, but its {len(ranks)} ranks",
                    "launch the same number of ranks per node (torchrun --nproc-per-node)")
        nodes_by_site: dict[int, list[int]] = {}
        for n in by_node:  # nodes in order of the group's first rank on them
            nodes_by_site.setdefault(self.site_of_node[n] if self.site_of_node else 0, []).append(n)
        _check_even(nodes_by_site, "site", "the same number of the group's nodes in every site, but they",
                    "set nodes_per_site so that sites hold equal shares of the nodes")
        out = []
        intra = list(by_node.values())  # index in a node's subgroup = the rank's local index l
        if len(intra[0]) > 1:
            out.append(("intra_node", intra))
        # every subgroup lists its members by node (then site) order, so a rank's index in its inter-node subgroup
        # is its node's index in the site: the ranks of one inter-site subgroup then hold the same chunk
        inter = [[by_node[n][l] for n in nodes] for nodes in nodes_by_site.values() for l in range(len(intra[0]))]
        if len(inter[0]) > 1:
            out.append(("inter_node", inter))
        site_list = list(nodes_by_site.values())
        cross = [[by_node[nodes[k]][l] for nodes in site_list] for l in range(len(intra[0]))
                 for k in range(len(site_list[0]))]
        if len(cross[0]) > 1:
            out.append(("inter_site", cross))
        return out


def _check_even(members: dict, unit: str, needs: str, fix: str) -> None:
    """ValueError (one line) unless every ``unit`` (node or site) in ``members`` holds as many members as the others."""
    counts = {k: len(v) for k, v in members.items()}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{unit} {k}: {c}" for k, c in sorted(counts.items()))
        raise ValueError(f"a hierarchical exchange needs {needs} sit unevenly ({shown}); {fix}, or use flat "
                         f"collectives (--dp-collectives flat)")


def check_topology(topology, world: int, owner: str) -> Topology:
    """``topology`` when it is a :class:`Topology` of ``world`` ranks; else ValueError (one line, naming ``owner``, the
    caller the user called, and how to build one for this job)."""
    if not isinstance(topology, Topology):
        raise ValueError(f"{owner}: topology must be a megacomp.placement.Topology (detect_topology() or "
                         f"Topology.uniform(world, ranks_per_node)), got {type(topology).__name__} {topology!r}")
    if topology.world != world:
        raise ValueError(f"{owner}: the topology places {topology.world} ranks but the job has {world}; build it for "
                         f"this job (detect_topology() or Topology.uniform({world}, ranks_per_node))")
    return topology


# -- from the launcher --------------------------------------------------------------------------------------
def launcher_placement(environ: Mapping[str, str] = os.environ) -> dict:
    """What this process's launcher says about its node: ``{"source", "node", "local_size"}``, where ``node`` is a
    key shared by the ranks of one node (an int from torchrun / Slurm, else the host name) and ``local_size``
    the ranks per node the launcher claims (0: it does not say). ``source`` names the variables read; a host name
    is marked ``host name`` (it may be overridden without contradiction)."""
    def _int(name: str) -> int:
        value = environ.get(name, "")
        head = value.split("(")[0].split(",")[0]  # Slurm's "4(x2),2" lists: the first node's count
        return int(head) if head.strip().isdigit() else 0
    if "GROUP_RANK" in environ and "LOCAL_WORLD_SIZE" in environ:
        return {"source": "torchrun GROUP_RANK/LOCAL_WORLD_SIZE", "node": int(environ["GROUP_RANK"]),
                "local_size": _int("LOCAL_WORLD_SIZE")}
    if "SLURM_NODEID" in environ and "SLURM_PROCID" in environ:
        size = _int("SLURM_NTASKS_PER_NODE") or _int("SLURM_TASKS_PER_NODE")
        return {"source": "Slurm SLURM_NODEID", "node": int(environ["SLURM_NODEID"]), "local_size": size}
    host = socket.gethostname()
    for var, name in (("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"), ("MPI_LOCALNRANKS", "MPICH")):
        if var in environ:
            return {"source": f"host name ({name} {var})", "node": host, "local_size": _int(var)}
    return {"source": "host name", "node": host, "local_size": 0}


def topology_from_placements(placements: Sequence[dict], ranks_per_node: int = 0,
                             nodes_per_site: int = 0) -> Topology:
    """The :class:`Topology` of a job from every rank's :func:`launcher_placement` (index = global rank), with the
    overrides ``ranks_per_node`` (0: none) and ``nodes_per_site`` (0: one site). Pure: tests call it directly.

    Raises:
        ValueError: see the module docstring."""
    world = len(placements)
    found: dict = {}
    node_of_rank = tuple(found.setdefault(p["node"], len(found)) for p in placements)
    source = placements[0]["source"] if placements else "none"
    said = Topology(node_of_rank, (), f"from {source}")
    counts = said.ranks_per_node()
    for n, count in enumerate(counts):
        claims = {p["local_size"] for p, m in zip(placements, node_of_rank) if m == n and p["local_size"]}
        if claims and claims != {count}:
            raise ValueError(f"the launcher ({source}) says {sorted(claims)[0]} ranks per node but placed {count} "
                             f"on node {n}; fix the launch, or set ranks_per_node (--ranks-per-node) explicitly")
    if ranks_per_node:
        if not isinstance(ranks_per_node, int) or ranks_per_node < 0 or world % ranks_per_node:
            raise ValueError(f"ranks_per_node (--ranks-per-node) must divide the {world} ranks, got {ranks_per_node!r}")
        chosen = Topology.uniform(world, ranks_per_node, source=f"ranks_per_node {ranks_per_node}")
        if not source.startswith("host name") and chosen.node_of_rank != node_of_rank:
            r = next(i for i in range(world) if chosen.node_of_rank[i] != node_of_rank[i])
            raise ValueError(f"ranks_per_node {ranks_per_node} (--ranks-per-node) contradicts the launcher ({source}): "
                             f"it puts rank {r} on node {chosen.node_of_rank[r]}, the launcher on node "
                             f"{node_of_rank[r]}; drop --ranks-per-node or fix the launch")
        return chosen.with_sites(nodes_per_site)
    return said.with_sites(nodes_per_site)


def detect_topology(ranks_per_node: int = 0, nodes_per_site: int = 0, group=None,
                    environ: Optional[Mapping[str, str]] = None) -> Topology:
    """The job's :class:`Topology` (a collective: every rank of ``group``, default the world, calls it): each rank's
    :func:`launcher_placement` gathered, then :func:`topology_from_placements`. Raises ValueError as that."""
    import torch.distributed as dist

    mine = launcher_placement(os.environ if environ is None else environ)
    placements: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(placements, mine, group=group)
    return topology_from_placements(placements, ranks_per_node, nodes_per_site)

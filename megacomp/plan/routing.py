"""Which link kinds a traffic kind's bytes cross, and how many bytes the busiest link of each tier carries.

Groups come from megacomp.parallel_state.rank_grid (TP fastest, then DP, then PP), ranks sit on nodes and sites in
order (megacomp.plan.cluster). All groups of one kind run their collective at the same time, so the load of a
node's (site's) uplink is the sum over every group of the bytes leaving that node (site). Patterns:

  ring    each rank sends ``b`` bytes to the next rank of its group (cyclic): NCCL/gloo ring all-reduce,
          reduce-scatter (gloo's: its all-reduce) and all-gather, and NCCL's all-gather of encoded bytes.
  direct  each rank sends ``b / (p-1)`` bytes to every other rank of its group: megacomp's reduce-scatter
          (all-to-all of encoded chunks) and, on gloo, every compressed exchange (direction-split p2p, the
          all-gathers too). A node holding ``m`` of the group's ``p`` ranks sends ``m (p - m) b / (p-1)`` bytes
          out (every local rank's pieces for the other nodes), ``m (p - m) / (p-1)`` times a ring's one edge of
          ``b``: direct exchanges are not topology-aware.
  chain   rank i sends ``b`` bytes to rank i+1 and rank i+1 sends ``b`` back (pipeline activations and
          gradients).

Which pattern each collective takes on each backend: megacomp.plan.estimate.phases.

megacomp's compressed DP exchanges run hop by hop where a DP group has several ranks on each of several nodes
(megacomp.comm.hierarchical): :func:`hop_stages` gives the subgroups of each hop, and megacomp.plan.estimate routes
each stage with the patterns above (uncompressed ring inside a node, the codec's direct exchange across nodes), so
the slow link carries each node's bytes once.

Returned loads are bytes on the busiest link of each tier: ``intra_node`` per GPU, ``inter_node`` per node,
``inter_site`` per site (a byte that leaves a site also leaves its node: it loads both). Exact for the patterns
above; failure behaviour: an unknown pattern raises ValueError.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from ..parallel_state import rank_grid
from ..placement import Topology
from .cluster import TIERS, Cluster
from .workload import Layout

PATTERNS = ("ring", "direct", "chain")
KINDS = ("tp", "dp", "pp")


def groups(layout: Layout, kind: str) -> tuple:
    """Every group of ``kind`` (``tp``, ``dp`` or ``pp``) as tuples of global ranks."""
    tp_g, dp_g, pp_g = rank_grid(layout.world, layout.tp, layout.pp)
    return tuple(tuple(g) for g in {"tp": tp_g, "dp": dp_g, "pp": pp_g}[kind])


def split_groups(groups_, replicas: int) -> tuple[tuple, tuple]:
    """(inner, outer) groups of local-step training with ``replicas`` replicas: each DP group's ranks in
    ``replicas`` contiguous blocks (a replica each: the inner groups), and the ranks at the same place in every
    block (the outer groups, which exchange pseudo-gradients). Raises ValueError when replicas does not divide DP."""
    inner, outer = [], []
    for g in groups_:
        if len(g) % replicas:
            raise ValueError(f"{replicas} replicas do not divide the data-parallel size {len(g)}: pick a replica count "
                             f"that divides DP (one per site is usual)")
        k = len(g) // replicas
        inner += [tuple(g[j * k:(j + 1) * k]) for j in range(replicas)]
        outer += [tuple(g[i::k]) for i in range(k)]
    return tuple(inner), tuple(outer)


def cluster_topology(cluster: Cluster) -> Topology:
    """The placement of a plan's cluster as a megacomp.placement.Topology (ranks fill nodes, nodes fill sites)."""
    nodes = tuple(cluster.unit(r, "inter_node") for r in range(cluster.gpus))
    sites = tuple(cluster.unit(n * cluster.gpus_per_node, "inter_site") for n in range(max(nodes) + 1)) \
        if cluster.sites > 1 else ()
    return Topology(nodes, sites, "megacomp.plan cluster")


def hop_stages(cluster: Cluster, groups_) -> tuple:
    """Per hop of a hop-by-hop exchange (fastest first), ``(link kind, every group's subgroups on it)``; empty when
    the groups exchange flat (inside one node, or one rank per node). Raises ValueError for groups that sit unevenly
    over nodes (megacomp.placement.Topology.hops)."""
    topology = cluster_topology(cluster)
    layouts = [topology.hops(g) for g in groups_ if len(g) > 1]
    if not layouts or len(layouts[0]) < 2:
        return ()
    return tuple((link, tuple(tuple(sub) for lay in layouts for sub in lay[i][1]))
                 for i, (link, _) in enumerate(layouts[0]))


def tier_loads(cluster: Cluster, groups_, pattern: str, bytes_per_rank: float) -> dict[str, float]:
    """Bytes on the busiest link of each tier when every group of ``groups_`` runs ``pattern`` at once with each
    rank sending ``bytes_per_rank`` (see the module docstring); tiers the traffic does not use are 0. Linear in
    ``bytes_per_rank`` (:class:`Routes` computes it once per groups and pattern)."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown traffic pattern {pattern!r}: use one of {', '.join(PATTERNS)}")
    loads = {t: 0.0 for t in TIERS}
    if bytes_per_rank <= 0:
        return loads
    out = {t: defaultdict(float) for t in TIERS}  # tier -> unit -> bytes leaving it
    for g in groups_:
        p = len(g)
        if p < 2:
            continue
        if pattern == "direct":
            per_peer = bytes_per_rank / (p - 1)
            for tier in TIERS:
                counts = Counter(cluster.unit(r, tier) if tier != "intra_node" else cluster.unit(r, "inter_node")
                                 for r in g)
                if tier == "intra_node":  # per rank: bytes to the other ranks of its own node
                    for r in g:
                        out[tier][r] += per_peer * (counts[cluster.unit(r, "inter_node")] - 1)
                else:
                    for u, m in counts.items():
                        out[tier][u] += m * (p - m) * per_peer
            continue
        edges = [(g[i], g[(i + 1) % p]) for i in range(p)] if pattern == "ring" else \
            [e for i in range(p - 1) for e in ((g[i], g[i + 1]), (g[i + 1], g[i]))]
        for a, b in edges:
            if cluster.unit(a, "inter_node") == cluster.unit(b, "inter_node"):
                out["intra_node"][a] += bytes_per_rank
                continue
            out["inter_node"][cluster.unit(a, "inter_node")] += bytes_per_rank
            if cluster.unit(a, "inter_site") != cluster.unit(b, "inter_site"):
                out["inter_site"][cluster.unit(a, "inter_site")] += bytes_per_rank
    for tier in TIERS:
        loads[tier] = max(out[tier].values(), default=0.0)
    return loads


def widest_tier(cluster: Cluster, layout: Layout, kind: str) -> str:
    """The slowest link kind any ``kind`` group spans (``intra_node`` for groups of one rank)."""
    order = {t: i for i, t in enumerate(TIERS)}
    return max((cluster.widest_tier(g) for g in groups(layout, kind)), key=order.__getitem__, default="intra_node")


def crossing_bytes(cluster: Cluster, groups_, pattern: str, bytes_per_rank: float) -> dict[str, float]:
    """Bytes all ranks together send over each tier (for bytes-per-token accounting): every byte counted once,
    under the slowest tier its hop crosses. Linear in ``bytes_per_rank``."""
    total = {t: 0.0 for t in TIERS}
    for g in groups_:
        p = len(g)
        if p < 2:
            continue
        if pattern == "direct":  # counted per node and site: O(p), not O(p^2)
            per_peer = bytes_per_rank / (p - 1)
            nodes = Counter(cluster.unit(r, "inter_node") for r in g)
            sites = Counter(cluster.unit(r, "inter_site") for r in g)
            site_of_node = {cluster.unit(r, "inter_node"): cluster.unit(r, "inter_site") for r in g}
            total["intra_node"] += per_peer * sum(m * (m - 1) for m in nodes.values())
            total["inter_node"] += per_peer * sum(m * (sites[site_of_node[n]] - m) for n, m in nodes.items())
            total["inter_site"] += per_peer * sum(m * (p - m) for m in sites.values())
            continue
        if pattern == "ring":
            hops = ((g[i], g[(i + 1) % p], bytes_per_rank) for i in range(p))
        else:
            hops = ((a, b, bytes_per_rank) for i in range(p - 1) for a, b in ((g[i], g[i + 1]), (g[i + 1], g[i])))
        for a, b, v in hops:
            total[cluster.widest_tier((a, b))] += v
    return total


class Routes:
    """The functions above for one cluster, remembered per (groups, pattern) for one byte and scaled (both are
    linear in the bytes), so ranking many methods and layouts routes each group set once. Holds no other state."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._loads: dict = {}
        self._crossing: dict = {}
        self._groups: dict = {}
        self._stages: dict = {}

    def hop_stages(self, groups_) -> tuple:
        """:func:`hop_stages` on this cluster, remembered."""
        if groups_ not in self._stages:
            self._stages[groups_] = hop_stages(self.cluster, groups_)
        return self._stages[groups_]

    def groups(self, layout: Layout, kind: str) -> tuple:
        """:func:`groups`, remembered."""
        key = (layout.world, layout.tp, layout.pp, kind)
        if key not in self._groups:
            self._groups[key] = groups(layout, kind)
        return self._groups[key]

    def tier_loads(self, groups_, pattern: str, bytes_per_rank: float) -> dict[str, float]:
        """:func:`tier_loads` on this cluster."""
        key = (groups_, pattern)
        if key not in self._loads:
            self._loads[key] = tier_loads(self.cluster, groups_, pattern, 1.0)
        return {t: v * max(0.0, bytes_per_rank) for t, v in self._loads[key].items()}

    def crossing_bytes(self, groups_, pattern: str, bytes_per_rank: float) -> dict[str, float]:
        """:func:`crossing_bytes` on this cluster."""
        key = (groups_, pattern)
        if key not in self._crossing:
            self._crossing[key] = crossing_bytes(self.cluster, groups_, pattern, 1.0)
        return {t: v * bytes_per_rank for t, v in self._crossing[key].items()}

"""The hardware a plan runs on: devices, the link of each tier (within a node, between nodes, between sites)
and where each rank sits.

    cluster = Cluster(device=DEVICES["h100"], gpus=256, nodes=32, sites=2,
                      inter_node=parse_link("100gbit"), inter_site=parse_link("10gbit,20ms"))

Bandwidths are one direction: ``intra_node`` per GPU (NVLink), ``inter_node`` per node (all GPUs of a node share
its NICs), ``inter_site`` per site (all nodes of a site share the site's uplink). Ranks fill nodes in order and
nodes fill sites in order (rank r sits on node r // gpus_per_node), which is what torchrun and Slurm do.

``backend`` is the torch.distributed backend the run's collectives use (:data:`BACKENDS`): it decides the
algorithm, so the bytes each link carries (megacomp.plan.estimate.phases), e.g. ``Cluster(..., backend="gloo")``
for CPU training over gloo.

Failure behaviour: an unknown device name or backend, a link text that does not parse or a GPU count that does not
divide into the nodes and sites raises ValueError in one line naming the fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

TIERS = ("intra_node", "inter_node", "inter_site")
"""The link kinds, fastest first."""
BACKENDS = ("nccl", "gloo")
"""The collective backends the plan models: ``nccl`` (GPU tensors; ring collectives, megacomp's compressed all-gather
as NCCL's ring all-gather of the encoded bytes) and ``gloo`` with host tensors (CPU training; a reduce-scatter is
gloo's all-reduce, megacomp's compressed all-gather a direct exchange). megacomp.plan.estimate.phases has the
patterns of each."""


@dataclass(frozen=True)
class Device:
    """One accelerator. Peak figures are the vendor's dense bf16 numbers; achieved fractions are assumptions."""

    name: str
    """Short name (``h100``)."""
    peak_flops: float
    """Dense bf16 FLOP/s (vendor peak)."""
    memory_bandwidth_Bps: float
    """HBM bytes per second."""
    memory_bytes: float
    """HBM capacity in bytes."""
    mfu: float = 0.45
    """Achieved fraction of ``peak_flops`` in the model's matmuls (an assumption; Megatron reports 0.4-0.55)."""
    codec_fraction: float = 0.25
    """Codec throughput as a fraction of ``memory_bandwidth_Bps`` (input bytes encoded or decoded per second):
    quantizing reads and writes each byte about twice, and kernels reach about half of the bandwidth."""

    @property
    def codec_Bps(self) -> float:
        """Input bytes a codec encodes (or decodes) per second on this device."""
        return self.codec_fraction * self.memory_bandwidth_Bps


GiB = float(1 << 30)
DEVICES = (
    Device("v100", 125e12, 0.9e12, 32 * GiB),
    Device("a100", 312e12, 2.0e12, 80 * GiB),
    Device("h100", 989e12, 3.35e12, 80 * GiB),
    Device("h200", 989e12, 4.8e12, 141e9),
    Device("b200", 2250e12, 8.0e12, 180e9),
)
"""Known devices (vendor datasheets: V100 SXM2 fp16 tensor cores, A100/H100/H200 SXM, B200)."""


def device(name: str) -> Device:
    """The device called ``name`` (case-insensitive); ValueError naming the known ones otherwise."""
    for d in DEVICES:
        if d.name == name.lower():
            return d
    raise ValueError(f"unknown hardware {name!r}: use one of {', '.join(d.name for d in DEVICES)} "
                     f"(or build a megacomp.plan.Device)")


@dataclass(frozen=True)
class Link:
    """One link kind: T(bytes) = latency + bytes / (bandwidth * efficiency)."""

    bandwidth_Bps: float
    """Nominal bytes per second, one direction."""
    latency_s: float = 0.0
    """One-way latency per message (alpha)."""
    efficiency: float = 0.9
    """Achieved fraction of the nominal bandwidth (eta)."""

    @property
    def rate_Bps(self) -> float:
        """Achieved bytes per second (bandwidth x efficiency)."""
        return self.bandwidth_Bps * self.efficiency

    def __str__(self) -> str:
        bits = self.bandwidth_Bps * 8
        rate = f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"
        return f"{rate}, {self.latency_s * 1e3:g} ms" if self.latency_s >= 1e-4 else f"{rate}, {self.latency_s * 1e6:g} us"


RATE_UNITS = (("tbit", 1e12 / 8), ("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("kbit", 1e3 / 8), ("gb", 1e9), ("mb", 1e6))
"""Link rate units and their bytes per second."""
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
"""Latency units in seconds."""


def parse_link(text: str, latency_s: float = 0.0, efficiency: float = 0.9) -> Link:
    """``"100gbit"``, ``"10gbit,20ms"`` or ``"400gbit,5us,0.8"`` (rate, optional latency, optional efficiency) ->
    Link. Rates: tbit, gbit, mbit, kbit (bits per second) or gb, mb (bytes per second); times: s, ms, us, ns."""
    rates, times = dict(RATE_UNITS), dict(TIME_UNITS)
    parts = [p.strip().lower() for p in str(text).split(",")]
    m = re.fullmatch(r"([0-9.]+(?:e[-+]?\d+)?)\s*([a-z]+?)(?:/s|ps)?", parts[0])
    if not m or m.group(2) not in rates or len(parts) > 3:
        raise ValueError(f"link {text!r}: write RATE[,LATENCY[,EFFICIENCY]] such as 100gbit or 10gbit,20ms "
                         f"(rates in {', '.join(rates)}; latencies in {', '.join(times)})")
    rate = float(m.group(1)) * rates[m.group(2)]
    if len(parts) > 1:
        t = re.fullmatch(r"([0-9.]+(?:e[-+]?\d+)?)\s*(s|ms|us|ns)", parts[1])
        if not t:
            raise ValueError(f"link {text!r}: latency {parts[1]!r} must be a number with s, ms, us or ns (e.g. 20ms)")
        latency_s = float(t.group(1)) * times[t.group(2)]
    if len(parts) > 2:
        efficiency = float(parts[2])
    if rate <= 0 or not 0 < efficiency <= 1:
        raise ValueError(f"link {text!r}: the rate must be > 0 and the efficiency in (0, 1]")
    return Link(rate, latency_s, efficiency)


@dataclass(frozen=True)
class Cluster:
    """GPUs grouped into nodes and sites, and the link of each tier."""

    device: Device
    """The accelerator every rank runs on."""
    gpus: int
    """Total ranks."""
    nodes: int = 1
    """Nodes (equal GPUs each)."""
    sites: int = 1
    """Sites / datacenters (equal nodes each)."""
    intra_node: Link = field(default_factory=lambda: Link(450e9, 3e-6, 0.8))
    """Per-GPU link inside a node (NVLink 4: 450 GB/s one way)."""
    inter_node: Link = field(default_factory=lambda: Link(8 * 400e9 / 8, 10e-6, 0.9))
    """Per-node link between nodes of a site (8 x 400 Gbit/s InfiniBand by default)."""
    inter_site: Link = field(default_factory=lambda: Link(100e9 / 8, 20e-3, 0.9))
    """Per-site link between sites."""
    backend: str = "nccl"
    """The torch.distributed backend of the run's collectives, one of :data:`BACKENDS`."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}: use one of {', '.join(BACKENDS)} (gloo for CPU "
                             f"training, nccl for GPUs)")
        if self.gpus < 1 or self.nodes < 1 or self.sites < 1:
            raise ValueError(f"gpus, nodes and sites must be >= 1, got {self.gpus}, {self.nodes}, {self.sites}")
        if self.gpus % self.nodes:
            raise ValueError(f"{self.gpus} GPUs do not divide into {self.nodes} nodes: give a GPU count that is a "
                             f"multiple of the node count")
        if self.nodes % self.sites:
            raise ValueError(f"{self.nodes} nodes do not divide into {self.sites} sites: give a node count that is a "
                             f"multiple of the site count")

    @property
    def gpus_per_node(self) -> int:
        """Ranks on one node."""
        return self.gpus // self.nodes

    @property
    def gpus_per_site(self) -> int:
        """Ranks in one site."""
        return self.gpus // self.sites

    def link(self, tier: str) -> Link:
        """The Link of ``tier`` (one of TIERS)."""
        return getattr(self, tier)

    def unit(self, rank: int, tier: str) -> int:
        """The node (``inter_node``) or site (``inter_site``) that ``rank`` sits in; the rank itself for
        ``intra_node``."""
        if tier == "intra_node":
            return rank
        return rank // (self.gpus_per_node if tier == "inter_node" else self.gpus_per_site)

    def widest_tier(self, ranks) -> str:
        """The slowest tier a group of ranks spans: ``inter_site`` when its ranks sit in more than one site,
        else ``inter_node`` when in more than one node, else ``intra_node``."""
        ranks = list(ranks)
        if len({self.unit(r, "inter_site") for r in ranks}) > 1:
            return "inter_site"
        if len({self.unit(r, "inter_node") for r in ranks}) > 1:
            return "inter_node"
        return "intra_node"

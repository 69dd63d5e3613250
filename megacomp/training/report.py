"""What a pretraining run tells its user: the start-up banner and the end-of-run summary (rank 0).

The banner says the layout, the model, the codec and error feedback of every traffic path (and which
paths this layout does not use), the small-tensor threshold, where metrics go, what the per-iteration
line's numbers mean and which link kind (within a node, between nodes) each group's traffic crosses. The summary
adds up every iteration of the run (warm-up iterations included): tokens, time, first and last loss, per traffic
kind the bytes on the wire next to the uncompressed bytes, and the bytes per link kind, so a run can be compared
with megacomp.plan's bytes per token per tier. Its tokens/s is the steady rate, over the iterations after this
run's first: the first carries one-time costs (the C++ codec kernels' build, about a minute on a fresh machine;
the allocator's and the transport's warm-up), which would hide the rate of every other iteration; the summary
says so and gives the first iteration's time apart. A run of one iteration reports its rate with those costs in.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

from ..config import FEATURE_PATHS, TRAFFIC_PATHS, CommCompressionConfig
from ..parallel_state import rank_grid
from ..placement import Topology

REPLICA_LINK = "between_replica_groups"
"""The link kind of torchft's cross-replica traffic: replica groups are separate jobs, usually on other nodes or
sites, so their link is not known from this group's layout and is reported apart."""
LINK_KINDS = ("intra_node", "inter_node", "inter_site", REPLICA_LINK)
"""The link kinds a run reports bytes for (megacomp.placement.LINKS, then torchft's replica link)."""
_ORDER = ("intra_node", "inter_node", "inter_site")  # fastest first


def split_tag(kind: str) -> tuple[str, Optional[str]]:
    """A traffic tag's kind and the link it names: ``dp_gradient@intra_node`` -> (dp_gradient, intra_node), the tag
    of one hop of a hierarchical exchange (megacomp.comm.hierarchical); a plain tag names no link (None)."""
    base, _, link = kind.partition("@")
    return base, (link or None)


def traffic_group(kind: str) -> str:
    """The group a traffic kind travels in: ``tp`` (tp_*, sp_*, loqt_merge_tp), ``pp`` (pp_*), ``replicas``
    (torchft's replica groups) or ``dp`` (every other kind: DP gradients and parameters, the 1-bit momentum, the
    outer loops' exchange, DeMo, LoQT)."""
    kind = split_tag(kind)[0]
    if kind.startswith(("tp_", "sp_")) or kind == "loqt_merge_tp":
        return "tp"
    if kind == "replicas":  # torchft's traffic between replica groups (separate jobs): never inside one group
        return "replicas"
    return "pp" if kind.startswith("pp_") else "dp"


def bytes_per_link(traffic: dict, tiers: dict[str, str]) -> dict[str, int]:
    """Wire bytes of ``traffic`` (``{kind: [wire, uncompressed]}``) per link kind (every one of LINK_KINDS): a hop of a
    hierarchical exchange (``kind@link``) under its own link, other traffic under the slowest link its group spans
    (``tiers``: :func:`layout_tiers`; a group it does not name counts as intra-node), torchft's under REPLICA_LINK."""
    per_link = {t: 0 for t in LINK_KINDS}
    for kind, (w, _) in traffic.items():
        group, link = traffic_group(kind), split_tag(kind)[1]
        per_link[link or (REPLICA_LINK if group == "replicas" else tiers.get(group, "intra_node"))] += w
    return per_link


def ranks_per_node(world: int) -> int:
    """Ranks on one node: torchrun's ``LOCAL_WORLD_SIZE``, else every rank on one node (a single-machine run)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return local if 0 < local <= world else world


def layout_tiers(world: int, tp: int, pp: int, placement) -> dict[str, str]:
    """The slowest link each group kind spans (``{"tp": "intra_node", "pp": ..., "dp": ...}``), ranks placed as
    megacomp.parallel_state.rank_grid; ``placement``: a megacomp.placement.Topology, or ranks per node (nodes filled
    in rank order)."""
    if isinstance(placement, int):
        placement = Topology.uniform(world, placement if world % placement == 0 else world)
    out = {}
    for kind, groups in zip(("tp", "dp", "pp"), rank_grid(world, tp, pp)):
        out[kind] = max((placement.slowest_link(g) for g in groups), key=_ORDER.index)
    return out


def tiers_line(tiers: dict[str, str], placement) -> str:
    """The banner's line saying which link kind each group's traffic crosses (``placement``: the topology's
    description, or ranks per node)."""
    where = f"{placement} ranks per node" if isinstance(placement, int) else placement
    return (f"  links ({where}): " + ", ".join(f"{k.upper()} traffic {v.replace('_', '-')}"
                                                                for k, v in tiers.items())
            + "; the summary adds up bytes per link kind")


def dp_hops_line(hierarchy, channels, mode: str, dp_link: str, dp_size: int) -> str:
    """The banner's line saying how the DP exchanges run: hop by hop (the hops, each DP path's codec per hop) or flat,
    and why."""
    if dp_size == 1:
        return "  DP exchanges: none (DP 1)"
    link = dp_link.replace("_", "-")
    if hierarchy is None:
        why = ("--dp-collectives flat" if mode == "flat" else "the DP group stays inside one node"
               if dp_link == "intra_node" else "one rank of each DP group per node: nothing to combine first")
        return f"  DP exchanges: flat over the {link} link ({why})"
    hops = " then ".join(f"{h.link.replace('_', '-')} ({len(h.ranks)} ranks)" for h in hierarchy.hops)
    paths = []
    for path in ("dp_gradient", "dp_parameter"):
        ch = getattr(channels, path)
        codecs = getattr(ch, "hop_codecs", None)
        paths.append(f"{path} " + (", ".join(f"{k.replace('_', '-')} {c}" for k, c in codecs.items()) if codecs
                                   else f"flat ({ch.name} sees whole buckets)"))
    return (f"  DP exchanges hop by hop, {hops}, so the {link} link carries each node's bytes once: " + "; ".join(paths)
            + "; the other DP-group traffic (1-bit momentum, DeMo, outer loops) exchanges flat")


def describe_model(m, vocab: int) -> str:
    """The banner's model text from a ModelConfig ``m``: a GPT, or Llama-style with the options that differ from
    the GPT's (RoPE, RMSNorm, SwiGLU, grouped-query attention, no linear biases, an untied output layer)."""
    options = [text for on, text in ((m.position_embedding_type == "rope", f"RoPE base {m.rotary_base:g}"),
                                     (m.normalization == "RMSNorm", "RMSNorm"), (m.swiglu, "SwiGLU"),
                                     (m.num_query_groups not in (None, m.num_attention_heads),
                                      f"{m.num_query_groups} query groups"),
                                     (not m.add_bias_linear, "no linear biases"),
                                     (m.untie_embeddings_and_output_weights, "untied output layer")) if on]
    kind = "Llama-style" if options else "GPT"
    return (f"{kind} {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, seq {m.seq_length}, "
            f"vocab {vocab}" + (f" ({', '.join(options)})" if options else ""))


def unused_paths(tp: int, pp: int, dp: int, sp: bool) -> dict[str, str]:
    """Traffic paths a layout never uses, with the reason (e.g. ``{"pp_activation": "PP 1"}``)."""
    out = {}
    for p in TRAFFIC_PATHS:
        if p.startswith(("tp_", "sp_")) and tp == 1:
            out[p] = "TP 1"
        elif p.startswith("sp_") and not sp:
            out[p] = "no sequence parallelism"
        elif p == "tp_forward" and sp:
            out[p] = "sequence parallelism uses sp_* instead"
        elif p.startswith("pp_") and pp == 1:
            out[p] = "PP 1"
        elif p.startswith("dp_") and dp == 1:
            out[p] = "DP 1"
    return out


def describe_path(comp: CommCompressionConfig, path: str) -> str:
    """``int4/b128 + loco(beta 0.8, reset 512)``-style text for one path's codec and error feedback."""
    text = str(getattr(comp, path))
    if comp.auto is not None and path in comp.auto.ladder:  # --compression auto: the rungs it may switch between
        text = "auto: " + " -> ".join(str(c) for c in comp.auto.allowed(path))
    efc = getattr(comp, path + "_error_feedback", None)  # tp_backward, pp_gradient, dp_gradient, outer: a config
    if isinstance(efc, bool):  # dp_momentum's worker and server error feedback: on or off
        return text + (" + worker/server error feedback" if efc else "")
    if efc is not None:
        kind = "classic error feedback" if efc.beta == 0 else f"LoCo error feedback (beta {efc.beta:g})"
        text += f" + {kind}" + (f", reset every {efc.reset_interval} steps" if efc.reset_interval else "")
    if path == "dp_gradient" and comp.dp_gradient_warmup_steps:
        text += f" after {comp.dp_gradient_warmup_steps} uncompressed steps"
    return text


def banner(*, world: int, tp: int, pp: int, dp: int, sp: bool, backend: str, device: str, model: str,
           params: int, compression_name: str, comp: CommCompressionConfig, log_dir: Optional[str],
           resumed_from: Optional[str]) -> str:
    """The start-up banner (several lines, no trailing newline)."""
    unused = unused_paths(tp, pp, dp, sp)
    used = [p for p in TRAFFIC_PATHS if p not in unused]
    lines = [f"megacomp-pretrain: {world} ranks = TP {tp} x PP {pp} x DP {dp}{' (sequence parallel)' if sp else ''} "
             f"on {backend}/{device} | {model}, {params / 1e6:.2f}M parameters"]
    lines.append(f"  compression '{compression_name}', per traffic path this layout uses:")
    for p in used:
        lines.append(f"    {p:<18} {describe_path(comp, p)}")
    if unused:
        lines.append("  not used by this layout: " + ", ".join(f"{p} ({why})" for p, why in unused.items()))
    owners = {"dp_momentum": "1-bit optimizers", "outer": "outer loops", "loqt_merge": "LoQT", "loqt_merge_tp": "LoQT",
              "replicas": "torchft replica groups"}
    lines.append("  training families' paths (their lines below say what each run sends): " + ", ".join(
        f"{p} {describe_path(comp, p) if getattr(comp, p) is not None else 'default'} ({owners[p]})"
        for p in FEATURE_PATHS))
    lossy_unused = [p for p in unused if not getattr(comp, p).is_identity]
    if lossy_unused:
        lines.append(f"  note: the preset compresses {', '.join(lossy_unused)}, which this layout does not use")
    lines.append(f"  small tensors: messages under {comp.min_compress_numel} elements travel uncompressed "
                 f"(pipelining segments of {comp.segment_numel} elements)")
    where = f"{log_dir}/metrics.jsonl" if log_dir else "the console only (no --log-dir)"
    lines.append(f"  metrics: {where}; each line: loss, learning rate, tokens/s, and this iteration's megabytes on "
                 f"the wire summed over all ranks, sent / uncompressed, per traffic kind")
    if resumed_from:
        lines.append(f"  {resumed_from}")
    return "\n".join(lines)


@dataclass
class RunTotals:
    """Adds up the iterations of one run (this process's part of it, when resumed)."""

    iterations: int = 0
    tokens: int = 0
    seconds: float = 0.0
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    first_iteration: Optional[int] = None
    first_seconds: Optional[float] = None
    """The time of this run's first iteration, which carries the one-time costs (kept out of the steady rate)."""
    first_tokens: int = 0
    """The tokens of this run's first iteration."""
    traffic: dict = field(default_factory=dict)
    skipped: int = 0
    tiers: dict = field(default_factory=dict)
    """Group kind -> the link kind it crosses (:func:`layout_tiers`); empty: the summary leaves out bytes per link."""

    def add(self, record: dict, tokens: int) -> None:
        """Account one iteration's record (as the trainer logs it)."""
        self.iterations += 1
        self.tokens += tokens
        self.seconds += record["iteration_time_s"]
        loss = record["loss"]
        if self.first_seconds is None:
            self.first_seconds, self.first_tokens = record["iteration_time_s"], tokens
        if self.first_loss is None:
            self.first_loss, self.first_iteration = loss, record["iteration"]
        self.last_loss = loss
        self.skipped += bool(record.get("skipped"))
        for kind, (w, u) in record["traffic"].items():
            tot = self.traffic.setdefault(kind, [0, 0])
            tot[0] += w
            tot[1] += u

    def rate_text(self) -> str:
        """The summary's tokens/s clause: the steady rate over the iterations after this run's first, which is
        timed apart (its one-time costs); with one iteration, its own rate, costs included."""
        if self.iterations < 2 or self.first_seconds is None:
            rate = self.tokens / self.seconds if self.seconds else 0.0
            return f"{rate:,.0f} tok/s, one iteration: one-time costs included"
        steady_s = self.seconds - self.first_seconds
        rate = (self.tokens - self.first_tokens) / steady_s if steady_s > 0 else 0.0
        return (f"{rate:,.0f} tok/s after the first iteration, which took {self.first_seconds:.1f} s with the run's "
                f"one-time costs")

    def summary(self, last_iteration: int, stopped: str = "") -> str:
        """The end-of-run summary (several lines)."""
        mb = 1e6

        def fmt(x):
            return "n/a" if x is None or not math.isfinite(x) else f"{x:.4f}"
        head = (f"megacomp-pretrain: {stopped or 'done'}: iterations {self.first_iteration}-{last_iteration} "
                f"({self.iterations} this run, {self.skipped} skipped), {self.tokens:,} tokens in {self.seconds:.1f} s "
                f"({self.rate_text()}), loss {fmt(self.first_loss)} -> {fmt(self.last_loss)}")
        lines = [head, "  bytes on the wire over all iterations of this run, all ranks (sent / uncompressed):"]
        total_w = total_u = 0
        for kind, (w, u) in sorted(self.traffic.items()):
            if not u:
                continue
            total_w, total_u = total_w + w, total_u + u
            lines.append(f"    {kind:<20} {w / mb:10.2f} MB of {u / mb:10.2f} MB  ({w / u:.2f}x)")
        if total_u:
            lines.append(f"    {'total':<20} {total_w / mb:10.2f} MB of {total_u / mb:10.2f} MB  ({total_w / total_u:.2f}x)")
        if total_u and self.tokens:
            outer = self.traffic.get("outer", (0, 0))[0]
            split = (f" (inner {(total_w - outer) / self.tokens:,.1f}, outer {outer / self.tokens:,.1f})"
                     if "outer" in self.traffic else "")
            lines.append(f"    {'per token':<20} {total_w / self.tokens:10,.1f} bytes{split}")
        if total_u and self.tiers:
            lines.append("  bytes per link kind (a hop of a hierarchical exchange under its own link, other traffic under "
                         "the slowest link its group spans; compare with megacomp.plan's bytes per token per tier):")
            for tier, w in bytes_per_link(self.traffic, self.tiers).items():
                if tier in (REPLICA_LINK, "inter_site") and not w:  # only runs across replica groups / sites
                    continue
                tok = f", {w / self.tokens:,.1f} per token" if self.tokens else ""
                lines.append(f"    {tier.replace('_', '-'):<22} {w / mb:8.2f} MB{tok}")
        return "\n".join(lines)

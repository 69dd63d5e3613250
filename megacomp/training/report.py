"""What a pretraining run tells its user: the start-up banner and the end-of-run summary (rank 0).

The banner says the layout, the model, the codec and error feedback of every traffic path (and which
paths this layout does not use), the small-tensor threshold, where metrics go and what the per-iteration
line's numbers mean. The summary adds up every iteration of the run (warm-up iterations included): tokens,
time, first and last loss, and per traffic kind the bytes on the wire next to the uncompressed bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ..config import TRAFFIC_PATHS, CommCompressionConfig

if TYPE_CHECKING:  # annotations only
    from ..optimizer import DeMo, DistributedOptimizer, OneBitOptimizer
    from .arguments import PretrainConfig

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
    efc = getattr(comp, path + "_error_feedback", None)  # only tp_backward, pp_gradient and dp_gradient have one
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
    traffic: dict = field(default_factory=dict)
    skipped: int = 0

    def add(self, record: dict, tokens: int) -> None:
        """Account one iteration's record (as the trainer logs it)."""
        self.iterations += 1
        self.tokens += tokens
        self.seconds += record["iteration_time_s"]
        loss = record["loss"]
        if self.first_loss is None:
            self.first_loss, self.first_iteration = loss, record["iteration"]
        self.last_loss = loss
        self.skipped += bool(record.get("skipped"))
        for kind, (w, u) in record["traffic"].items():
            tot = self.traffic.setdefault(kind, [0, 0])
            tot[0] += w
            tot[1] += u

    def summary(self, last_iteration: int, stopped: str = "") -> str:
        """The end-of-run summary (several lines)."""
        mb = 1e6
        rate = self.tokens / self.seconds if self.seconds else 0.0

        def fmt(x):
            return "n/a" if x is None or not math.isfinite(x) else f"{x:.4f}"
        head = (f"megacomp-pretrain: {stopped or 'done'}: iterations {self.first_iteration}-{last_iteration} "
                f"({self.iterations} this run, {self.skipped} skipped), {self.tokens:,} tokens in {self.seconds:.1f} s "
                f"({rate:,.0f} tok/s), loss {fmt(self.first_loss)} -> {fmt(self.last_loss)}")
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
        return "\n".join(lines)


def outer_summary(oc, replicas: int, dp: int, algorithm: str = "") -> str:
    """One line saying what the outer loop does (the banner's): algorithm, replicas, period, rule, codec."""
    per = f"{replicas} replicas of {dp // replicas} DP rank(s), sync every {oc.outer_steps} steps"
    codec = f"pseudo-gradient codec {oc.codec}{' + error feedback' if oc.error_feedback else ''} (traffic kind 'outer')"
    stream = (f" in {oc.fragments} fragments, each applied {oc.delay} steps after it starts, mixing {oc.mixing:g}"
              if oc.fragments > 1 or oc.delay or oc.mixing else "")
    if algorithm == "mt_dao":
        return (f"MT-DAO over {per}: parameters averaged (outer lr {oc.outer_lr:g}, momentum {oc.outer_momentum:g}, "
                f"{codec}) and every Adam moment averaged uncompressed; inner MultiTimescaleAdamW")
    if oc.algorithm == "noloco":
        return (f"NoLoCo{stream} over {per}, gossip in random groups of {oc.group_size} (no all-reduce), alpha "
                f"{oc.outer_lr:g} beta {oc.outer_momentum:g}, {codec}; slow weights sent uncompressed")
    if oc.algorithm == "sparseloco":
        return (f"SparseLoCo over {per}: accumulator e <- {oc.outer_momentum:g} e + Delta, C(e) all-gathered and "
                f"averaged, theta -= {oc.outer_lr:g} x mean, pseudo-gradient codec {oc.codec} (traffic kind 'outer')")
    nesterov = " (Nesterov)" if oc.nesterov and oc.outer_momentum else ""
    return (f"{'Streaming ' if stream else ''}DiLoCo{stream} over {per}, outer SGD lr {oc.outer_lr:g} momentum "
            f"{oc.outer_momentum:g}{nesterov}, {codec}")


def onebit_summary(opt: OneBitOptimizer, cfg: PretrainConfig) -> str:
    """One line saying what a 1-bit optimizer sends and when (the banner's)."""
    ch = opt.momentum_channel
    ef = " + worker/server error feedback" if ch.error_feedback is not None else ""
    when = (f"variance updates until step {cfg.var_freeze_step}, then local steps synchronised every 1..{cfg.local_step_clipper}"
            if cfg.optimizer == "zero_one_adam" else f"full-precision gradients for {cfg.freeze_step} steps, then momentum")
    shard = "masters sharded over DP, parameters all-gathered" if opt.sharded else "masters whole on every rank, no all-gather"
    return f"{cfg.optimizer}: {when} over dp_momentum with {ch.codec}{ef}; {shard}"


def demo_summary(opt: DeMo) -> str:
    """One line saying what DeMo sends (the banner's)."""
    dense = sum(p.numel() for p in opt.params) * 4
    return (f"DeMo, top-{opt.compression_topk} of each DCT tile (up to {opt.compression_chunk}x{opt.compression_chunk}), "
            f"momentum decay {opt.compression_decay:g}, kept values {opt.value_codec}: {opt.wire_bytes_per_step() / 1e6:.3f} "
            f"MB per step to each DP peer vs {dense / 1e6:.3f} MB dense fp32 (dp_gradient; no dp_parameter all-gather)")


def zero2_summary(opt: DistributedOptimizer, micro_batches: int) -> str:
    """One line saying what ZeRO-2 keeps and sends (the banner's)."""
    whole = [b for b in opt.buckets if b.deferred]
    kept = (f"; {len(whole)} deferred bucket(s) ({sum(b.padded for b in whole) * 4 / 2**20:.2f} MiB, tied embeddings / "
            f"sequence-parallel norms summed over another group first) stay whole until the step" if whole else "")
    shard = sum(b.padded for b in opt.buckets) // opt.world * 4
    largest = max(b.padded for b in opt.buckets) * 4
    return (f"ZeRO-2: fp32 gradient shard {shard / 2**20:.2f} MiB per rank; each bucket (largest {largest / 2**20:.2f} MiB) "
            f"reduce-scattered as soon as a micro-batch fills it and freed, {micro_batches} reduce-scatter(s) per "
            f"bucket per iteration ({micro_batches}x ZeRO-1's dp_gradient messages){kept}")

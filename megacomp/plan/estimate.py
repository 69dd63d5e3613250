"""Step time of one method on one cluster: compute per micro-batch, pipeline bubble, the bytes of every traffic path
on every tier (from the codecs, megacomp.plan.wire), codec time and what the method's schedule overlaps.

  t_mb       = FLOPs per token x tokens per micro-batch / (TP x PP) / (peak x MFU)        compute of one stage
  t_stage    = t_mb + TP collectives of the stage's layers + its pipeline sends (x VP)     exposed: on the critical path
  pipeline   = (M + (PP-1)/VP) x t_stage, bubble = (PP-1)/VP x t_stage                    1F1B / interleaved 1F1B
  collective = hops x alpha + pipeline(max over tiers of busiest-link bytes / rate, codec time); megacomp's compressed
               DP exchanges over groups spanning nodes: one such collective per hop, in turn (hop_by_hop_seconds)
               codec time = (E + D) x input bytes / device codec throughput (E, D: megacomp.plan.calibration)
  step       = pipeline + exposed DP communication (schedule, megacomp.plan.methods) + optimizer update

Outputs (StepEstimate): step seconds, compute seconds, bubble, exposed communication per path, compute utilisation
(M x t_mb / step) and MFU, bytes per token per tier (every byte under the slowest link its hop crosses), memory per
device. Assumptions (MFU, codec throughput, link efficiency) live in the Device and Link; nothing here is fitted.
Gradients travel in fp32 (megacomp's main gradients), parameters in the model's ``params_dtype`` (the sharded
optimizer all-gathers them in it), activations in bf16. Per-tier bytes are payload: TCP/IP headers and the
trainer's small per-iteration collectives (loss, statistics, argument checks) are left out (see docs/guide/plan.md).

Error bound: none a priori (see benchmarks/results/plan for measured and published comparisons). Failure behaviour:
a layout that does not fit raises ValueError (megacomp.plan.workload.Layout.check).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..comm.options import SEGMENT_NUMEL
from . import wire
from .calibration import codec_work, pipeline
from .cluster import TIERS, Cluster
from .methods import Method
from .routing import Routes, split_groups
from .workload import Layout, ModelSpec

BF16, FP32 = torch.bfloat16, torch.float32


@dataclass
class Transfer:
    """One traffic path's collective, as timed."""

    path: str
    """Traffic path (tp_forward, pp_activation, dp_gradient, outer, ...)."""
    seconds: float
    """Time of all its calls in one step (before overlap)."""
    exposed_s: float = 0.0
    """Part of ``seconds`` on the step's critical path."""
    tier_bytes: dict = field(default_factory=dict)
    """Bytes all ranks send over each tier in one step (amortised over H for local steps)."""


@dataclass
class StepEstimate:
    """The model's answer for one (model, layout, cluster, method)."""

    method: Method
    layout: Layout
    step_s: float
    """Seconds per iteration (steady state; 1-bit Adam after its warm-up)."""
    compute_s: float
    """M x t_mb: the step's useful compute on one stage."""
    bubble_s: float
    """Pipeline fill and drain."""
    transfers: list
    """One Transfer per traffic path."""
    memory_bytes: float
    """Peak memory per device (weights, gradients, optimizer state, error feedback, activations of 1F1B)."""
    mfu: float
    """Model FLOPs per second over all devices' peak."""
    tokens_per_step: int
    """Tokens of one iteration."""

    @property
    def utilisation(self) -> float:
        """Compute utilisation: compute / step."""
        return self.compute_s / self.step_s

    @property
    def exposed_comm_s(self) -> float:
        """Communication on the critical path per step."""
        return sum(t.exposed_s for t in self.transfers)

    def bytes_per_token(self) -> dict:
        """Bytes all ranks send per token of training, per tier."""
        out = {t: 0.0 for t in TIERS}
        for tr in self.transfers:
            for tier, b in tr.tier_bytes.items():
                out[tier] += b / self.tokens_per_step
        return out


def _hops(op: str, p: int, lossy: bool, backend: str = "nccl") -> int:
    """Sequential message rounds of one call, each paying the latency of the slowest tier it crosses. megacomp's
    pipeline segments are all issued before the first is waited on, so their latencies overlap: paid once."""
    if p < 2:
        return 0
    if op == "send":
        return 1
    if not lossy:
        # gloo's reduce-scatter is its ring all-reduce (see :func:`phases`)
        return 2 * (p - 1) if op == "all_reduce" or (op == "reduce_scatter" and backend == "gloo") else p - 1
    # megacomp: all-to-all (one round) then, for an all-reduce over > 2 ranks, a ring all-gather on NCCL; on gloo
    # the all-gather is one round of direct sends
    if backend == "gloo":
        return 2 if op == "all_reduce" and p > 2 else 1
    return 1 + (p - 1 if op in ("all_reduce", "all_gather") and p > 2 else 0)


def phases(backend: str, op: str, spec, numel: int, p: int, dtype=FP32,
           segment_numel: int = SEGMENT_NUMEL) -> list[tuple[str, float]]:
    """``(pattern, bytes each rank sends)`` of one call of ``op`` over ``p`` ranks (patterns:
    megacomp.plan.routing), per backend (megacomp.plan.cluster.BACKENDS):

      nccl   uncompressed all-reduce, reduce-scatter, all-gather: ring. Compressed (megacomp.comm.collectives):
             reduce-scatter direct (all-to-all of encoded chunks); all-gather a ring (all_gather_into_tensor of
             the encoded bytes); all-reduce over two ranks direct, over more the reduce-scatter's direct exchange
             then a ring all-gather of the re-encoded shards.
      gloo   (host tensors) uncompressed all-reduce and all-gather: ring. Uncompressed reduce-scatter: gloo runs its
             all-reduce on the whole input and keeps its chunk, so each rank sends all-reduce bytes, 2 (p-1) m
             itemsize for m output elements: twice the ring's (measured over a shaped link and on loopback,
             benchmarks/results/netns_nodes). Compressed: every exchange direct, the all-gathers too, since
             megacomp.comm.transport moves encoded bytes as direction-split p2p on gloo (each rank sends its encoded
             shard to each other rank; a node of m ranks sends m (p - m) shards out, not the ring's p - 1).

    Bytes are megacomp.plan.wire's (megacomp.comm.stats' counts) except gloo's uncompressed reduce-scatter, which
    megacomp.comm books at the ring's (p-1) m itemsize. ValueError for an unknown ``op``."""
    codec = wire.codec_of(spec)
    lossy = not codec.is_identity
    if op == "send":
        return [("chain", wire.send_bytes(codec, numel, dtype))]
    if op == "all_reduce":
        total = wire.all_reduce_bytes(codec, numel, p, dtype, segment_numel)
        if not lossy:
            return [("ring", total)]
        if p == 2:
            return [("direct", total)]
        ag = (p - 1) * sum(n * max(codec.wire_bytes(s) for s in wire.split_counts(seg, p))
                           for seg, n in wire.segment_counts(numel, segment_numel).items())
        return [("direct", total - ag), ("direct" if backend == "gloo" else "ring", ag)]
    if op == "reduce_scatter":
        if lossy:
            return [("direct", wire.reduce_scatter_bytes(codec, numel, p, dtype, segment_numel))]
        if backend == "gloo":
            return [("ring", wire.all_reduce_bytes(None, p * numel, p, dtype))]
        return [("ring", wire.reduce_scatter_bytes(None, numel, p, dtype))]
    if op == "all_gather":
        return [("direct" if lossy and backend == "gloo" else "ring",
                 wire.all_gather_bytes(codec, numel, p, dtype, segment_numel))]
    raise ValueError(f"unknown collective {op!r}: use all_reduce, reduce_scatter, all_gather or send")


def collective_seconds(routes: Routes, groups_, op: str, spec, numel: int, dtype=FP32,
                       segment_numel: int = SEGMENT_NUMEL) -> tuple[float, dict]:
    """(seconds, bytes per tier over all ranks) of one call of ``op`` (all_reduce, reduce_scatter with ``numel``
    output elements per rank, all_gather with ``numel`` input elements per rank, send) run by every group of
    ``groups_`` at once with codec ``spec``, on ``routes.cluster``."""
    cluster = routes.cluster
    p = len(groups_[0]) if groups_ else 1
    if p < 2 or numel <= 0:
        return 0.0, {t: 0.0 for t in TIERS}
    codec = wire.codec_of(spec)
    lossy = not codec.is_identity
    patterns = phases(cluster.backend, op, codec, numel, p, dtype, segment_numel)
    t_wire, used, tier_bytes = 0.0, set(), {t: 0.0 for t in TIERS}
    for pattern, b in patterns:
        loads = routes.tier_loads(groups_, pattern, b)
        t_wire += max(loads[t] / cluster.link(t).rate_Bps for t in TIERS)
        used |= {t for t in TIERS if loads[t] > 0}
        for t, v in routes.crossing_bytes(groups_, pattern, b).items():
            tier_bytes[t] += v
    in_numel = numel * (p if op == "reduce_scatter" else 1)
    segments = sum(wire.segment_counts(in_numel, segment_numel).values()) if lossy else 1
    alpha = max((cluster.link(t).latency_s for t in used), default=0.0)
    t = _hops(op, p, lossy, cluster.backend) * alpha
    if lossy and op != "send":
        E, D = codec_work(op, p)
        t_codec = (E + D) * in_numel * torch.empty((), dtype=dtype).element_size() / cluster.device.codec_Bps
        t += pipeline(t_wire, t_codec, segments)
    elif lossy:
        t += t_wire + 2 * numel * 2 / cluster.device.codec_Bps
    else:
        t += t_wire
    return t, tier_bytes


def hop_by_hop_seconds(routes: Routes, groups_, op: str, spec, numel: int, dtype=FP32,
                       segment_numel: int = SEGMENT_NUMEL) -> tuple[float, dict]:
    """:func:`collective_seconds` of megacomp's hop-by-hop exchange (megacomp.comm.hierarchical) where ``groups_``
    span nodes with several ranks on each and the codec is lossy: the stages one after another, the codec on the
    slowest hop, the faster hops uncompressed (reduce-scatter fastest hop first, all-gather slowest first,
    all-reduce = reduce-scatter up to the slowest hop, all-reduce there, all-gather back). Otherwise the flat
    collective (an uncompressed message is torch's collective over the whole group, as at run time)."""
    codec = wire.codec_of(spec)
    stages = routes.hop_stages(groups_) if op != "send" and not codec.is_identity else ()
    if not stages:
        return collective_seconds(routes, groups_, op, spec, numel, dtype, segment_numel)
    sizes = [len(subs[0]) for _, subs in stages]
    last = len(stages) - 1
    calls = []  # (stage, op, numel, lossy)
    if op == "reduce_scatter":  # numel: output per rank; stage i leaves numel x (slower sizes) per rank
        calls = [(i, "reduce_scatter", numel * math.prod(sizes[i + 1:]), i == last) for i in range(len(stages))]
    elif op == "all_gather":  # numel: input per rank
        calls = [(i, "all_gather", numel * math.prod(sizes[i + 1:]), i == last) for i in reversed(range(len(stages)))]
    elif op == "all_reduce":
        faster = math.prod(sizes[:-1])
        padded = -(-numel // faster) * faster
        up = [(i, padded // math.prod(sizes[:i + 1])) for i in range(last)]
        calls = ([(i, "reduce_scatter", n, False) for i, n in up] + [(last, "all_reduce", padded // faster, True)]
                 + [(i, "all_gather", n, False) for i, n in reversed(up)])
    else:
        raise ValueError(f"unknown collective {op!r}: use all_reduce, reduce_scatter, all_gather or send")
    total, tier_bytes = 0.0, {t: 0.0 for t in TIERS}
    for i, stage_op, n, lossy in calls:
        t, tb = collective_seconds(routes, stages[i][1], stage_op, spec if lossy else None, n, dtype, segment_numel)
        total += t
        for tier, v in tb.items():
            tier_bytes[tier] += v
    return total, tier_bytes


def _scaled(tier_bytes: dict, k: float) -> dict:
    return {t: v * k for t, v in tier_bytes.items()}


def estimate(model: ModelSpec, layout: Layout, cluster: Cluster, method: Method, replicas: int = 1,
             routes: Routes | None = None) -> StepEstimate:
    """The step-time estimate of ``method`` (see the module docstring); ``replicas``: local-step replicas (the
    DP groups split into that many contiguous blocks, one per site when replicas = sites); ``routes``: a
    megacomp.plan.routing.Routes of ``cluster`` to share between calls (ranking many methods), else a fresh one."""
    layout.check(model, cluster.gpus)
    routes = routes if routes is not None and routes.cluster == cluster else Routes(cluster)
    groups = routes.groups
    codecs = {k: wire.codec_of(getattr(method, k)) for k in ("dp_gradient", "dp_parameter", "tp", "pp", "outer")}
    dev, tp, pp, dp, vp = cluster.device, layout.tp, layout.pp, layout.dp, layout.vp
    M = layout.micro_batches(model)
    s, b, h, L = model.seq_length, model.micro_batch_size, model.hidden_size, model.num_layers
    tokens_mb = b * s
    t_mb = model.flops_per_token * tokens_mb / (tp * pp) / (dev.peak_flops * dev.mfu)
    transfers: list[Transfer] = []

    # -- TP / SP: per layer, forward 2 and backward 2 collectives of the s x b x h activations -------------------
    stage_extra = 0.0
    if tp > 1:
        tg = groups(layout, "tp")
        act = s * b * h
        calls_per_mb = 2 * (L // pp)
        if layout.sequence_parallel:
            ops = [("sp_all_gather", "all_gather", act // tp), ("sp_reduce_scatter", "reduce_scatter", act // tp)]
        else:
            ops = [("tp_forward", "all_reduce", act), ("tp_backward", "all_reduce", act)]
        for path, op, n in ops:
            t1, tb = collective_seconds(routes, tg, op, codecs["tp"], n, BF16)
            k = calls_per_mb * (2 if layout.sequence_parallel else 1)  # SP: each op in forward and backward
            transfers.append(Transfer(path, k * M * t1, k * M * t1, _scaled(tb, k * M)))
            stage_extra += k * t1
    # -- PP: an activation forward and its gradient backward per micro-batch and virtual stage boundary -----------
    if pp > 1:
        n = (s // tp if layout.sequence_parallel else s) * b * h
        t1, tb = collective_seconds(routes, groups(layout, "pp"), "send", codecs["pp"], n, BF16)
        # chain traffic counts both directions: one call = an activation and its gradient
        transfers.append(Transfer("pp_activation+gradient", vp * M * t1, vp * M * t1, _scaled(tb, vp * M)))
        stage_extra += vp * t1
    t_stage = t_mb + stage_extra
    bubble = (pp - 1) / vp * t_stage
    t_pipe = M * t_stage + bubble

    # -- DP: the method's schedule -------------------------------------------------------------------------------
    n_shard = model.params // (tp * pp)
    dpg = groups(layout, "dp")
    exposed_dp = 0.0
    sched = method.schedule
    if sched == "local_steps":
        inner, outer = split_groups(dpg, replicas) if replicas > 1 else (dpg, [])
        dpg = inner
    shard = math.ceil(n_shard / len(dpg[0]))
    gdt = BF16 if method.gradient_dtype in ("float16", "bfloat16") else FP32
    pdt = getattr(torch, model.params_dtype)
    window_bwd = 2.0 / 3.0 * t_mb  # the last micro-batch's backward: gradients are final only there
    window_fwd = 1.0 / 3.0 * t_mb
    if sched in ("zero1", "zero2", "acco", "local_steps"):
        # megacomp's sharded optimizer: hop by hop where the DP group spans nodes (pretraining's --dp-collectives auto)
        dp_call = hop_by_hop_seconds if method.dp_collectives == "auto" else collective_seconds
        # its 1-D parameters (biases, norms) sit in uncompressed buckets: their exchange goes uncompressed, flat
        vec = math.ceil(model.vector_params / (tp * pp) / len(dpg[0]))
        lossy = {k: not codecs[k].is_identity for k in ("dp_gradient", "dp_parameter")}
        mat = {k: shard - vec if lossy[k] else shard for k in lossy}
        t_rs, tb_rs = dp_call(routes, dpg, "reduce_scatter", codecs["dp_gradient"], mat["dp_gradient"], gdt)
        t_ag, tb_ag = dp_call(routes, dpg, "all_gather", codecs["dp_parameter"], mat["dp_parameter"], pdt)
        for key, op, dt in (("dp_gradient", "reduce_scatter", gdt), ("dp_parameter", "all_gather", pdt)):
            if lossy[key] and vec > 0:
                t_v, tb_v = collective_seconds(routes, dpg, op, None, vec, dt)
                if key == "dp_gradient":
                    t_rs, tb_rs = t_rs + t_v, {t: tb_rs[t] + tb_v[t] for t in TIERS}
                else:
                    t_ag, tb_ag = t_ag + t_v, {t: tb_ag[t] + tb_v[t] for t in TIERS}
        k = 2 if sched == "acco" else 1
        k_rs = M if sched == "zero2" else k  # megacomp's ZeRO-2 reduce-scatters every micro-batch's gradients
        if sched == "acco":  # both halves' exchanges run while the next half computes
            e_rs = max(0.0, k * (t_rs + t_ag) - t_pipe)
            e_ag = 0.0
        else:
            # megacomp's sharded optimizer starts each bucket's reduce-scatter from its gradient hooks, during the
            # last micro-batch's backward (ZeRO-2: every micro-batch's); the shaped-link runs confirm it
            # (benchmarks/results/plan: ZeRO-1 at 100 Mbit/s was over-predicted by 16-20% with it exposed)
            e_rs = M * max(0.0, t_rs - window_bwd) if sched == "zero2" else max(0.0, t_rs - window_bwd)
            e_ag = max(0.0, t_ag - window_fwd) if method.overlap_param_gather else t_ag
        transfers += [Transfer("dp_gradient", k_rs * t_rs, e_rs, _scaled(tb_rs, k_rs)),
                      Transfer("dp_parameter", k * t_ag, e_ag, _scaled(tb_ag, k))]
        exposed_dp += e_rs + e_ag
    elif sched == "ddp_buckets":
        t_ar, tb = collective_seconds(routes, dpg, "all_reduce", codecs["dp_gradient"], n_shard, gdt)
        e = max(0.0, t_ar - window_bwd)
        transfers.append(Transfer("dp_gradient", t_ar, e, tb))
        exposed_dp += e
    elif sched == "onebit":
        t_ar, tb = collective_seconds(routes, dpg, "all_reduce", codecs["outer"], n_shard, FP32)
        transfers.append(Transfer("dp_momentum", t_ar, t_ar, tb))
        exposed_dp += t_ar
    elif sched == "demo":
        t_ag, tb = collective_seconds(routes, dpg, "all_gather", codecs["outer"], n_shard, FP32)
        transfers.append(Transfer("demo", t_ag, t_ag, tb))
        exposed_dp += t_ag
    else:
        raise ValueError(f"unknown schedule {sched!r} of method {method.name!r}")
    opt_s = (n_shard / (len(dpg[0]) if sched not in ("ddp_buckets", "onebit", "demo") else 1)) * 36 / dev.memory_bandwidth_Bps
    step = t_pipe + exposed_dp + opt_s
    if sched == "local_steps" and outer:
        H, P = method.outer_steps, method.fragments
        # each rank exchanges its inner shard's pseudo-gradient (megacomp.outer: "this rank's parameter shards")
        t_o, tb_o = collective_seconds(routes, outer, method.outer_op, codecs["outer"],
                                       math.ceil(n_shard / len(inner[0]) / P), FP32)
        syncs_per_step = P / H
        hidden = method.delay * step if P > 1 else 0.0
        e = max(0.0, t_o - hidden) * syncs_per_step
        transfers.append(Transfer("outer", t_o * syncs_per_step, e, _scaled(tb_o, syncs_per_step)))
        step += e
    mem = memory_per_device(model, layout, method, replicas)
    flops_step = model.flops_per_token * model.tokens_per_iteration
    return StepEstimate(method, layout, step, M * t_mb, bubble, transfers, mem,
                        flops_step / (step * cluster.gpus * dev.peak_flops), model.tokens_per_iteration)


def memory_per_device(model: ModelSpec, layout: Layout, method: Method, replicas: int = 1) -> float:
    """Bytes per device: bf16 weights (2/param), fp32 gradients (4; ZeRO-2: /DP), fp32 master + Adam moments (12;
    /DP when sharded: zero1, zero2, acco, local steps over the replica), error feedback (4 per DP gradient
    element with error feedback; 1-bit Adam worker + server 4 + 4/DP), DiLoCo's outer copy and momentum (8), and the
    activations 1F1B keeps on the first stage (Korthikanti et al.: s b h (34 + 5 a s / h) per layer, / TP with
    sequence parallelism; L layers' worth: L/PP layers x PP micro-batches in flight)."""
    n = model.params / (layout.tp * layout.pp)
    dp = layout.dp // (replicas if method.schedule == "local_steps" else 1)
    sched = method.schedule
    sharded = sched in ("zero1", "zero2", "acco", "local_steps")
    mem = 2 * n + (4 * n / dp if sched == "zero2" else 4 * n) + (12 * n / dp if sharded else 12 * n)
    if method.compression.get("dp_gradient_error_feedback"):
        mem += 4 * n  # the worker error of the whole fp32 gradient
    if sched == "onebit":
        mem += 4 * n + 4 * n / dp
    if sched == "demo":
        mem -= 8 * n  # sign-SGD with momentum: one fp32 momentum, no Adam moments
    if sched == "local_steps":
        mem += 8 * n
    s, b, h, a, tp = model.seq_length, model.micro_batch_size, model.hidden_size, model.num_attention_heads, layout.tp
    per_layer = s * b * h * (34 + 5 * a * s / h) / (tp if layout.sequence_parallel else 1)
    if not layout.sequence_parallel and tp > 1:
        per_layer = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    return mem + per_layer * model.num_layers / layout.vp * (1 + (layout.vp - 1) / layout.pp)

"""The step model on the shaped-link benchmark's own runs (two CPU ranks joined by one ``tc``-shaped link), so the
plan's schedules are checked against measurements: megacomp.plan.estimate's overlap rules with the fitted link
(megacomp.plan.calibration) and the measured no-communication step as the compute.

  T_step = T_floor + exposed(schedule) + kappa x T_codec + T_work + T_extra
  exposed: after_backward   T_comm                                    (PowerSGD, run in the hook or after backward;
                                                                       1-bit Adam in step(); ZeRO-1's all-gather;
                                                                       torch ZeRO's broadcast)
           in_backward      max(T_last bucket, T_comm - o x 2/3 T_floor)  (DDP buckets, the megacomp hook,
                                                                           1-bit Adam's exchange in backward,
                                                                           megacomp ZeRO-1's reduce-scatter,
                                                                           launched by its gradient hooks)
           in_forward       max(0, T_comm - 1/3 T_floor)               (the overlapped parameter all-gather)
           in_step          max(0, T_comm - T_floor)                   (ACCO and DPU: the next step's compute)
  T_comm = calls x alpha + pipeline(wire bytes / (eta B), codec time) per phase, wire bytes from
           megacomp.plan.wire (the codecs) unless the method's bytes come from elsewhere (PowerSGD's low-rank
           factors, 0/1 Adam's skipped rounds: the measured bytes per step, 0/1 Adam's codec on that share)
  kappa    codec work that runs while the model computes (an exchange in backward, forward or the next step)
           competes with it for the machine's two cores (fitted); an exchange after backward has nothing to
           compete with, its codec time is in its T_comm
  o        fraction of the backward a bucketed exchange really overlaps on two cores, one per engine: torch's
           DDP buckets and hooks, megacomp's collectives finished on a background thread (fitted; the forward and
           next-step windows are taken whole: no fitted run has them, so their factor cannot be fitted)
  T_work   the method's CPU work on the critical path besides its codecs (megacomp.plan.cpu_work: PowerSGD's
           products and passes, Accordion's norm sums, the 1-bit family's momentum forming, 1-bit LAMB's longer
           step), on the run's Machine; nothing fitted
  T_extra  the method's CPU cost that T_work's operation counts miss (Python and dispatch overhead per tensor,
           finiteness checks whose kernel runs far below the memory rate, allocation, ACCO's two half-batch passes):
           measured, per parameter, on an unshaped link (benchmarks/results/plan/unshaped, 10 Gbit/s: the method's step
           minus the step this model predicts there, median over seeds) and scaled by the parameter count; the
           shaped-link points it is then checked on are never used. It adds to the critical path, except for the
           1-bit family (:func:`extra_in_codec_stage`), where it joins the codec stage inside pipeline() and so
           hides behind a slower wire
  Machine  the session that measured the codecs (benchmarks/results/benchmarks): F = the benchmark GPT's forward +
           backward FLOPs per step / its no-communication step; B = twice its measured memcpy rate (a copy reads
           and writes). Every run uses these, as it uses the codec throughputs measured there: the floors of one
           study's seeds (same code, same session) differ by up to 20%, so a run's floor is too noisy a measure of
           its machine's speed to rescale its CPU work by (doing so gave a 36.6% held-out maximum).

Error bound: none a priori; benchmarks/results/plan lists every point's error. Failure behaviour: a method the
table does not know returns None (the validation skips it and says so).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import wire
from .calibration import Model, _codec_time, pipeline
from .cpu_work import Work, accordion_observe_work, onebit_work, powersgd_work

INT4 = "int4"
"""Calibration name of the int4 codec."""


@dataclass(frozen=True)
class Phase:
    """One exchange of a step."""

    op: str
    """all_reduce, reduce_scatter, all_gather or broadcast."""
    codec: str
    """Calibration codec name (``none``, ``int4``, ``int8``, ``bf16``...)."""
    wire_bytes: float
    """Bytes one rank sends (torch ZeRO's broadcasts: the bytes their sequence holds the link for)."""
    codec_bytes: float
    """fp32 bytes the codec encodes (0 for an uncompressed phase)."""
    calls: int
    """Calls (buckets) of this phase."""
    window: str
    """after_backward, in_backward, in_forward or in_step."""
    engine: str = "torch"
    """Who runs the exchange: ``torch`` (DDP's buckets and hooks on the autograd thread) or ``megacomp`` (its
    collectives, finished on a background thread); each has its own fitted overlap share."""


def method_phases(method: str, params: int, world: int, bucket_bytes: float, measured_bytes=None):
    """The exchanges of a benchmark method (netns_bench's names), or None when the method is not modelled."""
    return _engine(method, _phases(method, params, world, bucket_bytes, measured_bytes))


def _phases(method: str, params: int, world: int, bucket_bytes: float, measured_bytes=None):
    S, n = 4.0 * params, params
    buckets = max(1, math.ceil(S / bucket_bytes))
    shard = math.ceil(n / world)
    int4 = {"name": "int4", "block_size": 128}
    int8p = {"name": "int8", "block_size": 256}
    sign = {"name": "sign", "block_size": 0}
    if method == "ddp_fp32":
        return [Phase("all_reduce", "none", wire.all_reduce_bytes("none", n, world), 0, buckets, "in_backward")]
    if method in ("ddp_fp16_hook", "ddp_bf16_hook"):
        return [Phase("all_reduce", "none", wire.all_reduce_bytes("none", n, world, torch.bfloat16), 0,
                      buckets, "in_backward")]
    if method == "zero_redundancy":
        # torch's ZeroRedundancyOptimizer broadcasts each rank's updated shard from that rank, one rank after
        # another: a rank sends (p - 1) / p S, but the p broadcasts of S / p hold the link for S / B in all (the
        # calibration run: 2.38 s at 100 Mbit/s, 1.85 s predicted with (p - 1) / p S), so the phase is timed on S
        return [Phase("all_reduce", "none", wire.all_reduce_bytes("none", n, world), 0, buckets, "in_backward"),
                Phase("broadcast", "none", S, 0, world, "after_backward")]
    if method.startswith("megacomp_hook_int4"):
        return [Phase("all_reduce", INT4, wire.all_reduce_bytes(int4, n, world), S, buckets, "in_backward")]
    if method.startswith("megacomp_zero_one_adam"):
        if measured_bytes is None:
            return None
        # 1-bit Adam's sign exchange on the share of steps that synchronise (its local steps skip it): the codec
        # encodes that share of the momentum, the wire carries the measured bytes
        share = measured_bytes / wire.all_reduce_bytes(sign, n, world)
        return [Phase("all_reduce", "sign", measured_bytes, share * S, buckets, "after_backward")]
    if method.startswith(("ddp_powersgd", "megacomp_powersgd", "megacomp_accordion")):
        if measured_bytes is None:
            return None
        # torch's hook: one bucket, three all-reduces (P, Q, the rest); megacomp's: three per bucket, each finished
        # in the hook before backward goes on (megacomp.comm.low_rank_channel): exposed either way
        calls = 3 * buckets if method.startswith(("megacomp_powersgd", "megacomp_accordion")) else 3
        return [Phase("all_reduce", "none", measured_bytes, 0, calls, "after_backward")]
    if method.startswith(("megacomp_onebit_adam", "megacomp_onebit_lamb")):
        where = "after_backward" if "in_step" in method else "in_backward"
        return [Phase("all_reduce", "sign", wire.all_reduce_bytes(sign, n, world), S, buckets, where)]
    if "_int4_loco_int8" in method:  # the sharded optimizer: reduce-scatter int4, all-gather int8
        # the reduce-scatter of each bucket starts from the gradient hooks, in backward (DistributedOptimizer)
        rs = Phase("reduce_scatter", INT4, wire.reduce_scatter_bytes(int4, shard, world), S, buckets, "in_backward")
        ag = Phase("all_gather", "int8", wire.all_gather_bytes(int8p, shard, world, torch.bfloat16), S / world,
                   buckets, "after_backward")
        if "overlap_gather" in method:
            ag = Phase(ag.op, ag.codec, ag.wire_bytes, ag.codec_bytes, ag.calls, "in_forward")
        if "_acco_" in method:
            return [Phase(p.op, p.codec, 2 * p.wire_bytes, 2 * p.codec_bytes, 2 * p.calls, "in_step") for p in (rs, ag)]
        if "_dpu_" in method:
            return [Phase(p.op, p.codec, p.wire_bytes, p.codec_bytes, p.calls, "in_step") for p in (rs, ag)]
        return [rs, ag]
    return None


def _engine(method: str, phases):
    """``phases`` with the engine that runs ``method`` (megacomp_* methods: megacomp's, the rest torch's)."""
    if phases is None or not method.startswith("megacomp_"):
        return phases
    return [Phase(p.op, p.codec, p.wire_bytes, p.codec_bytes, p.calls, p.window, "megacomp") for p in phases]


@dataclass(frozen=True)
class Machine:
    """The CPU that runs a method's work (module docstring): its compute rate and memory traffic rate."""

    flop_rate: float
    """F: FLOPs per second (the benchmark GPT's step FLOPs over its no-communication step)."""
    memory_Bps: float
    """B: bytes read + written per second by elementwise passes (twice the measured memcpy rate)."""


def method_work(method: str, shapes) -> Work:
    """CPU work of a benchmark method besides its codecs, on the critical path (megacomp.plan.cpu_work); ``shapes``:
    the model's parameter shapes. Zero for the methods that add none the model counts."""
    numel = sum(math.prod(s) for s in shapes)
    if method.startswith(("ddp_powersgd", "megacomp_powersgd")):
        engine = "torch" if method.startswith("ddp_") else "megacomp"
        return powersgd_work(shapes, int(method.rsplit("powersgd", 1)[1]), engine)
    if method == "megacomp_accordion":  # at its low (rank 1) level at the end of the run, whose bytes are measured
        return powersgd_work(shapes, 1, "megacomp") + accordion_observe_work(numel)
    if method.startswith("megacomp_onebit_lamb"):
        return onebit_work(numel, lamb=True)
    if method.startswith("megacomp_onebit_adam"):
        return onebit_work(numel)
    return Work()


def phase_seconds(model: Model, phase: Phase, rate_Bps: float, world: int, stage_s: float = 0.0) -> tuple[float, float]:
    """(communication seconds, codec seconds) of one phase with the fitted link and codecs; ``stage_s``: more
    seconds in its codec stage (pipelined with the wire, not counted in the codec seconds returned)."""
    op = "all_reduce" if phase.op == "broadcast" else phase.op
    alpha, eta = model.link(op if phase.codec == "none" else "all_reduce")
    t_wire = phase.wire_bytes / (eta * rate_Bps)
    t_codec = _codec_time(model, op, phase.codec, phase.codec_bytes, world) if phase.codec_bytes else 0.0
    segments = math.ceil(phase.codec_bytes / 4 / model.segment_elems) if phase.codec_bytes else 1
    return phase.calls * alpha + pipeline(t_wire, t_codec + stage_s, segments), t_codec


_WINDOWS = (("after_backward", 0.0), ("in_backward", 2.0 / 3.0), ("in_forward", 1.0 / 3.0), ("in_step", 1.0))


def predict_step(model: Model, phases, rate_Bps: float, world: int, floor_s: float, overlap=1.0,
                 contention: float = 0.0, work_s: float = 0.0, stage_s: float = 0.0) -> float:
    """T_step of the module docstring; ``overlap``: o for both engines, or (o_torch, o_megacomp); ``work_s``: T_work
    (and a serial T_extra) in seconds; ``stage_s``: a T_extra that runs in the codec stage of the compressed phases
    (:func:`extra_in_codec_stage`), shared among them by the bytes they encode (on the critical path when no phase
    is compressed)."""
    o_of = dict(zip(("torch", "megacomp"), overlap if isinstance(overlap, tuple) else (overlap, overlap)))
    windows = dict(_WINDOWS)
    by_window: dict = {}
    codec_s = 0.0
    last_bucket = 0.0
    coded = sum(ph.codec_bytes for ph in phases)
    for ph in phases:
        t, tc = phase_seconds(model, ph, rate_Bps, world, stage_s * ph.codec_bytes / coded if coded else 0.0)
        key = (ph.window, ph.engine)
        by_window[key] = by_window.get(key, 0.0) + t
        if ph.window != "after_backward":  # contention: only codec work that runs while the model computes
            codec_s += tc
        if ph.window == "in_backward":
            last_bucket = max(last_bucket, t / ph.calls)
    exposed = 0.0
    for (w, engine), t in by_window.items():
        hidden = (o_of[engine] if w == "in_backward" else 1.0) * windows[w] * floor_s
        exposed += max(last_bucket if w == "in_backward" else 0.0, t - hidden)
    return floor_s + exposed + contention * codec_s + work_s + (0.0 if coded else stage_s)


def extra_in_codec_stage(method: str) -> bool:
    """Whether a method's T_extra runs in its exchange's codec stage, beside the wire, rather than on the step's
    critical path: the 1-bit family's exchange encodes every segment with worker and server error feedback (an
    encode, a decode for the residual, a finiteness check and a blend, each side) inside megacomp's pipelined
    collective, so its cost beyond the bare sign codec overlaps the transfer of the other segments."""
    return method.startswith(("megacomp_onebit_", "megacomp_zero_one_adam"))


def fit_overlap_contention(model: Model, points) -> tuple[tuple[float, float], float]:
    """((o_torch, o_megacomp), kappa) minimising the squared relative error over ``points`` = [(phases, rate,
    world, floor, measured[, work seconds[, codec-stage seconds]])] on a grid (o in [0, 1] by 0.04, kappa in [0, 10] by 0.5).
    An engine with no point in backward keeps o = 1 (nothing to fit it on)."""
    engines = {ph.engine for phases, *_ in points for ph in phases if ph.window == "in_backward"}
    grid = np.linspace(0.0, 1.0, 26)
    best = ((1.0, 1.0), 0.0, math.inf)
    for ot in grid if "torch" in engines else (1.0,):
        for om in grid if "megacomp" in engines else (1.0,):
            for k in np.linspace(0.0, 10.0, 21):
                o = (float(ot), float(om))
                err = sum(((predict_step(model, ph, r, w, f, o, k, *extra) - m) / m) ** 2
                          for ph, r, w, f, m, *extra in points)
                if err < best[2]:
                    best = (o, float(k), err)
    return best[0], best[1]

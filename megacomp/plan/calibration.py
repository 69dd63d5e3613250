"""Calibration of the plan's link and codec constants on shaped-link measurements (the alpha-beta model).

Notation: S = fp32 bytes of the tensor (nccl-tests convention: all_reduce in/out S, reduce_scatter in S,
all_gather out S), p = ranks, B = nominal link rate (bytes/s), b = wire bits per element of a codec
(scales included; 32 for fp32), enc/dec = codec throughput in fp32 bytes per second.

Collectives (one call):
  wire bytes per rank     W = f_op(p) * S * b/32,  f = 2(p-1)/p for all_reduce, (p-1)/p for RS and AG
  transfer time           T_w = W / (eta * B)
  codec compute           T_c = E*S/enc + D*S/dec, with (E, D) the fp32 bytes encoded/decoded per byte of S:
                            all_reduce p=2: (1, 2); all_reduce p>2: (1+1/p, 2); reduce_scatter: (1, 1);
                            all_gather: (1/p, 1); uncompressed: (0, 0)
  uncompressed            T = alpha + T_w
  compressed              pipelined in segments of 1M elements (n segments), codec and wire overlap:
                            T = alpha + max(T_w, T_c) + min(T_w, T_c)/n
Fit: alpha and 1/eta by linear least squares in relative error on the uncompressed points, per collective where
it has two or more sizes or rates (one pooled fit biased every fp32 all-reduce by +8-11%), pooled otherwise; codec
throughput as measured (``codec_throughput``) or one throughput per codec fitted by a 1-D search. The DP-step part
(:mod:`megacomp.plan.shaped_steps`) adds a CPU-contention factor.

Error bound: none a priori; the validation tables (benchmarks/results/plan) state the held-out errors. Failure
behaviour: no uncompressed points raises ValueError.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

SEGMENT_ELEMS = 1 << 20  # megacomp.comm.transport pipeline segment (elements)
MiB = 1 << 20
DEFAULT_BITS = (("none", 32.0), ("fp32", 32.0), ("bf16", 16.0), ("fp16", 16.0), ("int8", 8.25), ("int4", 4.25))
"""Wire bits per element of the codecs the shaped-link benchmark runs, when a record does not say."""


@dataclass
class Codec:
    """Throughput of one codec on the calibration machine."""

    encode_Bps: float  # fp32 bytes encoded per second
    decode_Bps: float  # fp32 bytes decoded per second
    source: str  # "measured" (codec_throughput), "fitted" or "unidentifiable (transfer-bound)"


@dataclass
class Model:
    """The fitted link (alpha, eta; pooled and per collective) and codec constants."""

    alpha_s: float  # per-call latency
    eta: float  # achieved fraction of the nominal link rate
    codecs: dict[str, Codec] = field(default_factory=dict)
    bits: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BITS))
    n_points: int = 0  # uncompressed points alpha/eta were fitted on
    segment_elems: int = SEGMENT_ELEMS
    links: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # op -> (alpha, eta, points)

    def link(self, op: str) -> tuple[float, float]:
        """(alpha, eta) of collective ``op``: its own fit when it has one, else the pooled fit."""
        a, e, _ = self.links.get(op, (self.alpha_s, self.eta, 0))
        return a, e


@dataclass
class Row:
    """One validation point: measured and predicted seconds, and whether the fit saw it."""

    kind: str  # "collective" | "ddp"
    point: str
    measured_s: float
    predicted_s: float
    held_out: bool = False
    note: str = ""

    @property
    def rel_err(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass
class Validation:
    """Validation rows with error summaries."""

    rows: list[Row]

    def summary(self, kind: str | None = None, held_out: bool | None = None) -> dict:
        """n, median and max |relative error| of the rows of ``kind`` (all when None), held-out ones only
        (True), fitted ones only (False) or both (None)."""
        errs = [abs(r.rel_err) for r in self.rows if (kind is None or r.kind == kind)
                and (held_out is None or r.held_out == held_out)]
        return {"n": len(errs), "median": statistics.median(errs) if errs else math.nan,
                "max": max(errs, default=math.nan)}


# -- collective model ----------------------------------------------------------------------------------
def wire_bytes(op: str, bits: float, S: float, world: int) -> float:
    """Wire bytes per rank of one ring/direct collective on S fp32 bytes at ``bits`` per element."""
    f = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
    return f * S * bits / 32


def codec_work(op: str, world: int) -> tuple[float, float]:
    """(E, D): fp32 bytes encoded and decoded per fp32 byte of S (see the module docstring)."""
    if op == "all_reduce":
        return (1.0, 2.0) if world == 2 else (1.0 + 1.0 / world, 2.0)
    return (1.0, 1.0) if op == "reduce_scatter" else (1.0 / world, 1.0)


def pipeline(t_wire: float, t_codec: float, segments: int) -> float:
    """Two-stage pipeline of ``segments`` equal segments: max of the stages + one segment's fill/drain."""
    return max(t_wire, t_codec) + min(t_wire, t_codec) / max(1, segments)


def _codec_time(model: Model, op: str, codec: str, S: float, world: int, codec_obj: Codec | None = None) -> float:
    c = codec_obj or model.codecs.get(codec)
    if c is None:
        return 0.0
    E, D = codec_work(op, world)
    return E * S / c.encode_Bps + D * S / c.decode_Bps


def predict_collective(model: Model, op: str, codec: str, nbytes: float, world: int, rate_Bps: float,
                       _codec_obj: Codec | None = None) -> float:
    """Predicted seconds for one call of ``op`` on ``nbytes`` fp32 bytes (S) at ``world`` ranks."""
    bits = model.bits.get(codec, dict(DEFAULT_BITS).get(codec, 32.0))
    # uncompressed: the backend's own collective (its own fit); compressed: megacomp moves the encoded bytes as
    # p2p on direction groups (megacomp.comm.transport), which reach all-reduce's share of the link on gloo
    alpha, eta = model.link(op if codec in ("none", "fp32") else "all_reduce")
    t_wire = wire_bytes(op, bits, nbytes, world) / (eta * rate_Bps)
    if codec in ("none", "fp32"):
        return alpha + t_wire
    t_codec = _codec_time(model, op, codec, nbytes, world, _codec_obj)
    return alpha + pipeline(t_wire, t_codec, math.ceil(nbytes / 4 / model.segment_elems))


# -- calibration ---------------------------------------------------------------------------------------
def _points(results: dict):
    """(record, S, median seconds) of every collective measurement."""
    for r in results.get("collectives", []):
        if r.get("times_s"):
            yield r, r["mib"] * MiB, statistics.median(r["times_s"])


def fit(results: dict, refit_codecs: bool = False, keep=None) -> Model:
    """Calibrate alpha, eta (uncompressed points) and per-codec throughput (measured, else fitted)."""
    pts = [p for p in _points(results) if keep is None or keep(p[0])]
    bits: dict[str, list[float]] = {}
    for r, _, _ in pts:
        bits.setdefault(r["codec"], []).append(float(r.get("bits_per_element") or dict(DEFAULT_BITS).get(r["codec"], 32)))
    model = Model(alpha_s=0.0, eta=1.0)  # alpha, eta set below
    model.bits.update({c: statistics.median(v) for c, v in bits.items()})
    base = [p for p in pts if p[0]["codec"] in ("none", "fp32")] or pts  # fallback: ignore codec compute
    if not base:
        raise ValueError("no collective measurements to calibrate on")
    model.alpha_s, model.eta = _fit_link(model, base)
    model.n_points = len(base)
    # per collective: gloo's reduce-scatter and all-gather reach a lower share of the link than its all-reduce
    # (benchmarks/results/benchmarks), so one pooled (alpha, eta) biases every all-reduce prediction; each op with two or more
    # fp32 points of different sizes or rates gets its own, the rest keep the pooled fit
    for op in sorted({r["op"] for r, _, _ in base}):
        mine = [p for p in base if p[0]["op"] == op]
        if len({(S, r["rate_Bps"]) for r, S, _ in mine}) >= 2:
            alpha, eta = _fit_link(model, mine)
            model.links[op] = (alpha, eta, len(mine))
    measured = results.get("codec_throughput") or {}
    for codec in sorted({r["codec"] for r, _, _ in pts} - {"none", "fp32"}):
        m = measured.get(codec)
        if m and not refit_codecs:
            model.codecs[codec] = Codec(float(m["encode_Bps"]), float(m["decode_Bps"]), "measured")
        else:
            model.codecs[codec] = _fit_codec(model, codec, [p for p in pts if p[0]["codec"] == codec])
    return model


def _fit_link(model: Model, pts: list) -> tuple[float, float]:
    """(alpha, eta) by least squares in relative error on uncompressed points (T = alpha + W/B * 1/eta); a
    negative alpha (latency not resolved by the data) falls back to a pure-bandwidth fit."""
    x = np.array([wire_bytes(r["op"], model.bits.get(r["codec"], 32.0), S, r["world"]) / r["rate_Bps"]
                  for r, S, _ in pts])
    t = np.array([tm for _, _, tm in pts])
    A = np.stack([1 / t, x / t], axis=1)  # rows divided by t: least squares in relative error
    if len(pts) >= 2 and np.ptp(x) > 0:
        (alpha, inv_eta), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    else:
        alpha, inv_eta = 0.0, float(np.median(t / x))
    if alpha < 0:
        alpha, inv_eta = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    return float(alpha), float(1 / inv_eta)


def _fit_codec(model: Model, codec: str, pts: list) -> Codec:
    """One throughput R (encode = decode = R) minimising sum((pred - meas)/meas)^2 over log R."""
    def loss(logR: float) -> float:
        c = Codec(math.exp(logR), math.exp(logR), "fitted")
        return sum(((predict_collective(model, r["op"], codec, S, r["world"], r["rate_Bps"], c) - tm) / tm) ** 2
                   for r, S, tm in pts)
    grid = np.linspace(math.log(1e6), math.log(1e13), 141)
    vals = [loss(g) for g in grid]
    i = int(np.argmin(vals))
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    g = (math.sqrt(5) - 1) / 2
    for _ in range(60):  # golden-section refinement inside the bracketing grid cells
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if loss(a) < loss(b):
            hi = b
        else:
            lo = a
    R = math.exp((lo + hi) / 2)
    flat = vals[-1] - min(vals) <= 1e-9 * max(1.0, min(vals))
    return Codec(R, R, "unidentifiable (transfer-bound)" if flat else "fitted")

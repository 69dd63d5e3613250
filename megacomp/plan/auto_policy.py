"""``--compression auto``'s controller: from one window of measured calls to each laddered path's next codec.

Model (the planner's pieces: megacomp.plan.wire for the bytes each call sends, with gloo's uncompressed
reduce-scatter sending all-reduce bytes as megacomp.plan.estimate.phases says; megacomp.plan.calibration.codec_work
and pipeline for the codec's cost):

  one call, codec r     T(r) = alpha_link + pipeline(bytes(r) / rate_link, t_codec(r), segments)
  t_codec(r)            E x S / encode_Bps(r) + D x S / decode_Bps(r)   (S: the call's tensor bytes; E, D: codec_work;
                        the throughputs measured on this device when the run starts, slowest rank's)
  a path, per iteration T_p(r) = sum over its calls of T(r) / iterations in the window (the slowest rank's)
  exposed               cost_p(r) = max(0, T_p(r) - overlap_p), overlap_p: the compute the path's transfer overlaps
                        (given by the caller from the schedule, as megacomp.plan.estimate: 2/3 of the last
                        micro-batch for dp_gradient under ZeRO-1, 0 for the paths on the critical path; the
                        caller takes the least of that and :func:`overlapped_seconds`, what the run measured)
  step                  compute + sum over paths of cost_p

Link estimate, per link kind, pooled over paths and ranks, from the window's exact calls (megacomp.comm.link_meter:
synchronous ones and waits that blocked), after the codec's predicted time is taken off: t = alpha + bytes / rate,
with ``rate`` from how the time of one kind of call (one path, op, group size, dtype and codec) grows with its size
(least squares within each kind that came in two or more sizes, pooled) and ``alpha`` the mean time that rate leaves
per call. Calls of different kinds are never compared by size: an asynchronous reduce-scatter that overlaps compute
and a synchronous all-gather differ in more than their bytes (on a steady 1 Gbit/s link a fit across the two gave
0.45 to 22 Gbit/s, depending on which codec the gradient had). Without sizes to compare, or with a fit that is not
physical (alpha < 0, rate <= 0), alpha = 0 and rate = sum bytes / sum seconds. A link with no exact call keeps its
last estimate; one never measured exactly is bounded below by its calls' bytes over their issue-to-wait time (a
transfer that hid finished sooner), which can only over-compress.

Choice, per path (rungs within the error budget only, least lossy first):
  no target   the least lossy rung whose exposed time is at most ``slack`` x compute; a rung less lossy than the
              current one must fit with its transfer ``1 + margin`` times longer, the current one fits with its
              transfer ``1 + margin`` times shorter (a band either side of the threshold: a path whose rung sits on
              it, within the measurement's window-to-window noise, stays). None fits: the rung of least exposed
              time (ties: the less lossy).
  target S    from every path on its least lossy rung, step the path whose next rung saves the most exposed time
              until the predicted step is at most S (less lossy than now: S / (1 + margin)); when that ends above S
              every path takes its most lossy rung.
  hysteresis  a path switches only when the same rung was chosen at ``patience`` x 2^k consecutive decisions, k the
              path's switches since its link's estimated rate last moved by more than :data:`RATE_CHANGE` (at most
              :data:`MAX_DOUBLINGS`): a path that already moved on this link needs more evidence to move again, while
              a link that changed resets it.

Determinism: :meth:`Controller.decide` is a pure function of the merged window (every rank's summary, in rank order)
and the controller's state, both identical on every rank, so every rank switches alike; the state round-trips
through :meth:`Controller.state_dict` so a resumed run continues with the same rungs and pending counts.

Failure behaviour: none at decision time (a path without measurements keeps its rung and says so in its reason).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..compression import make_codec
from ..compression.ladder import AutoCodecConfig
from . import wire
from .calibration import codec_work, pipeline

RATE_CHANGE = 3.0
"""A link whose estimated rate moved by more than this factor since a path's last switch is a new link for that path's
patience. The estimates of a steady tc-shaped 1 Gbit/s link ranged over 306-1004 Mbit/s (3.3x) in 144 decisions of
six runs, two consecutive ones by up to 2.4x; the rate changes auto is built for (1 Gbit/s -> 100 -> 20 Mbit/s) are
5x and more. Noise that crosses it only restores the base patience."""

MAX_DOUBLINGS = 3
"""At most this many doublings of ``patience`` (16 decisions at the default 2), so a drift smaller than
:data:`RATE_CHANGE` still moves a path within a bounded time."""

CALIBRATION_NUMEL = 1 << 18
"""Elements of the fp32 tensor each rung's encode and decode are timed on when the run starts."""


def measure_codec(codec, device: torch.device, numel: int = CALIBRATION_NUMEL) -> tuple[float, float]:
    """(encode, decode) fp32 bytes per second of ``codec`` on ``device`` (best of three after a warm-up); (inf, inf)
    for the identity. Synchronises the device around each timing (called once, before training)."""
    codec = make_codec(codec)
    if codec.is_identity:
        return float("inf"), float("inf")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best_e = best_d = float("inf")
    for i in range(4):
        sync()
        t0 = time.perf_counter()
        buf = codec.encode_flat(x)
        sync()
        t1 = time.perf_counter()
        codec.decode_flat(buf, numel)
        sync()
        t2 = time.perf_counter()
        if i:  # the first pass warms caches and kernels
            best_e, best_d = min(best_e, t1 - t0), min(best_d, t2 - t1)
    nbytes = 4 * numel
    return nbytes / max(best_e, 1e-9), nbytes / max(best_d, 1e-9)


def codec_key(codec) -> str:
    """A codec's identity in summaries and state (its ``to_dict`` as sorted JSON)."""
    return json.dumps(make_codec(codec).to_dict(), sort_keys=True)


def summarise(records: list, iterations: int, wall_s: float) -> dict:
    """One rank's window as plain data (what the ranks exchange): compute seconds per iteration (wall time less the
    time blocked in calls), and the calls grouped by (path, link, op, numel, world, itemsize, codec, switchable)
    with [count, seconds, exact count, exact seconds, timed count, longest overlap]: the last is the most seconds
    the caller computed while one timed call of the group was outstanding (issue to the start of its wait)."""
    exposed = sum(r.exposed for r in records)
    calls: dict = {}
    for r in records:
        key = json.dumps([r.path, r.link, r.op, r.numel, r.world, r.itemsize, r.codec, r.switchable], sort_keys=True)
        row = calls.setdefault(key, [0, 0.0, 0, 0.0, 0, 0.0])
        row[0] += 1
        row[1] += r.seconds
        row[2] += int(r.exact)
        row[3] += r.seconds if r.exact else 0.0
        row[4] += int(r.timed)
        if r.timed:
            row[5] = max(row[5], r.seconds - r.exposed)
    return {"iterations": iterations, "compute_s": max(0.0, wall_s - exposed) / max(1, iterations), "calls": calls}


def overlapped_seconds(summaries: list, path: str) -> Optional[float]:
    """The compute ``path``'s transfer could hide behind in the measured window: per rank the longest time the
    caller computed while one of the path's timed calls was outstanding (issue to the start of its wait; 0 for a
    synchronous call), the least over the ranks; None when no rank timed a call of the path (e.g. asynchronous
    calls on CUDA).

    Why measured: the schedule's model (2/3 of the last micro-batch's backward for the gradient reduce-scatter)
    assumes many buckets whose reductions start during backward; a model of few buckets starts its only reduction
    after backward and waits for it at once, so nothing hides it. The longest window stands for the path (its first
    bucket's, which spans the later buckets' transfers too)."""
    per_rank = []
    for s in summaries:
        rows = [row for key, row in s["calls"].items() if json.loads(key)[0] == path and row[4]]
        if rows:
            per_rank.append(max(row[5] for row in rows))
    return min(per_rank) if per_rank else None


@dataclass
class Prediction:
    """A path's predicted transfer per iteration on each allowed rung, and what it overlaps."""

    seconds: list
    """T_p(r) per allowed rung."""
    overlap_s: float
    """The compute its transfer can hide behind."""
    link: str
    """The (slowest) link its switchable calls cross."""
    rate_Bps: float
    """That link's estimated rate."""

    def cost(self, i: int) -> float:
        """Exposed seconds of rung ``i``."""
        return max(0.0, self.seconds[i] - self.overlap_s)


class Controller:
    """Rungs, pending switches and measured codec throughputs of one run (see the module docstring).

    Args:
        config: the ``auto`` block (its ladders' codecs already offset per rank, or not: only their fields other
            than the seed matter here).
        paths: the laddered paths this layout uses (others are left alone).
        backend: 'gloo' or 'nccl' (how uncompressed collectives move bytes: megacomp.plan.estimate.phases).
        segment_numel: the channels' pipelining segment.
    """

    def __init__(self, config: AutoCodecConfig, paths: list, backend: str, segment_numel: int) -> None:
        self.config, self.backend, self.segment_numel = config, backend, segment_numel
        self.rungs = {p: config.allowed(p) for p in paths}
        self.current = {p: 0 for p in paths}
        self.pending: dict = {p: None for p in paths}  # [rung, consecutive decisions] or None
        self.codec_Bps: dict = {}  # codec_key -> (encode, decode) fp32 bytes per second
        self.links: dict = {}  # link -> [alpha_s, rate_Bps, exact]
        self.decisions = 0
        self.backoff: dict = {p: [0, None] for p in paths}  # [doublings, link rate at the last switch]

    # -- the model ------------------------------------------------------------------------------------------------
    def _call_bytes(self, op: str, codec, numel: int, world: int, itemsize: int) -> float:
        """Bytes this rank sends in one call (megacomp.plan.wire; gloo reduce-scatters uncompressed by all-reduce)."""
        dtype = {2: torch.bfloat16, 8: torch.float64}.get(itemsize, torch.float32)
        codec, seg = make_codec(codec), self.segment_numel
        if op == "send":
            return float(wire.send_bytes(codec, numel, dtype))
        if op == "reduce_scatter" and codec.is_identity and self.backend == "gloo":
            return float(wire.all_reduce_bytes(codec, world * numel, world, dtype))
        fn = {"all_reduce": wire.all_reduce_bytes, "reduce_scatter": wire.reduce_scatter_bytes,
              "all_gather": wire.all_gather_bytes}[op]
        return float(fn(codec, numel, world, dtype, seg))

    def _codec_s(self, op: str, codec, numel: int, world: int, itemsize: int) -> float:
        codec = make_codec(codec)
        if codec.is_identity:
            return 0.0
        enc, dec = self.codec_Bps.get(codec_key(codec), (float("inf"), float("inf")))
        S = numel * itemsize * (world if op in ("reduce_scatter", "all_gather") else 1)
        E, D = (1.0, 1.0) if op == "send" else codec_work(op, world)
        return E * S / enc + D * S / dec

    def call_seconds(self, link: str, op: str, codec, numel: int, world: int, itemsize: int) -> float:
        """Predicted seconds of one call with ``codec`` on ``link`` (its current estimate)."""
        alpha, rate, _ = self.links[link]
        t_wire = self._call_bytes(op, codec, numel, world, itemsize) / rate
        t_codec = self._codec_s(op, codec, numel, world, itemsize)
        in_numel = numel * (world if op == "reduce_scatter" else 1)
        segments = sum(wire.segment_counts(in_numel, self.segment_numel).values())
        return alpha + (pipeline(t_wire, t_codec, segments) if t_codec else t_wire)

    def _fit_links(self, summaries: list) -> None:
        """Update each link's (alpha, rate) from the window's calls (module docstring)."""
        exact: dict = {}
        bound: dict = {}
        for s in summaries:
            for key, (n, secs, n_exact, exact_s, n_timed, *_overlap) in s["calls"].items():
                path, link, op, numel, world, itemsize, codec, _ = json.loads(key)
                b = self._call_bytes(op, codec, numel, world, itemsize)
                t_codec = self._codec_s(op, codec, numel, world, itemsize)
                if n_exact:
                    kind = json.dumps([path, op, world, itemsize, codec], sort_keys=True)
                    exact.setdefault(link, []).append((b, max(exact_s / n_exact - t_codec, 1e-9), n_exact, kind))
                if n_timed:
                    lo = bound.setdefault(link, [0.0, 0.0])
                    lo[0] += b * n_timed
                    lo[1] += max(secs - t_codec * n_timed, 1e-9 * n_timed)
        for link in sorted(set(exact) | set(bound)):
            if link in exact:
                self.links[link] = [*_fit(exact[link]), True]
            elif link not in self.links or not self.links[link][2]:
                b, t = bound[link]
                self.links[link] = [0.0, b / t, False]

    def predict(self, summaries: list, overlap_s: dict) -> dict:
        """Per laddered path with measured calls on an estimated link: its :class:`Prediction` (slowest rank)."""
        out = {}
        for path, rungs in self.rungs.items():
            per_rank, link = [], None
            for s in summaries:
                times = [0.0] * len(rungs)
                for key, (n, *_rest) in s["calls"].items():
                    p, lk, op, numel, world, itemsize, codec, switchable = json.loads(key)
                    if p != path or lk not in self.links:
                        continue
                    link = lk if switchable or link is None else link
                    for i, r in enumerate(rungs):
                        c = r if switchable else codec
                        times[i] += n * self.call_seconds(lk, op, c, numel, world, itemsize) / max(1, s["iterations"])
                per_rank.append(times)
            if link is not None:
                seconds = [max(t[i] for t in per_rank) for i in range(len(rungs))]
                out[path] = Prediction(seconds, overlap_s.get(path, 0.0), link, self.links[link][1])
        return out

    # -- the choice ----------------------------------------------------------------------------------------------
    def _choose_hiding(self, path: str, pred: Prediction, compute: float) -> int:
        c = self.config
        tol, cur = c.slack * compute, self.current[path]
        for i in range(len(pred.seconds)):
            t = pred.seconds[i] * (1 + c.margin if i < cur else 1 / (1 + c.margin) if i == cur else 1.0)
            if t - pred.overlap_s <= tol:
                return i
        costs = [pred.cost(i) for i in range(len(pred.seconds))]
        return costs.index(min(costs))

    def _choose_target(self, preds: dict, compute: float) -> dict:
        target = self.config.step_time_target_s

        def greedy(limit: float) -> Optional[dict]:
            at = {p: 0 for p in preds}
            while compute + sum(preds[p].cost(at[p]) for p in preds) > limit:
                gains = [(preds[p].cost(at[p]) - preds[p].cost(at[p] + 1), p) for p in preds
                         if at[p] + 1 < len(preds[p].seconds)]
                best = max(gains, key=lambda g: g[0], default=(0.0, None))  # first path in order on ties
                if best[0] <= 0:
                    return None
                at[best[1]] += 1
            return at

        plain = greedy(target)
        if plain is None:
            return {p: len(preds[p].seconds) - 1 for p in preds}
        strict = greedy(target / (1 + self.config.margin)) or {p: len(preds[p].seconds) - 1 for p in preds}
        return {p: plain[p] if plain[p] >= self.current[p] else min(strict[p], self.current[p]) for p in preds}

    def decide(self, summaries: list, overlap_s: dict, iteration: int) -> tuple[list, dict]:
        """One decision from every rank's :func:`summarise` (rank order) and each path's overlapped compute:
        (switches as (path, old codec, new codec, reason), per-path record for the metrics). Updates the state."""
        self.decisions += 1
        self._fit_links(summaries)
        compute = max(s["compute_s"] for s in summaries)
        preds = self.predict(summaries, overlap_s)
        if self.config.step_time_target_s is not None:
            chosen = self._choose_target(preds, compute)
        else:
            chosen = {p: self._choose_hiding(p, pred, compute) for p, pred in preds.items()}
        switches, record = [], {}
        for path in self.rungs:
            rungs, cur = self.rungs[path], self.current[path]
            pred = preds.get(path)
            if pred is None:
                record[path] = {"codec": str(rungs[cur]), "reason": "no timed call on an estimated link yet"}
                continue
            cand = chosen[path]
            pend = self.pending[path]
            if cand == cur:
                self.pending[path] = None
            else:
                self.pending[path] = [cand, pend[1] + 1 if pend and pend[0] == cand else 1]
            why = (f"measured {8 * pred.rate_Bps / 1e6:.4g} Mbit/s on {pred.link}, {rungs[cur]} would take "
                   f"{pred.seconds[cur]:.3g} s against {pred.overlap_s:.3g} s of overlapped compute "
                   f"({compute:.3g} s per iteration)")
            need = self.patience(path, pred.rate_Bps)
            if self.pending[path] and self.pending[path][1] >= need:
                switches.append((path, rungs[cur], rungs[cand],
                                 f"{why}; {rungs[cand]} {pred.seconds[cand]:.3g} s"))
                self.current[path], self.pending[path] = cand, None
                self.backoff[path] = [min(self.backoff[path][0] + 1, MAX_DOUBLINGS), pred.rate_Bps]
            record[path] = {"codec": str(rungs[self.current[path]]), "predicted_s": pred.seconds,
                            "overlap_s": pred.overlap_s, "rate_Mbps": 8 * pred.rate_Bps / 1e6, "link": pred.link,
                            "pending": self.pending[path], "patience": need}
        record["compute_s"] = compute
        return switches, record

    def patience(self, path: str, rate_Bps: float) -> int:
        """Consecutive decisions a switch of ``path`` needs now: ``patience`` x 2^k (module docstring). Restarts k at
        0 (and forgets the last switch's rate) once its link's estimated rate ``rate_Bps`` is more than
        :data:`RATE_CHANGE` away from the rate at the path's last switch."""
        k, at = self.backoff[path]
        if at is not None and max(rate_Bps / at, at / rate_Bps) > RATE_CHANGE:
            self.backoff[path] = [0, None]
            k = 0
        return self.config.patience * 2 ** k

    def codec(self, path: str):
        """The codec ``path`` sends with now."""
        return self.rungs[path][self.current[path]]

    # -- checkpointing -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Rungs (as codecs, so a changed ladder is caught), pending switches, link estimates, codec throughputs."""
        return {"current": {p: codec_key(self.codec(p)) for p in self.rungs}, "pending": dict(self.pending),
                "links": {k: list(v) for k, v in self.links.items()}, "codec_Bps": dict(self.codec_Bps),
                "decisions": self.decisions, "backoff": {p: list(v) for p, v in self.backoff.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`. ValueError when a saved rung is not on this run's ladder."""
        keys = {p: [codec_key(c) for c in rungs] for p, rungs in self.rungs.items()}
        for path, key in state["current"].items():
            if path not in keys or key not in keys[path]:
                raise ValueError(f"auto: the checkpoint's {path} codec {key} is not on this run's ladder; resume with "
                                 f"the same auto block")
            self.current[path] = keys[path].index(key)
        self.pending = {p: (list(v) if v else None) for p, v in state["pending"].items()}
        self.links = {k: list(v) for k, v in state["links"].items()}
        self.codec_Bps = {k: tuple(v) for k, v in state["codec_Bps"].items()}
        self.decisions = int(state["decisions"])
        self.backoff.update({p: list(v) for p, v in state.get("backoff", {}).items() if p in self.backoff})


def _fit(points: list) -> tuple[float, float]:
    """(alpha, rate) of t = alpha + b / rate from (bytes, seconds, weight[, kind]) points (no kind: one kind): the rate
    from the weighted least-squares slope of seconds on bytes within each kind, pooled over the kinds (sizes are
    compared only between calls of one kind), alpha the weighted mean of t - b / rate over every point; the
    throughput form (alpha 0, rate = sum of bytes / sum of seconds) when no kind came in two sizes or the fit is not
    physical."""
    w = sum(p[2] for p in points)
    b_sum = sum(p[0] * p[2] for p in points)
    t_sum = sum(p[1] * p[2] for p in points)
    through = (0.0, b_sum / t_sum if t_sum > 0 else float("inf"))
    kinds: dict = {}
    for p in points:
        kinds.setdefault(p[3] if len(p) > 3 else None, []).append(p[:3])
    sbb = sbt = 0.0
    for pts in kinds.values():
        n_k = sum(n for _, _, n in pts)
        mb, mt = sum(b * n for b, _, n in pts) / n_k, sum(t * n for _, t, n in pts) / n_k
        sbb += sum(n * (b - mb) ** 2 for b, _, n in pts)
        sbt += sum(n * (b - mb) * (t - mt) for b, t, n in pts)
    if sbb <= 0 or sbt <= 0:
        return through
    slope = sbt / sbb
    alpha = (t_sum - slope * b_sum) / w
    if alpha < 0:
        return through
    return alpha, 1.0 / slope

"""``--compression auto`` (a compression config with an ``auto:`` block, megacomp.compression.ladder): every laddered
traffic path starts on its least lossy rung and, every ``interval`` iterations, moves to the rung the controller
(megacomp.plan.auto_policy) picks from what the run measured.

Per iteration: every channel of the layout carries a tap of one megacomp.comm.link_meter.LinkMeter (bytes, link
kind, wire time of each call, no added synchronisation), and this feature times the iteration. At a decision
(after iterations interval, 2 x interval, ...): each rank summarises its window, the summaries are all-gathered
(one small collective per decision), every rank runs the same deterministic decision on the same list, and a
switch is applied on every rank before the next iteration starts (``Channel.set_codec``: the error-feedback
residuals are kept exactly). Each switch is one line on rank 0 with its reason; every iteration's record carries
each laddered path's codec (``auto_codec``: the codec that sent that iteration's bytes) and a decision's record its
predictions (``auto_decision``).

Checkpoints: the channels are built with each ladder's most lossy rung within the budget (so every bucket,
residual key and stream exists from the start) and are set to their rungs before the first iteration; a checkpoint
is written with the channels on those build codecs (so its codec checks match any rung) and the controller's state
(rungs, pending switches, link estimates, measured codec throughputs, stochastic streams) under
``auto_compression``: a resumed run continues with the same rungs and the same pending switches.

Failure behaviour: ValueError (one line) for an optimizer family or overlap mode whose channels do not follow a
switch (1-bit, DeMo, LOMO, ACCO, outer loops, LoQT keep copies of their codecs).
"""
from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from ...comm.link_meter import LinkMeter
from ...config import TRAFFIC_PATHS
from ...plan.auto_policy import Controller, codec_key, measure_codec, overlapped_seconds, summarise
from ..report import unused_paths
from .base import Feature


class AutoCompression(Feature):
    """Measures, decides and switches the laddered paths' codecs (see the module docstring)."""

    name = "auto_compression"
    state_key = "auto_compression"

    @classmethod
    def selected(cls, cfg) -> bool:
        return cfg.compression_config().auto is not None

    @classmethod
    def check(cls, cfg, world) -> None:
        if not cls.selected(cfg):
            return
        t = cfg.training
        why = (f"--optimizer {t.optimizer} (its exchanges keep their own codecs; use --optimizer adamw)"
               if t.optimizer != "adamw" else
               f"--overlap-optimizer {cfg.overlap.mode} (its estimate channel copies the codec)" if cfg.overlap.mode != "none"
               else f"--outer-algorithm {cfg.outer.algorithm}" if cfg.outer.algorithm != "none"
               else "LoQT (--loqt-rank)" if cfg.loqt.rank else None)
        if why:
            raise ValueError(f"--compression auto switches the codecs of the sharded AdamW optimizer's and the layers' "
                             f"channels; it does not combine with {why}: drop one")

    def build(self, run) -> None:
        g, comp = run.groups, run.compression
        self.auto = comp.auto
        unused = unused_paths(g.tp_size, g.pp_size, g.dp_size, run.cfg.parallel.sequence_parallel)
        ranks = {"tp": g.tp_ranks, "sp": g.tp_ranks, "pp": g.pp_ranks, "dp": g.dp_ranks}
        self.meter = LinkMeter()
        for path, ch in run.channels.items():
            if path not in unused:  # every used path's calls estimate its link, laddered or not
                ch.attach_meter(self.meter, run.topology.slowest_link(ranks[path.split("_")[0]]))
        self.paths = [p for p in TRAFFIC_PATHS if p in self.auto.ladder and p not in unused]
        self.controller = Controller(self.auto, self.paths, dist.get_backend(), comp.segment_numel)
        codecs = {codec_key(c): c for p in self.paths for c in self.controller.rungs[p]}
        mine = {k: measure_codec(c, run.device) for k, c in sorted(codecs.items())}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)  # the slowest rank's throughput: the same numbers everywhere
        self.controller.codec_Bps = {k: (min(r[k][0] for r in every), min(r[k][1] for r in every)) for k in mine}
        self.built = {p: getattr(run.channels, p).codec for p in self.paths}
        self.channels = run.channels
        self.applied, self.wall, self.iterations, self.decision = False, 0.0, 0, None
        self.saved_streams: dict = {}

    def banner(self, run) -> list[str]:
        a = self.auto
        goal = (f"meets a step time of {a.step_time_target_s:g} s" if a.step_time_target_s is not None else
                "hides behind the compute it overlaps (else the one of least exposed time)")
        lines = [f"auto compression: every {a.interval} iterations each laddered path takes the least lossy codec "
                 f"whose predicted transfer on the measured link {goal}; a switch needs {a.patience} consecutive "
                 f"decisions, doubled per earlier switch on the same link, and {a.margin:g} to spare either side of "
                 f"the threshold; error budget {a.max_relative_error:g} "
                 f"relative error on Gaussian data"]
        for p in self.paths:
            refused = [str(c) for c in a.ladder[p][len(self.controller.rungs[p]):]]
            over = f" (over the budget: {', '.join(refused)})" if refused else ""
            lines.append(f"  {p}: {' -> '.join(str(c) for c in self.controller.rungs[p])}{over}, starting at "
                         f"{self.controller.codec(p)}")
        return lines

    def _apply(self, run) -> None:
        for p in self.paths:
            ch = getattr(run.channels, p)
            ch.set_codec(self.controller.codec(p))
            stream = self.saved_streams.pop(p, None)  # a resumed run: a rung's stochastic stream continues
            if stream is not None and ch.generator is not None:
                ch.generator.set_state(stream)
        self.applied = True

    def iteration(self, run, batches, inner):
        if not self.applied:  # after a resume too: the checkpoint was loaded on the build codecs
            self._apply(run)
        self.sent_with = {p: str(self.controller.codec(p)) for p in self.paths}  # this iteration's bytes: its codecs
        t0 = time.perf_counter()
        out = inner(batches)
        self.wall += time.perf_counter() - t0
        self.iterations += 1
        done = run.iteration + 1  # the iteration this one is logged as
        self.decision = None
        if done % self.auto.interval == 0:
            self._decide(run, done)
        return out

    def _decide(self, run, done: int) -> None:
        mine = summarise(self.meter.drain(), self.iterations, self.wall)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        self.wall, self.iterations = 0.0, 0
        switches, self.decision = self.controller.decide(every, self._overlap(run, every), done)
        for path, old, new, why in switches:
            getattr(run.channels, path).set_codec(new)
            if run.is_logger:
                print(f"megacomp-pretrain: auto: {path} {old} -> {new} after iteration {done}: {why}", flush=True)

    def _overlap(self, run, summaries: list) -> dict:
        """The compute each path's transfer overlaps per iteration: at most what megacomp.plan.estimate's schedule
        allows (the gradient reduce-scatter in the last micro-batch's backward, 2/3 of it, ZeRO-2: every
        micro-batch's; the parameter all-gather in the next forward, 1/3 of the first micro-batch, only when
        overlapped; the tensor- and pipeline-parallel paths on the critical path), and at most what the window
        measured (megacomp.plan.auto_policy.overlapped_seconds) where it timed the path's calls."""
        compute = max(s["compute_s"] for s in summaries)
        per_mb = compute / run.num_microbatches
        z = self.cfg.zero
        model = {"dp_gradient": 2.0 / 3.0 * (compute if z.stage == 2 else per_mb),
                 "dp_parameter": per_mb / 3.0 if z.overlap_param_gather else 0.0}
        for path, limit in model.items():
            measured = overlapped_seconds(summaries, path)
            if measured is not None:
                model[path] = min(limit, measured)
        return model

    def record(self, run, record: dict) -> None:
        record["auto_codec"] = self.sent_with
        if self.decision is not None:
            record["auto_decision"] = self.decision

    @contextlib.contextmanager
    def _on_build_codecs(self, run):
        for p in self.paths:
            getattr(run.channels, p).set_codec(self.built[p])
        try:
            yield
        finally:
            if self.applied:
                self._apply(run)

    def before_save(self, run):
        return self._on_build_codecs(run)  # the checkpoint's codec checks then match whatever rung runs

    def state_dict(self):
        streams = {p: getattr(self.channels, p).generator for p in self.paths}
        return {"controller": self.controller.state_dict(),
                "streams": {p: g.get_state() for p, g in streams.items() if g is not None}}

    def load_state_dict(self, state) -> None:
        self.controller.load_state_dict(state["controller"])
        self.saved_streams = dict(state["streams"])
        self.applied = False  # the rungs are set before the next iteration

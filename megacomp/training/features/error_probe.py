"""The compression-error probe (the compression config's ``error_probe_interval``; megacomp.comm.probe): on
iteration 1 and every N-th iteration, every channel of the layout's traffic paths measures what its codec did to
each message (relative error, crest factor, kurtosis) and the iteration's record carries the summary per path
(``probe``), which the metrics log keeps. A diagnostic: it adds collectives on the probed iterations only, and a
resume may turn it on, off or change its interval.
"""
from __future__ import annotations

from ...comm.probe import ErrorProbe
from ..metrics_log import gather_probe
from .base import Feature


class ErrorProbeFeature(Feature):
    """Arms the probe on the probed iterations and puts their measurements in the record."""

    name = "error_probe"

    @classmethod
    def selected(cls, cfg) -> bool:
        return bool(cfg.compression_config().error_probe_interval)

    def build(self, run) -> None:
        self.every = run.compression.error_probe_interval
        self.probe = ErrorProbe()
        run.channels.attach_probe(self.probe)
        self.probing = False

    def iteration(self, run, batches, inner):
        # every rank arms at the same iteration (the probe adds collectives)
        self.probing = run.iteration == 0 or (run.iteration + 1) % self.every == 0
        self.probe.arm(self.probing)
        return inner(batches)

    def record(self, run, record: dict) -> None:
        if self.probing:
            self.probe.arm(False)
            record["probe"] = gather_probe(self.probe)

"""ACCO and DPU (``--overlap-optimizer acco|dpu``; the algorithm is megacomp.optimizer.acco): the sharded
optimizer's reduce-scatter, update and parameter all-gather run in a background thread while the next gradients
are computed.

ACCO: an iteration's M micro-batches run in two halves of M / 2 (each a whole number of 1F1B rounds under PP).
After each half the model-parallel gradient sums run as usual on that half's gradients alone, since ACCO moves
every half's gradients out of the buckets; then half A ends with ``estimate`` and half B with ``step``. DPU: the
whole step's gradients, applied one step late. What the iteration's record says: the loss of both halves (at θ̃_t
and θ_t), and wire bytes of the jobs this iteration waited for (the previous step's update and this step's
estimate); ``skipped``/``grad_norm`` are the previous step's update's, the one that finished during this
iteration. The run's last iteration waits for its own update, and a run stopped early books the update in flight
into its last record, so every byte is counted. A checkpoint is written after the update in flight lands and
holds the estimate; the model ends on θ, not on the estimate a resume continues from.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ...compression import is_accordion, is_low_rank
from ...optimizer.acco import ACCO
from ..metrics_log import gather_traffic
from .base import Feature


@dataclass
class OverlapConfig:
    """Overlapping the optimizer step with the next gradients' computation."""

    mode: str = field(default="none", metadata={"flag": "overlap_optimizer"})
    """'acco' (megacomp.optimizer.acco): each iteration's micro-batches run in two halves; the sharded optimizer's
    reduce-scatter, update and parameter all-gather of one half run in a background thread while the other half's
    gradients are computed, with ACCO's estimate compensating the delay (twice the dp_gradient / dp_parameter bytes,
    hidden behind compute). Needs --optimizer adamw, the sharded ZeRO-1 optimizer, an even number of micro-batches
    (a multiple of 2 x PP), no outer loop, LoQT or error probe. 'dpu': the same background update without the
    halves and the estimate (DistributedOptimizer's bytes; each step's gradients are applied one step late).
    'none': the step waits for its communication."""

    warmup_steps: int = field(default=0, metadata={"flag": "overlap_optimizer_warmup_steps"})
    """Undelayed steps before the overlap starts (acco and dpu): each of the first N steps waits for its own update
    (ZeRO-1's step, the whole batch at the current parameters). 0: ACCO as published (the paper's ACCO needs no
    warm-up); ZeRO-Offload's DPU warms up this way (the ACCO authors' DPU baseline uses 1000)."""


class ACCOOverlap(Feature):
    """ACCO / DPU around the sharded AdamW optimizer (see the module docstring)."""

    name = "acco"
    CONFIG = OverlapConfig
    config_key = "overlap"

    @classmethod
    def selected(cls, cfg) -> bool:
        return cfg.overlap.mode in ("acco", "dpu")

    @classmethod
    def check(cls, cfg, world) -> None:
        mode = cfg.overlap.mode
        if mode not in ("none", "acco", "dpu"):
            raise ValueError(f"overlap_optimizer must be 'none', 'acco' or 'dpu', got {mode!r}")
        if mode == "none":
            return
        if cfg.overlap.warmup_steps < 0:
            raise ValueError(f"overlap_optimizer_warmup_steps must be >= 0, got {cfg.overlap.warmup_steps}")
        why = (f"optimizer {cfg.training.optimizer} has its own exchange (use --optimizer adamw)"
               if cfg.training.optimizer != "adamw" else
               "needs the sharded optimizer (drop --no-shard-optimizer)" if cfg.zero.shard is False else
               "overlaps ZeRO-1's whole-step reduce-scatter (use --zero-stage 1)" if cfg.zero.stage != 1 else
               f"does not combine with --outer-algorithm {cfg.outer.algorithm}" if cfg.outer.algorithm != "none" else
               "does not combine with LoQT (its merges replace optimizer steps)" if cfg.loqt.rank else None)
        if why is None:
            comp = cfg.compression_config()
            if is_low_rank(comp.dp_gradient) or is_accordion(comp.dp_gradient):
                why = f"reduce-scatters with a value codec; dp_gradient {comp.dp_gradient} all-reduces in low rank"
            elif comp.pp_activation_delta:
                why = ("does not combine with AQ-SGD activation deltas (pp_activation_delta: its per-sample caches are "
                       "indexed by the whole iteration's micro-batches)")
            elif comp.error_probe_interval:
                why = "does not run the error probe on its background collectives (set error_probe_interval: 0)"
        if why:
            raise ValueError(f"overlap_optimizer {mode} {why}")
        t, pp = cfg.training, cfg.parallel.pipeline_model_parallel_size
        dp = world // (cfg.parallel.tensor_model_parallel_size * pp) if world else 0
        if mode == "acco" and dp and t.global_batch_size % (t.micro_batch_size * dp) == 0:
            micro = t.global_batch_size // (t.micro_batch_size * dp)
            if micro % (2 * pp):  # dpu: no halves
                raise ValueError(f"overlap_optimizer acco runs each iteration's {micro} micro-batches in two equal "
                                 f"halves, each a multiple of the {pp} pipeline stage(s): raise global_batch_size to a "
                                 f"multiple of 2 x {pp} x micro_batch_size x DP")

    def build(self, run) -> None:
        self.acco = ACCO(run.optimizer, delay_compensation=self.cfg.overlap.mode == "acco",
                         warmup_steps=self.cfg.overlap.warmup_steps)
        run.optimizer = self.acco

    def banner(self, run) -> list[str]:
        return self._banner(run) + ([f"optimizer: the first {self.acco.warmup_steps} step(s) undelayed (warm-up), "
                                     f"then overlapped"] if self.acco.warmup_steps else [])

    def _banner(self, run) -> list[str]:
        m = run.num_microbatches
        if not self.acco.compensated:
            return ["optimizer: DPU (ACCO without delay compensation): each step's gradient reduce-scatter, update and "
                    "parameter all-gather run in a background thread during the next step, whose gradients are "
                    "computed at the parameters before that update (one step stale); DistributedOptimizer's bytes, "
                    "overlapped"]
        return [f"optimizer: ACCO: {m} micro-batches per iteration in two halves of {m // 2}; each half's gradient "
                f"reduce-scatter, update and parameter all-gather run in a background thread while the other half "
                f"computes (an estimate from half A, the update from both halves): 2x the dp_gradient and "
                f"dp_parameter bytes of the step, overlapped"]

    def iteration(self, run, batches, inner):
        """Half A at the estimate while the previous update finishes, ``estimate``, half B at the parameters while
        the estimate is computed, ``step`` (DPU: the whole step, applied late). Returns the losses and whether the
        previous step's update stepped (the verdict on this step's update arrives with the next iteration)."""
        acco, half, m = self.acco, len(batches) // 2, len(batches)
        if not acco.compensated:
            losses = run.forward_backward(batches)
            run.finalize_grads()
            acco.step()
            return losses, self._last_iteration_waits(run)
        pipelined = run.communicator is not None  # the 1F1B schedule divides each half's losses by M / 2
        losses = run.forward_backward(batches[:half])
        run.finalize_grads()
        acco.estimate(1.0 if pipelined else m / half)
        losses += run.forward_backward(batches[half:])
        run.finalize_grads()
        acco.step(half / m if pipelined else 1.0)
        return losses, self._last_iteration_waits(run)

    def _last_iteration_waits(self, run) -> bool:
        """The run's last iteration waits for its own update (its bytes go into this iteration's record) but keeps
        the estimate for the final checkpoint, so a resume with more iterations continues bit for bit; returns
        whether the update waited for last stepped."""
        if run.iteration + 1 == self.cfg.training.train_iters:
            with self.acco.synchronized():
                pass
        return self.acco.last_stepped is not False

    def before_save(self, run):
        return self.acco.synchronized()  # the update in flight lands; the checkpoint keeps the estimate

    def end_of_run(self, run, history, stopped_early) -> None:
        """A run stopped before ``train_iters``: wait for the update in flight (the estimate stays for the
        checkpoint) and add its wire bytes to the last record and the run's totals, so the summary counts every
        byte. A collective (every rank stops at the same iteration)."""
        if not (stopped_early and history):
            return
        with self.acco.synchronized():  # waits for the update, whose bytes are booked at the wait
            pass
        for kind, (w, u) in gather_traffic().items():
            for table in (history[-1]["traffic"], run.totals.traffic):
                row = table.setdefault(kind, [0, 0])
                row[0] += w
                row[1] += u

    def finish(self, run) -> None:
        self.acco.finish()  # the model ends on θ, not on the estimate a resume continues from

    def close(self, run) -> None:
        self.acco.close()  # no background collective may outlive the groups

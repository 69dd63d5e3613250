"""The divergence policy of a pretraining run: when to keep going, when to stop, and what to say.

Every rank decides from values that are already global (the loss is all-reduced over the pipeline and
data-parallel groups; the optimizer's inf/NaN check over the data-parallel and model-parallel groups), so
all ranks stop at the same iteration without an extra collective.

Per iteration:
  1. a skipped optimizer step (inf/NaN gradients) or a non-finite loss counts as a bad step; up to
     ``max_skipped_steps`` consecutive bad steps are tolerated (fp16 loss scaling skips a few by design),
     one more stops the run;
  2. a finite loss above ``loss_divergence_factor`` times the lowest loss so far stops the run at once,
     whether or not this step's gradients overflowed too: the weights that gave it are no longer worth
     keeping (checked first, so an exploding loss is never counted as a tolerated skip).
A stop raises :class:`TrainingDiverged` with a one-line reason; the trainer writes no checkpoint after it,
and moves aside the one written right before it (its weights gave the diverging loss). The state
(lowest loss, bad steps in a row) is saved in checkpoints, so a resumed run keeps the same verdicts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


class TrainingDiverged(RuntimeError):
    """Raised by :meth:`DivergenceGuard.observe` when the run must stop; ``str()`` is the one-line reason."""


@dataclass
class DivergenceGuard:
    """Counts bad steps and watches the loss (see the module docstring).

    Args:
        max_skipped_steps: consecutive skipped / non-finite steps tolerated (0: stop at the first).
        loss_divergence_factor: stop when a loss exceeds this times the lowest loss so far (0: off).
    """

    max_skipped_steps: int = 10
    loss_divergence_factor: float = 10.0
    consecutive: int = 0
    """Bad steps in a row so far."""
    best_loss: float = math.inf
    """Lowest finite loss seen."""
    skipped_total: int = 0
    """Bad steps over the whole run."""
    notes: list = field(default_factory=list)
    """Lines the trainer prints (rank 0) about tolerated bad steps."""

    def __post_init__(self) -> None:
        if self.max_skipped_steps < 0:
            raise ValueError(f"max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        if self.loss_divergence_factor < 0 or (0 < self.loss_divergence_factor <= 1):
            raise ValueError(f"loss_divergence_factor must be 0 (off) or > 1, got {self.loss_divergence_factor}")

    def observe(self, iteration: int, loss: float, stepped: bool, lr: float, excused: Optional[str] = None) -> Optional[str]:
        """Account iteration ``iteration`` (1-based); returns a note to print for a tolerated bad step. ``excused``:
        why a step with a finite loss was not taken for a reason other than its gradients (a fault-tolerance quorum
        that did not commit it): said in the note, not counted as a bad step.

        Raises:
            TrainingDiverged: too many consecutive bad steps, or an exploding loss (the message names the
                iteration, the values and what to change)."""
        finite = math.isfinite(loss)
        # an exploding loss stops the run even when this step's gradients overflowed too: the loss was computed
        # with the weights of the previous step, so skipping this step cannot save them
        if finite and self.loss_divergence_factor and self.best_loss < math.inf \
                and loss > self.loss_divergence_factor * self.best_loss:
            raise TrainingDiverged(
                f"training diverged at iteration {iteration}: loss {loss:.4g} is more than "
                f"--loss-divergence-factor {self.loss_divergence_factor:g} x the lowest loss so far "
                f"({self.best_loss:.4g}); lower --lr (now {lr:.3g}), then resume from the last checkpoint")
        if not stepped and finite and excused:
            return f"iteration {iteration}: step not taken ({excused})"
        if not stepped or not finite:
            self.consecutive += 1
            self.skipped_total += 1
            why = "non-finite loss" if not finite else "inf/NaN gradients"
            if self.consecutive > self.max_skipped_steps:
                raise TrainingDiverged(
                    f"training diverged at iteration {iteration}: {self.consecutive} consecutive steps skipped "
                    f"({why}; loss {loss:.4g}), more than --max-skipped-steps {self.max_skipped_steps}; lower --lr "
                    f"(now {lr:.3g}) or lower --clip-grad, then resume from the last checkpoint")
            return (f"iteration {iteration}: step skipped ({why}), {self.consecutive} in a row "
                    f"(stop after {self.max_skipped_steps})")
        self.consecutive = 0
        self.best_loss = min(self.best_loss, loss)
        return None

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so that a resumed run judges its losses against the same history."""
        return {"best_loss": self.best_loss, "consecutive": self.consecutive, "skipped_total": self.skipped_total}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values; a missing key (a checkpoint from before they were saved)
        keeps the fresh default."""
        self.best_loss = float(state.get("best_loss", math.inf))
        self.consecutive = int(state.get("consecutive", 0))
        self.skipped_total = int(state.get("skipped_total", 0))

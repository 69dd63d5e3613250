"""When each step of a 1-bit optimizer communicates, and what (the ``action`` of megacomp.optimizer.onebit.rules).

Every rank computes the same schedule from the count of steps taken (skipped overflow steps do not count:
the optimizer state did not move), so the ranks agree on every step's collective without exchanging it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class FreezeSchedule:
    """1-bit Adam and 1-bit LAMB: full-precision gradients for ``freeze_step`` steps, then the momentum."""

    freeze_step: int
    """Steps of full-precision warm-up (DeepSpeed's ``freeze_step``)."""

    def action(self, t: int) -> str:
        """The action of step ``t`` (1-based)."""
        return "grad" if t <= self.freeze_step else "momentum"

    def advance(self, t: int) -> None:
        """Nothing to count."""

    def communicates(self, t: int) -> bool:
        """Every step exchanges gradients or momentum."""
        return True

    def state_dict(self) -> dict:
        """The settings and counters as plain ints (checkpointed with the optimizer)."""
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Check the saved setting. Raises ValueError when it differs from this schedule's."""
        if int(state["freeze_step"]) != self.freeze_step:
            raise ValueError(f"1-bit optimizer checkpoint has freeze_step {state['freeze_step']}, this optimizer "
                             f"{self.freeze_step}; resume with the same value")


@dataclass
class ZeroOneSchedule:
    """0/1 Adam's two growing intervals (DeepSpeed's ZeroOneAdam counters).

    Up to ``var_freeze_step``: step t updates the variance with a full-precision gradient when
    ``t % var_interval == 0`` (action ``grad``), else averages a 1-bit gradient (``grad_1bit``); after every
    ``var_update_scaler`` variance updates ``var_interval`` doubles. After ``var_freeze_step`` every step is
    local, and it synchronises when ``t % local_interval == 0``; after every ``local_step_scaler`` local steps
    ``local_interval`` doubles, up to ``local_step_clipper``. Where we chose: DeepSpeed switches to local steps
    one step later (its check runs after step ``var_freeze_step + 1``); here step ``var_freeze_step`` is the
    last one with a variance schedule.
    """

    var_freeze_step: int
    """Last step that may update the variance."""
    var_update_scaler: int
    """Variance updates between doublings of the variance interval."""
    local_step_scaler: int
    """Local steps between doublings of the synchronisation interval."""
    local_step_clipper: int
    """Largest synchronisation interval."""
    var_interval: int = 1
    """Steps between variance updates now."""
    var_counter: int = 0
    """Variance updates since the last doubling."""
    local_interval: int = 1
    """Steps between synchronisations now."""
    local_counter: int = 0
    """Local steps since the last doubling."""

    def __post_init__(self) -> None:
        for name in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"0/1 Adam: {name} must be an int >= 1, got {v!r}")

    def action(self, t: int) -> str:
        """``grad`` | ``grad_1bit`` | ``local`` for step ``t`` (1-based)."""
        if t <= self.var_freeze_step:
            return "grad" if t % self.var_interval == 0 else "grad_1bit"
        return "local"

    def syncs(self, t: int) -> bool:
        """Whether local step ``t`` ends with a synchronisation."""
        return t > self.var_freeze_step and t % self.local_interval == 0

    def communicates(self, t: int) -> bool:
        """Whether step ``t`` sends a model-sized message (a round of communication)."""
        return t <= self.var_freeze_step or self.syncs(t)

    def advance(self, t: int) -> None:
        """Count step ``t`` (after it was taken)."""
        if t <= self.var_freeze_step:
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
            return
        self.local_counter += 1
        if self.local_counter == self.local_step_scaler:
            self.local_counter = 0
            self.local_interval = min(self.local_step_clipper, self.local_interval * 2)

    def state_dict(self) -> dict:
        """The settings and counters as plain ints (checkpointed with the optimizer)."""
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters. Raises ValueError when a saved setting differs from this schedule's."""
        for name in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
            if int(state[name]) != getattr(self, name):
                raise ValueError(f"0/1 Adam checkpoint has {name}={state[name]}, this optimizer {getattr(self, name)}; "
                                 f"resume with the same value")
        for name in ("var_interval", "var_counter", "local_interval", "local_counter"):
            setattr(self, name, int(state[name]))

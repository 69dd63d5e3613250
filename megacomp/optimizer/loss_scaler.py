"""Dynamic loss scaling for fp16 training (the torch.cuda.amp.GradScaler rule, device-agnostic).

The loss is multiplied by ``scale`` before backward; DistributedOptimizer divides the gradients by it before
they are communicated (so its error-feedback state is in unscaled units and never needs rescaling; LOMO sends
them at the scale, in fp16, and rescales its residuals when the scale changes: megacomp.optimizer.lomo). On a
step with inf/NaN gradients the step is skipped and ``scale *= backoff_factor``; after
``growth_interval`` clean steps in a row ``scale *= growth_factor``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DynamicLossScaler:
    """State and rule of the dynamic loss scale."""

    scale: float = 2.0 ** 16
    """Current loss scale."""
    growth_factor: float = 2.0
    """Multiplier after ``growth_interval`` clean steps."""
    backoff_factor: float = 0.5
    """Multiplier after an overflow."""
    growth_interval: int = 2000
    """Clean steps before growing the scale."""
    min_scale: float = 1.0
    """The scale never drops below this."""
    clean_steps: int = 0
    """Clean steps since the last change."""

    def update(self, overflow: bool) -> None:
        """Apply the rule after one step: on ``overflow`` multiply the scale by ``backoff_factor`` (not below
        ``min_scale``) and restart the count; otherwise count a clean step and, at ``growth_interval`` of
        them, multiply the scale by ``growth_factor``."""
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        """Every field (scale, rule and clean-step count) as a dict, for checkpoints."""
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Set the fields from ``state`` (a :meth:`state_dict`). Keys are not checked: an unknown one
        becomes a new attribute."""
        for k, v in state.items():
            setattr(self, k, v)

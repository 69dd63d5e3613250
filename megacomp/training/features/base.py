"""The interface between the pretraining loop and a training family (ZeRO, ACCO, the 1-bit optimizers, DeMo,
LOMO, LoQT, AQ-SGD, the outer loops, ...).

The loop (megacomp.training.trainer) knows a family only through the hooks below, called at fixed points, in
the registry's order (megacomp.training.features), for the families a configuration selects. It never tests a
type. A family is one module holding its config dataclass (a component of the configuration tree), its
validation, how it is built, its banner lines, its hooks and its checkpoint state; adding one is that module
plus one registry line.

Hooks that wrap a part of the iteration (``iteration``, ``forward_backward``, ``step``) receive the next
layer as ``inner``: a family that changes nothing returns ``inner(...)``; one that replaces the part (ACCO's
two halves, LOMO's update inside backward, LoQT's merge instead of a step) does its own work, calling
``inner`` or the run's public methods where it needs them. The first family in registry order is the
outermost layer.

The ``run`` every hook receives is the Trainer: its public attributes (``cfg``, ``groups``, ``channels``,
``compression``, ``model``, ``optimizer``, ``dataset``, ``device``, ``iteration``, ``num_microbatches``,
``num_chunks``, ``communicator``, ``totals``) and methods (``forward_backward``, ``finalize_grads``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional


class Feature:
    """A training family's part in the loop; every hook's default leaves the loop unchanged.

    Class attributes:
        name: the family's name in messages.
        optimizer_names: see below.
        CONFIG: its config dataclass (a component of PretrainConfig under ``config_key``), or None.
        config_key: the component's key in the configuration tree (YAML ``key: {...}``), or None.
        state_key: the key of its state in a checkpoint's extra state, or None when it keeps none there.
    """

    name: str = ""
    CONFIG: Optional[type] = None
    config_key: Optional[str] = None
    state_key: Optional[str] = None
    optimizer_names: tuple = ()
    """The ``--optimizer`` choices that select this family (an optimizer family builds ``run.optimizer``)."""
    config_shared: bool = False
    """Whether other families read settings of this family's component too (then a typed setting of it is never
    reported as unused when this family is not selected)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    # -- selection and validation (before any process group exists) -------------------------------------
    @classmethod
    def selected(cls, cfg) -> bool:
        """Whether ``cfg`` asks for this family (default: ``--optimizer`` names one of its optimizer_names)."""
        return cfg.training.optimizer in cls.optimizer_names

    @classmethod
    def check(cls, cfg, world: Optional[int]) -> None:
        """Called for every family, selected or not, with the world size when known: raise ValueError naming
        the setting and the fix for settings this family refuses (a family not selected checks only that
        nothing was asked of it that needs it)."""

    @classmethod
    def resolve(cls, cfg, world: Optional[int]) -> list[str]:
        """Settings a selected family chooses because only one works (e.g. 0/1 Adam's unsharded state): set them
        on ``cfg`` and return one banner line per choice. Called before :meth:`check`, for selected families."""
        return []

    # -- construction -------------------------------------------------------------------------------------
    def configure_model(self, gpt_kwargs: dict) -> None:
        """Adjust the GPTConfig keyword arguments before the model is built."""

    def build(self, run) -> None:
        """Build what the family needs (after the model; in registry order)."""

    def banner(self, run) -> list[str]:
        """Lines for the start-up banner, in the user's words (what it does and sends)."""
        return []

    # -- one iteration ------------------------------------------------------------------------------------
    def iteration(self, run, batches: list, inner: Callable[[list], tuple]) -> tuple[list[float], bool]:
        """The iteration's forward/backward, gradient finalisation and step; returns (losses, stepped)."""
        return inner(batches)

    def forward_backward(self, run, batches: list, inner: Callable[[list], list]) -> list[float]:
        """Forward and backward of ``batches``; returns the micro-batches' losses."""
        return inner(batches)

    def step(self, run, inner: Callable[[], bool]) -> bool:
        """The optimizer step after the gradients are final; returns whether it stepped."""
        return inner()

    def record(self, run, record: dict) -> None:
        """Add or adjust fields of the iteration's logged record."""

    # -- around the run -----------------------------------------------------------------------------------
    def before_save(self, run) -> ContextManager:
        """A context the checkpoint is written in (e.g. an update in flight lands first)."""
        return contextlib.nullcontext()

    def weights_loaded(self, run) -> None:
        """The model's weights were replaced from a checkpoint (fine-tuning): refresh what copies them."""

    def end_of_run(self, run, history: list[dict], stopped_early: bool) -> None:
        """The loop ended (``stopped_early``: before ``train_iters``), before the final checkpoint."""

    def finish(self, run) -> None:
        """After the final checkpoint: leave the model on its final parameters."""

    def state_dict(self) -> Any:
        """The family's checkpoint state (under ``state_key``)."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`."""

    def close(self, run) -> None:
        """Complete background work before the groups are torn down."""

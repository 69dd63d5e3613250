"""DiLoCo: replicas train locally for H steps, then exchange one pseudo-gradient through a compressed channel.

Algorithm (Douillard et al., "DiLoCo", 2023; ../shared/research/papers.md §6.1), per outer step t, on every
rank of a replica (a TP x PP [x inner-DP] model), for this rank's parameter shards:

    after H inner optimizer steps from theta_{t-1}:      theta_local
    Delta   = theta_{t-1} - theta_local                   the pseudo-gradient
    Delta   = mean over the outer group of Delta          one all-reduce every H steps (``outer`` channel:
                                                          divide by R, then SUM; codec and error feedback
                                                          as configured, counted in comm.stats())
    theta_t = SGD(theta_{t-1}, grad=Delta, lr, momentum, nesterov)   torch.optim.SGD's rule:
              m = momentum * m + Delta;  step = Delta + momentum * m (Nesterov) or m;  theta -= lr * step
    the model's parameters (and the inner optimizer's fp32 masters) are set to theta_t

The inner optimizer keeps its own state across outer steps (as in the paper). With H = 1, lr = 1 and no
momentum, theta_t = theta_{t-1} - mean(theta_{t-1} - theta_i): parameter averaging after every step, up to
fp32 rounding of the subtraction (tests/test_outer_diloco.py bounds it).

Error bound with a lossy outer codec: the averaged pseudo-gradient carries the compressed all-reduce's
error (megacomp.comm.collectives, applied to Delta / R); error feedback (``error_feedback``) carries the
residual into the next outer step.

State (checkpointed by :meth:`DiLoCo.state_dict`): theta_{t-1} (fp32, flat), the outer SGD's momentum, the
inner-step counter (position in the H-step cycle), and the outer channel's error feedback and stream.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ..comm import Channel
from ..compression import CodecLike, check_error_feedback_codec, make_codec, make_error_feedback_config


@dataclass
class DiLoCoConfig:
    """Settings of the DiLoCo outer loop (paper defaults for lr and momentum)."""

    outer_steps: int = 50
    """H: inner optimizer steps between two synchronisations."""
    outer_lr: float = 0.7
    """Outer SGD learning rate."""
    outer_momentum: float = 0.9
    """Outer SGD momentum (0 = plain SGD)."""
    nesterov: bool = True
    """Nesterov momentum (ignored without momentum)."""
    codec: CodecLike = None
    """Codec of the pseudo-gradient all-reduce (None: uncompressed)."""
    error_feedback: Any = None
    """Error feedback on the pseudo-gradient ('ef', 'loco' or a mapping); needs a lossy codec."""

    def __post_init__(self) -> None:
        if not isinstance(self.outer_steps, int) or self.outer_steps < 1:
            raise ValueError(f"outer_steps (H) must be an int >= 1, got {self.outer_steps!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        self.codec = make_codec(self.codec)
        if self.error_feedback is not None:
            self.error_feedback = make_error_feedback_config(self.error_feedback)
        check_error_feedback_codec(self.codec, self.error_feedback, "DiLoCo error_feedback")

    def to_dict(self) -> dict:
        """Plain data (for checkpoints and the compatibility check)."""
        d = asdict(self)
        d["codec"] = None if self.codec.is_identity else self.codec.to_dict()
        d["error_feedback"] = asdict(self.error_feedback) if self.error_feedback is not None else None
        return d


class DiLoCo:
    """The outer loop over ``params`` (this rank's parameter shards) across ``outer_group`` (see the module
    docstring). Call :meth:`step` after every inner optimizer step.

    Args:
        params: the model parameters this rank holds (any float dtype; the outer state is fp32).
        outer_group: one rank per replica (megacomp.outer.build_replica_groups' ``outer``).
        config: DiLoCoConfig.
        channel: the pseudo-gradient channel (default: built from the config's codec and error feedback,
            stats tag ``outer``).
        after_sync: called after the parameters were replaced (the trainer reloads the sharded optimizer's
            masters from the model here).

    Raises:
        ValueError: bad config values (DiLoCoConfig), an empty parameter list.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], outer_group, config: DiLoCoConfig, *,
                 channel: Optional[Channel] = None, after_sync: Optional[Callable[[], None]] = None) -> None:
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("DiLoCo: no parameters")
        self.config, self.group, self.after_sync = config, outer_group, after_sync
        self.replicas = dist.get_world_size(outer_group)
        self.channel = channel if channel is not None else Channel(
            "outer", config.codec, group=outer_group, error_feedback=config.error_feedback)
        with torch.no_grad():
            self.outer = torch.nn.Parameter(self._flat_local(), requires_grad=False)  # theta_{t-1}
        self.optimizer = torch.optim.SGD([self.outer], lr=config.outer_lr, momentum=config.outer_momentum,
                                         nesterov=config.nesterov and config.outer_momentum > 0)
        self.inner_steps = 0
        self.syncs = 0

    def _flat_local(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in self.params])

    def step(self) -> bool:
        """Count one inner step; every ``outer_steps`` steps synchronise (:meth:`sync`). Returns whether it did."""
        self.inner_steps += 1
        if self.inner_steps % self.config.outer_steps:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """One outer step now (a collective over the outer group)."""
        delta = self.outer.detach() - self._flat_local()  # Delta = theta_{t-1} - theta_local
        delta.div_(self.replicas)  # mean = sum of Delta / R: gloo has no AVG, and the codecs see the scaled values
        self.channel.all_reduce(delta, dist.ReduceOp.SUM, key="pseudo_gradient")
        self.outer.grad = delta
        self.optimizer.step()
        self.outer.grad = None
        off = 0
        for p in self.params:
            n = p.numel()
            p.copy_(self.outer[off:off + n].view_as(p))
            off += n
        self.syncs += 1
        if self.after_sync is not None:
            self.after_sync()

    def state_dict(self) -> dict[str, Any]:
        """theta_{t-1}, the outer optimizer, the cycle position and the channel (see the module docstring)."""
        return {"config": self.config.to_dict(), "outer": self.outer.detach().clone(),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),  # torch returns live momentum buffers
                "inner_steps": self.inner_steps, "syncs": self.syncs,
                "channel": self.channel.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError when it was saved with another outer configuration or
        another parameter count."""
        if state["config"] != self.config.to_dict():
            raise ValueError(f"DiLoCo state was saved with {state['config']}, this run uses {self.config.to_dict()}; "
                             f"resume with the same outer configuration")
        if state["outer"].numel() != self.outer.numel():
            raise ValueError(f"DiLoCo state holds {state['outer'].numel()} parameters, this rank has "
                             f"{self.outer.numel()}; resume with the same model and layout")
        with torch.no_grad():
            self.outer.copy_(state["outer"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.inner_steps, self.syncs = int(state["inner_steps"]), int(state["syncs"])
        self.channel.load_state_dict(state["channel"])

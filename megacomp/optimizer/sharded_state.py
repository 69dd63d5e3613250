"""Checkpointing of the sharded optimizer: this rank's shard as a state dict, its checks on load, and the state
rebuilt for another layout (megacomp.training.reshard).

A saved shard holds the fp32 masters, the inner optimizer's state, the data-parallel gradient channel's error
feedback (and PowerSGD / Accordion state), the step counters, the loss scale, the codecs and the bucket layout,
under a key naming the DP rank, so torch.distributed.checkpoint keeps every rank's shard.

Failure behaviour: loading a shard saved with another format, DP size, bucket layout, codecs, optimizer rule,
sharding or error-feedback setting raises ValueError naming the difference; a resharded master of the wrong length
raises ValueError.

Mixin of DistributedOptimizer: reads ``buckets``, ``masters``, ``optimizer``, ``grad_channel``, ``ef``,
``grad_codec``, ``param_codec``, ``hierarchy``, ``sharded``, ``world``, ``rank``, ``device``, ``scaler``,
``step_count`` and ``skipped_steps``, and calls ``wait_params`` and ``sync_params``.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from .params import plain_data

STATE_FORMAT = "megacomp.DistributedOptimizer/1"


class ShardedState:
    """state_dict / load_state_dict / load_resharded of DistributedOptimizer (see the module docstring)."""

    def _layout(self) -> list:
        return [[b.group, b.numel, b.padded, b.compressed, [list(p.shape) for p in b.params]] for b in self.buckets]

    def init_state(self) -> None:
        """Create the inner optimizer's state (as torch's DCP helpers do) so a fresh optimizer's state_dict()
        can serve as the template for torch.distributed.checkpoint.load."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(self.optimizer)
        self._init_ef_keys()

    def _init_ef_keys(self) -> None:
        """Zero errors for every compressed bucket that has none yet (same behaviour as no error), so saved
        and template state dicts have the same keys whatever the group sizes or steps taken (PowerSGD: also
        the start Q matrices)."""
        ch = self.grad_channel
        if ch.adaptive:  # Accordion's regime state per compressed bucket
            for b in self.buckets:
                if b.compressed:
                    ch.init_key(f"dp_gradient/b{b.index}", b.padded // self.world, False, self.device, b.padded)
        if ch.low_rank:  # PowerSGD (each level of Accordion's): residuals and start Q per matrix
            for b in self.buckets:
                for level in ch.levels if b.compressed else ():
                    level.init_keys(f"dp_gradient/b{b.index}", [p.shape for p in b.params], self.device)
            return
        if self.ef is None:
            return
        n_local = dist.get_world_size(self.hierarchy[0]) if self.hierarchy is not None else 1
        for b in self.buckets:
            if not b.compressed:
                continue
            if self.hierarchy is not None:  # the error lives on the input of the compressed (inter-node) reduce-scatter
                self.ef.init_key(f"dp_gradient/b{b.index}/worker", (b.padded // n_local,))
            else:  # the channel knows where its residuals sit (per hop, for a hierarchical channel)
                self.grad_channel.init_residuals(f"dp_gradient/b{b.index}", b.padded, all_reduce=not self.sharded)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard, under a key naming the DP rank (so torch.distributed.checkpoint keeps every
        rank's shard): masters, inner optimizer state, error feedback, counters, loss scale, codecs, layout."""
        self.wait_params()
        self._init_ef_keys()
        local = {
            "format": STATE_FORMAT, "dp_size": self.world, "layout": self._layout(), "sharded": self.sharded,
            "grad_codec": self.grad_codec.to_dict() if self.grad_codec else None,
            "param_codec": self.param_codec.to_dict() if self.param_codec else None,
            "masters": [m.detach().clone() for m in self.masters], "rule": type(self.optimizer).__name__,
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),  # torch returns live references
            "error_feedback": self.ef.state_dict() if self.ef is not None else None,
            "step": self.step_count, "skipped": self.skipped_steps,
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }
        if self.grad_channel.reduces_whole_buckets:  # Q matrices, regimes (residuals above)
            local["low_rank"] = self.grad_channel.state_dict(error_feedback=False)
        return {f"dp_rank_{self.rank}": local}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's shard and all-gather the parameters. Raises ValueError when the checkpoint has no
        shard for this DP rank, or its format, DP size, bucket layout, codecs or error-feedback setting differ."""
        self.wait_params()
        key = f"dp_rank_{self.rank}"
        if key not in state:
            raise ValueError(f"optimizer state has no shard for data-parallel rank {self.rank} (keys: {sorted(state)}); "
                             f"it was saved with another data-parallel size")
        s = state[key]
        if s.get("rule", type(self.optimizer).__name__) != type(self.optimizer).__name__:
            raise ValueError(f"optimizer checkpoint was saved by {s['rule']}, this optimizer steps with "
                             f"{type(self.optimizer).__name__}; resume with the same optimizer")
        checks = [("format", STATE_FORMAT), ("dp_size", self.world), ("layout", self._layout()),
                  ("grad_codec", self.grad_codec.to_dict() if self.grad_codec else None),
                  ("param_codec", self.param_codec.to_dict() if self.param_codec else None)]
        for name, mine in checks:
            if plain_data(s.get(name)) != plain_data(mine):
                raise ValueError(f"optimizer checkpoint {name} differs from this optimizer ({s.get(name)!r} vs "
                                 f"{mine!r}); resume with the same model, data-parallel size and codecs")
        if bool(s.get("sharded", True)) != self.sharded:
            raise ValueError(f"optimizer checkpoint was saved with shard={s.get('sharded', True)}, this optimizer has "
                             f"shard={self.sharded}; resume with the same setting")
        if (s["error_feedback"] is None) != (self.ef is None):
            raise ValueError("optimizer checkpoint and this optimizer disagree on error feedback; use the same setting")
        with torch.no_grad():
            for m, saved in zip(self.masters, s["masters"]):
                m.copy_(saved)
        self.optimizer.load_state_dict(s["optimizer"])
        if self.ef is not None:
            self.ef.load_state_dict(s["error_feedback"])
        if self.grad_channel.reduces_whole_buckets:
            self.grad_channel.load_state_dict(s["low_rank"])
        self.step_count, self.skipped_steps = int(s["step"]), int(s["skipped"])
        if self.scaler is not None and s["loss_scaler"] is not None:
            self.scaler.load_state_dict(s["loss_scaler"])
        self.sync_params()

    def load_resharded(self, masters: list, inner_state: list, step: int, skipped: int, loss_scaler: Optional[dict],
                       errors: Optional[dict] = None, error_steps: Optional[dict] = None) -> None:
        """Restore state rebuilt for this rank's shards from a checkpoint of another layout
        (megacomp.training.reshard): ``masters[i]`` and ``inner_state[i]`` ({name: tensor}) for bucket i's shard,
        the step counters, the loss scaler's state, and the DP-gradient residuals by error-feedback key
        (``errors``, with ``error_steps``; None resets them). Then all-gathers the parameters, as
        :meth:`load_state_dict` does. Raises ValueError when a shard's length differs from this optimizer's."""
        self.wait_params()
        self.init_state()  # the inner optimizer's state tensors, to be overwritten
        with torch.no_grad():
            for m, saved, st in zip(self.masters, masters, inner_state):
                if saved.shape != m.shape:
                    raise ValueError(f"resharded master shard of {tuple(saved.shape)} elements for a shard of "
                                     f"{tuple(m.shape)}")
                m.copy_(saved)
                mine = self.optimizer.state[m]
                for name, value in st.items():
                    mine[name] = value.to(m.device).clone()
        if self.ef is not None:
            self.ef.reset()
            if errors is not None:
                self.ef.load_state_dict({"config": dataclasses.asdict(self.ef.config), "errors": errors,
                                         "steps": dict(error_steps or {}), "dropped": {}})
        if self.grad_channel.reduces_whole_buckets:
            self._init_ef_keys()  # PowerSGD / Accordion: fresh state, as at step 0
        self.step_count, self.skipped_steps = int(step), int(skipped)
        if self.scaler is not None and loss_scaler is not None:
            self.scaler.load_state_dict(loss_scaler)
        self.sync_params()

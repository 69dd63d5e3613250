"""DeMo, decoupled momentum (``--optimizer demo``; the algorithm is megacomp.optimizer.DeMo): no gradient
reduction; each DP rank keeps its own momentum, extracts the top-k DCT components of each tile, all-gathers
only those (the dp_gradient path, its codec the format of the kept values) and applies the sign of their
average. Every DP rank applies the same update, so there is no parameter all-gather.

Failure behaviour: ValueError naming the flag for an outer loop or AdamW's variance freezing next to DeMo,
bad tile settings, --no-shard-optimizer, error feedback / a structured codec / a warm-up on dp_gradient, or a
dp_parameter codec (nothing would travel on it).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...optimizer import DeMo
from .base import Feature
from .param_groups import optimizer_inputs


@dataclass
class DeMoConfig:
    """DeMo's DCT top-k momentum exchange."""

    FLAT_PREFIX = "demo_"
    topk: int = 32
    """DeMo: coefficients kept per DCT tile (compression_topk)."""
    chunk: int = 64
    """DeMo: largest DCT tile side, tiles of up to chunk x chunk (compression_chunk)."""
    decay: float = 0.999
    """DeMo: momentum decay (compression_decay), in [0, 1)."""
    weight_decay_vectors: bool = False
    """DeMo: decay vectors (norms, biases) by --weight-decay too, as the reference optimizer does (one weight_decay
    for every tensor); off: matrices only, megacomp's groups for every optimizer."""


class DeMoMomentum(Feature):
    """DeMo (see the module docstring)."""

    name = "demo"
    optimizer_names = ("demo",)
    CONFIG = DeMoConfig
    config_key = "demo"

    @classmethod
    def check(cls, cfg, world) -> None:
        if not cls.selected(cfg):
            return
        d = cfg.demo
        if cfg.outer.algorithm != "none" or cfg.zero.freeze_variance_step:
            raise ValueError("optimizer demo replaces the data-parallel gradient exchange; it does not combine with "
                             "--outer-algorithm or --adam-freeze-variance-step")
        if d.topk < 1 or d.chunk < 1 or not 0 <= d.decay < 1:
            raise ValueError(f"DeMo needs demo_topk >= 1, demo_chunk >= 1 and demo_decay in [0, 1), got "
                             f"{d.topk}, {d.chunk} and {d.decay}")
        if cfg.zero.shard is False:
            raise ValueError("optimizer demo keeps no sharded state; drop --no-shard-optimizer")

    def build(self, run) -> None:
        channels, compression = run.channels, run.compression
        ch = channels.dp_gradient
        if ch.error_feedback is not None or ch.codec.structured or compression.dp_gradient_warmup_steps:
            raise ValueError(f"optimizer demo keeps its own residual (the momentum) and does its own DCT and top-k: "
                             f"the compression config's dp_gradient must be a plain value format without error "
                             f"feedback or warm-up (got {ch!r}, warm-up {compression.dp_gradient_warmup_steps}); "
                             f"e.g. none, bf16 or int8")
        if not channels.dp_parameter.codec.is_identity:
            raise ValueError(f"optimizer demo sends no parameters (every DP rank applies the same update), but the "
                             f"compression config sets dp_parameter {channels.dp_parameter.codec}; drop it")
        d, t, inputs = self.cfg.demo, self.cfg.training, optimizer_inputs(run)
        groups = inputs.groups
        if d.weight_decay_vectors:  # the reference's single weight_decay over every tensor
            groups = [{"params": [p for g in groups for p in g["params"]], "weight_decay": t.weight_decay}]
        self.opt = DeMo(groups, lr=t.lr, compression_decay=d.decay, compression_topk=d.topk,
                        compression_chunk=d.chunk, value_codec=ch.codec, channel=ch, max_grad_norm=t.clip_grad or None,
                        grad_norm_group=inputs.norm_group, grad_norm_weight=inputs.norm_weight)
        run.optimizer = self.opt

    def banner(self, run) -> list[str]:
        opt = self.opt
        dense = sum(p.numel() for p in opt.params) * 4
        return [f"optimizer: DeMo, top-{opt.compression_topk} of each DCT tile (up to {opt.compression_chunk}x"
                f"{opt.compression_chunk}), momentum decay {opt.compression_decay:g}, kept values {opt.value_codec}: "
                f"{opt.wire_bytes_per_step() / 1e6:.3f} MB per step to each DP peer vs {dense / 1e6:.3f} MB dense fp32 "
                f"(dp_gradient; no dp_parameter all-gather)"]

    def weights_loaded(self, run) -> None:
        self.opt.load_params_from_model()

"""The methods a plan ranks: each a DP schedule, a codec per traffic path, the compression YAML and pretraining
flags that run it, and its measured loss cost from megacomp's convergence studies (tiny models: the scale caveat
travels with it).

Schedules (what overlaps what; megacomp.plan.estimate costs them):

  ddp_buckets      gradients all-reduced in buckets during the last micro-batch's backward (DDP, LOMO-style hooks)
  zero1            gradients reduce-scattered in buckets during the last micro-batch's backward (from the
                   gradient hooks), parameters all-gathered after the step
                   (megacomp's sharded AdamW; ``overlap_param_gather``: the all-gather hidden behind the next
                   forward of the first micro-batch)
  zero2            megacomp's ZeRO-2: every micro-batch's gradients reduce-scattered in buckets during its own
                   backward (M x ZeRO-1's reduce-scatter bytes), only the 1/DP gradient shard kept
  acco             gradients and parameters exchanged while the next step computes (ACCO: twice zero1's bytes,
                   one step of delay)
  onebit           1-bit Adam after its warm-up: the momentum all-reduced as signs in ``step()`` (exposed)
  demo             DeMo: each rank all-gathers its top-k DCT components of the momentum, no gradient reduction
  local_steps      DiLoCo: inner zero1 inside each replica, the replicas' pseudo-gradients all-reduced every H
                   steps (blocking); Streaming DiLoCo: in P fragments, each hidden behind ``delay`` inner steps

Failure behaviour: :func:`method` with an unknown name raises ValueError listing the known ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

@dataclass(frozen=True)
class Method:
    """One candidate: a schedule and a codec per traffic path."""

    name: str
    """Label in tables."""
    schedule: str
    """One of the schedules in the module docstring."""
    dp_gradient: Any = None
    """Codec spec of the DP gradient exchange (None = uncompressed)."""
    dp_parameter: Any = None
    """Codec spec of the DP parameter all-gather (zero1/zero2/acco)."""
    tp: Any = None
    """Codec spec of TP / SP activations and their gradients."""
    pp: Any = None
    """Codec spec of pipeline activations and gradients."""
    gradient_dtype: str = "float32"
    """Dtype the DP gradients travel in uncompressed: megacomp keeps fp32 main gradients; ``float16`` /
    ``bfloat16`` for engines that reduce half-precision gradients (DeepSpeed's fp16 Adam)."""
    overlap_param_gather: bool = False
    """zero1: hide the parameter all-gather behind the next forward."""
    dp_collectives: str = "auto"
    """zero1/zero2/acco/local_steps: ``auto``, megacomp's compressed DP exchanges hop by hop where the DP group has
    several ranks on each of several nodes (pretraining's default), or ``flat`` (one exchange over the whole group)."""
    outer_steps: int = 0
    """local_steps: inner steps per outer step (H)."""
    fragments: int = 1
    """local_steps: Streaming DiLoCo fragments (1 = plain DiLoCo)."""
    delay: int = 0
    """local_steps: inner steps a fragment's exchange may overlap (Streaming DiLoCo's tau)."""
    outer_op: str = "all_reduce"
    """local_steps: the pseudo-gradient exchange, ``all_reduce`` (DiLoCo) or ``all_gather`` (SparseLoCo, DCT-DiLoCo:
    every replica's message reaches every other)."""
    outer: Any = None
    """local_steps: codec spec of the pseudo-gradient exchange; onebit: of the momentum; demo: the top-k codec."""
    loss_cost: str = ""
    """Measured loss cost and where it was measured (convergence studies on tiny models)."""
    compression: dict = field(default_factory=dict)
    """The compression YAML mapping that runs it (megacomp.config.CommCompressionConfig keys)."""
    flags: dict = field(default_factory=dict)
    """Pretraining settings besides compression (flat names, as megacomp-pretrain's flags)."""

    def describe(self) -> str:
        """Short settings text."""
        bits = [f"{k}={_short(v)}" for k, v in (("dp_grad", self.dp_gradient), ("dp_param", self.dp_parameter),
                                                 ("tp", self.tp), ("pp", self.pp), ("outer", self.outer)) if v]
        if self.outer_steps:
            bits.append(f"H={self.outer_steps}" + (f" P={self.fragments} tau={self.delay}" if self.fragments > 1 else ""))
        return ", ".join(bits) or "uncompressed"


def _short(spec) -> str:
    if isinstance(spec, dict):
        extra = f"/k{spec['k']}" if spec.get("k") else ""
        return f"{spec['name']}{extra}"
    return str(spec)


def _comp(**paths) -> dict:
    return {k: v for k, v in paths.items() if v is not None}


def catalogue(replicas: int = 1) -> list[Method]:
    """Every method the plan ranks; local-step methods only when ``replicas`` > 1 (one replica per site)."""
    INT4 = {"name": "int4", "block_size": 128}  # noqa: N806 (codec specs, read as constants)
    INT8 = {"name": "int8", "block_size": 128}  # noqa: N806
    INT8_P = {"name": "int8", "block_size": 256}  # noqa: N806
    SIGN = {"name": "sign", "block_size": 0}  # noqa: N806
    TP_INT8 = {"name": "int8", "block_size": 128, "hadamard": 128}  # noqa: N806
    out = [
        Method("AdamW (ZeRO-1), uncompressed", "zero1", loss_cost="baseline", compression={}, flags={}),
        Method("DDP buckets, uncompressed", "ddp_buckets", loss_cost="baseline (same maths as ZeRO-1)",
               flags={"shard_optimizer": False}),
        Method("all_int8 (every path int8)", "zero1", dp_gradient=INT8, dp_parameter=INT8_P, tp=TP_INT8, pp=INT8,
               loss_cost="+0.10% / +0.15% (TP2xDP2 / TP2xPP2), +0.21% +- 0.55% at 8 ranks (convergence_ablation)",
               compression={"preset": "all_int8"}),
        Method("ZeRO-1 int4+LoCo grads, int8 params, overlapped gather", "zero1", dp_gradient=INT4, dp_parameter=INT8_P,
               tp=TP_INT8, pp=INT8, overlap_param_gather=True,
               loss_cost="+0.56% +- 0.65% (int4 + LoCo, 3 seeds, convergence_zero)",
               compression=_comp(dp_gradient=INT4, dp_gradient_error_feedback="loco", dp_parameter=INT8_P,
                                 tp_forward=TP_INT8, tp_backward=TP_INT8, sp_all_gather=TP_INT8,
                                 sp_reduce_scatter=TP_INT8, pp_activation=INT8, pp_gradient=INT8),
               flags={"overlap_param_gather": True}),
        Method("ZeRO-2 int8 grads and params", "zero2", dp_gradient=INT8, dp_parameter=INT8_P, tp=TP_INT8, pp=INT8,
               loss_cost="as all_int8's DP paths (int8 gradients without error feedback; convergence_ablation)",
               compression={"preset": "all_int8"}, flags={"zero_stage": 2}),
        Method("ACCO int4+LoCo / int8", "acco", dp_gradient=INT4, dp_parameter=INT8_P, tp=TP_INT8, pp=INT8,
               loss_cost="+0.41% +- 0.17% at 2000 iterations (convergence_acco_long)",
               compression=_comp(dp_gradient=INT4, dp_gradient_error_feedback="loco", dp_parameter=INT8_P,
                                 tp_forward=TP_INT8, tp_backward=TP_INT8, sp_all_gather=TP_INT8,
                                 sp_reduce_scatter=TP_INT8, pp_activation=INT8, pp_gradient=INT8),
               flags={"overlap_optimizer": "acco"}),
        Method("1-bit Adam (after warm-up)", "onebit", tp=TP_INT8, pp=INT8, outer=SIGN,
               loss_cost="-2.11% +- 0.61% vs its Adam (convergence_onebit)",
               compression=_comp(tp_forward=TP_INT8, tp_backward=TP_INT8, sp_all_gather=TP_INT8,
                                 sp_reduce_scatter=TP_INT8, pp_activation=INT8, pp_gradient=INT8, dp_momentum=SIGN,
                                 dp_momentum_error_feedback=True),
               flags={"optimizer": "onebit_adam"}),
        Method("DeMo top-32/64 DCT", "demo", tp=TP_INT8, pp=INT8,
               outer={"name": "none", "k": 32, "chunk": 4096},
               loss_cost="+0.68% at 25.5x fewer bytes, 2000 iterations, one seed (convergence_demo_long_seed1)",
               compression=_comp(tp_forward=TP_INT8, tp_backward=TP_INT8, sp_all_gather=TP_INT8,
                                 sp_reduce_scatter=TP_INT8, pp_activation=INT8, pp_gradient=INT8),
               flags={"optimizer": "demo", "demo_topk": 32, "demo_chunk": 64}),
    ]
    if replicas > 1:
        out += [
            Method("DiLoCo H=100, int8 outer", "local_steps", tp=TP_INT8, pp=INT8, outer=INT8, outer_steps=100,
                   loss_cost="+13.5% +- 0.4% at H=50 on a 0.27M-parameter model (convergence_diloco; the gap shrinks "
                             "with scale in the DiLoCo papers)",
                   compression=_comp(tp_forward=TP_INT8, tp_backward=TP_INT8, sp_all_gather=TP_INT8,
                                     sp_reduce_scatter=TP_INT8, pp_activation=INT8, pp_gradient=INT8, outer=INT8),
                   flags={"outer_algorithm": "diloco", "num_replicas": replicas, "outer_steps": 100}),
            Method("Streaming DiLoCo H=100 P=4 tau=5, int4+EF outer", "local_steps", tp=TP_INT8, pp=INT8, outer=INT4,
                   outer_steps=100, fragments=4, delay=5,
                   loss_cost="about DiLoCo's (+13.5% at H=50 on 0.27M parameters; convergence_diloco)",
                   compression=_comp(tp_forward=TP_INT8, tp_backward=TP_INT8, sp_all_gather=TP_INT8,
                                     sp_reduce_scatter=TP_INT8, pp_activation=INT8, pp_gradient=INT8, outer=INT4),
                   flags={"outer_algorithm": "streaming_diloco", "num_replicas": replicas, "outer_steps": 100,
                          "outer_fragments": 4, "outer_delay": 5, "outer_error_feedback": "ef"}),
        ]
    return out


def method(name: str, replicas: int = 1) -> Method:
    """The catalogue entry called ``name``."""
    for m in catalogue(max(2, replicas)):
        if m.name == name:
            return m
    raise ValueError(f"unknown method {name!r}: use one of {', '.join(m.name for m in catalogue(2))}")

"""Local-step outer loops over model replicas (``--outer-algorithm diloco | streaming_diloco | noloco | mt_dao |
sparseloco | sparseloco_dct | dct_diloco | locodl | lodadac``; the algorithms are megacomp.outer): the data-parallel ranks split into replicas, the sharded
optimizer works inside a replica, and every ``outer_steps`` inner steps the replicas exchange a pseudo-gradient
on the ``outer`` path (its codec from the compression config's ``outer`` / ``outer_error_feedback``, or from
``--outer-codec`` / ``--outer-error-feedback``, which win when given).

DiLoCo is Streaming DiLoCo with one fragment, no delay, no mixing; MT-DAO is its parameter averaging (outer lr
1, no momentum) plus megacomp.outer.mt_dao's averaging of the inner optimizer's moments, with the inner
optimizer MultiTimescaleAdamW. Replicas skip steps independently, so each iteration's verdict is agreed on
every rank before the outer step. The outer state (momentum, the replicas' anchor, streams) is checkpointed.

Failure behaviour: ValueError naming the flag for a bad algorithm or value, fewer than 2 replicas, a replica
count that does not divide DP, NoLoCo groups that do not split the replicas, Streaming settings with plain
DiLoCo, fine-tuning, a biased codec for LoCoDL (it needs megacomp.compression.unbiased's), error feedback for LoCoDL or
LoDAdaC, a gossip topology that does not fit the replica count; a replica that does not arrive within ``outer_timeout`` stops every rank with an error
naming it (megacomp.outer.ReplicaWatch).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...compression import make_codec, parse_codec_arg
from ...compression.unbiased import unbiased_name
from ...optimizer import MultiTimescaleAdamW
from ...outer import DiLoCo, DiLoCoConfig, ReplicaWatch, build_replica_groups
from ...outer.locodl import LoCoDL, LoCoDLConfig
from ...outer.lodadac import RULES as LODADAC_RULES
from ...outer.lodadac import LoDAdaC, LoDAdaCAdam, LoDAdaCConfig
from ...outer.mt_dao import average_optimizer_state
from ...outer.topology import check_topology, mixing_rho
from ...outer.sparseloco import DEFAULT_CODEC as SPARSELOCO_CODEC
from ...outer import dct_diloco

SPARSELOCO_DCT_CODEC = "{name: bf16, k: 4, chunk: 64, transform: dct}"
"""SparseLoCo-DCT's outer codec when none is set: top-4 of every 64 coefficients of a 1-D chunked DCT, bf16 values
(the setting of megacomp's structured-codec study)."""
from .base import Feature

OUTER_ALGORITHMS = ("none", "diloco", "streaming_diloco", "noloco", "mt_dao", "sparseloco", "sparseloco_dct",
                    "dct_diloco", "locodl", "lodadac")


@dataclass
class OuterConfig:
    """The local-step outer loop over replicas."""

    FLAT_PREFIX = "outer_"
    algorithm: str = "none"
    """Local-step outer loop over model replicas: none, diloco, streaming_diloco, noloco, mt_dao, sparseloco,
    sparseloco_dct, dct_diloco, locodl or lodadac (megacomp.outer; sparseloco_dct: SparseLoCo's accumulator with a
    1-D DCT top-k codec, megacomp's own variant; dct_diloco: DCT-DiLoCo as published, Nesterov momentum whose
    largest 2-D DCT components are shared; locodl: local training plus unbiased compression with control variates;
    lodadac: the paper's Algorithm 1, local Adam-type steps plus compressed gossip)."""
    num_replicas: int = field(default=1, metadata={"flag": "num_replicas"})
    """Replicas the data-parallel ranks are split into (must divide the DP size); each trains on its own
    and they exchange a pseudo-gradient every --outer-steps steps."""
    steps: int = 50
    """H: inner steps between two outer synchronisations (DiLoCo)."""
    lr: Optional[float] = None
    """Outer learning rate. Default: the algorithm's, 0.7 for DiLoCo and NoLoCo, 1.0 for MT-DAO (averaging) and
    SparseLoCo (alpha)."""
    momentum: Optional[float] = None
    """Outer momentum (0 = none). Default: the algorithm's, 0.9 Nesterov for DiLoCo, 0.5 for NoLoCo, 0 for
    MT-DAO, and for SparseLoCo the error-feedback accumulator's decay beta, 0.95."""
    group_size: int = 2
    """NoLoCo: replicas per gossip group, drawn at random every outer step (must divide num_replicas)."""
    codec: Any = None
    """Codec of the pseudo-gradient exchange, the compression config's ``outer`` path (a name, or a mapping, also
    as '{name: int4, ...}' on the command line); given here it wins over the compression config. Default:
    uncompressed; for sparseloco {name: int2, k: 64, chunk: 4096}, for sparseloco_dct {name: bf16, k: 4, chunk: 64,
    transform: dct}; for dct_diloco the format of the kept DCT coefficients only (default fp32, as published)."""
    error_feedback: Any = None
    """Error feedback on the pseudo-gradient ('ef', 'loco'; the compression config's outer_error_feedback, which
    this wins over when given); needs a lossy outer codec."""
    dct_topk: int = dct_diloco.DEFAULT_TOPK
    """DCT-DiLoCo: DCT coefficients of largest magnitude each replica shares per tile (the release's 32)."""
    dct_chunk: int = dct_diloco.DEFAULT_CHUNK
    """DCT-DiLoCo: largest DCT tile side, tiles of up to dct_chunk x dct_chunk (the release's 64; at most 256)."""
    sparseloco_tiles: str = "flat"
    """SparseLoCo: where the codec's top-k runs: 'flat' (runs of chunk entries of the flat parameters) or
    'reference' (each tensor's tiles of up to sqrt(chunk) x sqrt(chunk), as the reference code)."""
    sparseloco_quantizer: str = "codec"
    """SparseLoCo: the kept values in the codec's format ('codec') or the reference code's statistical 2-bit code
    ('stat2': per tensor, 4 bins of 1.5 sigma around the mean, each decoded to its mean; needs tiles 'reference')."""
    fragments: int = 1
    """Streaming DiLoCo: parameter fragments synchronised at staggered steps (at most num_layers)."""
    delay: int = 0
    """Streaming DiLoCo: inner steps an exchange overlaps before it is applied (tau < outer_steps)."""
    mixing: float = 0.0
    """Streaming DiLoCo: alpha in local = alpha * local + (1 - alpha) * outer when a fragment lands."""
    schedule: str = "megacomp"
    """Streaming DiLoCo: 'megacomp' (fragment p starts when (step + p * H / P) % H == 0, lands delay steps later) or
    'torchft' (torchft 0.2.0's DiLoCo: fragment p lands at (p + 1) * H / P, started delay steps before; needs
    outer_steps divisible by outer_fragments and outer_delay < outer_steps / outer_fragments)."""
    timeout: float = 600.0
    """Seconds a replica waits for the others at an outer exchange; then it stops with an error naming the
    replicas that did not arrive (a dead or stalled replica must not hang the rest)."""
    mt_dao_slow_betas: str = field(default="0.999", metadata={"flag": "mt_dao_slow_betas"})
    """MT-DAO: comma list of the slow first moments' betas (the fast one is --adam-beta1; 0 = raw gradient)."""
    mt_dao_slow_weights: str = field(default="0.9", metadata={"flag": "mt_dao_slow_weights"})
    """MT-DAO: comma list of the slow moments' weights in the update (sum <= 1; the fast one gets the rest)."""
    probability: Optional[float] = None
    """LoCoDL: p, the probability of communicating after an inner step (one shared coin). Default: 1 / outer_steps."""
    chi: Optional[float] = None
    """LoCoDL: chi, the control variates' stepsize. Default: 1 / (1 + omega / num_replicas), omega the codec's."""
    rho: Optional[float] = None
    """LoCoDL: rho in (0, 1], how far the models move to the consensus point at a communication. Default: chi."""
    topology: str = "ring"
    """LoDAdaC: gossip graph of the replicas: ring, torus, exponential or random_peer (NoLoCo's random pairs)."""
    lodadac_rule: str = field(default="adam", metadata={"flag": "lodadac_rule"})
    """LoDAdaC: the local update's r_t (the paper's Table 2): adam, amsgrad or adagrad."""
    lodadac_delta: float = field(default=1e-4, metadata={"flag": "lodadac_delta"})
    """LoDAdaC: delta in x -= lr m / (sqrt(u_prev) + delta); the first step divides by it (u starts at 0). 1e-4 is
    the authors' release (sqrt(u + 1e-8) at u = 0)."""
    lodadac_bias_correction: bool = field(default=False, metadata={"flag": "lodadac_bias_correction"})
    """LoDAdaC: Adam's bias correction of m and u (not in the paper's Algorithm 1; off by default)."""
    lodadac_weight_decay: bool = field(default=False, metadata={"flag": "lodadac_weight_decay"})
    """LoDAdaC: apply --weight-decay as AdamW's decoupled decay (not in the paper's Algorithm 1; off by default)."""


def mt_dao_optimizer_kwargs(cfg) -> dict:
    """``slow_betas`` and ``slow_weights`` of megacomp.optimizer.MultiTimescaleAdamW from the comma lists.

    Raises:
        ValueError: a list that does not parse, lists of different lengths, betas outside [0, 1), weights < 0
            or summing to more than 1."""
    out = {}
    for flag, key in (("mt_dao_slow_betas", "slow_betas"), ("mt_dao_slow_weights", "slow_weights")):
        text = str(getattr(cfg.outer, flag))
        try:
            out[key] = tuple(float(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"{flag} must be a comma list of numbers, got {text!r}") from None
    betas, weights = out["slow_betas"], out["slow_weights"]
    if len(betas) != len(weights) or not all(0 <= b < 1 for b in betas) or any(w < 0 for w in weights) \
            or sum(weights) > 1:
        raise ValueError(f"mt_dao_slow_betas {betas} and mt_dao_slow_weights {weights}: one weight per beta, betas in "
                         f"[0, 1), weights >= 0 summing to at most 1")
    return out


def locodl_config(cfg) -> LoCoDLConfig:
    """The megacomp.outer.LoCoDLConfig of a run: gamma is the peak --lr, p defaults to 1 / outer_steps, the codec is the
    outer codec read as an unbiased compressor. Raises ValueError for bad values or a biased codec."""
    o = cfg.outer
    codec = parse_codec_arg(o.codec) if o.codec is not None else cfg.compression_config().outer
    if o.error_feedback is not None or cfg.compression_config().outer_error_feedback is not None:
        raise ValueError("LoCoDL's compressors are unbiased and its control variates correct them; drop "
                         "outer_error_feedback")
    try:
        return LoCoDLConfig(probability=o.probability if o.probability is not None else 1.0 / o.steps,
                            gamma=cfg.training.lr, chi=o.chi, rho=o.rho, codec=codec, seed=cfg.training.seed)
    except ValueError as e:
        raise ValueError(f"outer_algorithm locodl: {e} (--outer-codec takes randk with k, usq2, usq4, usq8 or none)") \
            from None


def lodadac_config(cfg) -> LoDAdaCConfig:
    """The megacomp.outer.LoDAdaCConfig of a run: H = outer_steps, the gossip step is --outer-lr, the codec the outer
    codec. Raises ValueError for bad values or error feedback (the gossip copies are LoDAdaC's error feedback)."""
    o = cfg.outer
    codec = parse_codec_arg(o.codec) if o.codec is not None else cfg.compression_config().outer
    if o.error_feedback is not None or cfg.compression_config().outer_error_feedback is not None:
        raise ValueError("LoDAdaC's gossip copies are its error feedback; drop outer_error_feedback")
    return LoDAdaCConfig(outer_steps=o.steps, topology=o.topology, gossip_lr=o.lr, codec=codec, seed=cfg.training.seed)


def lodadac_optimizer(cfg):
    """The local update of a LoDAdaC run, megacomp.outer.lodadac.LoDAdaCAdam (Algorithm 1, lines 5-8) with the
    --lodadac-* settings, for the sharded optimizer. Raises ValueError for delta <= 0 or an unknown rule."""
    o = cfg.outer
    if o.lodadac_rule not in LODADAC_RULES:
        raise ValueError(f"lodadac_rule must be one of {', '.join(LODADAC_RULES)} (the paper's Table 2), got "
                         f"{o.lodadac_rule!r}")
    if not o.lodadac_delta > 0:
        raise ValueError(f"lodadac_delta must be > 0 (Algorithm 1's first step divides by it), got {o.lodadac_delta}")
    return functools.partial(LoDAdaCAdam, eps=o.lodadac_delta, rule=o.lodadac_rule,
                             bias_correction=o.lodadac_bias_correction, apply_weight_decay=o.lodadac_weight_decay)


def outer_config(cfg) -> DiLoCoConfig:
    """The megacomp.outer.DiLoCoConfig of a run. Raises ValueError for bad values (see DiLoCoConfig)."""
    o = cfg.outer
    noloco, mt_dao, dct = o.algorithm == "noloco", o.algorithm == "mt_dao", o.algorithm == "dct_diloco"
    sparse = o.algorithm in ("sparseloco", "sparseloco_dct")
    lr, momentum = o.lr, o.momentum  # None: the algorithm's published values (DiLoCoConfig fills them)
    if mt_dao:  # MT-DAO's outer step is plain averaging of the replicas (DiLoCo's rule at lr 1, no momentum)
        lr, momentum = (1.0 if lr is None else lr), (0.0 if momentum is None else momentum)
    comp = cfg.compression_config()
    codec = parse_codec_arg(o.codec) if o.codec is not None else comp.outer
    error_feedback = o.error_feedback if o.error_feedback is not None else comp.outer_error_feedback
    if o.algorithm == "sparseloco_dct":
        codec = parse_codec_arg(SPARSELOCO_DCT_CODEC) if codec is None else codec
        if make_codec(codec).transform != "dct":
            raise ValueError(f"outer_algorithm sparseloco_dct needs a codec with transform: dct, got {codec}; add "
                             f"transform: dct or use --outer-algorithm sparseloco")
    if sparse and codec is None:
        codec = SPARSELOCO_CODEC
    algorithm = "noloco" if noloco else "sparseloco" if sparse else "dct_diloco" if dct else "diloco"
    return DiLoCoConfig(outer_steps=o.steps, outer_lr=lr, outer_momentum=momentum, algorithm=algorithm,
                        dct_topk=o.dct_topk, dct_chunk=o.dct_chunk, sparseloco_tiles=o.sparseloco_tiles,
                        sparseloco_quantizer=o.sparseloco_quantizer,
                        group_size=o.group_size, seed=cfg.training.seed if noloco else 0, codec=codec,
                        error_feedback=error_feedback, fragments=o.fragments, delay=o.delay, mixing=o.mixing,
                        schedule=o.schedule)


class OuterLoop(Feature):
    """The outer loops (see the module docstring)."""

    name = "outer"
    CONFIG = OuterConfig
    config_key = "outer"
    state_key = "outer"

    @classmethod
    def selected(cls, cfg) -> bool:
        return cfg.outer.algorithm != "none"

    @classmethod
    def check(cls, cfg, world) -> None:
        o = cfg.outer
        if o.algorithm not in OUTER_ALGORITHMS:
            raise ValueError(f"outer_algorithm must be one of {', '.join(OUTER_ALGORITHMS)}, got {o.algorithm!r}")
        unbiased = unbiased_name(parse_codec_arg(o.codec) if o.codec is not None else cfg.compression_config().outer)
        if o.algorithm != "locodl" and unbiased is not None:
            raise ValueError(f"outer codec {unbiased} is an unbiased compressor, which only --outer-algorithm locodl "
                             f"takes; for {o.algorithm} use a value codec (int4, int8, ...) or top-k ({{name: int2, k: 64}})")
        if o.algorithm in ("diloco", "mt_dao") and (o.fragments != 1 or o.delay or o.mixing):
            raise ValueError("outer_fragments, outer_delay and outer_mixing are Streaming DiLoCo (and NoLoCo) settings: "
                             "use --outer-algorithm streaming_diloco")
        if o.algorithm == "dct_diloco" and (o.fragments != 1 or o.delay or o.mixing):
            raise ValueError("DCT-DiLoCo as published synchronises every parameter every outer_steps steps: drop "
                             "outer_fragments, outer_delay and outer_mixing")
        if o.algorithm == "mt_dao":
            mt_dao_optimizer_kwargs(cfg)  # raises on bad lists
            if cfg.zero.freeze_variance_step:
                raise ValueError("adam_freeze_variance_step and outer_algorithm mt_dao both replace the inner optimizer; "
                                 "use one of them")
        if o.algorithm == "none":
            if o.num_replicas != 1:
                raise ValueError(f"num_replicas {o.num_replicas} needs an outer algorithm (--outer-algorithm diloco)")
            return
        if o.algorithm == "locodl":
            locodl_config(cfg)  # raises on bad values
        elif o.algorithm == "lodadac":
            lodadac_config(cfg)
            lodadac_optimizer(cfg)
            check_topology(o.topology, o.num_replicas)
            if cfg.zero.freeze_variance_step:
                raise ValueError("adam_freeze_variance_step and outer_algorithm lodadac both replace the inner "
                                 "optimizer; use one of them")
        else:
            outer_config(cfg)  # raises on bad values
        if o.fragments > cfg.model.num_layers:
            raise ValueError(f"outer_fragments {o.fragments} is larger than the {cfg.model.num_layers} layers; use "
                             f"at most one fragment per layer")
        if o.num_replicas < 2:
            raise ValueError(f"outer_algorithm {o.algorithm} needs num_replicas >= 2, got {o.num_replicas}")
        if o.algorithm == "noloco" and o.num_replicas % o.group_size:
            raise ValueError(f"outer_group_size {o.group_size} does not divide num_replicas {o.num_replicas}; "
                             f"NoLoCo's gossip groups must split the replicas evenly")
        if cfg.checkpoint.finetune:
            raise ValueError("finetune with an outer loop is not supported (the replicas' outer weights are built "
                             "before the checkpoint is read); fine-tune without --outer-algorithm")
        p = cfg.parallel
        if world and world % (p.tensor_model_parallel_size * p.pipeline_model_parallel_size) == 0:
            dp = world // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)
            if dp % o.num_replicas:
                raise ValueError(f"num_replicas {o.num_replicas} does not divide the data-parallel size {dp} (world "
                                 f"{world} = TP {p.tensor_model_parallel_size} x PP {p.pipeline_model_parallel_size} "
                                 f"x DP {dp})")

    @classmethod
    def resolve(cls, cfg, world) -> list[str]:
        """LoDAdaC is the paper's Algorithm 1, which clips nothing (nor does the authors' release): unless
        --clip-grad was typed, the trainer's global-norm clip (1.0 by default, and in the model YAMLs) is turned
        off for it, said in the banner; a typed --clip-grad is kept and the LoDAdaC banner names it."""
        t = cfg.training
        if cfg.outer.algorithm != "lodadac" or not t.clip_grad or "clip_grad" in cfg.explicit:
            return []
        was, t.clip_grad = t.clip_grad, 0.0
        return [f"optimizer: no gradient clipping (clip_grad 0 instead of {was:g}): LoDAdaC's Algorithm 1 and the "
                f"authors' release do not clip (--clip-grad N clips)"]

    def build(self, run) -> None:
        """Split DP into replicas (the inner optimizer then works inside one) and build the outer step; MT-DAO also
        picks the inner optimizer."""
        o = self.cfg.outer
        self.replicas = build_replica_groups(run.groups, o.num_replicas)
        run.dp_group, run.replica = self.replicas.inner, self.replicas.replica
        if o.algorithm == "mt_dao":
            run.inner_optimizer_class = functools.partial(MultiTimescaleAdamW, **mt_dao_optimizer_kwargs(self.cfg))
        if o.algorithm == "lodadac":
            run.inner_optimizer_class = lodadac_optimizer(self.cfg)
        watch = ReplicaWatch(self.replicas.outer_ranks, self.replicas.replica, o.timeout)
        if o.algorithm in ("locodl", "lodadac"):
            engine, config = (LoCoDL, locodl_config) if o.algorithm == "locodl" else (LoDAdaC, lodadac_config)
            self.outer = engine(run.model.parameters(), self.replicas.outer, config(self.cfg),
                                after_sync=lambda: run.optimizer.load_params_from_model(), watch=watch)
            return
        self.outer = DiLoCo(run.model.parameters(), self.replicas.outer, outer_config(self.cfg),
                            after_sync=lambda: self._after_sync(run), watch=watch)

    def _after_sync(self, run) -> None:
        """The model's parameters were replaced by the outer step: reload the optimizer's fp32 masters; under
        MT-DAO also average the optimizer's moments across the replicas (megacomp.outer.mt_dao)."""
        run.optimizer.load_params_from_model()
        if self.cfg.outer.algorithm == "mt_dao":
            average_optimizer_state(run.optimizer.optimizer, self.outer.plain)

    def banner(self, run) -> list[str]:
        oc, replicas, dp = self.outer.config, self.cfg.outer.num_replicas, run.groups.dp_size
        if self.cfg.outer.algorithm == "locodl":
            e = self.outer
            return [f"outer loop: LoCoDL over {replicas} replicas of {dp // replicas} DP rank(s): communicate with "
                    f"probability p {oc.probability:g} after each step (shared coin), gamma {oc.gamma:g}, chi "
                    f"{e.chi:g}, rho {e.rho:g}, unbiased codec {oc.codec} (omega {e.omega:.3g}), d_i all-gathered "
                    f"(traffic kind 'outer'); control variates u_i, v and the copy y in fp32"]
        if self.cfg.outer.algorithm == "lodadac":
            o = self.cfg.outer
            clip = self.cfg.training.clip_grad
            off = [name for name, on in (("bias correction", o.lodadac_bias_correction),
                                         (f"decoupled weight decay {self.cfg.training.weight_decay:g}",
                                          o.lodadac_weight_decay),
                                         (f"gradient clipping at global norm {clip:g} (--clip-grad)", clip)) if on]
            local = (f"local {o.lodadac_rule} (Table 2: m, the previous u, delta {o.lodadac_delta:g}, lr from the "
                     f"schedule; " + (f"with {' and '.join(off)}, which Algorithm 1 does not have" if off else
                                      "no bias correction, no weight decay, no clipping") + ")")
            graph = ("topology random_peer (a new W each round, outside the paper: per-pair copies)"
                     if oc.topology == "random_peer" else
                     f"topology {oc.topology} (rho {mixing_rho(oc.topology, replicas):.3g})")
            return [f"outer loop: LoDAdaC (Algorithm 1) over {replicas} replicas of {dp // replicas} DP rank(s): "
                    f"{local}; every K = {oc.outer_steps} steps xh += Q[x - xh] sent to each neighbour, x += gamma "
                    f"{oc.gossip_lr:g} (sum_j W_ji xh_j - xh), {graph}, Q {oc.codec} (traffic kind 'outer', bytes per "
                    f"neighbour)"]
        per = f"{replicas} replicas of {dp // replicas} DP rank(s), sync every {oc.outer_steps} steps"
        codec = (f"pseudo-gradient codec {oc.codec}{' + error feedback' if oc.error_feedback else ''} (traffic kind "
                 f"'outer')")
        stream = (f" in {oc.fragments} fragments, each applied {oc.delay} steps after it starts, mixing {oc.mixing:g}"
                  if oc.fragments > 1 or oc.delay or oc.mixing else "")
        if self.cfg.outer.algorithm == "mt_dao":
            text = (f"MT-DAO over {per}: parameters averaged (outer lr {oc.outer_lr:g}, momentum {oc.outer_momentum:g}, "
                    f"{codec}) and every Adam moment averaged uncompressed; inner MultiTimescaleAdamW")
        elif oc.algorithm == "noloco":
            text = (f"NoLoCo{stream} over {per}, gossip in random groups of {oc.group_size} (no all-reduce), alpha "
                    f"{oc.outer_lr:g} beta {oc.outer_momentum:g}, {codec}; slow weights sent uncompressed")
        elif oc.algorithm == "dct_diloco":
            text = (f"DCT-DiLoCo over {per}: m <- {oc.outer_momentum:g} m + Delta, the top-{oc.dct_topk} of each "
                    f"2-D DCT tile (up to {oc.dct_chunk}x{oc.dct_chunk}) of m all-gathered in {oc.codec} and averaged "
                    f"into m, the rest kept; theta -= {oc.outer_lr:g} x (Delta + {oc.outer_momentum:g} m) with the "
                    f"replica's own Delta (traffic kind 'outer')")
        elif oc.algorithm == "sparseloco":
            text = (f"SparseLoCo{'-DCT' if self.cfg.outer.algorithm == 'sparseloco_dct' else ''} over {per}: accumulator e <- {oc.outer_momentum:g} e + Delta, C(e) all-gathered and "
                    f"averaged, theta -= {oc.outer_lr:g} x mean, pseudo-gradient codec {oc.codec} (traffic kind "
                    f"'outer')")
        else:
            nesterov = " (Nesterov)" if oc.nesterov and oc.outer_momentum else ""
            text = (f"{'Streaming ' if stream else ''}DiLoCo{stream} over {per}, outer SGD lr {oc.outer_lr:g} momentum "
                    f"{oc.outer_momentum:g}{nesterov}, {codec}")
        return [f"outer loop: {text}"]

    def iteration(self, run, batches, inner):
        losses, stepped = inner(batches)
        # replicas skip steps independently; the verdict and the outer cycle must be the same everywhere
        flag = torch.tensor([0.0 if stepped else 1.0], device=run.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.outer.step()
        return losses, not flag.item()

    def state_dict(self) -> Any:
        return self.outer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.outer.load_state_dict(state)

    def close(self, run) -> None:
        self.outer.finish()  # complete outer exchanges still in flight

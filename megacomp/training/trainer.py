"""GPT pretraining loop over TP x PP x DP with every traffic kind compressible.

Per iteration: M = global_batch / (micro_batch x DP) micro-batches go through the model (1F1B when
PP > 1), gradients are accumulated in the sharded optimizer's buffers and reduce-scattered after the
last micro-batch; tied-embedding and sequence-parallel gradients are summed over their groups first;
then the optimizer steps and all-gathers parameters. Loss, learning rate, tokens/s and the iteration's
wire bytes per traffic kind are logged; checkpoints are written every ``save_interval`` iterations.

Around the loop (rank 0 prints): a start-up banner (megacomp.training.report), a note per tolerated
skipped step, an end-of-run summary, a line per saved checkpoint. The divergence policy
(megacomp.training.guard) stops a diverging run with TrainingDiverged before anything of it is saved. An
exit signal (SIGTERM, SIGUSR1: megacomp.training.signals) makes every rank save at the next iteration
boundary and return normally. ``--load DIR`` with no checkpoint in DIR starts fresh and says so, so one
``--save DIR --load DIR`` command serves every attempt of a job (Slurm requeue, torchrun --max-restarts).
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm, parallel_state
from ..config import ModelParallelConfig
from ..data import DistributedBatchSampler, get_batch, prepare_data
from ..comm.probe import ErrorProbe
from ..launch import init_distributed
from ..models.chunks import GPTChunks
from ..models.gpt import GPTConfig, GPTModel, split_layers
from ..optimizer import DeMo, DistributedOptimizer, FrozenVarianceAdamW, MultiTimescaleAdamW, OneBitOptimizer
from ..optimizer.acco import ACCO
from ..outer import DiLoCo, ReplicaWatch, build_replica_groups
from ..outer.mt_dao import average_optimizer_state
from ..pipeline_parallel import (PipelineCommunicator, forward_backward_pipelining_with_interleaving,
                                 forward_backward_pipelining_without_interleaving)
from .arguments import (LOMO_OPTIMIZERS, ONEBIT_OPTIMIZERS, PretrainConfig, check, mt_dao_optimizer_kwargs,
                        outer_config, virtual_chunks)
from .checkpoint import (discard_checkpoint, latest_iteration, load_checkpoint, load_model_weights, prune_checkpoints,
                         save_checkpoint)
from .fused import FusedStep, build_fused, lomo_summary
from .guard import DivergenceGuard, TrainingDiverged
from .acco import acco_halves, acco_summary, book_acco_tail
from .aqsgd import build_activation_delta, summary as aqsgd_summary
from .loqt import LoQTDriver
from .metrics import MetricsLogger, gather_probe, gather_traffic
from .optimizers import build_demo, build_onebit
from .report import RunTotals, banner, demo_summary, onebit_summary, outer_summary, zero2_summary
from .signals import ExitSignals


def learning_rate(cfg: PretrainConfig, it: int) -> float:
    """Linear warm-up then cosine decay to ``min_lr`` at ``train_iters``."""
    if it < cfg.lr_warmup_iters:
        return cfg.lr * (it + 1) / cfg.lr_warmup_iters
    span = max(1, cfg.train_iters - cfg.lr_warmup_iters)
    progress = min(1.0, (it - cfg.lr_warmup_iters) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


class Trainer:
    """Builds everything for one rank and runs the iterations."""

    def __init__(self, cfg: PretrainConfig) -> None:
        self.cfg = cfg
        init_distributed(timeout_s=cfg.distributed_timeout_minutes * 60)
        self.world = dist.get_world_size()
        check(cfg, self.world)
        self.groups = parallel_state.initialize_model_parallel(cfg.tensor_model_parallel_size,
                                                               cfg.pipeline_model_parallel_size)
        g = self.groups
        self.compression_spec = cfg.compression_config()  # as configured (recorded in checkpoints)
        self.compression = self.compression_spec.for_rank(dist.get_rank())  # per-rank stochastic-rounding seeds
        self.channels = self.compression.build_channels(g)  # one per traffic path, used by everything below
        self.probe = ErrorProbe() if self.compression.error_probe_interval else None
        self.channels.attach_probe(self.probe)
        self.tokenizer, self.dataset = prepare_data(cfg.data_path, cfg.vocab_size, cfg.seq_length, cfg.data_cache_dir,
                                                    max_bytes=cfg.tokenizer_max_bytes)
        if cfg.dataset_samples is not None:
            if not 0 < cfg.dataset_samples <= len(self.dataset):
                raise ValueError(f"dataset_samples {cfg.dataset_samples} must be in [1, {len(self.dataset)}] (the "
                                 f"corpus has {len(self.dataset)} samples of {cfg.seq_length} tokens)")
            self.dataset = torch.utils.data.Subset(self.dataset, range(cfg.dataset_samples))
        tp, pp = g.tp_size, g.pp_size
        multiple = 8 * tp
        vocab = -(-self.tokenizer.vocab_size // multiple) * multiple  # pad so the vocabulary splits over TP
        self.gpt = GPTConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                             ffn_hidden_size=cfg.ffn_hidden_size, num_layers=cfg.num_layers, vocab_size=vocab,
                             max_seq_length=cfg.seq_length, seed=cfg.seed,
                             cross_entropy_inplace_backward=cfg.optimizer not in LOMO_OPTIMIZERS)  # LOMO: 2 passes
        mpc = ModelParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  sequence_parallel=cfg.sequence_parallel, params_dtype=cfg.params_dtype,
                                  compression=self.compression, channels=self.channels, process_groups=g)
        self.device = comm.comm_device()  # cuda:<local rank> under NCCL (set by init_distributed), else CPU
        self.num_chunks = virtual_chunks(cfg)
        if self.num_chunks > 1:  # interleaved schedule: this stage's chunks of virtual stages
            self.model = GPTChunks(self.gpt, mpc, pp_size=pp, pp_rank=g.pp_rank, num_chunks=self.num_chunks).to(self.device)
        else:
            self.model = GPTModel(self.gpt, mpc, pre_process=g.pp_rank == 0, post_process=g.pp_rank == pp - 1,
                                  layer_range=split_layers(cfg.num_layers, pp, g.pp_rank)).to(self.device)
        # LoQT: quantised base weights and trainable low-rank factors, before the optimizer sees the parameters
        self.loqt = LoQTDriver(cfg, self.model, g) if cfg.loqt_rank else None
        # local-step training: the DP ranks split into replicas; the sharded optimizer works inside a replica
        self.replicas = build_replica_groups(g, cfg.num_replicas) if cfg.outer_algorithm != "none" else None
        self.optimizer = self._build_optimizer()
        self.outer = None
        if self.replicas is not None:
            oc = outer_config(cfg)
            watch = ReplicaWatch(self.replicas.outer_ranks, self.replicas.replica, cfg.outer_timeout)
            self.outer = DiLoCo(self.model.parameters(), self.replicas.outer, oc, after_sync=self._after_outer_sync,
                                watch=watch)
        self.num_microbatches = cfg.global_batch_size // (cfg.micro_batch_size * g.dp_size)
        self.iteration = 0
        self.activation_delta = None
        if self.compression.pp_activation_delta:  # AQ-SGD: per-sample caches, fixed data shards
            self.activation_delta = build_activation_delta(
                num_samples=len(self.dataset), shard=self._sampler(0).shard(), pp_size=pp, pp_rank=g.pp_rank,
                num_chunks=self.num_chunks, sample_shape=(self._activation_shape()[0], cfg.hidden_size),
                dtype=next(self.model.parameters()).dtype, warmup_visits=self.compression.pp_activation_delta_warmup_visits)
        self.communicator = (PipelineCommunicator(g.pp_ranks, channels=self.channels,
                                                  activation_delta=self.activation_delta) if pp > 1 else None)
        self._validated_once = False
        self.is_logger = dist.get_rank() == 0
        resumed = None
        self.guard = DivergenceGuard(cfg.max_skipped_steps, cfg.loss_divergence_factor)  # _load restores its state
        if cfg.finetune and cfg.save and latest_iteration(cfg.save) is not None:  # a restarted fine-tuning job
            self._load(cfg.save)
            resumed = f"resumed the fine-tuning run from {cfg.save} at iteration {self.iteration} (--finetune: " \
                      f"{cfg.load} is only read when {cfg.save} holds no checkpoint yet)"
        elif cfg.finetune:  # raises FileNotFoundError when --load holds no checkpoint
            it = load_model_weights(cfg.load, self.model, self.groups, self.run_info())
            if hasattr(self.optimizer, "load_params_from_model"):
                self.optimizer.load_params_from_model()  # the optimizer's fp32 masters from the loaded weights
            resumed = (f"fine-tuning from the model weights of {cfg.load} (iteration {it}); optimizer, RNG, error "
                       f"feedback and data order start fresh at iteration 0")
        elif cfg.load and latest_iteration(cfg.load) is not None:
            self._load(cfg.load)
            resumed = f"resumed from {cfg.load} at iteration {self.iteration}"
        elif cfg.load:
            resumed = f"no checkpoint in {cfg.load} yet: starting from iteration 0"
        self.resumed = self.iteration > 0
        self.totals = RunTotals()
        if self.is_logger:
            params = sum(p.numel() for p in self.model.parameters() if not getattr(p, "tensor_model_parallel", False))
            params += sum(p.numel() for p in self.model.parameters() if getattr(p, "tensor_model_parallel", False)) * tp
            model = (f"GPT {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
                     f"seq {cfg.seq_length}, vocab {vocab}" + (" (counted: pipeline stage 0)" if pp > 1 else ""))
            name = cfg.compression if isinstance(cfg.compression, str) else "inline"
            print(banner(world=self.world, tp=tp, pp=pp, dp=g.dp_size, sp=cfg.sequence_parallel,
                         backend=dist.get_backend(), device=self.device.type, model=model,
                         params=params,
                         compression_name=name, comp=self.compression_spec, log_dir=cfg.log_dir,
                         resumed_from=resumed), flush=True)
            if self.num_chunks > 1:
                print(f"  pipeline: interleaved 1F1B, {self.num_chunks} model chunks per stage "
                      f"({pp * self.num_chunks} virtual stages of {cfg.num_layers_per_virtual_pipeline_stage} layers; "
                      f"stage-to-stage traffic {self.num_chunks}x the non-interleaved schedule's)", flush=True)
            if self.outer is not None:
                print(f"  outer loop: {outer_summary(self.outer.config, cfg.num_replicas, g.dp_size, cfg.outer_algorithm)}", flush=True)
            if isinstance(self.optimizer, DeMo):
                print(f"  optimizer: {demo_summary(self.optimizer)}", flush=True)
            if isinstance(self.optimizer, OneBitOptimizer):
                print(f"  optimizer: {onebit_summary(self.optimizer, cfg)}", flush=True)
            if isinstance(self.optimizer, FusedStep):
                print(f"  optimizer: {lomo_summary(self.optimizer, cfg)}", flush=True)
            if cfg.zero_stage == 2:
                print(f"  optimizer: {zero2_summary(self.optimizer, self.num_microbatches)}", flush=True)
            if isinstance(self.optimizer, ACCO):
                print(f"  optimizer: {acco_summary(self.num_microbatches, self.optimizer.compensated)}", flush=True)
            if self.loqt is not None:
                print(f"  weights: {self.loqt.summary()}", flush=True)
            if self.activation_delta is not None:
                print(f"  pipeline: {aqsgd_summary(self.activation_delta, self.channels.pp_activation.codec)}", flush=True)
        self.sampler = self._sampler(self.iteration * self.num_microbatches)
        self.metrics = MetricsLogger(cfg.log_dir, dist.get_rank() == 0, resume=self.resumed)

    # -- construction --------------------------------------------------------------------------------
    def _sampler(self, start: int) -> DistributedBatchSampler:
        g = self.groups
        return DistributedBatchSampler(len(self.dataset), self.cfg.micro_batch_size, g.dp_rank, g.dp_size,
                                       seed=self.cfg.seed, start_iteration=start,
                                       shard_samples=self.compression.pp_activation_delta)

    def _activation_shape(self) -> tuple:
        """The tensor stages exchange: ``(s, micro-batch, h)``, ``s / tp`` under sequence parallelism."""
        cfg, tp = self.cfg, self.groups.tp_size
        s = cfg.seq_length // tp if cfg.sequence_parallel else cfg.seq_length
        return (s, cfg.micro_batch_size, cfg.hidden_size)

    def _tied(self) -> Optional[torch.nn.Parameter]:
        m = self.model
        if self.groups.pp_size == 1 or self.groups.embedding is None:
            return None
        return m.word_embeddings.weight if m.pre_process else m.output_weight

    def _sp_params(self) -> list:
        if not (self.cfg.sequence_parallel and self.groups.tp_size > 1):
            return []
        return [p for p in self.model.parameters() if getattr(p, "sequence_parallel", False)]

    def _build_optimizer(self) -> DistributedOptimizer:
        cfg, g, c = self.cfg, self.groups, self.compression
        if cfg.optimizer in LOMO_OPTIMIZERS:
            return build_fused(cfg.optimizer, self.model, g, self.channels, c, cfg)
        params = list(self.model.parameters())
        decay = [p for p in params if p.dim() > 1]
        no_decay = [p for p in params if p.dim() <= 1]
        tied = self._tied()
        tp = g.tp_size

        def norm_weight(p) -> float:  # each parameter counts once in the model-parallel norm
            w = 1.0 if getattr(p, "tensor_model_parallel", False) else 1.0 / tp
            return w * (0.5 if p is tied else 1.0)

        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        norm_group = g.mp if g.tp_size * g.pp_size > 1 else None
        if cfg.optimizer == "demo":
            return build_demo(cfg, self.compression, self.channels, groups, norm_group, norm_weight)
        deferred = ([tied] if tied is not None else []) + self._sp_params()
        if cfg.optimizer in ONEBIT_OPTIMIZERS:
            return build_onebit(cfg, self.compression, self.channels, g.dp, groups, norm_group, norm_weight, deferred)
        optimizer_class = torch.optim.AdamW
        if cfg.outer_algorithm == "mt_dao":
            optimizer_class = functools.partial(MultiTimescaleAdamW, **mt_dao_optimizer_kwargs(cfg))
        if cfg.adam_freeze_variance_step:
            optimizer_class = functools.partial(FrozenVarianceAdamW, freeze_step=cfg.adam_freeze_variance_step)
        opt = DistributedOptimizer(
            groups, optimizer_class, self.replicas.inner if self.replicas is not None else g.dp,
            grad_channel=self.channels.dp_gradient, param_channel=self.channels.dp_parameter,
            grad_codec_warmup_steps=c.dp_gradient_warmup_steps,
            max_grad_norm=cfg.clip_grad or None, grad_norm_group=norm_group,
            grad_norm_weight=norm_weight, deferred_params=deferred, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
            shard=cfg.shard_optimizer, zero_stage=cfg.zero_stage)
        if cfg.overlap_param_gather:
            opt.overlap_param_gather(self.model)
        return opt if cfg.overlap_optimizer == "none" else ACCO(opt, delay_compensation=cfg.overlap_optimizer == "acco")

    def _after_outer_sync(self) -> None:
        """The model's parameters were replaced by the outer step: reload the optimizer's fp32 masters; under
        MT-DAO also average the optimizer's moments across the replicas (megacomp.outer.mt_dao)."""
        self.optimizer.load_params_from_model()
        if self.cfg.outer_algorithm == "mt_dao":
            average_optimizer_state(self.optimizer.optimizer, self.outer.plain)

    def run_info(self) -> dict:
        """The run's configuration as recorded in megacomp.json (the fields a resume must match)."""
        info = asdict(self.cfg)
        info["vocab_size"] = self.gpt.vocab_size
        # the error probe is a diagnostic: a resume may turn it on, off or change its interval
        info["compression_resolved"] = {k: v for k, v in self.compression_spec.to_dict().items()
                                        if k != "error_probe_interval"}
        info["world_size"] = self.world
        return info

    # -- state -------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        # the channels' error feedback (TP backward per layer, PP gradients per slot) and stochastic streams;
        # the DP gradient error lives in the optimizer's sharded state
        return {"rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
                "channels": self.channels.state_dict(skip_error_feedback=("dp_gradient",)),
                "outer": self.outer.state_dict() if self.outer is not None else None,
                "guard": self.guard.state_dict(),  # the lowest loss so far: a resumed run judges against it
                "aqsgd": self.activation_delta.state_dict() if self.activation_delta is not None else None}

    def _replica(self) -> Optional[int]:
        return self.replicas.replica if self.replicas is not None else None

    def _load(self, root: str) -> None:
        self.iteration, extra = load_checkpoint(root, self.model, self.optimizer, self.groups, self.run_info(),
                                                replica=self._replica())
        torch.set_rng_state(extra["rng"])
        if extra.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(extra["cuda_rng"])
        self.channels.load_state_dict(extra["channels"])  # error feedback and seeded stochastic streams continue
        if (extra.get("outer") is None) != (self.outer is None):
            raise ValueError(f"checkpoint {root} was written {'with' if extra.get('outer') else 'without'} an "
                             f"outer loop and this run is {'with' if self.outer else 'without'} one; resume with the "
                             f"same --outer-algorithm")
        if self.outer is not None:
            self.outer.load_state_dict(extra["outer"])
        guard = extra.get("guard") or {}  # a checkpoint from before the guard's state was saved: a fresh guard
        self.guard.load_state_dict(guard)
        if self.activation_delta is not None:  # compression_resolved matched, so the checkpoint has the caches
            self.activation_delta.load_state_dict(extra["aqsgd"])

    def save(self) -> None:
        """Write a checkpoint of this iteration under ``cfg.save`` (a collective: every rank calls it), say
        where (rank 0), and keep only the newest ``keep_checkpoints`` when that is set. Under ACCO the update in
        flight lands first and the checkpoint holds the real parameters (and the estimate, in the optimizer's)."""
        if hasattr(self.optimizer, "wait_params"):  # --overlap-param-gather: the last step's all-gathers land first
            self.optimizer.wait_params()
        with (self.optimizer.synchronized() if isinstance(self.optimizer, ACCO) else contextlib.nullcontext()):
            path = save_checkpoint(self.cfg.save, self.iteration, self.model, self.optimizer, self._extra_state(),
                                   self.groups, self.run_info(), replica=self._replica())
        if self.is_logger:
            removed = prune_checkpoints(self.cfg.save, self.cfg.keep_checkpoints) if self.cfg.keep_checkpoints else []
            extra = f" (removed {len(removed)} older: --keep-checkpoints {self.cfg.keep_checkpoints})" if removed else ""
            print(f"megacomp-pretrain: saved checkpoint to {path}{extra}", flush=True)


    # -- one iteration -------------------------------------------------------------------------------
    def _micro_batches(self) -> list:
        indices = [next(self._batches) for _ in range(self.num_microbatches)]
        if self.communicator is not None:
            self.communicator.set_sample_ids(indices)  # AQ-SGD's caches are per sample
        batches = [get_batch(self.dataset, i) for i in indices]
        return [(ids.to(self.device), labels.to(self.device)) for ids, labels in batches]

    def _forward_backward(self, batches) -> list[float]:
        """Forward and backward of ``batches`` (all of the iteration's micro-batches, or one ACCO half); each
        micro-batch's loss is divided by the iteration's M (by the pipeline schedule's len(batches) under PP)."""
        m, M = self.model, len(batches)
        scale = self.num_microbatches
        if isinstance(self.optimizer, FusedStep):  # LOMO / AdaLomo: the update happens inside backward
            return self.optimizer.forward_backward(m, batches)
        if self.communicator is None:
            losses = []
            for k, (ids, labels) in enumerate(batches):
                with (self.optimizer.no_sync() if k < M - 1 else torch.enable_grad()):
                    loss = m(ids, labels)
                    (loss / scale).backward()
                losses.append(loss.item())
            return losses

        dtype = next(m.parameters()).dtype
        shape = self._activation_shape()

        def run(chunk, x, k):
            ids, labels = batches[k]
            inp = ids if chunk.pre_process else x
            return chunk(inp, labels) if chunk.post_process else chunk(inp)

        if self.num_chunks > 1:
            return forward_backward_pipelining_with_interleaving(
                stage_forward=lambda x, k, v: run(m.chunks[v], x, k), num_microbatches=M,
                communicator=self.communicator, activation_shape=shape, num_model_chunks=self.num_chunks, dtype=dtype,
                no_sync=self.optimizer.no_sync, models=list(m.chunks))
        return forward_backward_pipelining_without_interleaving(
            stage_forward=lambda x, k: run(m, x, k), num_microbatches=M, communicator=self.communicator,
            activation_shape=shape, dtype=dtype, no_sync=self.optimizer.no_sync, model=m)

    def _finalize_grads(self) -> None:
        """Sum gradients that several model-parallel ranks compute for one parameter (uncompressed)."""
        tied = self._tied()
        if tied is not None:
            dist.all_reduce(self.optimizer.main_grad(tied), group=self.groups.embedding)
        sp = self._sp_params()
        if sp:
            grads = [self.optimizer.main_grad(p) for p in sp]
            flat = torch.cat([x.reshape(-1) for x in grads])
            dist.all_reduce(flat, group=self.groups.tp)
            off = 0
            for x in grads:
                x.copy_(flat[off:off + x.numel()].view_as(x))
                off += x.numel()

    def _global_loss(self, losses: list[float]) -> float:
        """Mean loss over micro-batches and DP ranks, known on every rank."""
        g = self.groups
        mine = sum(losses) / len(losses) if losses else 0.0
        t = torch.tensor([mine], dtype=torch.float64, device=self.device)
        if g.pp_size > 1:
            dist.all_reduce(t, group=g.pp)  # only the last stage contributes
        dist.all_reduce(t, group=g.dp)
        return t.item() / g.dp_size

    def train_step(self) -> dict:
        """One iteration: micro-batches forward/backward (1F1B under PP), gradient reduction, optimizer step;
        returns the record that is logged (loss, lr, tokens/s, wire bytes per traffic kind, grad norm, skipped)."""
        cfg = self.cfg
        lr = learning_rate(cfg, self.iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        every = self.compression.error_probe_interval
        probing = bool(every) and (self.iteration == 0 or (self.iteration + 1) % every == 0)
        if probing:  # every rank arms at the same iteration (the probe adds collectives)
            self.probe.arm(True)
        t0 = time.perf_counter()
        merging = self.loqt is not None and self.loqt.begin(self.iteration)  # captures full weight gradients
        batches = self._micro_batches()
        if isinstance(self.optimizer, ACCO):
            losses, stepped = acco_halves(self, batches)
        else:
            losses = self._forward_backward(batches)
            self._finalize_grads()
            if merging:  # LoQT: merge and re-initialise instead of an optimizer step (as the reference)
                stepped = self.loqt.finish(self.iteration, self.optimizer)  # False: inf/NaN, merged next iteration
            else:
                stepped = self.optimizer.step()
        if self.outer is not None:
            # replicas skip steps independently; the verdict and the outer cycle must be the same everywhere
            flag = torch.tensor([0.0 if stepped else 1.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stepped = not flag.item()
            self.outer.step()
        elapsed = time.perf_counter() - t0
        loss = self._global_loss(losses)
        traffic = gather_traffic()
        probed = None
        if probing:
            self.probe.arm(False)
            probed = gather_probe(self.probe)
        self.iteration += 1
        if not self._validated_once and not cfg.validate_collectives_every:
            self.channels.set_validate(False)  # shapes are fixed from now on: skip the per-call argument check
        self._validated_once = True
        tokens = cfg.global_batch_size * cfg.seq_length
        wire = sum(w for w, _ in traffic.values())
        outer = traffic.get("outer", [0, 0])[0]  # local-step runs: the replicas' exchange; the rest is inner traffic
        return {"iteration": self.iteration, "loss": loss, "lr": lr,
                "tokens_per_second": tokens / elapsed, "iteration_time_s": elapsed,
                "wire_bytes": wire, "inner_wire_bytes": wire - outer, "outer_wire_bytes": outer,
                "wire_bytes_per_token": wire / tokens,
                "uncompressed_bytes": sum(u for _, u in traffic.values()), "traffic": traffic,
                "grad_norm": self.optimizer.last_grad_norm if stepped and not merging else None,
                "skipped": not stepped, "loqt_merge": merging and stepped,
                "dp_rounds": getattr(self.optimizer, "rounds", None), **({"probe": probed} if probed else {})}

    def train(self) -> list[dict]:
        """Iterate to ``train_iters`` (or ``exit_interval``, or an exit signal), logging and checkpointing;
        returns the records of this run's iterations.

        Raises:
            TrainingDiverged: the divergence policy stopped the run (nothing was saved after the last good
                checkpoint: one written at the iteration before the stop holds the weights that diverged and is
                renamed to ``iter_N.diverged``); the message is the one-line reason, and says so."""
        cfg = self.cfg
        self._batches = iter(self.sampler)
        history, saved_at, stopped = [], None, ""
        signals = ExitSignals() if cfg.exit_on_signal else None
        try:
            while self.iteration < cfg.train_iters:
                record = self.train_step()
                history.append(record)
                self.totals.add(record, cfg.global_batch_size * cfg.seq_length)
                bad = record["skipped"] or not math.isfinite(record["loss"])
                if (bad or self.iteration % cfg.log_interval == 0 or self.iteration == cfg.train_iters
                        or "probe" in record):
                    self.metrics.log(record)  # before the verdict: a diverging iteration is on record too
                note = self.guard.observe(self.iteration, record["loss"], not record["skipped"], record["lr"])
                if note and self.is_logger:
                    print(f"megacomp-pretrain: {note}", flush=True)
                if cfg.save and cfg.save_interval and self.iteration % cfg.save_interval == 0:
                    self.save()
                    saved_at = self.iteration
                if signals is not None and signals.received_anywhere(self.device):
                    stopped = f"stopped by {signals.received or 'a signal on another rank'} at iteration {self.iteration}"
                    break
                if cfg.exit_interval and self.iteration % cfg.exit_interval == 0 and self.iteration < cfg.train_iters:
                    stopped = f"stopped at iteration {self.iteration} (--exit-interval {cfg.exit_interval})"
                    break
        except TrainingDiverged as e:
            # the loss of iteration N comes from the weights after step N-1: a checkpoint of N-1 holds the
            # diverged state; rank 0 sets it aside (checkpoint.discard_checkpoint), the others wait for it
            note = ""
            if cfg.save:
                if self.is_logger:
                    try:
                        latest = latest_iteration(cfg.save)
                    except ValueError:  # an unreadable latest file names no checkpoint of ours
                        latest = None
                    if latest is not None and latest == self.iteration - 1:
                        try:
                            note = "; " + discard_checkpoint(cfg.save, latest)
                        except OSError as err:
                            note = (f"; the checkpoint of iteration {latest} holds the diverged weights but could "
                                    f"not be set aside ({err}): do not resume from it")
                dist.barrier()
            if self.is_logger and self.totals.iterations:
                print(self.totals.summary(self.iteration, "diverged"), flush=True)
            if note:
                raise TrainingDiverged(f"{e}{note}") from e
            raise
        finally:
            if signals is not None:
                signals.restore()
            self.metrics.close()
        if isinstance(self.optimizer, ACCO) and history and self.iteration < cfg.train_iters:
            book_acco_tail(self, history[-1])  # stopped early: the last update lands now
        if cfg.save and history and saved_at != self.iteration:  # the last iteration, once
            self.save()
        elif stopped and not cfg.save and self.is_logger:
            print("megacomp-pretrain: no --save directory: nothing was checkpointed", flush=True)
        if isinstance(self.optimizer, ACCO):
            self.optimizer.finish()  # the model ends on θ, not on the estimate a resume continues from
        elif hasattr(self.optimizer, "wait_params"):
            self.optimizer.wait_params()  # --overlap-param-gather: the model ends on the last step's parameters
        if self.is_logger and history:
            print(self.totals.summary(self.iteration, stopped), flush=True)
        return history

    def close(self) -> None:
        """Complete outer exchanges still in flight, then tear down the model-parallel groups (the process
        group stays: its owner destroys it)."""
        if self.outer is not None:
            self.outer.finish()
        if isinstance(self.optimizer, ACCO):  # no background collective may outlive the groups
            self.optimizer.close()
        parallel_state.destroy_model_parallel()


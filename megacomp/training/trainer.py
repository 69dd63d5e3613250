"""GPT pretraining loop over TP x PP x DP with every traffic kind compressible.

Per iteration: M = global_batch / (micro_batch x DP) micro-batches go through the model (1F1B when
PP > 1), gradients are accumulated in the sharded optimizer's buffers and reduce-scattered after the
last micro-batch; tied-embedding and sequence-parallel gradients are summed over their groups first;
then the optimizer steps and all-gathers parameters. Loss, learning rate, tokens/s and the iteration's
wire bytes per traffic kind are logged (metrics.jsonl, and TensorBoard / W&B: megacomp.training.trackers), with the
time elapsed and left; checkpoints are written every ``save_interval`` iterations. Every ``eval_interval`` iterations
and after the last, the validation split's loss is measured forward only, its traffic apart
(megacomp.training.evaluation).

Around the loop (rank 0 prints): a start-up banner (megacomp.training.report), a note per tolerated
skipped step, an end-of-run summary, a line per saved checkpoint. The divergence policy
(megacomp.training.guard) stops a diverging run with TrainingDiverged before anything of it is saved. An
exit signal (SIGTERM, SIGUSR1: megacomp.training.signals) makes every rank save at the next iteration
boundary and return normally. ``--load DIR`` with no checkpoint in DIR starts fresh and says so, so one
``--save DIR --load DIR`` command serves every attempt of a job (Slurm requeue, torchrun --max-restarts).
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import math
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import comm, parallel_state
from ..config import ModelParallelConfig
from ..data import DistributedBatchSampler, build_datasets, get_batch
from ..launch import init_distributed
from ..placement import detect_topology
from ..models.chunks import GPTChunks
from ..models.gpt import GPTConfig, GPTModel, split_layers
from ..optimizer.model_grads import finalize_model_grads
from ..pipeline_parallel import (PipelineCommunicator, forward_backward_pipelining_with_interleaving,
                                 forward_backward_pipelining_without_interleaving)
from .arguments import PretrainConfig, check, resolve, virtual_chunks
from .pretrain_config import MODEL_OPTION_FIELDS
from .checkpoint import latest_iteration
from .evaluation import Evaluation
from .checkpoint_paths import discard_checkpoint, last_checkpoint_clause
from .features import FEATURES
from .guard import DivergenceGuard, TrainingDiverged
from .metrics_log import MetricsLogger, Progress, gather_traffic
from .report import RunTotals, banner, describe_model, dp_hops_line
from .report import layout_tiers, tiers_line
from .trackers import Trackers
from .trainer_state import TrainerCheckpointing
from .signals import DEFAULT_SIGNALS, ExitSignals, log_error_line, stop_requested


def learning_rate(cfg: PretrainConfig, it: int) -> float:
    """Linear warm-up then cosine decay to ``min_lr`` at ``train_iters``."""
    if it < cfg.lr_warmup_iters:
        return cfg.lr * (it + 1) / cfg.lr_warmup_iters
    span = max(1, cfg.train_iters - cfg.lr_warmup_iters)
    progress = min(1.0, (it - cfg.lr_warmup_iters) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


class Trainer(TrainerCheckpointing):
    """Builds everything for one rank and runs the iterations. The training families a configuration selects
    (megacomp.training.features) are built and called through their hooks; the public attributes below are what
    they read and set.

    Attributes:
        cfg, groups, channels, compression: the configuration, process groups, one channel per traffic path and
            the per-rank compression config.
        model, dataset, device: this rank's model (or its pipeline chunks), the training dataset, the device.
        valid_dataset, test_dataset, data: the validation and test datasets of ``--split`` (None when the split leaves
            one no sample) and the megacomp.data.Datasets they come from (``data.require(part, because)``).
        optimizer: the optimizer the selected optimizer family built (param_groups, step, state).
        dp_group: the group the optimizer reduces over (an outer loop narrows it to one replica).
        inner_optimizer_class: the rule inside the sharded optimizer (MT-DAO swaps it).
        replica: this rank's replica under an outer loop (None otherwise: one checkpoint for all).
        activation_delta: AQ-SGD's caches for the pipeline communicator (None otherwise).
        num_microbatches, num_chunks, communicator, iteration, totals: the loop's own state.
    """

    def __init__(self, cfg: PretrainConfig) -> None:
        try:
            self._construct(cfg)
        except BaseException:
            # a refusal after the groups exist (a bad data path, a checkpoint that does not fit) must not leave them,
            # or the --save lock, to the next Trainer of this process
            if getattr(self, "groups", None) is not None:
                parallel_state.destroy_model_parallel()
            if getattr(self, "lock", None) is not None:
                self.lock.release()
                atexit.unregister(self.lock.release)
            raise

    def _construct(self, cfg: PretrainConfig) -> None:
        cfg = dataclasses.replace(cfg)  # a copy: the choices below must not change the caller's object
        self.cfg = cfg
        init_distributed(timeout_s=cfg.parallel.distributed_timeout_minutes * 60)
        self.world = dist.get_world_size()
        chosen = resolve(cfg, self.world)  # settings a family picks because only one works: said in the banner
        check(cfg, self.world)
        self.lock, took_over = self._lock_save_dir(cfg.checkpoint.save)  # one run per --save directory
        chosen = chosen + ([took_over] if took_over else [])
        self.features = [f(cfg) for f in FEATURES if f.selected(cfg)]
        t, p = cfg.training, cfg.parallel
        self.groups = parallel_state.initialize_model_parallel(p.tensor_model_parallel_size,
                                                               p.pipeline_model_parallel_size)
        g = self.groups
        self.compression_spec = cfg.compression_config()  # as configured (recorded in checkpoints)
        self.compression = self.compression_spec.for_rank(dist.get_rank())  # per-rank stochastic-rounding seeds
        # where ranks sit; a DP group with several ranks on each of several nodes exchanges hop by hop
        self.topology = detect_topology(p.ranks_per_node, p.nodes_per_site)
        self.dp_hierarchy = comm.new_hierarchical_group(
            self.topology, parallel_state.rank_grid(self.world, g.tp_size, g.pp_size)[1], group=g.dp,
            timeout=parallel_state.group_timeout(p.distributed_timeout_minutes)) if p.dp_collectives == "auto" else None
        self.channels = self.compression.build_channels(  # one per traffic path, used by everything below
            g, dp_hierarchy=self.dp_hierarchy, dp_link=self.topology.slowest_link(g.dp_ranks))
        d = cfg.data
        # the corpus or Megatron indexed data, the tokenizer, --split (megacomp.data.run_datasets); valid/test None when empty
        self.data = build_datasets(d.data_path, cfg.model.seq_length, vocab_size=cfg.model.vocab_size,
                                   cache_dir=d.data_cache_dir, max_bytes=d.tokenizer_max_bytes, seed=t.seed,
                                   tokenizer_type=d.tokenizer_type, tokenizer_model=d.tokenizer_model,
                                   vocab_file=d.vocab_file, merge_file=d.merge_file, json_keys=d.json_keys,
                                   split=d.split)
        self.tokenizer, self.dataset = self.data.tokenizer, self.data.train
        self.valid_dataset, self.test_dataset = self.data.valid, self.data.test
        if d.dataset_samples is not None:
            if not 0 < d.dataset_samples <= len(self.dataset):
                raise ValueError(f"dataset_samples {d.dataset_samples} must be in [1, {len(self.dataset)}] (the "
                                 f"corpus has {len(self.dataset)} samples of {cfg.model.seq_length} tokens)")
            self.dataset = torch.utils.data.Subset(self.dataset, range(d.dataset_samples))
        tp, pp = g.tp_size, g.pp_size
        m = cfg.model
        multiple = 8 * tp
        vocab = -(-self.tokenizer.vocab_size // multiple) * multiple  # pad so the vocabulary splits over TP
        gpt = dict(hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                   ffn_hidden_size=m.ffn_hidden_size, num_layers=m.num_layers, vocab_size=vocab,
                   max_seq_length=m.seq_length, seed=t.seed, **{k: getattr(m, k) for k in MODEL_OPTION_FIELDS})
        for f in self.features:
            f.configure_model(gpt)
        self.gpt = GPTConfig(**gpt)
        mpc = ModelParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  sequence_parallel=p.sequence_parallel, params_dtype=m.params_dtype,
                                  compression=self.compression, channels=self.channels, process_groups=g)
        self.device = comm.comm_device()  # cuda:<local rank> under NCCL (set by init_distributed), else CPU
        self.num_chunks = virtual_chunks(cfg)
        if self.num_chunks > 1:  # interleaved schedule: this stage's chunks of virtual stages
            self.model = GPTChunks(self.gpt, mpc, pp_size=pp, pp_rank=g.pp_rank, num_chunks=self.num_chunks).to(self.device)
        else:
            self.model = GPTModel(self.gpt, mpc, pre_process=g.pp_rank == 0, post_process=g.pp_rank == pp - 1,
                                  layer_range=split_layers(m.num_layers, pp, g.pp_rank)).to(self.device)
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * g.dp_size)
        self.iteration = 0
        # what the families read and may replace while they are built (in registry order)
        self.dp_group, self.replica = g.dp, None
        self.inner_optimizer_class = torch.optim.AdamW
        self.activation_delta = None
        self.optimizer = None
        for f in self.features:
            f.build(self)
        self.communicator = (PipelineCommunicator(g.pp_ranks, channels=self.channels,
                                                  activation_delta=self.activation_delta) if pp > 1 else None)
        self.evaluation = Evaluation(self)  # --eval-interval (megacomp.training.evaluation); no validation set: raises
        self._iteration = self._chain("iteration", self._plain_iteration)
        self.forward_backward = self._chain("forward_backward", self._model_forward_backward)
        self._step = self._chain("step", lambda: self.optimizer.step())
        self._validated_once = False
        self.is_logger = dist.get_rank() == 0
        resumed = None
        self.guard = DivergenceGuard(t.max_skipped_steps, t.loss_divergence_factor)  # _load restores its state
        resumed, chosen = self._resume(chosen)  # --load / --finetune (megacomp.training.trainer_state)
        self.resumed = self.iteration > 0
        self.totals = RunTotals()
        # --tensorboard-dir, --wandb-project: rank 0 writes what metrics.jsonl gets (megacomp.training.trackers)
        self.trackers = Trackers(cfg, self.is_logger, self.iteration, layout_tiers(self.world, tp, pp, self.topology))
        if self.is_logger:
            print(self._banner(vocab, resumed, chosen), flush=True)
        self.sampler = self.sampler_at(self.iteration * self.num_microbatches)
        self.metrics = MetricsLogger(cfg.logging.log_dir, dist.get_rank() == 0, resume=self.resumed,
                                     trackers=self.trackers)

    # -- construction --------------------------------------------------------------------------------
    def _chain(self, hook: str, innermost):
        """``innermost`` wrapped in every selected family's ``hook``, the first family outermost."""
        fn = innermost
        for f in reversed(self.features):
            fn = functools.partial(getattr(f, hook), self, inner=fn)
        return fn

    def _banner(self, vocab: int, resumed: Optional[str], chosen: list) -> str:
        cfg, g = self.cfg, self.groups
        m, tp, pp = cfg.model, g.tp_size, g.pp_size
        params = sum(p.numel() for p in self.model.parameters() if not getattr(p, "tensor_model_parallel", False))
        params += sum(p.numel() for p in self.model.parameters() if getattr(p, "tensor_model_parallel", False)) * tp
        model = describe_model(m, vocab) + (" (counted: pipeline stage 0)" if pp > 1 else "")
        name = cfg.compression if isinstance(cfg.compression, str) else "inline"
        lines = [banner(world=self.world, tp=tp, pp=pp, dp=g.dp_size, sp=cfg.parallel.sequence_parallel,
                        backend=dist.get_backend(), device=self.device.type, model=model, params=params,
                        compression_name=name, comp=self.compression_spec, log_dir=cfg.logging.log_dir,
                        resumed_from=resumed)]
        # which link kind each group crosses; the summary adds bytes per kind
        self.totals.tiers = layout_tiers(self.world, tp, pp, self.topology)
        lines.append(tiers_line(self.totals.tiers, self.topology.describe()))
        lines.append(dp_hops_line(self.dp_hierarchy, self.channels, self.cfg.parallel.dp_collectives,
                                  self.totals.tiers["dp"], g.dp_size))
        if self.num_chunks > 1:
            lines.append(f"  pipeline: interleaved 1F1B, {self.num_chunks} model chunks per stage "
                         f"({pp * self.num_chunks} virtual stages of {cfg.parallel.num_layers_per_virtual_pipeline_stage} "
                         f"layers; stage-to-stage traffic {self.num_chunks}x the non-interleaved schedule's)")
        lines += [f"  {line}" for line in chosen + self.evaluation.banner() + self.trackers.lines]
        lines += [f"  {line}" for f in self.features for line in f.banner(self)]
        return "\n".join(lines)

    def sampler_at(self, start: int) -> DistributedBatchSampler:
        """This DP rank's sampler, starting at micro-batch ``start`` of the run."""
        g = self.groups
        return DistributedBatchSampler(len(self.dataset), self.cfg.training.micro_batch_size, g.dp_rank, g.dp_size,
                                       seed=self.cfg.training.seed, start_iteration=start,
                                       shard_samples=self.compression.pp_activation_delta)

    def activation_shape(self) -> tuple:
        """The tensor stages exchange: ``(s, micro-batch, h)``, ``s / tp`` under sequence parallelism."""
        cfg, tp = self.cfg, self.groups.tp_size
        s = cfg.model.seq_length // tp if cfg.parallel.sequence_parallel else cfg.model.seq_length
        return (s, cfg.training.micro_batch_size, cfg.model.hidden_size)

    # -- one iteration -------------------------------------------------------------------------------
    def _micro_batches(self) -> list:
        indices = [next(self._batches) for _ in range(self.num_microbatches)]
        if self.communicator is not None:
            self.communicator.set_sample_ids(indices)  # AQ-SGD's caches are per sample
        batches = [get_batch(self.dataset, i) for i in indices]
        return [(ids.to(self.device), labels.to(self.device)) for ids, labels in batches]

    def _model_forward_backward(self, batches) -> list[float]:
        """Forward and backward of ``batches`` (all of the iteration's micro-batches, or one ACCO half); each
        micro-batch's loss is divided by the iteration's M (by the pipeline schedule's len(batches) under PP)."""
        m, M = self.model, len(batches)
        scale = self.num_microbatches
        if self.communicator is None:
            losses = []
            for k, (ids, labels) in enumerate(batches):
                with (self.optimizer.no_sync() if k < M - 1 else torch.enable_grad()):
                    loss = m(ids, labels)
                    (loss / scale).backward()
                losses.append(loss.item())
            return losses

        dtype = next(m.parameters()).dtype
        shape = self.activation_shape()

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

    def finalize_grads(self) -> None:
        """Sum gradients that several model-parallel ranks compute for one parameter (uncompressed;
        megacomp.optimizer.model_grads)."""
        finalize_model_grads(self.model, lambda p: self.optimizer.main_grad(p), self.groups,
                             self.cfg.parallel.sequence_parallel)

    def _plain_iteration(self, batches) -> tuple[list[float], bool]:
        losses = self.forward_backward(batches)
        self.finalize_grads()
        return losses, self._step()

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
        """One iteration: micro-batches forward/backward (1F1B under PP), gradient reduction, optimizer step (each
        as the selected families shape it); returns the record that is logged (loss, lr, tokens/s, wire bytes per
        traffic kind, grad norm, skipped)."""
        cfg = self.cfg
        lr = learning_rate(cfg.training, self.iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()
        batches = self._micro_batches()
        losses, stepped = self._iteration(batches)
        elapsed = time.perf_counter() - t0
        loss = self._global_loss(losses)
        traffic = gather_traffic()
        self.iteration += 1
        if not self._validated_once and not cfg.parallel.validate_collectives_every:
            self.channels.set_validate(False)  # shapes are fixed from now on: skip the per-call argument check
        self._validated_once = True
        tokens = cfg.training.global_batch_size * cfg.model.seq_length
        wire = sum(w for w, _ in traffic.values())
        outer = traffic.get("outer", [0, 0])[0]  # local-step runs: the replicas' exchange; the rest is inner traffic
        record = {"iteration": self.iteration, "loss": loss, "lr": lr,
                  "tokens_per_second": tokens / elapsed, "iteration_time_s": elapsed,
                  "wire_bytes": wire, "inner_wire_bytes": wire - outer, "outer_wire_bytes": outer,
                  "wire_bytes_per_token": wire / tokens,
                  "uncompressed_bytes": sum(u for _, u in traffic.values()), "traffic": traffic,
                  "grad_norm": self.optimizer.last_grad_norm if stepped else None,
                  "skipped": not stepped, "loqt_merge": False, "dp_rounds": None}
        for f in self.features:
            f.record(self, record)
        self.evaluation.after_iteration(self, record)  # when due: valid_loss, valid_ppl, its traffic kept apart
        return record

    def train(self, watch: Optional[Callable[[], Optional[str]]] = None) -> list[dict]:
        """Iterate to ``train_iters`` (or ``exit_interval``, or an exit signal, or a reason from ``watch``, or a
        metrics.jsonl that cannot be written), logging and checkpointing; returns the records of this run's
        iterations. The exit signals' handlers (megacomp.training.signals) stay installed until the last checkpoint
        is written. ``watch`` (the heartbeat's launcher watch) is polled at every boundary; the reason the ranks
        agreed to stop for is left in ``self.stop_reason``.

        Raises:
            TrainingDiverged: the divergence policy stopped the run (nothing was saved after the last good
                checkpoint: one written at the iteration before the stop holds the weights that diverged and is
                renamed to ``iter_N.diverged``); the message is the one-line reason, and says so.
            OSError: rank 0 could not append to metrics.jsonl (a full or read-only ``--log-dir``): every rank
                stops at that iteration's boundary, saves it first (with ``--save``) and raises the same line,
                which says what was saved."""
        signals = ExitSignals(DEFAULT_SIGNALS if self.cfg.training.exit_on_signal else (), self.cfg.checkpoint.save,
                              watch)
        try:
            return self._train(signals)
        finally:
            signals.restore()
            self.stop_reason = signals.reason

    def _train(self, signals: Optional[ExitSignals]) -> list[dict]:
        cfg, t, c = self.cfg, self.cfg.training, self.cfg.checkpoint
        self._batches = iter(self.sampler)
        # what setting up sent (a resumed run's parameter all-gather) is no iteration's traffic: each iteration's
        # record (gather_traffic) starts from here, so a resumed iteration counts what an uninterrupted one does
        comm.reset_stats()
        history, saved_at, stopped, log_error = [], None, "", None
        progress = Progress(self.iteration, t.train_iters)
        try:
            while self.iteration < t.train_iters:
                record = self.train_step()
                record.update(progress.fields(self.iteration))  # elapsed, it/s, ETA (console and metrics.jsonl)
                history.append(record)
                self.totals.add(record, t.global_batch_size * cfg.model.seq_length)
                bad = record["skipped"] or not math.isfinite(record["loss"])
                if (bad or self.iteration % cfg.logging.log_interval == 0 or self.iteration == t.train_iters
                        or "probe" in record or "valid_loss" in record):
                    try:
                        self.metrics.log(record)  # before the verdict: a diverging iteration is on record too
                    except OSError as e:  # rank 0 only: the ranks stop together at this boundary, after saving
                        log_error = e
                note = self.guard.observe(self.iteration, record["loss"], not record["skipped"], record["lr"],
                                          record.get("skip_reason"))
                if note and self.is_logger:
                    print(f"megacomp-pretrain: {note}", flush=True)
                signalled, log_error = stop_requested(signals, log_error, self.device,  # agreed by every rank
                                                      log_file=bool(cfg.logging.log_dir))
                if log_error is not None:
                    break
                if c.save and c.save_interval and self.iteration % c.save_interval == 0:
                    self.save()
                    saved_at = self.iteration
                if signalled:
                    stopped = signals.stopped(self.iteration)
                    break
                if t.exit_interval and self.iteration % t.exit_interval == 0 and self.iteration < t.train_iters:
                    stopped = f"stopped at iteration {self.iteration} (--exit-interval {t.exit_interval})"
                    break
        except TrainingDiverged as e:
            # the loss of iteration N comes from the weights after step N-1: a checkpoint of N-1 holds the
            # diverged state; rank 0 sets it aside (checkpoint_paths.discard_checkpoint), the others wait for it
            note = ""
            if c.save:
                if self.is_logger:
                    try:
                        latest = latest_iteration(c.save)
                    except ValueError:  # an unreadable latest file names no checkpoint of ours
                        latest = None
                    if latest is not None and latest == self.iteration - 1:
                        try:
                            note = "; " + discard_checkpoint(c.save, latest)
                        except OSError as err:
                            note = (f"; the checkpoint of iteration {latest} holds the diverged weights but could "
                                    f"not be set aside ({err}): do not resume from it")
                dist.barrier()
            if self.is_logger and self.totals.iterations:
                print(self.totals.summary(self.iteration, "diverged") + self.evaluation.summary(), flush=True)
            if note:
                raise TrainingDiverged(f"{e}{note}") from e
            raise
        finally:
            self.metrics.close()
        for f in self.features:
            f.end_of_run(self, history, self.iteration < t.train_iters)
        if log_error is not None:  # what training did is kept: save it, then the one line says so
            raise log_error_line(log_error, self.save if c.save and saved_at != self.iteration else None,
                                 lambda: last_checkpoint_clause(c.save))
        if c.save and history and saved_at != self.iteration:  # the last iteration, once
            self.save()
        elif stopped and not c.save and self.is_logger:
            print("megacomp-pretrain: no --save directory: nothing was checkpointed", flush=True)
        for f in self.features:
            f.finish(self)  # the model ends on its final parameters (e.g. ACCO's θ, the last all-gather landed)
        if self.is_logger and history:
            print(self.totals.summary(self.iteration, stopped) + self.evaluation.summary(), flush=True)
        return history

    def close(self) -> None:
        """Complete the families' work in flight (outer exchanges, background updates), then tear down the
        model-parallel groups (the process group stays: its owner destroys it)."""
        for f in self.features:
            f.close(self)
        parallel_state.destroy_model_parallel()
        if self.lock is not None:
            self.lock.release()  # never raises (a read-only file system keeps the file: the next run takes it over)
            atexit.unregister(self.lock.release)

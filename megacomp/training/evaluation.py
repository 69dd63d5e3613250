"""Validation during pretraining, as Megatron-LM's ``--eval-interval`` / ``--eval-iters``.

After every ``eval_interval``-th iteration, and after the last one, the run measures the loss of the validation
split: ``eval_iters`` rounds, each one global batch (the training's ``global_batch_size``) split into the training's
micro-batches over the DP ranks, forward only (no gradient, no optimizer step) through the same layout: TP
collectives, the pipeline schedule's forward-only path under PP (megacomp.pipeline_parallel, Megatron's
``forward_only=True``), the loss averaged over the micro-batches and the DP ranks in float64 as the training loss is
(Trainer._global_loss). After the last iteration the test split is measured too, when it has samples. The
perplexity is ``exp(min(20, loss))`` (Megatron's clamp against overflow).

Samples: round ``r`` is samples ``r B ... r B + B - 1`` of the split (modulo its length: a split smaller than
``eval_iters x B`` wraps around), micro-batch ``k`` of DP rank ``d`` taking the ``k DP + d``-th slice of
``micro_batch_size``: every evaluation sees the same samples (a curve of like with like, where Megatron's persistent
iterator moves on), and every TP / PP / DP layout the same set per round, so the loss differs between layouts only by
the order of float additions.

What evaluation leaves alone, so that a run trains bit for bit as it does without it: torch's CPU and CUDA
generators, every channel's stochastic-rounding stream and each module's train/eval mode are restored afterwards;
AQ-SGD's activation caches are bypassed (the pipeline forward goes through a communicator of its own, whose
activations travel through the ``pp_activation`` codec directly); work in flight lands first through the families'
``before_save`` contexts (ACCO's update: the model then holds θ_t, as a checkpoint does; the overlapped parameter
all-gather), whose bytes stay training traffic.

Traffic: the forward pass's TP and PP messages are recorded under their usual tags but held
(megacomp.comm.stats.held_records) and summed over the ranks apart from the training's: the record's ``eval_traffic``,
``eval_wire_bytes`` and ``eval_uncompressed_bytes``, never in the next iteration's ``traffic``.

Failure behaviour: ``--eval-interval`` with no validation samples raises ValueError at setup on every rank, naming
``--split`` as the fix.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Optional

import torch

from ..comm.stats import PROCESS_STATS, held_records
from ..data import get_batch
from ..pipeline_parallel import (PipelineCommunicator, forward_backward_pipelining_with_interleaving,
                                 forward_backward_pipelining_without_interleaving)
from .metrics_log import sum_traffic

PPL_CLAMP = 20.0
"""Perplexity is reported as ``exp(min(PPL_CLAMP, loss))`` (Megatron-LM's clamp)."""


def perplexity(loss: float) -> float:
    """``exp(min(20, loss))``; NaN for a NaN loss."""
    return math.exp(min(PPL_CLAMP, loss)) if not math.isnan(loss) else math.nan


def evaluation_samples(round_: int, microbatch: int, dp_rank: int, dp_size: int, micro_batch_size: int,
                       global_batch_size: int, num_samples: int) -> list[int]:
    """The split's sample indices of micro-batch ``microbatch`` of DP rank ``dp_rank`` in evaluation round ``round_``
    (see the module docstring)."""
    start = round_ * global_batch_size + (microbatch * dp_size + dp_rank) * micro_batch_size
    return [(start + j) % num_samples for j in range(micro_batch_size)]


@contextlib.contextmanager
def training_state_kept(run):
    """Inside, forward passes may draw random numbers and switch modules to eval mode: on exit torch's CPU (and this
    device's CUDA) generator, every channel's stochastic-rounding stream and every module's training flag are what
    they were on entry."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(run.device) if run.device.type == "cuda" else None
    streams = [(ch.generator, ch.generator.get_state()) for _, ch in run.channels.items()
               if getattr(ch, "generator", None) is not None]
    modes = [(m, m.training) for m in run.model.modules()]
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        for gen, state in streams:
            gen.set_state(state)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, run.device)
        torch.set_rng_state(cpu)


class Evaluation:
    """The run's evaluations: when they are due, what they measured, their traffic and their checkpointed history.

    Built by the Trainer after its families (it reads ``run.valid_dataset`` / ``run.test_dataset``, None or empty
    when the split leaves none). With ``eval_interval`` unset every method is a no-op.

    Raises:
        ValueError: ``eval_interval`` is set and there are no validation samples (one line naming ``--split``).
    """

    def __init__(self, run) -> None:
        e, t = run.cfg.evaluation, run.cfg.training
        self.interval, self.iters = e.eval_interval, e.eval_iters
        self.train_iters, self.global_batch = t.train_iters, t.global_batch_size
        self.valid = getattr(run, "valid_dataset", None)
        self.test = getattr(run, "test_dataset", None)
        if self.interval and (self.valid is None or len(self.valid) == 0):
            raise ValueError(f"--eval-interval {self.interval} evaluates on the validation split, and this run's data "
                             f"has no validation samples: give it a share with --split (e.g. --split 969,30,1)")
        if self.test is not None and len(self.test) == 0:
            self.test = None
        g = run.groups
        # a communicator of its own: no AQ-SGD caches (evaluation samples are not training samples)
        self.communicator = (PipelineCommunicator(g.pp_ranks, channels=run.channels)
                             if self.interval and g.pp_size > 1 else None)
        self.history: list[list] = []
        """[[iteration, validation loss, test loss or None], ...] of the whole run (checkpointed)."""
        self.loaded = 0  # evaluations a resumed run found in its checkpoint
        self.traffic = [0, 0]  # this process's evaluations: wire and uncompressed bytes, all ranks
        self.seconds = 0.0

    def banner(self) -> list[str]:
        """The start-up banner's line (none when off)."""
        if not self.interval:
            return []
        n = self.iters * self.global_batch
        wraps = " (wrapping around: fewer samples than that)" if n > len(self.valid) else ""
        test = f"; the test split's {len(self.test)} samples alike after the last" if self.test is not None else ""
        return [f"evaluation: every {self.interval} iterations and after the last, {self.iters} forward-only rounds "
                f"of {self.global_batch} samples: the same first {n} of the {len(self.valid)} validation samples "
                f"each time{wraps}{test}; its traffic is counted apart from training's"]

    def due(self, iteration: int) -> bool:
        """Whether the run evaluates after ``iteration``."""
        return bool(self.interval) and (iteration % self.interval == 0 or iteration == self.train_iters)

    def after_iteration(self, run, record: dict) -> None:
        """When due: evaluate (a collective), and add ``valid_loss``, ``valid_ppl`` (and after the last iteration
        ``test_loss``, ``test_ppl`` when there is a test split), ``eval_wire_bytes``, ``eval_uncompressed_bytes``,
        ``eval_traffic`` ({tag: [wire, uncompressed]}, all ranks), ``eval_samples`` and ``eval_time_s`` to
        ``record``."""
        if not self.due(run.iteration):
            return
        sets = [("valid", self.valid)] + ([("test", self.test)] if self.test is not None
                                           and run.iteration == self.train_iters else [])
        traffic, seconds = {}, 0.0
        for name, dataset in sets:
            loss, used, took = self.evaluate(run, dataset)
            record[f"{name}_loss"], record[f"{name}_ppl"] = loss, perplexity(loss)
            seconds += took
            for kind, (w, u) in used.items():
                row = traffic.setdefault(kind, [0, 0])
                row[0] += w
                row[1] += u
        wire, raw = sum(w for w, _ in traffic.values()), sum(u for _, u in traffic.values())
        record.update(eval_wire_bytes=wire, eval_uncompressed_bytes=raw, eval_traffic=traffic,
                      eval_samples=self.iters * self.global_batch * len(sets), eval_time_s=seconds)
        self.traffic[0] += wire
        self.traffic[1] += raw
        self.seconds += seconds
        self.history.append([run.iteration, record["valid_loss"], record.get("test_loss")])

    def evaluate(self, run, dataset) -> tuple[float, dict, float]:
        """``eval_iters`` forward-only rounds over ``dataset`` (a collective of every rank); returns (the mean loss,
        known on every rank; the traffic {tag: [wire, uncompressed]} summed over the ranks; seconds)."""
        t0 = time.perf_counter()
        losses = []
        with contextlib.ExitStack() as stack:
            for f in run.features:  # work in flight lands first, booked as the training traffic it is
                stack.enter_context(f.before_save(run))
            stack.enter_context(training_state_kept(run))
            held = stack.enter_context(held_records())  # this thread's records from here on: evaluation's
            run.model.eval()
            with torch.no_grad():
                for r in range(self.iters):
                    losses += self._forward(run, self._round(run, dataset, r))
        mine = {}
        for table, tag, wire, raw in held:
            if table is PROCESS_STATS:  # what the training's records read (comm.stats()); other tables keep theirs
                row = mine.setdefault(tag, [0, 0])
                row[0] += wire
                row[1] += raw
            else:
                table.record(tag, wire, raw)
        traffic = sum_traffic(mine)
        loss = run._global_loss(losses)
        return loss, traffic, time.perf_counter() - t0

    def _round(self, run, dataset, r: int) -> list:
        g, t = run.groups, run.cfg.training
        batches = [get_batch(dataset, evaluation_samples(r, k, g.dp_rank, g.dp_size, t.micro_batch_size,
                                                         self.global_batch, len(dataset)))
                   for k in range(run.num_microbatches)]
        return [(ids.to(run.device), labels.to(run.device)) for ids, labels in batches]

    def _forward(self, run, batches) -> list[float]:
        """The micro-batches' losses (on the last pipeline stage; [] on the others)."""
        m = run.model
        if self.communicator is None:
            return [m(ids, labels).item() for ids, labels in batches]

        def stage(chunk, x, k):
            ids, labels = batches[k]
            inp = ids if chunk.pre_process else x
            return chunk(inp, labels) if chunk.post_process else chunk(inp)

        dtype, shape = next(m.parameters()).dtype, run.activation_shape()
        if run.num_chunks > 1:
            return forward_backward_pipelining_with_interleaving(
                stage_forward=lambda x, k, v: stage(m.chunks[v], x, k), num_microbatches=len(batches),
                communicator=self.communicator, activation_shape=shape, num_model_chunks=run.num_chunks, dtype=dtype,
                forward_only=True)
        return forward_backward_pipelining_without_interleaving(
            stage_forward=lambda x, k: stage(m, x, k), num_microbatches=len(batches), communicator=self.communicator,
            activation_shape=shape, dtype=dtype, forward_only=True)

    def summary(self) -> str:
        """The end-of-run summary's evaluation lines (each starting with a newline; empty when nothing was
        evaluated)."""
        if not self.history:
            return ""

        def at(row, i=1):
            return f"{row[i]:.4f} (PPL {perplexity(row[i]):.2f}) at iteration {row[0]}"
        first, last = self.history[0], self.history[-1]
        best = min(self.history, key=lambda row: row[1] if math.isfinite(row[1]) else math.inf)
        earlier = self.loaded
        mb = 1e6
        text = (f"\n  validation lm loss {at(first)}" + (f" -> {at(last)}, best {best[1]:.4f} at iteration {best[0]}"
                                                           if last is not first else "")
                + f"; {len(self.history)} evaluations" + (f" ({earlier} before the resume)" if earlier else ""))
        if self.traffic[1]:
            text += (f"\n  evaluation traffic of this run, not in the totals above: {self.traffic[0] / mb:.2f} MB of "
                     f"{self.traffic[1] / mb:.2f} MB ({self.traffic[0] / self.traffic[1]:.2f}x) in "
                     f"{self.seconds:.1f} s")
        if last[2] is not None:
            text += f"\n  test lm loss {at(last, 2)}"
        return text

    def state_dict(self) -> Optional[dict]:
        """The evaluations so far (checkpointed in the extra state; plain data); None when off and none ran."""
        return {"history": [list(row) for row in self.history]} if self.history or self.interval else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Continue the history a checkpoint recorded (None: a checkpoint without one)."""
        self.history = [list(row) for row in (state or {}).get("history", [])]
        self.loaded = len(self.history)

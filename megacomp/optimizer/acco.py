"""ACCO (Accumulate while you Communicate; Nabli et al. 2024): the sharded optimizer's communication and update of
one half of the batch run in a background thread while the other half's gradients are computed.

Each optimizer step t splits the step's micro-batches into two halves, A and B. With θ_t the parameters after
step t (θ_0 the initial ones) and θ̃_t an estimate of them (θ̃_0 = θ_0), on every data-parallel rank:

  half A of step t    model at θ̃_t: gradients G_A = Σ_A ∇ℓ(θ̃_t)      background: real update of step t - 1
                                                                       (reduce-scatter, update, all-gather θ_t)
  ``estimate(scale)``  waits for θ_t; puts θ_t into the model; starts the estimate in the background:
                      θ̃_{t+1} = Opt(θ_t, scale · mean_ranks G_A) on a copy of the masters and optimizer state
                      (the state is not advanced), all-gathered into a side buffer
  half B of step t    model at θ_t:  gradients G_B = Σ_B ∇ℓ(θ_t)       background: the estimate
  ``step()``          waits for θ̃_{t+1}; puts it into the model; starts the real update in the background:
                      θ_{t+1} = Opt(θ_t, mean_ranks (G_A + G_B)), masters and optimizer state advanced,
                      all-gathered into a second side buffer

So the update of step t is the optimizer's step on the gradient of the whole batch (with the loss divided by the
number of micro-batches M, as for DistributedOptimizer), whose half B is evaluated at θ_t and half A at θ̃_t, the
parameters the half-batch update predicted: the delay of the overlap is compensated by the estimate, and with
θ̃_t = θ_t the step is DistributedOptimizer's. ``scale`` (M / |A|) turns the half sum into a mean for the estimate.
Every wait happens between halves, so the wire time of both collectives is hidden when a half's computation is
longer than a reduce-scatter + update + all-gather. Bytes on the wire per step: two reduce-scatters and two
all-gathers, i.e. twice DistributedOptimizer's dp_gradient and dp_parameter bytes (both counted there). Memory: a
second full fp32 gradient buffer (the reduction's input while the next half accumulates) and two full parameter
buffers per bucket, plus a copy of the shard's masters and optimizer state during an estimate.

Without delay compensation (``delay_compensation=False``: DPU, the delayed parameter update of ZeRO-Offload) there
are no halves and no estimate: ``step()`` after each step's whole backward waits for the previous update, puts θ_t
into the model and starts θ_{t+1} = Opt(θ_t, mean G(θ_{t-1})) in the background, so the next step's whole compute
overlaps one reduce-scatter + update + all-gather: DistributedOptimizer's bytes, gradients one step stale.

Warm-up (``warmup_steps`` W, default 0): the first W steps are DistributedOptimizer's undelayed steps on the whole
batch at θ_t (both halves at θ_t, no estimate; DPU: the step's gradient at θ_t), each update waited for before the
step returns, so the model holds θ_{t+1} for the next step; overlap starts at step W with θ̃_W = θ_W (ACCO's start).
ACCO as published needs none (0 in the authors' ACCO configuration); ZeRO-Offload's DPU warms up with undelayed steps
and the authors' DPU baseline uses 1000. Counted in optimizer steps (committed + skipped), so a resumed run keeps
the count.

Not built: the paper's time-varying accumulation (Algorithm 1 with per-worker N_i^(t)): the authors' workers keep
adding micro-batches until the background job finishes, and divide the summed gradients by the micro-batch count
summed over workers (an all-reduce of the counts), advancing the learning-rate schedule by that count. Here each
half is a fixed number of micro-batches (the case where every half outlasts the background job), so a step's batch
is fixed and a run is deterministic; a rank cannot accumulate extra micro-batches while it waits.

Error bound: with codecs the real update's reduce-scatter keeps the gradient channel's error feedback (key per
bucket, as DistributedOptimizer); the estimate's is the same codec without error feedback (its error affects only
θ̃, never the committed state). With no codecs ``step()`` is exact: tests/test_optimizer_acco.py compares it with an
independent single-process restatement of the two formulas above, bit for bit on integer-valued data.

Threads and groups: the background thread issues the optimizer's collectives (reduce-scatter, all-gather, the
overflow and gradient-norm all-reduces) on private copies of its data-parallel and gradient-norm groups created
here (collectively over each group's members: construct on every rank in the same order), so collectives of the
model (TP, PP, the tied-embedding sum) on the main thread never interleave with them on one communicator.

Checkpoints: :meth:`synchronized` (a context) waits for the update in flight and puts θ_t into the model, so a
checkpoint written inside holds the real parameters; :meth:`state_dict` adds this rank's shard of θ̃ (as all ranks
received it) to the optimizer's; :meth:`load_state_dict` restores both, so a resumed run continues bit for bit. A
checkpoint without the estimate (written without ACCO) resumes with θ̃ = θ, ACCO's own start.

Failure behaviour: a DistributedOptimizer that is unsharded, ZeRO-2, hierarchical, PowerSGD / Accordion, fp16 with a
loss scaler, overlapping its parameter all-gather, with stochastic rounding on its codecs, or a subclass (1-bit
family) raises ValueError; calls out of
order (``step`` before ``estimate``, ``estimate`` twice) raise RuntimeError; an exception in the background thread
is raised again at the next wait.
Inf/NaN gradients: the real update is skipped on every rank (counted in ``skipped_steps``, error feedback reset, as
DistributedOptimizer), an estimate from them is θ_t itself.
"""
from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm.common import global_ranks
from ..comm.spans import span
from ..comm.stats import held_records, replay
from ..comm.transport import _transport, use_duplex
from ..parallel_state import default_group_timeout
from .distributed_optimizer import DistributedOptimizer

log = logging.getLogger("megacomp")


def private_group(group):
    """A new communicator over the members of ``group``, with its gloo direction groups made now, on the calling
    thread, not lazily on a background one.

    A collective of the default group: every rank of the job calls it at the same point, each with its own group
    (all ranks' data-parallel groups at once, as ACCO is built on every rank). The ranks all-gather their groups'
    members and every rank creates every distinct group with ``new_group`` in one sorted order, as megatron-core
    creates its groups. ``new_group(..., use_local_synchronization=True)``, which only the members call, is not
    used: torch names such a group after how many groups the calling process holds, which differs between members
    once an earlier group left some ranks out (megatron-core's embedding groups under PP >= 3), and the members
    then wait for each other under different names until the timeout."""
    if group is None and dist.get_world_size() == 1:
        return group
    mine = tuple(global_ranks(group))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    clone = None
    for ranks in sorted(set(every)):
        made = dist.new_group(list(ranks), backend=dist.get_backend(group),
                              timeout=default_group_timeout())  # a stall fails like the world group's collectives
        if ranks == mine:
            clone = made
    if use_duplex(clone, None):
        _transport(clone).direction_groups()
    return clone


class ACCO:
    """Overlaps a :class:`DistributedOptimizer`'s communication and update with the next half-batch's gradients (see
    the module docstring). ``optimizer``: ZeRO-1, sharded, flat (no hierarchy), a value codec or none, no loss
    scaler, no overlapped parameter all-gather. Its hooks then only accumulate; drive it with :meth:`estimate` after
    half A and :meth:`step` after half B of every step, instead of ``optimizer.step()``
    (``delay_compensation=False``, DPU: :meth:`step` after each step's whole backward). ``warmup_steps``: that many
    undelayed steps first (see the module docstring). Constructing it is a collective of the default group: every
    rank of the job builds its ACCO at the same point (:func:`private_group`)."""

    def __init__(self, optimizer: DistributedOptimizer, delay_compensation: bool = True, warmup_steps: int = 0) -> None:
        opt = optimizer
        self.compensated = bool(delay_compensation)
        if not (isinstance(warmup_steps, int) and warmup_steps >= 0):
            raise ValueError(f"ACCO: warmup_steps must be an integer >= 0 (undelayed steps before the overlap), got "
                             f"{warmup_steps!r}")
        self.warmup_steps = warmup_steps
        if type(opt) is not DistributedOptimizer:
            raise ValueError(f"ACCO overlaps DistributedOptimizer's AdamW-style update; {type(opt).__name__} has its "
                             f"own reduction (1-bit family): use it without ACCO")
        why = ("unsharded (shard=False)" if not opt.sharded else "ZeRO-2" if opt.zero_stage == 2 else
               "hierarchical" if opt.hierarchy is not None else "fp16 with a loss scaler" if opt.scaler is not None
               else "PowerSGD / Accordion" if opt.grad_channel.reduces_whole_buckets
               else "overlapping its parameter all-gather with the next forward (ACCO gathers into its own buffers)"
               if opt._prefetch else
               "stochastic rounding on its gradient or parameter codec (the background jobs would draw from a stream "
               "the estimate shares and a checkpoint does not hold; use rounding: nearest)"
               if any(ch.lossy and ch.codec.to_dict().get("rounding") == "stochastic"
                      for ch in (opt.grad_channel, opt.param_channel)) else None)
        if why:
            raise ValueError(f"ACCO needs a ZeRO-1 sharded DistributedOptimizer with a value codec (or none), flat "
                             f"data parallelism and bf16/fp32 parameters; this one is {why}")
        if opt.step_count or opt.skipped_steps or any(b.ready for b in opt.buckets):
            raise ValueError("ACCO must wrap a DistributedOptimizer before its first backward")
        self.opt = opt
        opt.group = private_group(opt.group)
        if opt.grad_norm_group is not None:
            opt.grad_norm_group = private_group(opt.grad_norm_group)
        opt._accumulating = True  # the hooks only accumulate; the reductions run in the background jobs
        self._estimate_channel = opt.grad_channel.without_error_feedback()
        self._reduced_input = [torch.zeros_like(b.grad) for b in opt.buckets]  # G_A, then G_A + G_B
        flat = [opt._flat_params(b).to(b.params[0].dtype) for b in opt.buckets]
        self._real = [f.clone() for f in flat]  # θ_t as all-gathered (the model's values)
        self._estimate = flat  # θ̃_t as all-gathered
        device = opt.device
        # a new thread starts on CUDA device 0: kernels that launch on the current device (Triton codecs) must see
        # this rank's
        init = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megacomp-acco", initializer=init)
        self._job: Optional[Future] = None
        self._job_kind = ""
        self._records: list = []  # the finished job's wire statistics, booked at the wait
        # what callers set between steps (lr, weight decay, ...): the jobs of a step apply the values of its
        # estimate() to the inner optimizer on their own thread, so a change for step t + 1 made while step t's
        # update is in flight cannot reach it
        self._param_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
        self._hyper: list[dict] = []
        self.phase = "A"
        self.last_stepped: Optional[bool] = None
        """Whether the most recently waited-for real update stepped (False: skipped on inf/NaN); None before one.
        Jobs return what they produce and :meth:`_wait` sets it on the calling thread, so every rank reads the same
        value at the same point, whatever the job's timing."""
        self._last_norm: Optional[float] = None

    # -- the two calls per step -------------------------------------------------------------------------
    def estimate(self, scale: float = 2.0) -> None:
        """After half A: wait for the previous real update, put θ_t into the model, start the estimate from this
        half's gradients times ``scale`` (M / micro-batches in A)."""
        if not self.compensated:
            raise RuntimeError("ACCO(delay_compensation=False) (DPU) has no estimate: call step() once per step")
        if self.phase != "A":
            raise RuntimeError("ACCO.estimate() was already called for this step; call step() after half B")
        if not (scale > 0):
            raise ValueError(f"ACCO.estimate: scale must be > 0 (micro-batches per step / micro-batches in half A), "
                             f"got {scale!r}")
        self._wait()
        self._hyper = [dict(g) for g in self._param_groups]  # this step's hyperparameters, for both of its jobs
        for b, r in zip(self.opt.buckets, self._reduced_input):  # G_A leaves the accumulation buffers
            b.grad, self._reduced_input[b.index] = r.zero_(), b.grad
        if not self.warming():  # a warm-up step has no estimate: half B runs at θ_t, as half A did
            self._submit(self._estimate_job, "estimate", float(scale))
        self._load_model(self._real)
        self.phase = "B"

    def warming(self) -> bool:
        """Whether the current step is a warm-up step (undelayed, no estimate); read between the calls of a step."""
        return self.opt.step_count + self.opt.skipped_steps < self.warmup_steps

    def step(self, scale: float = 1.0) -> None:
        """After half B: wait for the estimate, put θ̃_{t+1} into the model, start the real update of this step
        from the gradients of both halves (times ``scale``: 1 when each micro-batch's loss was divided by the step's
        M; 0.5 when each half divided by its own M / 2, as a pipeline schedule run per half does). The update lands
        by the next :meth:`estimate` (or :meth:`synchronized`)."""
        if self.compensated and self.phase != "B":
            raise RuntimeError("ACCO.step() needs ACCO.estimate() after the first half of the step")
        if not (scale > 0):
            raise ValueError(f"ACCO.step: scale must be > 0, got {scale!r}")
        self._wait()
        if not self.compensated:  # DPU: this step's gradients (computed at θ_{t-1}) update θ_t in the background
            self._hyper = [dict(g) for g in self._param_groups]
            for b, r in zip(self.opt.buckets, self._reduced_input):
                b.grad, self._reduced_input[b.index] = r.zero_(), b.grad
            warming = self.warming()
            self._submit(self._real_job, "update", float(scale))
            if warming:  # undelayed: the next step's gradients at θ_{t+1}
                self._wait()
            self._estimate = self._real  # the next step computes at θ_t (θ_{t+1} replaces _real at the next wait)
            self._load_model(self._estimate)
            return
        for b, r in zip(self.opt.buckets, self._reduced_input):
            r.add_(b.grad)
            b.grad.zero_()
        warming = self.warming()
        self._submit(self._real_job, "update", float(scale))
        if warming:
            self._land()
        self._load_model(self._estimate)
        self.phase = "A"

    def _land(self) -> None:
        """A warm-up step: wait for its update now; the next step computes at θ_{t+1} (θ̃_{t+1} = θ_{t+1})."""
        self._wait()
        self._estimate = [r.clone() for r in self._real]

    @contextlib.contextmanager
    def synchronized(self):
        """Inside: the update in flight has landed and the model holds θ_t (to evaluate or checkpoint); on exit the
        model goes back to θ̃_t for the next half A. Only between steps."""
        if self.phase != "A":
            raise RuntimeError("ACCO.synchronized() between estimate() and step(): call it between steps")
        self._wait()
        self._load_model(self._real)
        try:
            yield
        finally:
            self._load_model(self._estimate)

    def finish(self) -> None:
        """Wait for the last update and leave θ_T in the model (end of training). Training may go on: the next half A
        then runs at θ_T (estimate = parameters, as at the start)."""
        if self.phase != "A":
            raise RuntimeError("ACCO.finish() between estimate() and step(): finish the step first")
        self._wait()
        self._load_model(self._real)
        self._estimate = [r.clone() for r in self._real]

    # -- background jobs ----------------------------------------------------------------------------------
    def _submit(self, fn, kind: str, *args) -> None:
        def job():
            with held_records() as records, span(f"acco_{kind}"):  # bytes booked by the waiting thread (_wait)
                try:
                    return fn(*args)
                finally:
                    self._records = records
        self._job, self._job_kind = self._pool.submit(job), kind

    def _wait(self) -> None:
        """Wait for the job in flight and take what it produced (a job returns its results instead of setting this
        object's attributes, so they change only here, on the calling thread, at the same point on every rank); its
        wire bytes are booked into comm.stats() now, so an iteration's statistics hold the jobs it waited for (the
        previous step's update and this step's estimate)."""
        if self._job is not None:
            job, kind, self._job = self._job, self._job_kind, None
            try:
                with span("acco_wait"):
                    results = job.result()
            except Exception as e:
                raise RuntimeError(f"ACCO: the background {kind} failed: {e}") from e
            finally:
                replay(self._records)
                self._records = []
            for name, value in results.items():
                setattr(self, name, value)

    def close(self) -> None:
        """Wait for the job in flight (ignoring its failure: the caller is already handling another) and stop the
        background thread, so no collective of a job outlives the process groups."""
        try:
            self._wait()
        except Exception:  # noqa: BLE001 (reported by the failure that made the caller close)
            pass
        self._pool.shutdown(wait=True)

    def _reduce(self, estimate: bool) -> list[torch.Tensor]:
        opt = self.opt
        warm = opt.step_count + opt.skipped_steps < opt.grad_codec_warmup_steps
        shards = []
        for b, g in zip(opt.buckets, self._reduced_input):
            out = torch.empty(b.padded // opt.world, dtype=torch.float32, device=opt.device)
            if not b.compressed or warm:
                ch, key = opt._grad_plain, None
            else:
                ch, key = (self._estimate_channel, None) if estimate else (opt.grad_channel, f"dp_gradient/b{b.index}")
            ch.reduce_scatter_tensor(out, g, group=opt.group, key=key, validate=not opt._validated)
            out.mul_(1.0 / opt.world)
            start, end = b.shard_range(opt.shard_index, opt.parts)
            if end > b.numel:  # padding carries no gradient (a sign codec would decode 0 as +scale)
                out[max(b.numel - start, 0):].zero_()
            shards.append(out)
        return shards

    def _update(self, shards: list[torch.Tensor]) -> bool:
        """DistributedOptimizer.step's overflow check, clipping and inner step on the given averaged shards, with this
        step's hyperparameters; False (nothing updated) on inf/NaN."""
        opt = self.opt
        if opt._overflowed(shards):
            return False
        for group, hyper in zip(opt.optimizer.param_groups, self._hyper):
            group.update(hyper)
        opt._clip_and_update(shards)
        for m in opt.masters:
            m.grad = None
        return True

    @torch.no_grad()
    def _estimate_job(self, scale: float) -> dict:
        opt = self.opt
        shards = self._reduce(estimate=True)
        for s in shards:
            s.mul_(scale)
        masters = [m.detach().clone() for m in opt.masters]
        state = {p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                 for p, st in opt.optimizer.state.items()}
        norm = opt.last_grad_norm
        try:
            if self._update(shards):
                with span("param_all_gather"):
                    estimate = [opt.gather_bucket(b, m) for b, m in zip(opt.buckets, opt.masters)]
            else:  # inf/NaN in half A: no prediction, the estimate is θ_t
                estimate = [r.clone() for r in self._real]
        finally:  # the estimate never advances the committed state
            for m, saved in zip(opt.masters, masters):
                m.copy_(saved)
            for p in list(opt.optimizer.state):
                if p in state:
                    opt.optimizer.state[p] = state[p]
                else:
                    del opt.optimizer.state[p]
            opt.last_grad_norm = norm
        return {"_estimate": estimate}

    @torch.no_grad()
    def _real_job(self, scale: float) -> dict:
        opt = self.opt
        shards = self._reduce(estimate=False)
        if scale != 1.0:
            for s in shards:
                s.mul_(scale)
        stepped = self._update(shards)
        results = {"last_stepped": stepped, "_last_norm": opt.last_grad_norm}
        if stepped:
            with span("param_all_gather"):
                results["_real"] = [opt.gather_bucket(b, m) for b, m in zip(opt.buckets, opt.masters)]
            opt.step_count += 1
            opt._validated = True
        else:
            opt.skipped_steps += 1
            if opt.ef is not None:
                opt.ef.reset()
            log.debug("megacomp ACCO: inf/NaN gradients, step %d skipped", opt.step_count)
        return results

    @torch.no_grad()
    def _load_model(self, buffers: list[torch.Tensor]) -> None:
        for b, full in zip(self.opt.buckets, buffers):
            for p, o in zip(b.params, b.offsets):
                p.copy_(full[o:o + p.numel()].view_as(p))

    # -- checkpointing -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state_dict (call inside :meth:`synchronized`) plus this rank's shard of θ̃ per bucket."""
        if self._job is not None or self.phase != "A":
            raise RuntimeError("ACCO.state_dict() inside ACCO.synchronized() (the update in flight must land first)")
        state = self.opt.state_dict()
        local = state[f"dp_rank_{self.opt.rank}"]
        local["acco_estimate"] = [e[slice(*b.shard_range(self.opt.shard_index, self.opt.parts))].clone()
                                  for b, e in zip(self.opt.buckets, self._estimate)]
        return state

    def init_state(self) -> None:
        """A fresh optimizer's state for the torch.distributed.checkpoint template (see DistributedOptimizer)."""
        self.opt.init_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the optimizer (θ_t into the model) and θ̃_t (all-gathered from the saved shards; θ_t when the
        checkpoint has none), then put θ̃_t into the model for the next half A."""
        if self._job is not None or self.phase != "A":
            raise RuntimeError("ACCO.load_state_dict() between steps only")
        opt = self.opt
        opt.load_state_dict(state)  # raises ValueError on a mismatched checkpoint; gathers θ_t into the model
        self._param_groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
        self._real = [opt._flat_params(b).to(b.params[0].dtype) for b in opt.buckets]
        saved = state[f"dp_rank_{opt.rank}"].get("acco_estimate")
        if saved is None:
            log.info("megacomp ACCO: the checkpoint has no ACCO estimate (written without ACCO): resuming with "
                     "estimate = parameters, as ACCO starts")
            self._estimate = [r.clone() for r in self._real]
        else:
            self._estimate = []
            for b, shard in zip(opt.buckets, saved):
                full = torch.empty(b.padded, dtype=shard.dtype, device=opt.device)
                dist.all_gather_into_tensor(full, shard.to(opt.device), group=opt.group)
                self._estimate.append(full)
        self._load_model(self._estimate)

    # -- what DistributedOptimizer users read --------------------------------------------------------------
    @property
    def last_grad_norm(self) -> Optional[float]:
        """The gradient norm of the last real update waited for (one step behind while an update is in flight)."""
        return self._last_norm

    @torch.no_grad()
    def load_params_from_model(self) -> None:
        """After the model's weights were replaced (fine-tuning from a checkpoint): masters, θ and θ̃ from them."""
        if self._job is not None or self.phase != "A":
            raise RuntimeError("ACCO.load_params_from_model() between steps only (after synchronized() or finish())")
        self.opt.load_params_from_model()
        self._real = [self.opt._flat_params(b).to(b.params[0].dtype) for b in self.opt.buckets]
        self._estimate = [r.clone() for r in self._real]

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's hyperparameters per param group (without ``params``): set ``lr`` here before
        ``estimate``; both updates of the step use the values ``estimate`` saw."""
        return self._param_groups

    def no_sync(self):
        """A no-op context (ACCO's hooks never communicate), so code written for DistributedOptimizer runs."""
        return contextlib.nullcontext()

    def main_grad(self, param):
        """The accumulated gradient of ``param`` in the current half (see DistributedOptimizer.main_grad)."""
        return self.opt.main_grad(param)

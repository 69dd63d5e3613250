"""The same gradient compression for plain torch DDP users, as a communication hook.

    from megacomp.optimizer import CompressedHookState, compressed_allreduce_hook
    state = CompressedHookState(codec="int4", error_feedback="loco")
    state.register(ddp)        # = ddp.register_comm_hook(state, compressed_allreduce_hook), keyed by parameter name

Each DDP bucket is averaged with megacomp's compressed all-reduce (encode -> all-to-all -> fp32 sum ->
re-encode -> all-gather, with a worker and a server error per bucket under error feedback; two ranks
exchange their whole encodings instead, one quantization and a worker error only). The hook
issues the collective and returns a future that a background thread completes (wait, decode), so the
transfer overlaps the rest of backward. That is safe where the completion issues no backend
collective: two ranks (one phase), or megacomp's tagged p2p transport on gloo (the second phase's
messages are matched by tag, whatever thread posts them). Otherwise (``overlap=False``, or NCCL with
more than two ranks) the hook finishes the all-reduce before returning: issuing a backend collective
from another thread would race the main thread's (the failure torch's own PowerSGD hook shows on gloo).
Buckets below ``min_compress_numel`` elements (the channel's small-tensor rule), and the first
``start_iter`` iterations, use the plain all-reduce. The state's ``channel`` (megacomp.comm.Channel, built
from these fields) owns the error feedback.
``codec=None`` is bit-identical to DDP's default hook (divide by the world size, then all-reduce SUM).

Bucket keys follow the parameters, not the bucket index. torch DDP buckets a fresh model's first iteration in
one layout (its initial one) and rebuilds the buckets after it in gradient-ready order; another
``bucket_cap_mb`` gives other buckets again. So each bucket's state is keyed ``ddp_bucket:<digest>:<numel>``,
the digest (sha1) of the bucket's parameter keys in bucket order: parameter names when the state was registered
with :meth:`CompressedHookState.register` (``module.named_parameters()``), else ``param<n>``, ``n`` the
parameter's position in the first iteration this process sees (DDP's initial layout, read from its last bucket
to its first: the order of ``module.parameters()`` for a model of one dtype). The state remembers the layout (each
bucket's parameters and sizes), saves it with the residuals, and moves state element-wise when the layout changes:
- resume (:meth:`~CompressedHookState.load_state_dict`, or :meth:`~CompressedHookState.register` on another DDP):
  the first iteration is deferred to its last bucket and, when its buckets differ from the saved layout but hold the
  same parameters, the gradients are copied into the saved layout's buckets, reduced there (the same buffers, keys
  and residuals an uninterrupted run reduces) and copied back. A resumed run therefore continues bit for bit; the
  cost is one iteration without overlap and one copy of the gradients.
- a layout that differs for good (another ``bucket_cap_mb``, another model's parameter set): each new bucket's
  residual is assembled from its parameters' slices of the old buckets' residuals (zero for a parameter no old
  bucket held), its error-feedback count from theirs; over more than two ranks each rank's server error (its shard
  of the old bucket) is all-gathered once and re-split. PowerSGD's residual and warm-start Q are per parameter and
  move with it; Accordion's regimes start over (critical) for new buckets. int8/bf16 error storage is re-rounded
  when moved. :meth:`~CompressedHookState.parameter_residuals` gives the per-parameter (flat) residual views.
- a state saved by megacomp before this scheme (keys ``ddp_bucket<i>:<numel>``, no saved layout) loads with its
  iteration count and the codec check, and its residuals (and PowerSGD Q) are dropped with one warning line: which
  elements an index-keyed residual belonged to cannot be told from the key (that is the flaw this scheme fixes).

PowerSGD (``codec={"name": "powersgd", "rank": 4}`` or a ``PowerSGD``): the state's channel is a
megacomp.comm.LowRankChannel; each bucket's parameters are read as matrices (views of the bucket buffer)
and reduced with PowerSGD (error feedback and warm-start Q per parameter, keys ``<bucket key>/<j>``).
That exchange runs in the hook's own thread, so it works on gloo with any number of buckets (torch's
PowerSGD hook does not: its second all-reduce runs in a callback thread and races the next bucket's);
it does not overlap the rest of backward.

Accordion (``codec={"name": "accordion", "low": ..., "high": ...}``; megacomp.comm.AccordionChannel): each
bucket is reduced with the level its regime picks, completed in the hook (the policy reads the reduced
bucket), and the regimes are decided at the first bucket of every ``interval``-th compressed iteration (the
hook cannot see an optimizer's skipped steps; a GradScaler's inf bucket then enters that interval's norms).

Failure behaviour: a bucket whose parameters do not fill its buffer raises RuntimeError (a torch that lays buckets
out otherwise); loading a state saved with another codec, or with parameter names into a hook registered without
them (or the reverse), raises ValueError with one line naming the fix.
"""
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm import make_channel, use_duplex
from ..comm.common import split_sizes
from ..comm.transport import pipeline_segments
from ..compression import CodecLike, is_accordion, is_low_rank, make_low_rank

log = logging.getLogger("megacomp")

Layout = list  # [(bucket key, [(parameter key, numel), ...]), ...] in bucket index order


@dataclass
class CompressedHookState:
    """Settings and error-feedback state of :func:`compressed_allreduce_hook` (state keyed by the buckets'
    parameters; see the module docstring)."""

    codec: CodecLike = None
    """Codec of the gradient all-reduce (None: uncompressed), or PowerSGD settings (see the module docstring)."""
    error_feedback: Any = None
    """'ef', 'loco', an ErrorFeedbackConfig or an ErrorFeedback (one error per bucket)."""
    process_group: Optional[dist.ProcessGroup] = None
    """Group to average over (default: the world)."""
    min_compress_numel: int = 65536
    """Smaller buckets are averaged uncompressed."""
    start_iter: int = 2
    """Iterations run uncompressed first (DDP finalises its bucket layout after iteration 1)."""
    overlap: bool = True
    """Finish each compressed all-reduce (wait, decode, and for more than two ranks the second phase) in a
    background thread, so the transfer overlaps the rest of backward. Only where that finish issues no
    backend collective (megacomp's tagged p2p transport on gloo, or two ranks); otherwise, and with
    False, the hook completes the all-reduce before returning."""
    iteration: int = field(default=0, init=False)
    """Iterations seen (counted on bucket 0)."""

    def __post_init__(self) -> None:
        low_rank = make_low_rank(self.codec) if is_low_rank(self.codec) else None
        stateful = is_accordion(self.codec) or (low_rank is not None and (low_rank.error_feedback or low_rank.warm_start))
        if stateful and self.start_iter < 2:
            raise ValueError(f"powersgd/accordion keep state per bucket and parameter (residual, Q), and DDP rebuilds its "
                             f"buckets after iteration 1: start_iter must be >= 2, got {self.start_iter} (or turn off "
                             f"error_feedback and warm_start)")
        self.channel = make_channel("dp_gradient", self.codec, group=self.process_group,
                                    error_feedback=self.error_feedback, min_compress_numel=self.min_compress_numel,
                                    error_feedback_arg="the hook's error_feedback")
        self.codec, self.error_feedback = self.channel.codec, self.channel.error_feedback
        self.plain = self.channel.uncompressed()
        self._names: Optional[dict[int, str]] = None  # id(parameter) -> name (register)
        self._order: Optional[dict[int, str]] = None  # id(parameter) -> param<n> (no names: the first iteration)
        self._saved_kind: Optional[str] = None  # "names" / "order": how a loaded state keyed its parameters
        self._buckets: dict[tuple, tuple] = {}  # parameter ids of a bucket -> (key, entries, shapes)
        self.layout: Layout = []  # the layout the state belongs to (the last iteration's)
        self._seen: Layout = []  # this iteration's buckets so far
        self._target: Optional[Layout] = None  # the layout to reduce the next deferred iteration in
        self._defer_next = True  # defer the next iteration to its last bucket (this process's first; after a load)
        self._deferring = False
        self._pending: list = []  # (buffer, parameters, future) of the deferred iteration
        self._homes_of: Optional[tuple] = None  # (layout, its _homes())
        self._full_server: Optional[dict] = None  # old buckets' gathered server errors during a move

    # -- registration and keys --------------------------------------------------------------------
    def register(self, ddp: torch.nn.Module) -> None:
        """``ddp.register_comm_hook(self, compressed_allreduce_hook)``, keying the state by the parameter names of
        ``ddp.module`` (stable across processes and models built alike). A state that already holds a layout (the
        same state on a new DDP) reduces the new DDP's first iteration in that layout."""
        self._names = {id(p): name for name, p in ddp.module.named_parameters()}
        self._buckets.clear()
        if self.layout:
            self._target = self.layout
        self._defer_next = True
        ddp.register_comm_hook(self, compressed_allreduce_hook)

    def _kind(self) -> str:
        return "names" if self._names is not None else "order"

    def _param_key(self, p: torch.Tensor) -> str:
        table = self._names if self._names is not None else self._order
        key = table.get(id(p)) if table is not None else None
        if key is None:
            raise ValueError(f"megacomp DDP hook: a bucket holds a parameter of shape {tuple(p.shape)} that "
                             f"{'the registered module does not name' if self._names is not None else 'was not in the first iteration'}"
                             f"; register the state on the DDP model that owns it (state.register(ddp))")
        return key

    def _bucket(self, params: list, numel: int) -> tuple:
        """(key, [(parameter key, numel)], [shape]) of a bucket's parameters (cached per parameter tuple)."""
        ids = tuple(id(p) for p in params)
        hit = self._buckets.get(ids)
        if hit is None:
            entries = [(self._param_key(p), p.numel()) for p in params]
            if sum(n for _, n in entries) != numel:
                raise RuntimeError(f"a DDP bucket holds {numel} elements but its parameters "
                                   f"{sum(n for _, n in entries)}; this torch version lays buckets out differently, "
                                   f"so the hook cannot key its state by parameter")
            digest = hashlib.sha1("\n".join(f"{k}:{n}" for k, n in entries).encode()).hexdigest()[:16]
            hit = self._buckets[ids] = (f"ddp_bucket:{digest}:{numel}", entries, [p.shape for p in params])
        return hit

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Iteration count, codec, error-feedback state, the bucket layout it belongs to and how parameters were
        keyed (load with :meth:`load_state_dict`)."""
        out = {"iteration": self.iteration, "codec": self.codec.to_dict(),
               "error_feedback": self.error_feedback.state_dict() if self.error_feedback else None,
               "layout": [[k, [[p, n] for p, n in entries]] for k, entries in self.layout],
               "parameter_keys": self._kind()}
        if self.channel.reduces_whole_buckets:  # Q matrices, regimes (the residuals above)
            out["low_rank"] = self.channel.state_dict(error_feedback=False)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the next iteration reduces in the saved layout (module docstring). ValueError:
        saved with another codec. A state of the older index-keyed format: see the module docstring (one warning)."""
        if state["codec"] != self.codec.to_dict():
            raise ValueError(f"hook state was saved with codec {state['codec']}, this hook uses {self.codec.to_dict()}")
        self.iteration = state["iteration"]
        if "layout" not in state:
            if not (state["error_feedback"] or {}).get("errors") and not state.get("low_rank"):
                return  # nothing index-keyed to drop
            log.warning("megacomp: this DDP hook state was saved by an older megacomp that keyed residuals by bucket "
                        "index (ddp_bucket<i>:<numel>), which a fresh DDP's buckets do not follow; its residuals "
                        "restart at zero (iteration %d kept); save again with this version to resume exactly",
                        self.iteration)
            return
        if self.error_feedback is not None and state["error_feedback"] is not None:
            self.error_feedback.load_state_dict(state["error_feedback"])
        if self.channel.reduces_whole_buckets:
            self.channel.load_state_dict(state["low_rank"])
        self.layout = [(k, [(p, int(n)) for p, n in entries]) for k, entries in state["layout"]]
        self._saved_kind = state["parameter_keys"]
        self._target, self._defer_next = self.layout, True

    def parameter_residuals(self) -> dict[str, torch.Tensor]:
        """Each parameter's flat worker residual (fp32, a slice of its bucket's) by parameter key, for the
        buckets of :attr:`layout` that hold one. (PowerSGD keeps its residuals per matrix, keys
        ``<bucket key>/<j>``, already one per parameter: not listed here.)"""
        out = {}
        ef = self.error_feedback
        for key, entries in self.layout if ef is not None else ():
            e = ef.error(key + "/worker")
            if e is None:
                continue
            e, pos = e.reshape(-1), 0
            for pkey, n in entries:
                out[pkey] = e[pos:pos + n]
                pos += n
        return out

    # -- layout changes ---------------------------------------------------------------------------
    def _homes(self) -> dict[str, tuple]:
        """Parameter key -> (bucket key, offset, position in bucket) in :attr:`layout` (cached per layout)."""
        if self._homes_of is not None and self._homes_of[0] is self.layout:
            return self._homes_of[1]
        homes = {}
        for key, entries in self.layout:
            pos = 0
            for j, (pkey, n) in enumerate(entries):
                homes[pkey] = (key, pos, j)
                pos += n
        self._homes_of = (self.layout, homes)
        return homes

    def _move_into(self, key: str, entries: list, homes: dict) -> None:
        """Give bucket ``key`` its parameters' state from :attr:`layout`'s buckets, element-wise, if it has none
        (a no-op for a bucket of that layout). A collective over more than two ranks (server errors)."""
        if not self.layout or any(key == k for k, _ in self.layout):
            return
        ef = self.error_feedback
        if self.channel.low_rank:  # per-matrix residual and Q: rename each parameter's
            if not _matrix_tables(self.channel):  # LGC: one autoencoder per whole bucket; a new bucket trains its own
                return
            for j, (pkey, _) in enumerate(entries):
                home = homes.get(pkey)
                if home is not None:
                    _rename(self.channel, ef, f"{home[0]}/{home[2]}", f"{key}/{j}")
            return
        if ef is None or key + "/worker" in ef.keys():
            return
        worker, steps = _assemble(ef, "/worker", entries, homes, lambda okey, e: e)
        if steps:
            _store(ef, key + "/worker", worker, max(steps))
        world = dist.get_world_size(self.process_group)
        numel = sum(n for _, n in entries)
        if world > 2 and any(ef.error(k + "/server") is not None for k, _ in self.layout):
            full = self._gather_server(world)
            server, steps = _assemble(ef, "/server", entries, homes, lambda okey, e: full[okey])
            if steps:
                own = _owned(numel, world, dist.get_rank(self.process_group), self.channel.options.segment_numel)
                _store(ef, key + "/server", server[own], max(steps))

    def _gather_server(self, world: int) -> dict[str, torch.Tensor]:
        """Every old bucket's full server error (each rank's shard put back in place), gathered from all ranks."""
        if self._full_server is None:
            ef, mine = self.error_feedback, {}
            for k, entries in self.layout:
                e = ef.error(k + "/server")
                if e is not None:
                    mine[k] = e.reshape(-1).float().cpu()
            every = [None] * world
            dist.all_gather_object(every, mine, group=self.process_group)
            self._full_server = {}
            for k, entries in self.layout:
                if all(k in r for r in every):
                    numel = sum(n for _, n in entries)
                    full = torch.zeros(numel)
                    for r in range(world):
                        full[_owned(numel, world, r, self.channel.options.segment_numel)] = every[r][k]
                    self._full_server[k] = full
        return self._full_server

    def _end_iteration(self, seen: Layout) -> None:
        """Adopt this iteration's layout: move state into any bucket of it that has none, drop old buckets' keys."""
        if [k for k, _ in seen] == [k for k, _ in self.layout]:
            return
        if self.layout:
            homes = self._homes()
            for key, entries in seen:
                self._move_into(key, entries, homes)
            _drop(self.channel, self.error_feedback, {k for k, _ in self.layout} - {k for k, _ in seen})
        self._full_server = None
        self.layout = seen


def compressed_allreduce_hook(state: CompressedHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket.buffer()`` over the group with ``state.codec`` (state keyed by the
    bucket's parameters; the first iteration of a process or after a load is reduced at its last bucket)."""
    buf, params = bucket.buffer(), bucket.parameters()
    if bucket.index() == 0:
        state.iteration += 1
        if state.channel.adaptive and state.iteration > state.start_iter + 1:
            state.channel.end_step(state.process_group)  # the previous iteration is complete on every rank
        state._seen, state._deferring, state._defer_next = [], state._defer_next, False
    if state._deferring:
        fut = torch.futures.Future()
        state._pending.append((buf, params, fut))
        if bucket.is_last():
            _run_deferred(state)
        return fut
    key, entries, shapes = state._bucket(params, buf.numel())
    state._seen.append((key, entries))
    if state.iteration > state.start_iter and state.layout and state.channel.compresses(buf.numel()):
        state._move_into(key, entries, state._homes())
    fut = _reduce(state, buf, key, shapes, bucket.index())
    if bucket.is_last():
        state._end_iteration(state._seen)
    return fut


def _run_deferred(state: CompressedHookState) -> None:
    """Reduce the deferred iteration: in the saved layout when it holds the same parameters as this DDP's buckets
    (gradients copied in and out), else bucket by bucket; then complete every bucket's future."""
    pending, state._pending, state._deferring = state._pending, [], False
    if state._names is None and state._order is None:
        state._order = {}
        for _, params, _ in reversed(pending):
            for p in params:
                state._order.setdefault(id(p), f"param{len(state._order)}")
    if state._saved_kind is not None and state._saved_kind != state._kind():
        raise ValueError(f"megacomp DDP hook: the loaded state keys parameters by {state._saved_kind}, this hook by "
                         f"{state._kind()}; register it as it was when saved ("
                         f"{'state.register(ddp)' if state._saved_kind == 'names' else 'ddp.register_comm_hook(state, compressed_allreduce_hook)'})")
    current = [state._bucket(params, buf.numel()) for buf, params, _ in pending]
    target, state._target = state._target, None
    same_params = target is not None and sorted(e for _, es in target for e in es) == sorted(
        e for _, es, _ in current for e in es)
    if same_params and [k for k, _ in target] != [k for k, _, _ in current]:
        where, shapes = {}, {}
        for (buf, params, _), (_, entries, shp) in zip(pending, current):
            pos = 0
            for (pkey, n), s in zip(entries, shp):
                where[pkey], shapes[pkey] = buf[pos:pos + n], s
                pos += n
        for i, (key, entries) in enumerate(target):
            flat = torch.cat([where[pkey] for pkey, _ in entries])
            _reduce(state, flat, key, [shapes[pkey] for pkey, _ in entries], i).wait()
            pos = 0
            for pkey, n in entries:
                where[pkey].copy_(flat[pos:pos + n])
                pos += n
        state._seen = [(k, list(es)) for k, es in target]
    else:
        for i, ((buf, _, _), (key, entries, shp)) in enumerate(zip(pending, current)):
            if state.iteration > state.start_iter and state.layout and state.channel.compresses(buf.numel()):
                state._move_into(key, entries, state._homes())
            _reduce(state, buf, key, shp, i).wait()
        state._seen = [(k, es) for k, es, _ in current]
    state._end_iteration(state._seen)
    for buf, _, fut in pending:
        fut.set_result(buf)


def _reduce(state: CompressedHookState, buf: torch.Tensor, key: str, shapes: list,
            index: int) -> torch.futures.Future:
    """Average ``buf`` (one bucket, key ``key``, parameters of ``shapes`` back to back) over the group."""
    world = dist.get_world_size(state.process_group)
    lossy = state.channel.compresses(buf.numel()) and state.iteration > state.start_iter
    buf.div_(world)  # divide first, as DDP's default hook does (no fp16 overflow in the sum)
    validate = state.iteration == state.start_iter + 1
    if not lossy:
        work = state.plain.all_reduce(buf, validate=False, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    channel = state.channel.level_for(key)  # Accordion: the level of this bucket's regime
    fut = torch.futures.Future()
    if channel.low_rank:
        channel.all_reduce_coalesced(_param_views(buf, shapes), key=key, validate=validate)
        work = None
    else:
        work = channel.all_reduce(buf, key=key, validate=validate, async_op=True)
    if state.channel.adaptive:  # the policy reads the reduced bucket: finish here
        if work is not None:
            work.wait()
        state.channel.observe(key, buf, replicated=True)
    if work is None or state.channel.adaptive:
        fut.set_result(buf)
    elif state.overlap and (world == 2 or use_duplex(state.process_group, channel.options.duplex, buf.device)):
        _finish_in_thread(work, buf, fut, index)
    else:
        _finish([work], buf, fut)
    return fut


def _param_views(buf: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Each parameter's gradient as a view of the bucket buffer (DDP lays them out back to back, in
    ``bucket.parameters()`` order; :meth:`CompressedHookState._bucket` checked that they fill it)."""
    views, pos = [], 0
    for s in shapes:
        n = s.numel()
        views.append(buf[pos:pos + n].view(s))
        pos += n
    return views


def _owned(numel: int, world: int, rank: int, segment_numel: int) -> torch.Tensor:
    """Positions of a bucket of ``numel`` elements whose server error ``rank`` keeps: its chunk of every pipeline
    segment (megacomp.comm.collectives.server_numel), in the order it keeps them."""
    parts, base = [], 0
    for length in pipeline_segments(numel, segment_numel):
        sizes = split_sizes(length, world)
        start = base + sum(sizes[:rank])
        parts.append(torch.arange(start, start + sizes[rank]))
        base += length
    return torch.cat(parts)


def _assemble(ef, suffix: str, entries: list, homes: dict, full_of) -> tuple:
    """A new bucket's error from its parameters' slices of the old buckets' (``full_of(old key, error)``: the old
    bucket's error over all its elements); zeros where no old bucket held one. Returns (error, old step counts)."""
    pieces, steps = [], []
    for pkey, n in entries:
        home = homes.get(pkey)
        e = ef.error(home[0] + suffix) if home is not None else None
        if e is None:
            pieces.append(torch.zeros(n))
            continue
        full = full_of(home[0], e.reshape(-1))
        pieces.append(full[home[1]:home[1] + n].float().cpu())
        steps.append(ef.steps.get(home[0] + suffix, 0))
    return torch.cat(pieces), steps


def _store(ef, key: str, error: torch.Tensor, steps: int) -> None:
    """Give ``key`` a moved error and its old step count (the periodic reset keeps its phase); the error is
    stored as the ErrorFeedback's storage keeps it (re-rounded for int8/bf16)."""
    ef._store(key, error)  # the ErrorFeedback's own storage path (fp32 / bf16 / int8)
    ef.steps[key] = steps


def _matrix_tables(channel) -> list:
    """PowerSGD's per-matrix state tables (warm-start Q, start-matrix draws), keyed ``bucket/matrix``; none for
    other channels (LGC's whole-bucket channel keeps one autoencoder per bucket, which cannot move elsewhere)."""
    return [channel.q, channel.draws] if channel.low_rank and hasattr(channel, "q") else []


def _rename(channel, ef, old: str, new: str) -> None:
    """Move PowerSGD's per-matrix state (residual, warm-start Q, start-matrix draws) from key ``old`` to ``new``,
    unless ``new`` has state already (moved, and maybe updated, earlier in this iteration)."""
    if old == new or any(new in t for t in _matrix_tables(channel)) or (ef is not None and ef.error(new) is not None):
        return
    if ef is not None and ef.error(old) is not None:
        _store(ef, new, ef.error(old).clone(), ef.steps.get(old, 0))
    for table in _matrix_tables(channel):
        if old in table:
            table[new] = table[old]


def _drop(channel, ef, keys: set) -> None:
    """Forget the state of buckets no longer in the layout (after it was moved into the new buckets)."""
    if not keys:
        return
    prefixes = tuple(k + "/" for k in keys)
    if ef is not None:
        for k in [k for k in ef.keys() if k.startswith(prefixes)]:
            ef.reset(k)
            ef.steps.pop(k, None)
    for table in _matrix_tables(channel):
        for k in [k for k in table if k.startswith(prefixes)]:
            del table[k]


def _finish_in_thread(work, buf: torch.Tensor, fut: torch.futures.Future, index: int) -> None:
    """Run :func:`_finish` in a thread of its own. Not a daemon: completing the future wakes DDP's main thread
    before this thread has left torch's C++ future code (its callbacks, then taking the GIL back), and a daemon
    thread still there when the interpreter shuts down is ended by a forced unwind that aborts the process
    ("terminate called without an active exception"). Python joins a non-daemon thread before shutting down."""
    threading.Thread(target=_finish, args=([work], buf, fut), name=f"megacomp-ddp-bucket{index}").start()


def _finish(box: list, buf: torch.Tensor, fut: torch.futures.Future) -> None:
    """Complete the compressed all-reduce held in ``box`` and hand the bucket to DDP (errors reach DDP through the
    future). The work is released before the future completes: once it does, DDP's backward, the step and maybe
    ``destroy_process_group`` go on in the main thread, and a backend work object freed later on this thread (the
    thread's arguments live until it ends) can outlive its process group and abort the process at exit."""
    work = box.pop()
    try:
        work.wait()
    except BaseException as e:  # DDP re-raises it from the future in finalize_backward
        del work
        fut.set_exception(e)
        return
    del work
    fut.set_result(buf)

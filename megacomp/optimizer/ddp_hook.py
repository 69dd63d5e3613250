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

Hop by hop (``topology``, megacomp.placement.Topology): flat, every rank sends encoded chunks to every other rank, so
a node of m ranks sends its data across its slow link about m times over. Given the cluster's topology, and when the
group spans N >= 2 nodes with the same number m >= 2 of its ranks on each, the state builds the group's hops
(megacomp.comm.new_hierarchical_group: a collective over the default group, so every rank constructs its state; a
``process_group`` that is not the world needs ``groups``, every group of the job) and its channel is a
megacomp.comm.HierarchicalChannel: each compressed bucket is reduce-scattered uncompressed inside the node (stats tag
``dp_gradient@intra_node``), all-reduced with ``codec`` between nodes on its 1/m chunk (tag ``dp_gradient``), and
all-gathered back inside the node. So the slow link carries each node's bytes once: for a bucket whose encoding is S
bytes a rank sends 2 (N - 1) / N x S / m over the slow hop (S / m for two nodes: one direct exchange), its node m times
that; flat, every rank sends 2 (W - 1) / W x S over W = N m ranks (1.5 S at 2 nodes x 2 ranks: three times the
hop-by-hop rank's S / 2). Sites (``Topology.with_sites``) add an inter-site hop the same way.
Error: the slow hop quantizes each node's sum, not each rank's gradient: per element, at most the sum over the N nodes
of the codec's bound on that node's sum s_n (of its ranks' gradients, each divided by the world size first), e.g. block
max |s_n| / (2 qmax) for int codecs (with error feedback: on s_n plus the node's residual), plus, over more than two
nodes, the bound of the reduced shard's re-encoding (as flat). A node's sum has up to m times one rank's scale, but
there are m times fewer of them. ``codec`` may be a codec per link kind (``{"inter_node": "int4", "intra_node":
"bf16"}``): a lossy fast hop adds its own error (on each rank's gradient) and residual.
Residuals per hop (where each sits and how it moves: megacomp.optimizer.ddp_residuals) checkpoint with the state,
which also records the hops (a state saved flat loaded into a hop-by-hop hook, or the reverse, or over other hop sizes,
is refused in one line).
Overlap: a bucket's finish all-gathers over the fast hop (a backend collective, which must not race the next
bucket's from another thread), so it runs in the hook's own thread at the next bucket's hook call (the last bucket's
before the hook returns): the slow hop's transfer overlaps the backward computation in between; ``overlap=False``
finishes each bucket before its hook returns (the same result, bit for bit). Compression off (``codec=None``, small
buckets, the first ``start_iter`` iterations) is torch's all-reduce on the whole group, bit-identical to DDP's.
PowerSGD, Accordion and LGC see whole buckets: they stay flat with a topology, crossing the slow link once per local
rank (:meth:`CompressedHookState.describe`, logged at INFO when a topology is given, says which way the hook runs).

DDP re-bucketing (state keyed by parameter, resume, residuals moved): megacomp.optimizer.ddp_residuals.

PowerSGD (``codec={"name": "powersgd", "rank": 4}`` or a ``PowerSGD``): the state's channel is a
megacomp.comm.LowRankChannel; each bucket's parameters are read as matrices (views of the bucket buffer)
and reduced with PowerSGD (error feedback and warm-start Q per parameter, keys ``<bucket key>/<j>``).
That exchange runs in the hook's own thread, so it works on gloo with any number of buckets (torch's
PowerSGD hook does not: its second all-reduce runs in a callback thread and races the next bucket's);
it does not overlap the rest of backward.

Accordion (``codec={"name": "accordion", "low": ..., "high": ...}``; megacomp.comm.AccordionChannel): each
bucket is reduced with the level its regime picks, completed in the hook (the policy reads the reduced
bucket), and the regimes are decided at the first bucket of the iteration after each window's end (the
hook cannot see an optimizer's skipped steps; a GradScaler's inf bucket then enters that interval's norms); with
``lr_trigger`` give it the learning rate: ``state.channel.follow_lr(lambda: optimizer.param_groups[0]["lr"])``.

Failure behaviour: a bucket whose parameters do not fill its buffer raises RuntimeError (a torch that lays buckets
out otherwise); loading a state saved with another codec, or with parameter names into a hook registered without
them (or the reverse), raises ValueError with one line naming the fix. With a topology, ValueError (one line, alike on
every rank, before any collective) for a topology of another world size, a ``process_group`` that is not the world
without ``groups`` (or not one of them), a group that sits unevenly over nodes, a codec per link kind without a
topology, a state saved with other hops, and :meth:`~CompressedHookState.parameter_residuals` (per-chunk residuals).
"""
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm import HierarchicalChannel, make_channel, new_hierarchical_group, use_duplex
from ..comm.hop_groups import HopCodecs, is_hop_mapping
from ..compression import CodecLike, is_accordion, is_learned, is_low_rank, make_low_rank
from ..placement import Topology, check_topology
from .ddp_residuals import Layout, _adopt_layout, _move_into, _parameter_residuals

log = logging.getLogger("megacomp")


@dataclass
class CompressedHookState:
    """Settings and error-feedback state of :func:`compressed_allreduce_hook` (state keyed by the buckets'
    parameters; see megacomp.optimizer.ddp_residuals)."""

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
    False, the hook completes the all-reduce before returning. Hop by hop (``topology``) the finish runs in the
    hook's own thread instead, at the next bucket's hook call (see the module docstring)."""
    topology: Optional[Topology] = None
    """Where every rank of the job sits (megacomp.placement: ``Topology.uniform(world, ranks_per_node)`` or
    ``detect_topology()``). Set, and the group spans several nodes with several of its ranks on each, each bucket's
    all-reduce runs hop by hop (uncompressed inside a node, ``codec`` between nodes, so the slow link carries each
    node's bytes once); ``codec`` may then also be a codec per link kind (``{"inter_node": "int4", "intra_node":
    "bf16"}``). None: flat over ``process_group``. Building the hops is a collective over the default group: every
    rank of the job constructs its state, in the same order relative to its other ``new_group`` calls."""
    groups: Optional[Sequence[Sequence[int]]] = None
    """With ``topology`` and a ``process_group`` that is not the whole world: every group the job's hook states
    average over, as lists of global ranks, the same list on every rank (``process_group``'s ranks must be one of
    them), since every rank builds the hops of every group. None: ``process_group`` is the world."""
    iteration: int = field(default=0, init=False)
    """Iterations seen (counted on bucket 0)."""

    def __post_init__(self) -> None:
        per_hop = isinstance(self.codec, HopCodecs) or is_hop_mapping(self.codec)
        if per_hop and self.topology is None:
            raise ValueError(f"megacomp DDP hook: a codec per link kind ({self.codec}) needs the hops: set topology "
                             f"(megacomp.placement.Topology), or give the hook one codec")
        low_rank = make_low_rank(self.codec) if not per_hop and is_low_rank(self.codec) else None
        stateful = not per_hop and (is_accordion(self.codec) or (
            low_rank is not None and (low_rank.error_feedback or low_rank.warm_start)))
        if stateful and self.start_iter < 2:
            raise ValueError(f"powersgd/accordion keep state per bucket and parameter (residual, Q), and DDP rebuilds its "
                             f"buckets after iteration 1: start_iter must be >= 2, got {self.start_iter} (or turn off "
                             f"error_feedback and warm_start)")
        # PowerSGD, Accordion and LGC see whole buckets: they run flat (megacomp.comm.make_channel), no hops built
        whole_bucket = not per_hop and (low_rank is not None or is_accordion(self.codec) or is_learned(self.codec))
        self.hierarchy = self._build_hierarchy() if self.topology is not None and not whole_bucket else None
        self.channel = make_channel("dp_gradient", self.codec,
                                    group=self.hierarchy if self.hierarchy is not None else self.process_group,
                                    error_feedback=self.error_feedback, min_compress_numel=self.min_compress_numel,
                                    error_feedback_arg="the hook's error_feedback")
        if not isinstance(self.channel, HierarchicalChannel):
            self.hierarchy = None
        self.codec, self.error_feedback = self.channel.codec, self.channel.error_feedback
        if self.topology is not None:
            log.info("%s", self.describe())
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
        # megacomp.optimizer.ddp_residuals' caches while the state moves into a new layout
        self._homes_of: Optional[tuple] = None  # (layout, its parameters' homes)
        self._full_server: Optional[dict] = None  # old buckets' gathered server errors during a move
        self._full_hops: Optional[dict] = None  # hop by hop: old buckets' gathered residuals during a move
        self._unfinished: list = []  # ([work], buffer, future) of hop-by-hop buckets to finish in this thread

    # -- hops -----------------------------------------------------------------------------------------
    def _build_hierarchy(self):
        """This rank's HierarchicalGroup for ``process_group`` under :attr:`topology` (None: the group is flat), a
        collective over the default group. ValueError (one line, raised alike on every rank before any collective)
        for a topology of another world size, a subgroup without ``groups``, or a group that sits unevenly."""
        world = dist.get_world_size()
        topo = check_topology(self.topology, world, "megacomp DDP hook")
        pg = self.process_group
        ranks = list(range(world)) if pg is None else sorted(dist.get_process_group_ranks(pg))
        if self.groups is None:
            if ranks != list(range(world)):
                raise ValueError(f"megacomp DDP hook: process_group holds ranks {ranks} of the {world}, and building "
                                 f"its hops is a collective over every rank: pass groups=[...] (every group's global "
                                 f"ranks, the same list on every rank), or leave topology None (flat)")
            groups = [ranks]
        else:
            groups = [sorted(int(r) for r in g) for g in self.groups]
            if ranks not in groups:
                raise ValueError(f"megacomp DDP hook: process_group's ranks {ranks} are not one of groups {groups}; "
                                 f"list every group the job's hook states average over (this one included)")
        try:
            for g in groups:  # uneven groups: refused alike on every rank, before any new_group
                topo.hops(g)
        except ValueError as e:
            raise ValueError(f"megacomp DDP hook: {e}".replace("(--dp-collectives flat)", "(topology=None)")) from None
        return new_hierarchical_group(topo, groups, group=pg)

    def describe(self) -> str:
        """One line saying how the hook averages a compressed bucket: hop by hop (the hops, each hop's codec) or flat,
        and why (logged at INFO when the state is built with a topology)."""
        if self.hierarchy is not None:
            hops = " then ".join(f"{h.link.replace('_', '-')} ({len(h.ranks)} ranks)" for h in self.hierarchy.hops)
            codecs = ", ".join(f"{k.replace('_', '-')} {c}" for k, c in self.channel.hop_codecs.items())
            slow = self.hierarchy.slowest.replace("_", "-")
            return (f"megacomp DDP hook: buckets averaged hop by hop, {hops}, so the {slow} link carries each node's "
                    f"bytes once: {codecs}")
        if self.topology is None:
            return "megacomp DDP hook: buckets averaged flat over process_group (no topology given)"
        if self.channel.reduces_whole_buckets or self.channel.adaptive:
            why = (f"{type(self.channel).__name__} sees whole buckets: PowerSGD, Accordion and LGC run flat, each "
                   f"node's data crossing the slow link once per local rank")
        else:
            ranks = (list(range(self.topology.world)) if self.process_group is None
                     else dist.get_process_group_ranks(self.process_group))
            link = self.topology.slowest_link(ranks)
            why = ("the group stays inside one node" if link == "intra_node"
                   else "one rank of the group per node: nothing to combine first")
        return f"megacomp DDP hook: buckets averaged flat over process_group ({why})"

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
               "parameter_keys": self._kind(), "hops": self._hops()}
        if self.hierarchy is not None:
            out["hop_codecs"] = {link: c.to_dict() for link, c in self.channel.hop_codecs.items()}
        if self.channel.reduces_whole_buckets:  # Q matrices, regimes (the residuals above)
            out["low_rank"] = self.channel.state_dict(error_feedback=False)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the next iteration reduces in the saved layout (ddp_residuals). ValueError:
        saved with another codec, or with other hops (hop by hop vs flat, other hop sizes: the residuals' shapes
        differ). A state of the older index-keyed format: see ddp_residuals (one warning)."""
        if state["codec"] != self.codec.to_dict():
            raise ValueError(f"hook state was saved with codec {state['codec']}, this hook uses {self.codec.to_dict()}")
        saved_hops, hops = [tuple(h) for h in state.get("hops", [])], [tuple(h) for h in self._hops()]
        if saved_hops != hops:
            shown = lambda hs: " then ".join(f"{link} x{n}" for link, n in hs) if hs else "flat"  # noqa: E731
            raise ValueError(f"megacomp DDP hook: the state was saved {'hop by hop, ' if saved_hops else ''}"
                             f"{shown(saved_hops)}, this hook runs {'hop by hop, ' if hops else ''}{shown(hops)}; its "
                             f"residuals sit on other chunks: resume with the topology and process group it was "
                             f"saved with")
        mine = ({link: c.to_dict() for link, c in self.channel.hop_codecs.items()} if self.hierarchy is not None
                else None)
        if state.get("hop_codecs") != mine:
            raise ValueError(f"hook state was saved with per-hop codecs {state.get('hop_codecs')}, this hook uses "
                             f"{mine}")
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
        ``<bucket key>/<j>``, already one per parameter: not listed here.) ValueError hop by hop: a rank there keeps
        its node's residual on its chunk of each bucket, not per parameter (``state.error_feedback`` has them)."""
        return _parameter_residuals(self)

    def _hops(self) -> list:
        """[[link, subgroup size], ...] of the hops the channel runs (empty: flat), saved with the state."""
        return [[h.link, len(h.ranks)] for h in self.hierarchy.hops] if self.hierarchy is not None else []



def compressed_allreduce_hook(state: CompressedHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket.buffer()`` over the group with ``state.codec`` (state keyed by the
    bucket's parameters; the first iteration of a process or after a load is reduced at its last bucket).

    Flat (no ``state.topology``), a compressed bucket crosses the slow link once per rank of a node. With a topology
    (and a group of several ranks on each of several nodes) it runs hop by hop and crosses it once per node; the
    error is then that of quantizing each node's sum (per element at most the sum over nodes of the codec's bound on
    the node's sum), not each rank's gradient (module docstring)."""
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
    _drain(state)  # hop by hop: the previous bucket's finish, before this bucket's first collective
    if state.iteration > state.start_iter and state.layout and state.channel.compresses(buf.numel()):
        _move_into(state, key, entries)
    fut = _reduce(state, buf, key, shapes, bucket.index())
    if bucket.is_last():
        _drain(state)
        _adopt_layout(state, state._seen)
    return fut


def _run_deferred(state: CompressedHookState) -> None:
    """Reduce the deferred iteration: in the saved layout when it holds the same parameters as this DDP's buckets
    (gradients copied in and out), else bucket by bucket; then complete every bucket's future."""
    pending, state._pending, state._deferring = state._pending, [], False
    _drain(state)
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
            fut = _reduce(state, flat, key, [shapes[pkey] for pkey, _ in entries], i)
            _drain(state)
            fut.wait()
            pos = 0
            for pkey, n in entries:
                where[pkey].copy_(flat[pos:pos + n])
                pos += n
        state._seen = [(k, list(es)) for k, es in target]
    else:
        for i, ((buf, _, _), (key, entries, shp)) in enumerate(zip(pending, current)):
            if state.iteration > state.start_iter and state.layout and state.channel.compresses(buf.numel()):
                _move_into(state, key, entries)
            fut = _reduce(state, buf, key, shp, i)
            _drain(state)
            fut.wait()
        state._seen = [(k, es) for k, es, _ in current]
    _adopt_layout(state, state._seen)
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
    if state.channel.adaptive:  # Accordion, norm_of local: this rank's bucket before its reduction
        state.channel.observe_local(key, buf)
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
    elif state.hierarchy is not None and state.overlap:  # its finish issues fast-hop collectives: in this thread
        state._unfinished.append(([work], buf, fut))
    elif state.overlap and (world == 2 or use_duplex(state.process_group, channel.options.duplex, buf.device)):
        _finish_in_thread(work, buf, fut, index)
    else:
        _finish([work], buf, fut)
    return fut


def _drain(state: CompressedHookState) -> None:
    """Finish the hop-by-hop buckets issued so far (oldest first), in the hook's thread. Their finish all-gathers over
    the fast hop (a backend collective), which must not race the next bucket's collectives from another thread; run
    at the next bucket's hook call, the slow hop's transfer still overlaps the backward computation in between."""
    while state._unfinished:
        box, buf, fut = state._unfinished.pop(0)
        _finish(box, buf, fut)


def _param_views(buf: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Each parameter's gradient as a view of the bucket buffer (DDP lays them out back to back, in
    ``bucket.parameters()`` order; :meth:`CompressedHookState._bucket` checked that they fill it)."""
    views, pos = [], 0
    for s in shapes:
        n = s.numel()
        views.append(buf[pos:pos + n].view(s))
        pos += n
    return views


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

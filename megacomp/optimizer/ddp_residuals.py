"""How the DDP hook's state follows its parameters when DDP's buckets change: keys, layouts, where residuals sit.

Bucket keys follow the parameters, not the bucket index. torch DDP buckets a fresh model's first iteration in one
layout (its initial one) and rebuilds the buckets after it in gradient-ready order; another ``bucket_cap_mb`` gives
other buckets again. So megacomp.optimizer.ddp_hook keys each bucket's state ``ddp_bucket:<digest>:<numel>``, the
digest (sha1) of the bucket's parameter keys in bucket order: parameter names when the state was registered with
``CompressedHookState.register`` (``module.named_parameters()``), else ``param<n>``, ``n`` the parameter's position in
the first iteration this process sees (DDP's initial layout, read from its last bucket to its first: the order of
``module.parameters()`` for a model of one dtype). The state remembers the layout (:data:`Layout`: each bucket's key
and its parameters' keys and sizes) and saves it with the residuals. When the layout changes:
- resume (``load_state_dict``, or ``register`` on another DDP; done by ddp_hook): the first iteration is deferred to
  its last bucket and, when its buckets differ from the saved layout but hold the same parameters, the gradients are
  copied into the saved layout's buckets, reduced there (the same buffers, keys and residuals an uninterrupted run
  reduces) and copied back. A resumed run therefore continues bit for bit; the cost is one iteration without overlap
  and one copy of the gradients.
- a layout that differs for good (another ``bucket_cap_mb``, another model's parameter set): the state moves
  element-wise (this module, below).
- a state saved by megacomp before this scheme (keys ``ddp_bucket<i>:<numel>``, no saved layout) loads with its
  iteration count and the codec check, and its residuals (and PowerSGD Q) are dropped with one warning line: which
  elements an index-keyed residual belonged to cannot be told from the key (that is the flaw this scheme fixes).

Where residuals sit, flat (megacomp.comm.collectives):
- ``<bucket key>/worker``: this rank's worker error over the whole bucket, in bucket order (parameters back to back);
  ``CompressedHookState.parameter_residuals`` gives its per-parameter slices (:func:`_parameter_residuals`).
- ``<bucket key>/server`` (more than two ranks): this rank's shard of the bucket's server error, its chunk of every
  pipeline segment (:func:`_owned`); the group's ranks together hold the whole bucket's.
- PowerSGD (megacomp.comm.LowRankChannel): per matrix, ``<bucket key>/<j>`` for the bucket's j-th parameter: the
  residual (error feedback), the warm-start Q and the start-matrix draws (the channel's tables).
Hop by hop (megacomp.comm.hierarchical; the bucket padded to a multiple of the faster hops' sizes multiplied,
:func:`_padded`; m ranks of the group per node):
- ``<bucket key>/worker``: the slow hop's worker error on this rank's 1/m chunk of the padded bucket; the node's ranks
  together hold the node's residual.
- ``<bucket key>/server`` (more than two nodes): this rank's shard of that chunk's server error.
- ``<bucket key>@<link>/worker``: a lossy fast hop's worker error, on the part of the bucket that hop reduces.
Each has a block, the ranks whose residuals of that suffix tile one bucket (:func:`_hop_slots`): a node's ranks for the
slow hop's worker error, every rank for its server error, the rank alone for a fast hop's.

Moving. A new bucket gets state before its first compressed reduce (:func:`_move_into`, from the hook), and every
bucket of an iteration that has none gets it when the state adopts that iteration's layout (:func:`_adopt_layout`,
after the last bucket), which then drops the old buckets' keys. For each new bucket and residual suffix:
- flat worker error: its parameters' slices of the old buckets' worker errors, back to back (zeros for a parameter
  no old bucket held); its error-feedback step count is the largest of theirs (the periodic reset keeps its phase).
- flat server error: every rank all-gathers its shards once per move, so each rank rebuilds every old bucket's whole
  server error, assembles the new bucket's the same way and keeps its own shard of it.
- hop by hop: every rank all-gathers all its hops' residuals once per move; each rank rebuilds each old bucket's padded
  residual as its block holds it (each member's slots put back in place), assembles the new bucket's from the
  parameters' slices, pads it and keeps its own slots. So each element goes to the rank that now holds its slot,
  within its block.
- PowerSGD: each parameter's residual, Q and draws are renamed from ``<old bucket>/<i>`` to ``<new bucket>/<j>``.
  Accordion's regimes start over (critical) for new buckets; LGC's autoencoder is per whole bucket, so a new bucket
  trains its own.
Moved errors are stored as the ErrorFeedback stores them (int8/bf16 storage re-rounded). Every function takes the
hook's state (a CompressedHookState) explicitly; the caches it fills live on that state until it adopts a layout.

Failure behaviour: nothing here refuses a layout; a parameter no old bucket held starts at zero. A move over more than
two ranks (server errors) or hop by hop is an ``all_gather_object`` over the hook's process group, which every rank
reaches at the same bucket (DDP buckets alike on every rank); an error from it reaches DDP through the hook, as any
collective's does. :func:`_parameter_residuals` raises ValueError (one line) hop by hop, where a rank keeps a chunk
of each bucket's residual, not per-parameter ones.
"""
from typing import Optional

import torch
import torch.distributed as dist

from ..comm.common import split_sizes
from ..comm.transport import pipeline_segments

Layout = list  # [(bucket key, [(parameter key, numel), ...]), ...] in bucket index order


def _parameter_residuals(state) -> dict[str, torch.Tensor]:
    """Each parameter's flat worker residual (a slice of its bucket's) by parameter key, for the buckets of
    ``state.layout`` that hold one (CompressedHookState.parameter_residuals says more)."""
    out = {}
    ef = state.error_feedback
    if state.hierarchy is not None and ef is not None:
        raise ValueError("megacomp DDP hook: hop by hop each rank keeps its node's residual on its chunk of each "
                         "bucket (keys <bucket>/worker, <bucket>@<link>/worker), not per parameter; read "
                         "state.error_feedback instead")
    for key, entries in state.layout if ef is not None else ():
        e = ef.error(key + "/worker")
        if e is None:
            continue
        e, pos = e.reshape(-1), 0
        for pkey, n in entries:
            out[pkey] = e[pos:pos + n]
            pos += n
    return out


def _adopt_layout(state, seen: Layout) -> None:
    """Adopt this iteration's layout: move state into any bucket of it that has none, drop old buckets' keys."""
    if [k for k, _ in seen] == [k for k, _ in state.layout]:
        return
    if state.layout:
        for key, entries in seen:
            _move_into(state, key, entries)
        # only now: the moves above read the old buckets' state, and every new bucket has its own
        _drop(state.channel, state.error_feedback, {k for k, _ in state.layout} - {k for k, _ in seen})
    state._full_server = state._full_hops = None  # the gathered old errors belong to the layout just left
    state.layout = seen


def _homes(state) -> dict[str, tuple]:
    """Parameter key -> (bucket key, offset, position in bucket) in ``state.layout`` (cached per layout: the hook asks
    for every compressed bucket of every iteration)."""
    if state._homes_of is not None and state._homes_of[0] is state.layout:
        return state._homes_of[1]
    homes = {}
    for key, entries in state.layout:
        pos = 0
        for j, (pkey, n) in enumerate(entries):
            homes[pkey] = (key, pos, j)
            pos += n
    state._homes_of = (state.layout, homes)
    return homes


def _move_into(state, key: str, entries: list) -> None:
    """Give bucket ``key`` (parameters ``entries``) its parameters' state from ``state.layout``'s buckets,
    element-wise, if it has none (a no-op for a bucket of that layout). A collective over more than two ranks (server
    errors), and hop by hop."""
    if not state.layout or any(key == k for k, _ in state.layout):
        return
    homes, ef, channel = _homes(state), state.error_feedback, state.channel
    if channel.low_rank:  # per-matrix residual and Q: rename each parameter's
        if not _matrix_tables(channel):  # LGC: one autoencoder per whole bucket; a new bucket trains its own
            return
        for j, (pkey, _) in enumerate(entries):
            home = homes.get(pkey)
            if home is not None:
                _rename(channel, ef, f"{home[0]}/{home[2]}", f"{key}/{j}")
        return
    if ef is None:
        return
    if state.hierarchy is not None:
        _move_hops(state, key, entries, homes)
        return
    if key + "/worker" in ef.keys():
        return
    worker, steps = _assemble(ef, "/worker", entries, homes, lambda okey, e: e)  # each rank holds whole buckets'
    if steps:
        _store(ef, key + "/worker", worker, max(steps))
    world = dist.get_world_size(state.process_group)
    numel = sum(n for _, n in entries)
    if world > 2 and any(ef.error(k + "/server") is not None for k, _ in state.layout):
        full = _gather_server(state, world)
        server, steps = _assemble(ef, "/server", entries, homes, lambda okey, e: full[okey])
        if steps:
            own = _owned(numel, world, dist.get_rank(state.process_group), channel.options.segment_numel)
            _store(ef, key + "/server", server[own], max(steps))


def _move_hops(state, key: str, entries: list, homes: dict) -> None:
    """:func:`_move_into` hop by hop: each residual (per hop, on this rank's slots of the padded bucket,
    :func:`_hop_slots`) assembled from its parameters' elements of the old buckets' residuals of the same block. A
    collective (once per move) when old residuals exist."""
    ef = state.error_feedback
    numel = sum(n for _, n in entries)
    slots = _hop_slots(state, numel)
    if all(key + sfx in ef.keys() for sfx in slots) or not any(
            ef.error(k + sfx) is not None for k, _ in state.layout for sfx in slots):
        return
    full = _gather_hops(state)
    padded = _padded(state, numel)
    for sfx, (_, positions) in slots.items():
        if key + sfx in ef.keys():
            continue
        error, steps = _assemble(ef, sfx, entries, homes, lambda okey, e: full[okey, sfx])
        if steps:
            whole = torch.zeros(padded)  # the padding past the bucket's elements carries no error
            whole[:numel] = error
            _store(ef, key + sfx, whole[positions], max(steps))


def _padded(state, numel: int) -> int:
    """A bucket's length as the hop-by-hop all-reduce pads it: a multiple of the faster hops' sizes multiplied."""
    faster = 1
    for h in state.hierarchy.hops[:-1]:
        faster *= len(h.ranks)
    return -(-numel // faster) * faster


def _hop_slots(state, numel: int, index: Optional[list] = None) -> dict[str, tuple]:
    """Hop by hop, per residual suffix of a bucket of ``numel`` elements: (block, positions) of the rank whose index in
    its subgroup of each hop is ``index`` (default: this rank's). ``positions``: the elements of the padded bucket its
    residual covers, in its order (megacomp.comm.hierarchical: a lossy hop reduces the chunk the faster hops left it,
    the slow hop's server error is its shard of that chunk); ``block``: the ranks whose residuals of that suffix tile
    one bucket share it (their indices on that hop and the slower ones)."""
    hops = state.hierarchy.hops
    if index is None:
        me = dist.get_rank()
        index = [h.ranks.index(me) for h in hops]
    size, start, out = _padded(state, numel), 0, {}
    for j, h in enumerate(hops):
        last = j == len(hops) - 1
        if not state.channel.hop_codecs[h.link].is_identity:
            out["/worker" if last else f"@{h.link}/worker"] = (tuple(index[j:]), torch.arange(start, start + size))
            if last and len(h.ranks) > 2:
                seg = state.channel.options.segment_numel
                out["/server"] = ((), start + _owned(size, len(h.ranks), index[j], seg))
        if not last:
            size //= len(h.ranks)
            start += index[j] * size
    return out


def _gather_hops(state) -> dict[tuple, torch.Tensor]:
    """(old bucket key, suffix) -> the old bucket's residual over its whole padded length as this rank's block holds
    it (each member's slots put back in place), from every rank's residuals (all-gathered once per move: every new
    bucket may need slices of any old bucket)."""
    if state._full_hops is None:
        ef, me = state.error_feedback, dist.get_rank()
        index = [h.ranks.index(me) for h in state.hierarchy.hops]
        mine = {}
        for k, entries in state.layout:
            for sfx in _hop_slots(state, sum(n for _, n in entries)):
                e = ef.error(k + sfx)
                if e is not None:
                    mine[k, sfx] = e.reshape(-1).float().cpu()
        every = [None] * dist.get_world_size(state.process_group)
        # each rank's hop indices travel with its residuals: the receiver recomputes where they sit
        dist.all_gather_object(every, (index, mine), group=state.process_group)
        state._full_hops = {}
        for k, entries in state.layout:
            numel = sum(n for _, n in entries)
            for sfx, (block, _) in _hop_slots(state, numel).items():
                if (k, sfx) not in mine:
                    continue
                full = torch.zeros(_padded(state, numel))
                for theirs, errors in every:
                    their_block, positions = _hop_slots(state, numel, theirs)[sfx]
                    if their_block == block and (k, sfx) in errors:  # only the ranks that share this rank's residual
                        full[positions] = errors[k, sfx]
                state._full_hops[k, sfx] = full
    return state._full_hops


def _gather_server(state, world: int) -> dict[str, torch.Tensor]:
    """Every old bucket's full server error (each rank's shard put back in place), gathered from all ranks (once per
    move: every new bucket may need slices of any old bucket)."""
    if state._full_server is None:
        ef, mine = state.error_feedback, {}
        for k, entries in state.layout:
            e = ef.error(k + "/server")
            if e is not None:
                mine[k] = e.reshape(-1).float().cpu()
        every = [None] * world
        dist.all_gather_object(every, mine, group=state.process_group)
        state._full_server = {}
        for k, entries in state.layout:
            if all(k in r for r in every):
                numel = sum(n for _, n in entries)
                full = torch.zeros(numel)
                for r in range(world):
                    full[_owned(numel, world, r, state.channel.options.segment_numel)] = every[r][k]
                state._full_server[k] = full
    return state._full_server


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
    prefixes = tuple(k + sep for k in keys for sep in ("/", "@"))  # "@": a hop-by-hop fast hop's residual
    if ef is not None:
        for k in [k for k in ef.keys() if k.startswith(prefixes)]:
            ef.reset(k)
            ef.steps.pop(k, None)
    for table in _matrix_tables(channel):
        for k in [k for k in table if k.startswith(prefixes)]:
            del table[k]

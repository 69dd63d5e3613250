"""Resuming (or fine-tuning from) a checkpoint written at another TP x PP x DP layout.

What a checkpoint records (at save, by :func:`layout_entries`): per rank one small ``layout/rank<r>`` entry, a
JSON string, with the rank's coordinates ``[pp, tp, dp]`` and the sizes of the layout; the first DP rank of each
(stage, TP rank) also records its model entry's map (local name -> global name, global shape, TP split dim) and,
for the ZeRO optimizer (megacomp.optimizer.DistributedOptimizer), its flat buckets: per bucket the padded
length, whether it is compressed, the inner optimizer's state index and the (global name, offset, numel, local
shape) of each parameter in it; a DP rank's shard of a bucket is the equal slice ``[d P / D, (d + 1) P / D)``.
Global names count layers over the whole model (``layers.<global index>.*``); the last stage's tied copy of the
word embedding (``output_weight``) is the global ``word_embeddings.weight``.

Loading at another layout (:func:`load_resharded`, called by megacomp.training.checkpoint when the TP, PP,
virtual-stage or world size differs): every rank reads, through the same safe reader as a plain load (DCP
``.metadata`` under the allow-list, entries with ``torch.load(weights_only=True)``), the saved entries that
hold any parameter of its new stage: the model tensors of the lowest saved stage holding each parameter (all of
its TP pieces), and of the optimizer the buckets holding them on every saved DP rank (masters, per-element
state such as Adam's moments, error-feedback residuals). Memory: per rank, the saved fp32 masters, moments and
DP residuals of every parameter of its new stage, i.e. about (3 + D_saved) x 4 bytes x the stage's parameters
(whole, not TP-sliced) on top of the run's own state; a small model reads everything. It assembles each global
tensor (TP pieces concatenated along the split dim; a bucket's DP shards concatenated, then cut per parameter)
and keeps this rank's slice of the new layout.

Exactness: the model, fp32 masters, per-element optimizer state and step counters move bit for bit (a slice of a
concatenation copies values). The continuation is bit-identical to the uninterrupted run only when the
arithmetic is unchanged; a different TP size changes how matmuls are split and summed, a different DP size the
order of the gradient sum over ranks and micro-batches, a different PP size only the order of the tied
embedding's two gradient terms and of the gradient-norm sum: those continue within fp32 round-off, which Adam's
normalised update can amplify on elements whose gradient is near zero.

Error feedback (the residual a lossy codec still owes the next message):
* DP gradient residuals (a flat exchange keeps one per DP rank over the whole bucket, the input of the
  compressed reduce-scatter; a hop-by-hop one (megacomp.comm.hierarchical) keeps one per lossy hop, on the chunks
  that hop's input covers, e.g. the slow hop's on the node's chunk this rank sends). Same DP size, flat at both
  layouts: each DP rank's residual moves, element by element, into its new buckets (exact). Otherwise the saved
  residuals of every rank and hop are summed per element (``E``: the next reduction owed ``E / D_saved``, as it
  sums every residual, then divides by the DP size) and spread evenly over the ranks holding each element at the
  new layout: flat, every DP rank starts from ``E / D_saved``, the mean, within the bound each residual had; hop by
  hop, the ``share`` ranks holding an element on the slowest lossy hop (one per node) get ``E x D_new / (D_saved x
  share)``, m x the mean, the scale of the node sums that hop compresses. Either way ``sum_new / D_new = E /
  D_saved``: the next reduction owes exactly what the saved ranks owed, up to one scaling's round-off.
  int8-stored residuals and the two-level (hierarchy) layout are reset instead, as are the unsharded all-reduce's
  server residuals; PowerSGD / Accordion state (per-matrix Q and residuals) starts fresh, as at step 0.
* TP-backward and pipeline-gradient residuals (per layer and activation shape of the saved layout) are reset,
  and stochastic-rounding streams restart from their seeds.
A reset is safe: a residual only carries the compression error of the last message into the next one; without
it the next message has the codec's plain error bound, as at the start of a run (a skipped step resets the DP
residuals the same way). Every reset is said in the banner (the notes :func:`load_resharded` returns).

Refused (ValueError, one line naming the fix): a checkpoint without layout entries (written before them), an
optimizer other than the ZeRO AdamW family's DistributedOptimizer, the two-level DP hierarchy, outer-loop
replicas, AQ-SGD caches and other per-rank family state, parameters whose names the map does not know.
"""
from __future__ import annotations

import io
import json
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.metadata as dcp_md

LAYOUT_VERSION = 1
"""Version of the ``layout/rank<r>`` entries this module writes and reads."""
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "num_layers_per_virtual_pipeline_stage", "world_size")
"""The run_info fields whose change makes a resume reshard (instead of loading each rank's own entries)."""
_PLAIN_EXTRA = ("rng", "cuda_rng", "channels", "guard", "evaluation")  # per-rank state that needs no layout


def layout_changed(saved: dict, run_info: dict) -> bool:
    """Whether the checkpoint's recorded layout (``saved``: its megacomp.json) differs from this run's."""
    return any(saved.get(k) != run_info.get(k) for k in LAYOUT_FIELDS)


def describe(info: dict) -> str:
    """``TP t x PP p x DP d (world w)`` of a run_info / megacomp.json dict."""
    tp, pp, world = (info.get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size"))
    dp = world // (tp * pp) if isinstance(world, int) and isinstance(tp, int) and isinstance(pp, int) else "?"
    vpp = info.get("num_layers_per_virtual_pipeline_stage")
    return f"TP {tp} x PP {pp} x DP {dp} (world {world}{f', {vpp} layers per virtual stage' if vpp else ''})"


# -- the map, written at save ------------------------------------------------------------------------
def _stages(model) -> list[tuple[str, Any]]:
    """(state_dict prefix, GPTModel) of each chunk this rank holds (one unless interleaved)."""
    return [(f"chunks.{v}.", c) for v, c in enumerate(model.chunks)] if hasattr(model, "chunks") else [("", model)]


def global_names(model) -> dict[str, tuple[str, Optional[int]]]:
    """local parameter name -> (global name, TP split dim or None for a replicated parameter). A module that is not
    a GPT stage (no ``layer_range``) keeps its names."""
    out = {}
    for prefix, stage in _stages(model):
        start = stage.layer_range.start if hasattr(stage, "layer_range") else None
        for name, p in stage.named_parameters():
            if start is not None and name.startswith("layers."):
                index, rest = name[len("layers."):].split(".", 1)
                glob = f"layers.{start + int(index)}.{rest}"
            elif name == "output_weight":  # the last stage's copy of the tied word embedding
                glob = "word_embeddings.weight"
            else:
                glob = name
            out[prefix + name] = (glob, p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
    return out


def _optimizer_map(model, optimizer) -> Optional[dict]:
    from ..optimizer.distributed_optimizer import DistributedOptimizer

    if type(optimizer) is not DistributedOptimizer:
        return None
    names = global_names(model)
    by_id = {id(p): names[n][0] for n, p in model.named_parameters()}
    if any(id(p) not in by_id for b in optimizer.buckets for p in b.params):  # not the model's: nothing to map
        return None
    order = {id(m): k for k, m in enumerate(p for g in optimizer.optimizer.param_groups for p in g["params"])}
    buckets = [{"padded": b.padded, "compressed": b.compressed, "state": order[id(m)], "group": b.group,
                "params": [[by_id[id(p)], off, p.numel(), list(p.shape)] for p, off in zip(b.params, b.offsets)]}
               for b, m in zip(optimizer.buckets, optimizer.masters)]
    hier = getattr(optimizer.grad_channel, "hierarchy", None)  # a hop-by-hop exchange: where its residuals sit
    return {"dp_size": optimizer.world, "sharded": optimizer.sharded, "hierarchy": optimizer.hierarchy is not None,
            "dp_hops": [[h.link, len(h.ranks)] for h in hier.hops] if hier is not None else [],
            "dp_positions": list(hier.positions) if hier is not None else None, "buckets": buckets}


def layout_entries(model, optimizer, groups, where: str) -> dict[str, str]:
    """This rank's ``layout/rank<r>`` entry (a JSON string) for the checkpoint (see the module docstring)."""
    entry: dict[str, Any] = {"version": LAYOUT_VERSION, "coords": [groups.pp_rank, groups.tp_rank, groups.dp_rank],
                             "sizes": [groups.pp_size, groups.tp_size, groups.dp_size], "entry": where}
    if groups.dp_rank == 0:
        tp = groups.tp_size
        params = dict(model.named_parameters())
        entry["model"] = {n: [g, dim, [s * (tp if i == dim else 1) for i, s in enumerate(params[n].shape)]]
                          for n, (g, dim) in global_names(model).items()}
        entry["optim"] = _optimizer_map(model, optimizer)
    return {f"layout/rank{dist.get_rank()}": json.dumps(entry, sort_keys=True)}


# -- reading ----------------------------------------------------------------------------------------
def _refuse(path: str, saved: dict, run_info: dict, why: str) -> ValueError:
    return ValueError(f"checkpoint {path} was written at {describe(saved)} and this run is {describe(run_info)}: "
                      f"{why}")


def _read(metadata: dcp_md.Metadata, keys: list[str], load) -> dict[str, Any]:
    """The entries ``keys`` of the checkpoint (a collective: every rank calls it, each with its own keys):
    ``load(template)`` fills a flat template with the checkpoint's safe reader (megacomp.training.checkpoint)."""
    state: dict[str, Any] = {}
    for k in keys:
        md = metadata.state_dict_metadata[k]
        state[k] = (torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, dcp_md.TensorStorageMetadata)
                    else b"")
    load(state)
    return state


def _json(value) -> Any:
    if isinstance(value, (bytes, bytearray)):
        value = torch.load(io.BytesIO(value), weights_only=True)
    return json.loads(value)


class _Saved:
    """The saved layout (from the ``layout/rank<r>`` entries) and lookups into it."""

    def __init__(self, entries: dict[str, Any]) -> None:
        self.ranks = {}
        self.maps: dict[str, dict] = {}  # model entry ("pp0_tp1") -> its map (dp rank 0's entry)
        for key, raw in entries.items():
            e = _json(raw)
            if e.get("version") != LAYOUT_VERSION:
                raise ValueError(f"layout entry version {e.get('version')}, this megacomp reads {LAYOUT_VERSION}")
            self.ranks[int(key[len("layout/rank"):])] = e
            if "model" in e:
                self.maps[e["entry"]] = e
        first = self.ranks[0]
        self.pp_size, self.tp_size, self.dp_size = first["sizes"]
        # global name -> [(pp, tp, entry, local name, split dim, global shape)]
        self.holders: dict[str, list] = {}
        for where, e in sorted(self.maps.items(), key=lambda kv: tuple(kv[1]["coords"])):
            pp, tp, _ = e["coords"]
            for local, (glob, dim, shape) in e["model"].items():
                self.holders.setdefault(glob, []).append((pp, tp, where, local, dim, shape))

    def sources(self, glob: str) -> list:
        """The TP pieces of ``glob`` from the lowest stage holding it, in TP order (one piece if replicated)."""
        held = self.holders.get(glob)
        if not held:
            raise KeyError(glob)
        pp = min(h[0] for h in held)
        pieces = sorted((h for h in held if h[0] == pp), key=lambda h: h[1])
        return pieces if pieces[0][4] is not None else pieces[:1]

    def rank_at(self, coords: list) -> int:
        """The saved rank at ``coords`` ([pp, tp, dp]), or rank 0 when the saved layout has none there."""
        return next((r for r, e in sorted(self.ranks.items()) if e["coords"] == coords), 0)


def _assemble(pieces: list[torch.Tensor], dim: Optional[int]) -> torch.Tensor:
    return pieces[0] if dim is None else torch.cat(pieces, dim=dim)


def _my_slice(full: torch.Tensor, dim: Optional[int], tp_rank: int, tp_size: int) -> torch.Tensor:
    return full if dim is None else full.chunk(tp_size, dim=dim)[tp_rank]


def load_resharded(path: str, metadata: dcp_md.Metadata, saved: dict, run_info: dict, model, optimizer, groups,
                   load, weights_only: bool = False) -> tuple[Optional[dict], list[str]]:
    """Load the checkpoint at ``path`` (written at another layout) into this rank's ``model`` and ``optimizer``
    (see the module docstring); a collective. ``weights_only`` (fine-tuning): the model only. Returns (the
    per-rank ``extra`` state to resume with, None when ``weights_only``; the banner notes). Raises ValueError
    naming what cannot be resharded. ``load(template)``: fills a flat {key: tensor or placeholder} template from
    the checkpoint with the safe reader, raising the one-line error of a broken file (megacomp.training.checkpoint
    passes it, so this module reads nothing by itself)."""
    md_keys = metadata.state_dict_metadata
    layout_keys = sorted(k for k in md_keys if k.startswith("layout/rank"))
    if not layout_keys:
        raise _refuse(path, saved, run_info, "it has no layout map (written before megacomp recorded one), so it "
                                             "cannot be resharded; resume at the saved layout")
    where = f"pp{groups.pp_rank}_tp{groups.tp_rank}"
    old = _Saved(_read(metadata, layout_keys, load))
    names = global_names(model)
    params = dict(model.named_parameters())
    extra_keys = set(model.state_dict()) - set(names)
    if extra_keys:
        raise _refuse(path, saved, run_info, f"this run's model holds state the layout map does not cover "
                                             f"({sorted(extra_keys)[:3]}); resume at the saved layout")
    missing = sorted({g for g, _ in names.values() if g not in old.holders})
    if missing:
        raise _refuse(path, saved, run_info, f"the checkpoint has no parameter {missing[0]} (another model or "
                                             f"training family); resume at the saved layout")
    use_opt = not weights_only
    if use_opt:
        _check_optimizer(path, saved, run_info, optimizer, old)
    # which saved entries this rank reads
    keys = set()
    for glob, _ in set(names.values()):
        for _, _, entry, local, _, _ in old.sources(glob):
            keys.add(f"model/{entry}.{local}")
    plan = _optimizer_reads(old, names, md_keys) if use_opt else {}
    keys.update(k for ks in plan.values() for k in ks)
    src = old.rank_at([groups.pp_rank, groups.tp_rank, groups.dp_rank])
    first = next(iter(sorted(old.maps)))
    counters = [f"optim/{first}.dp_rank_0.{k}" for k in ("step", "skipped")]
    if use_opt:
        keys.update(counters)
        keys.update(k for k in md_keys if k.startswith(f"optim/{first}.dp_rank_0.loss_scaler")
                    or k.startswith(f"optim/{first}.dp_rank_0.error_feedback.steps."))
        keys.add(f"extra/rank{src}")
    got = _read(metadata, sorted(keys), load)

    state = {}
    for local, (glob, dim) in names.items():
        srcs = old.sources(glob)
        full = _assemble([got[f"model/{e}.{loc}"] for _, _, e, loc, _, _ in srcs], srcs[0][4])
        state[local] = _my_slice(full, dim, groups.tp_rank, groups.tp_size).to(params[local].dtype)
    model.load_state_dict(state)
    notes = [f"resharded {path} from {describe(saved)} to {describe(run_info)}: model"
             + ("" if weights_only else ", fp32 masters, optimizer state and step counters") + " moved exactly"]
    if weights_only:
        return None, notes
    local_of = {id(p): n for n, p in model.named_parameters()}
    notes += _load_optimizer(optimizer, old, names, local_of, got, groups, first)
    extra = got[f"extra/rank{src}"]
    if isinstance(extra, (bytes, bytearray)):
        extra = torch.load(io.BytesIO(extra), weights_only=True)
    other = sorted(k for k, v in extra.items() if k not in _PLAIN_EXTRA and v is not None)
    if other:
        raise _refuse(path, saved, run_info, f"its {', '.join(other)} state is per rank of the saved layout and "
                                             f"cannot be resharded; resume at the saved layout")
    extra["channels"], reset = _fresh_channels(extra.get("channels") or {})
    if reset:
        notes.append(f"{' and '.join(reset)} reset: they are per layer and activation shape of the saved layout; a "
                     f"reset only drops the last message's compression error, the next message has the codec's plain "
                     f"bound, as at the start of a run")
    return extra, notes


def _check_optimizer(path, saved, run_info, optimizer, old: _Saved) -> None:
    from ..optimizer.distributed_optimizer import DistributedOptimizer

    if type(optimizer) is not DistributedOptimizer:
        raise _refuse(path, saved, run_info, f"resharding covers the ZeRO AdamW family's sharded optimizer, this "
                                             f"run's is {type(optimizer).__name__}; resume at the saved layout "
                                             f"(or fine-tune from its weights with --finetune)")
    if any(e["optim"] is None for e in old.maps.values()):
        raise _refuse(path, saved, run_info, "its optimizer is not the ZeRO AdamW family's sharded optimizer; resume "
                                             "at the saved layout (or fine-tune from its weights with --finetune)")
    if optimizer.hierarchy is not None or any(e["optim"]["hierarchy"] for e in old.maps.values()):
        raise _refuse(path, saved, run_info, "the two-level (intra/inter-node) optimizer layout is not resharded; "
                                             "resume at the saved layout")


def _optimizer_reads(old: _Saved, names: dict, md_keys) -> dict[tuple, list[str]]:
    """(entry, bucket index) -> the saved keys (every DP rank's) of the buckets holding this rank's parameters."""
    wanted = {g for g, _ in names.values()}
    plan: dict[tuple, list[str]] = {}
    for glob in wanted:
        for _, _, entry, _, _, _ in old.sources(glob):
            opt = old.maps[entry]["optim"]
            for i, b in enumerate(opt["buckets"]):
                if (entry, i) in plan or not any(p[0] == glob for p in b["params"]):
                    continue
                ranks = range(opt["dp_size"]) if opt["sharded"] else range(1)
                ks = []
                for d in ranks:
                    prefix = f"optim/{entry}.dp_rank_{d}."
                    ks.append(f"{prefix}masters.{i}")
                    ks += [k for k in md_keys if k.startswith(f"{prefix}optimizer.state.{b['state']}.")]
                for d in range(opt["dp_size"]):
                    ks += [k for k in (_residual_key(entry, d, i, opt, h) for h in range(len(_hops(opt))))
                           if k in md_keys]
                plan[(entry, i)] = ks
    return plan


def _flat(got: dict, opt: dict, entry: str, i: int, kind: str) -> Optional[torch.Tensor]:
    """Bucket ``i`` of ``entry`` as one flat tensor: ``kind`` 'masters' or an inner-state name (DP shards
    concatenated), or None when a shard lacks it."""
    b = opt["buckets"][i]
    ranks = range(opt["dp_size"]) if opt["sharded"] else range(1)
    key = (lambda d: f"optim/{entry}.dp_rank_{d}.masters.{i}") if kind == "masters" else \
        (lambda d: f"optim/{entry}.dp_rank_{d}.optimizer.state.{b['state']}.{kind}")
    if any(key(d) not in got for d in ranks):
        return None
    return torch.cat([got[key(d)].reshape(-1) for d in ranks])


def _global(old: _Saved, got: dict, glob: str, flat_of) -> Optional[torch.Tensor]:
    """The global tensor ``glob`` assembled from flat buckets: ``flat_of(entry, bucket index)`` -> tensor or None."""
    srcs = old.sources(glob)
    pieces = []
    for _, _, entry, _, dim, _ in srcs:
        opt = old.maps[entry]["optim"]
        for i, b in enumerate(opt["buckets"]):
            hit = next((p for p in b["params"] if p[0] == glob), None)
            if hit is not None:
                flat = flat_of(entry, i)
                if flat is None:
                    return None
                pieces.append(flat[hit[1]:hit[1] + hit[2]].view(hit[3]))
                break
    return _assemble(pieces, srcs[0][4])


def _load_optimizer(optimizer, old: _Saved, names: dict, local_of: dict, got: dict, groups, first: str) -> list[str]:
    """Fill this rank's shards of the new buckets from the saved global state; returns the banner notes."""
    cache: dict[tuple, Optional[torch.Tensor]] = {}

    def flat(kind):
        def of(entry, i):
            if (entry, i, kind) not in cache:
                cache[(entry, i, kind)] = _flat(got, old.maps[entry]["optim"], entry, i, kind)
            return cache[(entry, i, kind)]
        return of

    # a state tensor shaped like the master is per element (Adam's moments), a 0-d one shared (Adam's step)
    per_element, scalars = [], {}
    for key, v in sorted(got.items()):
        if ".optimizer.state." in key:
            name = key.rsplit(".", 1)[1]
            if v.dim() == 0:
                scalars.setdefault(name, v)
            elif name not in per_element:
                per_element.append(name)
    masters, inner = [], []
    rank, parts = optimizer.shard_index, optimizer.parts
    for b in optimizer.buckets:
        lo, hi = b.shard_range(rank, parts)
        fills = {kind: torch.zeros(b.padded, dtype=torch.float32) for kind in ["masters", *per_element]}
        for p, off in zip(b.params, b.offsets):
            glob, dim = names[local_of[id(p)]]
            for kind, buf in fills.items():
                full = _global(old, got, glob, flat(kind))
                if full is None:
                    raise ValueError(f"the checkpoint's optimizer holds no {kind} for {glob}; resume at the saved "
                                     f"layout")
                buf[off:off + p.numel()] = _my_slice(full, dim, groups.tp_rank, groups.tp_size).reshape(-1)
        masters.append(fills.pop("masters")[lo:hi].clone())
        inner.append({**{k: v[lo:hi].clone() for k, v in fills.items()}, **{k: v.clone() for k, v in scalars.items()}})
    prefix = f"optim/{first}.dp_rank_0."
    scaler = {k[len(prefix + "loss_scaler."):]: v for k, v in got.items() if k.startswith(prefix + "loss_scaler.")}
    errors, steps, notes = _dp_errors(optimizer, old, names, got, local_of, groups)
    optimizer.load_resharded(masters, inner, int(got[prefix + "step"]), int(got[prefix + "skipped"]), scaler or None,
                             errors, steps)
    return notes


def _hops(opt: dict) -> list:
    """A saved DP exchange's hops, fastest first, as [link, size] (a flat exchange: one hop over the DP size)."""
    return opt.get("dp_hops") or [["flat", opt["dp_size"]]]


def _residual_key(entry: str, d: int, i: int, opt: dict, hop: int) -> str:
    """The checkpoint key of saved DP rank ``d``'s residual of bucket ``i`` on hop ``hop`` (the slowest hop keeps
    a flat exchange's key; a faster one adds ``@<link>``: megacomp.comm.hierarchical)."""
    hops = _hops(opt)
    link = "" if hop == len(hops) - 1 else f"@{hops[hop][0]}"
    return f"optim/{entry}.dp_rank_{d}.error_feedback.errors.dp_gradient/b{i}{link}/worker"


def _owed(got: dict, opt: dict, entry: str, i: int, ranks=None) -> torch.Tensor:
    """Bucket ``i`` of ``entry`` (padded, flat, torch's order): the sum over the saved DP ``ranks`` (None: all) of
    every hop's residual, each added at the chunks it covers (megacomp.comm.hop_groups.residual_chunks); over all
    ranks, DP x what the next reduction owed (it sums every hop's residuals, then divides by the DP size)."""
    from ..comm.hop_groups import residual_chunks

    padded, hops, dp = opt["buckets"][i]["padded"], _hops(opt), opt["dp_size"]
    positions, sizes = opt.get("dp_positions") or list(range(dp)), [size for _, size in hops]
    chunk = padded // dp
    out = torch.zeros(padded, dtype=torch.float32)
    for d in range(dp) if ranks is None else ranks:
        for h in range(len(hops)):
            e = got.get(_residual_key(entry, d, i, opt, h))
            if e is None:  # an uncompressed bucket or hop
                continue
            e = e.float().reshape(-1)
            for k, g in enumerate(residual_chunks(positions, sizes, h, d)[0]):
                out[g * chunk:(g + 1) * chunk] += e[k * chunk:(k + 1) * chunk]
    return out


def _dp_errors(optimizer, old: _Saved, names, got, local_of, groups):
    """This rank's DP-gradient residual per new compressed bucket (or None: reset), their step counts, notes.

    The saved residuals (every hop's, on the chunks each covers) are summed per element over the saved DP ranks:
    ``E``, and the next reduction owed ``E / D_saved``. At the new layout each element's residual sits on one hop
    (the slowest lossy one) and ``share`` ranks hold it (all D_new ranks flat; one per node on the inter-node hop);
    each of them gets ``E x D_new / (D_saved x share)``, so their sum over D_new again owes ``E / D_saved`` (up to
    the round-off of one scaling). Flat at both layouts that is the mean of the saved residuals, within the bound
    each had; on a hop-by-hop exchange, whose slow hop compresses a node's sum of m ranks, it is m x that mean, the
    scale of the node sums it corrects. At the same DP size, flat at both layouts, each rank's residual moves as is.
    """
    ef = optimizer.ef
    if ef is None:
        return None, None, []
    channel = optimizer.grad_channel
    hier = getattr(channel, "hierarchy", None)
    why = None
    if ef.config.storage == "int8":
        why = "they are stored as int8 blocks of the saved buckets"
    elif channel.reduces_whole_buckets:
        why = "PowerSGD / Accordion state is per matrix of the saved layout"
    elif not optimizer.sharded and optimizer.world > 2:
        why = "the unsharded all-reduce's server residuals are per chunk of the saved DP size"
    elif any(e["optim"].get("hops") and "dp_hops" not in e["optim"] for e in old.maps.values()):
        why = "the checkpoint predates the record of where hop-by-hop residuals sit"
    if why:
        return None, None, [f"DP gradient error feedback reset ({why}): a reset only drops the last reduction's "
                            f"compression error, as a skipped step does"]
    old_dp, new_dp = old.dp_size, groups.dp_size
    flat_saved = not any(e["optim"].get("dp_hops") for e in old.maps.values())
    exact = flat_saved and hier is None and old_dp == new_dp
    if hier is None:
        key_of, chunks, share = (lambda b: f"dp_gradient/b{b.index}/worker"), list(range(new_dp)), new_dp
    else:
        link = [h.link for h in hier.hops if not channel.hop_codecs[h.link].is_identity][-1]
        chunks, share = channel.residual_chunks(link)
        key_of = lambda b: channel.residual_key(f"dp_gradient/b{b.index}", link)  # noqa: E731
    cache: dict = {}

    def owed(entry, i):
        if (entry, i) not in cache:
            cache[(entry, i)] = _owed(got, old.maps[entry]["optim"], entry, i, [groups.dp_rank] if exact else None)
        return cache[(entry, i)]

    scale = 1.0 if exact else new_dp / (old_dp * share)
    errors, steps = {}, {}
    step_keys = [k for k in got if ".error_feedback.steps." in k]
    count = int(got[step_keys[0]]) if step_keys else 0
    dtype = torch.bfloat16 if ef.config.storage == "bf16" else torch.float32
    for b in optimizer.buckets:
        if not b.compressed:
            continue
        total = torch.zeros(b.padded, dtype=torch.float32)
        for p, off in zip(b.params, b.offsets):
            glob, dim = names[local_of[id(p)]]
            total[off:off + p.numel()] = _my_slice(_global(old, got, glob, owed), dim, groups.tp_rank,
                                                   groups.tp_size).reshape(-1)
        chunk = b.padded // new_dp
        mine = torch.cat([total[g * chunk:(g + 1) * chunk] for g in chunks])
        errors[key_of(b)] = (mine if scale == 1.0 else mine * scale).to(dtype)
        steps[key_of(b)] = count
    if exact:
        note = "DP gradient error feedback: each DP rank's residual moved into its new buckets exactly"
    else:
        where = (f"over the {link} hop's residuals (each element held by {share} of the {new_dp} DP ranks)"
                 if hier is not None else f"over the {new_dp} DP ranks")
        note = (f"DP gradient error feedback: the residuals of the {old_dp} saved DP ranks"
                f"{' (every hop, on the chunks each covered)' if not flat_saved else ''} summed and spread {where} "
                f"(the next reduction owes sum/DP: the same total as saved, within one scaling's round-off)")
    return errors, steps, [note]


def _fresh_channels(state: dict) -> tuple[dict, list[str]]:
    """The saved channel states with error feedback emptied and stochastic streams dropped (the channels keep
    their fresh ones); the names of what held something."""
    out, reset = {}, []
    for path, s in state.items():
        s = dict(s)
        s.pop("hop_codecs", None)  # the saved layout's hops; the new layout may cross others (flat or hop by hop)
        ef = s.get("error_feedback")
        if ef is not None:
            if ef.get("errors"):
                reset.append(f"{path} error feedback")
            s["error_feedback"] = {**ef, "errors": {}, "steps": {}, "dropped": {}}
        if s.get("generator") is not None:
            reset.append(f"{path} stochastic-rounding stream")
            s["generator"] = None
        unknown = set(s) - {"codec", "generator", "error_feedback"}
        if unknown:
            raise ValueError(f"the {path} channel's {sorted(unknown)} state is per rank of the saved layout and cannot "
                             f"be resharded; resume at the saved layout")
        out[path] = s
    return out, reset

"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, safe to load, and checked on resume.

Layout of ``SAVE/``:
    iter_0000100/            a DCP checkpoint (every rank writes its shards) + megacomp.json (the run's config)
    latest_checkpointed_iteration.txt
    iter_0000101.diverged/   set aside by a run that diverged right after writing it
                             (megacomp.training.checkpoint_paths.discard_checkpoint); never resumed, pruned or
                             offered as a fallback

Contents: the model (keys per pipeline stage and TP rank, so DP replicas deduplicate), the sharded
optimizer (masters, AdamW state, DP-gradient error feedback, counters; keys per stage, TP and DP rank),
and per rank one ``extra`` entry with the RNG state and the state of every traffic channel (TP-backward
and pipeline-gradient error feedback, seeded stochastic-rounding streams).

Format versions (``format_version`` in megacomp.json): 1 (no field) stored error feedback per TP layer and
per pipeline communicator and the stochastic streams in a process-wide table; 2 stores them per channel.
A checkpoint of another version is refused with a message naming both versions. A write goes to ``iter_N.tmp`` and is renamed when every rank is done, and only then does the
``latest`` file (itself replaced atomically) point at it: a run killed while saving keeps its last good
checkpoint. Loading refuses a checkpoint whose model shape, codecs or data order differ, naming the fields;
one written at another parallel layout (TP, PP, DP, world size) is resharded (megacomp.training.reshard).

Integrity: every file's SHA-256 is in the manifest (megacomp.training.checkpoint_integrity); a resume verifies
them first (:func:`verify_checkpoint`, :func:`select_checkpoint`). Safe reading (no code from the directory runs)
and the per-file checks: megacomp.training.checkpoint_reader.
"""
from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint.api import CheckpointException

from . import checkpoint_integrity as integrity
from .checkpoint_reader import METADATA_GLOBALS, read_metadata  # noqa: F401 -- part of this module's interface
from .checkpoint_reader import SafeFileSystemReader, SafeLoadPlanner, _check_iteration, _short, _Unreadable
from . import reshard

LATEST = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 2
"""Version of the checkpoint layout this code writes and reads (see the module docstring)."""
MUST_MATCH = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size",
              "sequence_parallel", "params_dtype", "compression_resolved")
"""Fields a resume must share with the checkpoint. The parallel layout (TP, PP, virtual stages, world size:
megacomp.training.reshard.LAYOUT_FIELDS) may differ: the checkpoint is then resharded."""
DATA_ORDER = ("seed", "data_path", "dataset_samples", "global_batch_size", "tokenizer_max_bytes", "split",
              "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "json_keys")
"""Fields that change which samples a resumed iteration sees: a resume refuses a change unless
``allow_data_order_change`` (``--allow-data-order-change``) is set."""
_ITER_DIR = re.compile(r"iter_(\d+)$")


def verify_checkpoint(path: str) -> tuple[dict, dcp_md.Metadata]:
    """The structural checks of :func:`_check_iteration`, then the files' SHA-256 digests against the manifest,
    the ranks hashing a share each (a collective: every rank calls it). Returns (manifest, DCP index); raises
    _Unreadable naming the first bad file, on every rank alike."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = md = None
    try:
        saved, md = _check_iteration(path)
        mine = integrity.verify_share(path, saved, rank, world)
    except _Unreadable as e:
        mine = (e.path, e.reason, e.refused)
    bad = next((b for b in _agree(mine) if b), None)
    if bad:
        raise _Unreadable(*bad)
    return saved, md


def select_checkpoint(root: str, fallback: bool = False, iteration: Optional[int] = None) -> tuple[int, Optional[str]]:
    """The iteration to resume from under ``root`` and, when it is not the latest, why (a collective).

    The latest checkpoint is verified (:func:`verify_checkpoint`); iter_N directories without a latest file
    count as an unusable latest file. When it fails, the newest older one that verifies is found; with
    ``fallback`` (``--load-fallback``) it is chosen and the note says what was skipped and why; without,
    ValueError names the bad file and that checkpoint. FileNotFoundError: no checkpoint at all. ``iteration``:
    the one the user named (``--load ROOT/iter_N``), verified alone: ValueError when it fails."""
    if iteration is not None:
        try:
            verify_checkpoint(_iter_dir(root, iteration))
            return iteration, None
        except _Unreadable as e:
            raise ValueError(f"{e}; --load named this checkpoint: name another iteration directory, or --load {root} "
                             f"to resume from the latest that verifies") from None
    try:
        latest = latest_iteration(root)
        unusable = None
    except ValueError as e:  # an unreadable latest file: every complete iteration is a candidate
        latest, unusable = None, e
    if latest is None and unusable is None:
        if not _iterations(root):
            raise FileNotFoundError(f"no checkpoint in {root!r} ({LATEST} missing); check --load or drop it to start fresh")
        # iter_N directories without the latest file (removed, or a first save killed between the two renames)
        unusable = _Unreadable(os.path.join(root, LATEST), "missing, although there are iter_* checkpoints")
    if latest is not None:
        try:
            verify_checkpoint(_iter_dir(root, latest))
            return latest, None
        except _Unreadable as e:
            unusable = e
    found = None
    for it in reversed(_iterations(root)):
        if latest is not None and it >= latest:
            continue
        try:
            verify_checkpoint(_iter_dir(root, it))
        except _Unreadable:
            continue
        found = it
        break
    if found is not None and fallback:
        return found, f"{unusable}; resuming from iteration {found} ({_iter_dir(root, found)}) instead (--load-fallback)"
    if found is not None:
        move = f" and move {_iter_dir(root, latest)} out of the way" if latest is not None else ""
        raise ValueError(f"{unusable}; iteration {found} is the newest checkpoint that verifies: add --load-fallback "
                         f"or, to resume from iteration {found} ({_iter_dir(root, found)}), write {found} into "
                         f"{os.path.join(root, LATEST)}{move}")
    raise ValueError(f"{unusable}; there is no older complete checkpoint under {root} that verifies: start fresh "
                     f"(without --load)")


def _iterations(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = (m for m in map(_ITER_DIR.match, names) if m and os.path.isdir(os.path.join(root, m.group(0))))
    return sorted(int(m.group(1)) for m in found)


def _fix(root: str, below: Optional[int], broken: Optional[str]) -> str:
    """What to do instead: the newest complete iteration under ``root`` older than ``below``, or start fresh."""
    for it in reversed(_iterations(root)):
        if below is not None and it >= below:
            continue
        try:
            _check_iteration(_iter_dir(root, it))
        except _Unreadable:
            continue
        move = f" and move {broken} out of the way" if broken else ""
        return (f"to resume from iteration {it} ({_iter_dir(root, it)}), write {it} into "
                f"{os.path.join(root, LATEST)}{move}")
    older = "older " if below is not None else ""
    return f"there is no {older}complete checkpoint under {root}: start fresh (without --load)"


def _error(e: _Unreadable, root: str, below: Optional[int], broken: Optional[str]) -> ValueError:
    return ValueError(f"{e}; {_fix(root, below, broken)}")


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _where(groups, replica: Optional[int]) -> str:
    """The key of this rank's model and optimizer entries: per pipeline stage and TP rank (data-parallel
    copies are equal and deduplicate), and per replica when local-step replicas hold different weights."""
    return (f"r{replica}_" if replica is not None else "") + f"pp{groups.pp_rank}_tp{groups.tp_rank}"


def _state(model, optimizer, extra: bytes, groups, replica: Optional[int] = None) -> dict[str, Any]:
    """What a rank writes (and, less the layout entry, reads back at the same layout): its model and optimizer
    entries, its ``extra`` bytes and its ``layout/rank<r>`` map (megacomp.training.reshard; not under replicas,
    which are never resharded)."""
    where = _where(groups, replica)
    state = {f"model/{where}": model.state_dict(), f"optim/{where}": optimizer.state_dict(),
             f"extra/rank{dist.get_rank()}": extra}
    if replica is None:
        state.update(reshard.layout_entries(model, optimizer, groups, where))
    return state


def _pack(extra: dict) -> bytes:
    """Per-rank state of any nesting as one opaque entry (DCP only fills entries its template already has)."""
    buf = io.BytesIO()
    torch.save(extra, buf)
    return buf.getvalue()


def _estimate_bytes(state: dict, groups) -> int:
    """This rank's bytes in the checkpoint: its tensors and blobs, the model's only on the first DP rank (DCP
    writes an entry all DP replicas share once)."""
    def size(v) -> int:
        if isinstance(v, torch.Tensor):
            return v.numel() * v.element_size()
        if isinstance(v, (bytes, bytearray)):
            return len(v)
        if isinstance(v, dict):
            return sum(size(x) for x in v.values())
        if isinstance(v, (list, tuple)):
            return sum(size(x) for x in v)
        return 0
    return sum(size(v) for k, v in state.items() if not (k.startswith("model/") and groups.dp_rank != 0))


def _as_failure(e: BaseException) -> tuple:
    """A picklable (errno, strerror, filename, text) of a save error, for the exchange between ranks."""
    if isinstance(e, CheckpointException):  # DCP gathered every rank's failure: the lowest rank's, an OSError first
        failures = [exc for _, (exc, _tb) in sorted(e.failures.items())]
        e = next((x for x in failures if isinstance(x, OSError)), failures[0] if failures else e)
    return (getattr(e, "errno", None), getattr(e, "strerror", None), getattr(e, "filename", None), _short(e))


def _agree(mine) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _checkpoint_bytes(path: str) -> int:
    try:
        return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    except OSError:
        return 0


def save_checkpoint(root: str, iteration: int, model, optimizer, extra: dict, groups, run_info: dict,
                    replica: Optional[int] = None, lock=None) -> str:
    """Write iteration ``iteration`` under ``root`` (a collective: every rank calls it).

    The shards go to ``iter_N.tmp``; the ranks hash its files (each a share) into the manifest ``megacomp.json``
    (see megacomp.training.checkpoint_integrity); then rank 0 renames it to ``iter_N`` and points ``latest`` at
    it. ``lock`` (rank 0's SaveDirLock, or None): checked first, so a run that lost its lock writes nothing.

    Raises:
        OSError: on every rank alike, one line (megacomp.training.checkpoint_integrity.save_failure), when a
            rank could not write or hash its part (a full disk, a quota, an I/O error) or the space free is less
            than the previous checkpoint's size; the partial ``iter_N.tmp`` is removed and the previous
            checkpoint and ``latest`` are untouched.
        ValueError: the lock is no longer this run's (nothing is written).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    final = _iter_dir(root, iteration)
    tmp = final + ".tmp"
    state = _state(model, optimizer, _pack(extra), groups, replica)
    failure, free, lock_error, prev, prev_bytes = None, None, None, None, 0
    if rank == 0:
        try:
            if lock is not None:
                lock.check()
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            free = integrity.free_bytes(root)
            prev = next((it for it in reversed(_iterations(root)) if it != iteration), None)
            prev_bytes = _checkpoint_bytes(_iter_dir(root, prev)) if prev is not None else 0
            if prev is not None and free is not None and free < prev_bytes:
                failure = (errno.ENOSPC, f"less space free than the checkpoint of iteration {prev} takes", final, "")
        except ValueError as e:
            lock_error = str(e)
        except OSError as e:
            failure = _as_failure(e)
    everyone = _agree((_estimate_bytes(state, groups), failure, free, lock_error, prev, prev_bytes))
    needed = max(sum(x[0] for x in everyone), everyone[0][5])  # the previous checkpoint's size when there is one
    free, lock_error, prev = everyone[0][2], everyone[0][3], everyone[0][4]
    intact = (f"the latest checkpoint (iteration {prev}, {_iter_dir(root, prev)}) is untouched" if prev is not None
              else "no earlier checkpoint was affected")

    def fail(failures) -> OSError:
        err_no, strerror, filename, text = next(f for f in failures if f)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        err = OSError(err_no, strerror or text, filename) if err_no else OSError(text)
        return OSError(integrity.save_failure(final, err, needed, free, intact))

    if lock_error:
        raise ValueError(lock_error)
    if everyone[0][1]:
        raise fail([everyone[0][1]])
    mine, digests = None, {}
    try:
        dcp.save(state, checkpoint_id=tmp)
        digests = integrity.digest_files(tmp, integrity.share(integrity.checkpoint_files(tmp), rank, world))
    except (OSError, CheckpointException) as e:
        mine = _as_failure(e)
    everyone = _agree((mine, digests))
    if any(m for m, _ in everyone):
        raise fail([m for m, _ in everyone])
    done = None
    if rank == 0:
        try:
            manifest = {"iteration": iteration, "format_version": FORMAT_VERSION, **run_info,
                        "files": {k: v for _, d in everyone for k, v in d.items()}}
            manifest = json.loads(json.dumps(manifest, default=str))  # the digest covers what a reader sees
            manifest["manifest_sha256"] = integrity.manifest_digest(manifest)
            with open(os.path.join(tmp, "megacomp.json"), "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _write_latest(root, iteration)
        except OSError as e:
            done = _as_failure(e)
    everyone = _agree(done)
    if everyone[0]:
        raise fail(everyone)
    return final


def latest_iteration(root: str) -> Optional[int]:
    """The iteration ``root``'s latest file points at, or None when there is none; raises ValueError naming the
    file when it holds anything but a number."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        text = f.read(64).decode("utf-8", "replace").strip()
    if not (text.isascii() and text.isdigit()):
        raise _error(_Unreadable(path, f"holds {text!r}, not an iteration number"), root, None, None)
    return int(text)


def _write_latest(root: str, iteration: int) -> None:
    latest_tmp = os.path.join(root, LATEST + ".tmp")
    with open(latest_tmp, "w", encoding="utf-8") as f:
        f.write(str(iteration))
    os.replace(latest_tmp, os.path.join(root, LATEST))


def _differences(saved: Any, mine: Any, name: str) -> list[str]:
    """``name: checkpoint X vs this run Y`` for each differing field; dicts are compared key by key, so a nested
    config names only its keys that differ (``compression_resolved.dp_gradient.name: ...``)."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        return [d for k in sorted(set(saved) | set(mine), key=str)
                for d in _differences(saved.get(k), mine.get(k), f"{name}.{k}")]
    return [] if saved == mine else [f"{name}: checkpoint {saved!r} vs this run {mine!r}"]


def check_compatible(saved: dict, run_info: dict, path: str) -> None:
    """Raise ValueError (one line naming only the fields that differ) when the checkpoint's format version or a
    MUST_MATCH field differs from this run's, or a DATA_ORDER field does without ``allow_data_order_change``.
    A different parallel layout is not refused here: the load reshards (megacomp.training.reshard)."""
    version = saved.get("format_version", 1)
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format version {version}, this megacomp reads format version "
                         f"{FORMAT_VERSION} (version 2 keeps error feedback and stochastic-rounding streams per "
                         f"traffic channel); resume it with the megacomp release that wrote it, or start a new "
                         f"--save dir")
    diffs = [d for k in MUST_MATCH for d in _differences(saved.get(k), run_info.get(k), k)]
    if diffs:
        raise ValueError(f"checkpoint {path} was written by another configuration ({'; '.join(diffs)}); resume with "
                         f"the same model and compression, or start a new --save dir")
    order = [d for k in DATA_ORDER if k in saved for d in _differences(saved.get(k), run_info.get(k), k)]
    if order and not run_info.get("allow_data_order_change"):
        raise ValueError(f"checkpoint {path} was written with another data order ({'; '.join(order)}); the resumed "
                         f"run would see other samples than the interrupted one: resume with the same settings, or "
                         f"add --allow-data-order-change to continue with the new order on purpose")


# optimizer state an option adds (ACCO's estimate): a checkpoint written without the option has none, and the
# optimizer then starts it fresh (ACCO: estimate = parameters), so the load template leaves it out
OPTIONAL_OPTIMIZER_STATE = ("acco_estimate",)


def _drop_optional_state(state: dict, metadata: dcp_md.Metadata) -> None:
    saved = list(metadata.state_dict_metadata)
    for key, value in state.items():
        if not key.startswith("optim/") or not isinstance(value, dict):
            continue
        for local in value.values():
            for name in OPTIONAL_OPTIMIZER_STATE:
                if isinstance(local, dict) and name in local and not any(f".{name}" in k for k in saved):
                    del local[name]


def _safe_load(path: str, metadata: dcp_md.Metadata, root: str, iteration: int):
    """``load(state)``: DCP's load of ``state`` from ``path`` with the safe reader and planner, a failure raised as
    :func:`_load_failure`'s one line (what megacomp.training.reshard reads with)."""
    def load(state: dict) -> None:
        try:
            dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata), planner=SafeLoadPlanner())
        except CheckpointException as e:
            raise _load_failure(e, root, iteration, path) from None
    return load


def _load_failure(e: CheckpointException, root: str, iteration: int, path: str) -> ValueError:
    """The one-line error for a failed DCP read: the lowest rank's broken file, or the entry that does not fit."""
    failures = [exc for _, (exc, _tb) in sorted(e.failures.items())]
    broken = [exc for exc in failures if isinstance(exc, _Unreadable)]
    if broken:
        return _error(broken[0], root, iteration, path)
    return _error(_Unreadable(os.path.join(path, ".metadata"), f"does not fit this run's state: {_short(failures[0])}"),
                  root, iteration, path)


def load_checkpoint(root: str, model, optimizer, groups, run_info: dict,
                    replica: Optional[int] = None, iteration: Optional[int] = None) -> tuple[int, dict]:
    """Load the latest checkpoint under ``root``; returns (iteration, this rank's extra state). Raises ValueError
    naming the file (and the newest older complete iteration, if any) when a file is missing, truncated,
    garbled or holds a pickle outside the allow-lists (see the module docstring), on every rank alike.
    ``iteration``: the one to load (e.g. chosen by :func:`select_checkpoint`) instead of the latest."""
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise FileNotFoundError(f"no checkpoint in {root!r} ({LATEST} missing); check --load or drop it to start fresh")
    path = _iter_dir(root, iteration)
    try:  # every rank checks the same files, so all fail alike before DCP's first collective
        saved, metadata = _check_iteration(path)
    except _Unreadable as e:
        raise _error(e, root, iteration, path) from None
    check_compatible(saved, run_info, path)
    if reshard.layout_changed(saved, run_info):
        if replica is not None or saved.get("num_replicas", 1) != 1:
            raise reshard._refuse(path, saved, run_info, "outer-loop replicas are not resharded; resume at the saved "
                                                         "layout")
        optimizer.init_state()
        extra, notes = reshard.load_resharded(path, metadata, saved, run_info, model, optimizer, groups,
                                              _safe_load(path, metadata, root, iteration))
        extra["resharded"] = notes
        return iteration, extra
    optimizer.init_state()
    state = _state(model, optimizer, b"", groups, replica)
    for key in [k for k in state if k.startswith("layout/")]:  # written for resharding, not read back here
        del state[key]
    _drop_optional_state(state, metadata)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata), planner=SafeLoadPlanner())
    except CheckpointException as e:  # DCP gathered the failures of every rank: report the lowest rank's
        failures = [exc for _, (exc, _tb) in sorted(e.failures.items())]
        broken = [exc for exc in failures if isinstance(exc, _Unreadable)]
        if broken:
            raise _error(broken[0], root, iteration, path) from None
        unfit = _Unreadable(os.path.join(path, ".metadata"), f"does not fit this run's state: {_short(failures[0])}")
        raise _error(unfit, root, iteration, path) from e
    where = _where(groups, replica)
    model.load_state_dict(state[f"model/{where}"])
    optimizer.load_state_dict(state[f"optim/{where}"])
    extra = state[f"extra/rank{dist.get_rank()}"]  # opened by SafeLoadPlanner (weights_only=True)
    if isinstance(extra, (bytes, bytearray)):
        extra = torch.load(io.BytesIO(extra), weights_only=True)
    return iteration, extra


MODEL_MUST_MATCH = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size",
                    "params_dtype")
"""The fields that decide the model's tensors: what fine-tuning from a checkpoint must share with it (the parallel
layout may differ: the weights are then resharded)."""


def load_model_weights(root: str, model, groups, run_info: dict, iteration: Optional[int] = None) -> int:
    """Fine-tuning (Megatron's ``--finetune``): load only the model weights of the latest checkpoint under ``root``
    (no optimizer, RNG, error feedback or data position; the run starts at iteration 0); returns the checkpoint's
    iteration. The compression, optimizer, batch sizes, data and parallel layout may differ (another TP / PP /
    virtual-stage layout is resharded: megacomp.training.reshard); the model shape (MODEL_MUST_MATCH) may not.
    Raises ValueError naming the differing fields or the broken file,
    FileNotFoundError when there is no checkpoint. ``iteration``: the one to load instead of the latest."""
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        raise FileNotFoundError(f"no checkpoint in {root!r} ({LATEST} missing) to fine-tune from; check --load")
    path = _iter_dir(root, iteration)
    try:
        saved, metadata = _check_iteration(path)
    except _Unreadable as e:
        raise _error(e, root, iteration, path) from None
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs this run {run_info.get(k)!r}" for k in MODEL_MUST_MATCH
             if saved.get(k) != run_info.get(k)]
    if saved.get("num_replicas", 1) != 1:
        diffs.append(f"num_replicas: checkpoint {saved.get('num_replicas')} (one model per replica) vs 1")
    if diffs:
        raise ValueError(f"cannot fine-tune from {path}: its model differs from this run's ({'; '.join(diffs)}); use "
                         f"the same model shape")
    if any(saved.get(k) != run_info.get(k) for k in reshard.LAYOUT_FIELDS[:3]):
        reshard.load_resharded(path, metadata, saved, run_info, model, None, groups,
                               _safe_load(path, metadata, root, iteration), weights_only=True)
        return iteration
    where = _where(groups, None)
    state = {f"model/{where}": model.state_dict()}  # DCP loads just these entries
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata), planner=SafeLoadPlanner())
    except CheckpointException as e:
        failures = [exc for _, (exc, _tb) in sorted(e.failures.items())]
        unfit = _Unreadable(os.path.join(path, ".metadata"), f"does not fit this run's model: {_short(failures[0])}")
        raise _error(unfit, root, iteration, path) from e
    model.load_state_dict(state[f"model/{where}"])
    return iteration

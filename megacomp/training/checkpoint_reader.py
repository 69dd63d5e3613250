"""Reading a checkpoint directory without running code from it, and the per-file checks before DCP starts.

Threat model: a checkpoint directory is data from somewhere else (a shared file system, a download, a
colleague's run) and ``--load`` must not run code from it. Everything in it that is a pickle is read so:

* ``.metadata`` (DCP's index: which tensor lives at which offset of which ``__R_K.distcp`` file). DCP's own
  ``FileSystemReader`` reads it with plain ``pickle.load``, which calls whatever the file names. Here it is
  read by :class:`SafeFileSystemReader` with an allow-list unpickler: ``find_class`` returns only the
  objects listed in ``METADATA_GLOBALS`` and raises, before anything is called, for every other global
  (so ``os.system``, ``builtins.eval``, ``subprocess.Popen`` ... never even get looked up). The list is what a
  ``.metadata`` written by this module references, found by saving real checkpoints (1, 2 and 4 ranks,
  TP/PP/SP, every compression kind, frozen-variance Adam) and recording every ``find_class`` call: DCP's
  metadata dataclasses (``Metadata``, ``MetadataIndex``, ``StorageMeta``, ``TensorStorageMetadata``,
  ``BytesStorageMetadata``, ``ChunkStorageMetadata``, ``TensorProperties`` and its ``_MEM_FORMAT_ENCODING``
  enum), the filesystem layer's ``_StorageInfo``, ``torch.Size``, the torch dtypes,
  ``torch.serialization._get_layout`` (a name -> layout table lookup) and ``pathlib.PosixPath`` (the
  checkpoint id DCP records). No tensor or storage rebuild helper occurs: the index holds no tensors.
  Each admitted callable only builds a value from its arguments. Residual risk: pickle's BUILD can set
  attributes on an admitted class or function in the loading process; the values it can set are again
  only admitted objects and plain data, so this can break the load but not run code.
* Shard entries (``__R_K.distcp``). Each entry, tensor or not, is a ``torch.save`` blob: DCP reads tensors
  with ``torch.load(weights_only=True)``; non-tensor entries (the optimizer's format fields, the per-rank
  ``extra`` bytes) go to :class:`SafeLoadPlanner`, which also uses ``weights_only=True`` (DCP's default
  planner uses ``weights_only=False``), and the ``extra`` bytes, themselves a ``torch.save`` blob, are
  opened the same way. torch's weights-only unpickler admits tensors, their rebuild helpers and plain data.
* DCP's fallback to per-rank ``__R.metadata`` files is off (:meth:`SafeFileSystemReader.read_metadata`
  takes no ``rank``), and ``megacomp.json`` and ``latest_checkpointed_iteration.txt`` are JSON and text.

Broken checkpoints: every rank checks the files before DCP starts (megacomp.json parses, ``.metadata``
unpickles under the allow-list into DCP's index, each shard it names exists, lies in the directory and is
long enough), so all ranks fail alike with one ``ValueError`` naming the file, e.g. ``checkpoint file
.../iter_0000002/__0_0.distcp is unreadable (truncated: ...)``, and the newest older iteration that passes
the same checks (``resume from iteration 1 (.../iter_0000001)``) or, when there is none, says to start
fresh. A shard that is garbled without being short, or holds a refused pickle, fails inside DCP's read
step; DCP gathers that error on every rank and it is re-raised the same way.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import pickle
import re
import types
from typing import Any, Optional

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, set_element
from torch.futures import Future

from . import checkpoint_integrity as integrity


def _allowed_globals() -> dict[tuple[str, str], Any]:
    wanted = [(dcp_md, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                                    "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                    "_MEM_FORMAT_ENCODING")]
    wanted += [(dcp_fs, "_StorageInfo"), (torch, "Size"), (torch.serialization, "_get_layout"), (pathlib, "PosixPath")]
    allowed = {(m.__name__, n): getattr(m, n) for m, n in wanted if hasattr(m, n)}  # a renamed one is refused
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


METADATA_GLOBALS = types.MappingProxyType(_allowed_globals())
"""(module, name) -> object: everything a DCP ``.metadata`` may reference (see the module docstring)."""


class _Unreadable(ValueError):
    """A checkpoint file that cannot be used: ``path``, a short ``reason``, and whether it was refused as hostile."""

    def __init__(self, path: str, reason: str, refused: bool = False) -> None:
        super().__init__(path, reason, refused)  # args only: DCP pickles it across ranks
        self.path, self.reason, self.refused = str(path), reason, refused

    def __str__(self) -> str:
        return f"checkpoint file {self.path} is {'refused' if self.refused else 'unreadable'} ({self.reason})"


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata``; any global outside METADATA_GLOBALS raises before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {str(pid)[:40]!r}")


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _refusal(what: str, allow_list: str) -> str:
    what = "".join(c if c.isprintable() else "?" for c in what[:100])  # the name comes from the file
    return f"its pickle references {what}, which is not on {allow_list}; nothing was called"


def read_metadata(path: str) -> dcp_md.Metadata:
    """DCP's index ``<path>/.metadata`` read with the allow-list unpickler; raises ValueError naming the file."""
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise _Unreadable(file, "missing") from None
    except _Refused as e:
        raise _Unreadable(file, _refusal(str(e), "megacomp's allow-list of checkpoint metadata types"),
                          refused=True) from None
    except Exception as e:  # noqa: BLE001 -- a truncated or garbled pickle fails in many ways
        raise _Unreadable(file, f"truncated or garbled: {_short(e)}") from None
    if not isinstance(md, dcp_md.Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise _Unreadable(file, f"garbled: holds a {type(md).__name__}, not DCP's checkpoint index")
    for index, info in md.storage_data.items():
        if not (isinstance(index, dcp_md.MetadataIndex) and isinstance(info, dcp_fs._StorageInfo)
                and isinstance(info.relative_path, str) and isinstance(info.offset, int)
                and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0):
            raise _Unreadable(file, f"garbled: storage entry {index!r} -> {info!r}")
        name = info.relative_path
        if os.path.basename(name) != name or name in ("", ".", "..") or not name.endswith(".distcp"):
            raise _Unreadable(file, f"garbled: names the data file {name!r} outside the checkpoint directory")
        if info.transform_descriptors:
            raise _Unreadable(file, f"uses storage transforms {info.transform_descriptors!r}, which megacomp "
                                    f"never writes")
    return md


def _check_iteration(path: str) -> tuple[dict, dcp_md.Metadata]:
    """megacomp.json, .metadata and every shard of the checkpoint at ``path``; raises _Unreadable."""
    if not os.path.isdir(path):
        raise _Unreadable(path, "missing: the directory does not exist")
    file = os.path.join(path, "megacomp.json")
    try:
        with open(file, "rb") as f:
            saved = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise _Unreadable(file, "missing") from None
    except UnicodeDecodeError:
        raise _Unreadable(file, "garbled: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise _Unreadable(file, f"truncated or garbled: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(saved, dict):
        raise _Unreadable(file, f"garbled: holds a JSON {type(saved).__name__}, not an object")
    garbled = integrity.check_manifest(saved)
    if garbled:
        raise _Unreadable(file, garbled)
    md = read_metadata(path)  # first: a hostile index is named as such, not as a file of the wrong size
    wrong_size = integrity.check_sizes(path, saved)
    if wrong_size:
        raise _Unreadable(*wrong_size)
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = os.path.join(path, name)
        try:
            size = os.path.getsize(shard)
        except OSError:
            raise _Unreadable(shard, "missing") from None
        if size < end:
            raise _Unreadable(shard, f"truncated: {size} bytes, .metadata places data up to byte {end}")
    return saved, md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor entries with weights_only=False; only allow plain data."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Unpickle one non-tensor entry with ``torch.load(weights_only=True)`` (plain data only); a bytes
        ``extra/`` entry (itself a ``torch.save`` blob) is opened the same way, so its errors surface in
        DCP's read step on every rank."""
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if fqn.startswith("extra/") and isinstance(obj, (bytes, bytearray)):
            obj = torch.load(io.BytesIO(obj), weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeFileSystemReader(dcp_fs.FileSystemReader):
    """DCP's file reader with the allow-list ``.metadata`` reader and per-file errors (see the module docstring).

    ``metadata``: the index already read and checked by :func:`read_metadata` (read here when None)."""

    def __init__(self, path: str, metadata: Optional[dcp_md.Metadata] = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> dcp_md.Metadata:  # no **kwargs: DCP's per-rank .metadata fallback stays off
        """The checkpoint's index, unpickled with the allow-list (never with plain pickle)."""
        md = self._metadata if self._metadata is not None else read_metadata(str(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner) -> Future:
        """DCP's read, one shard file at a time, so that a failure names the file it came from."""
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:  # noqa: BLE001 -- whatever a garbled or hostile shard raises
                found = re.search(r"GLOBAL (\S+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
                reason = _refusal(found.group(1), "torch.load(weights_only=True)'s allow-list") if found \
                    else f"garbled: {_short(e)}"
                raise _Unreadable(os.path.join(str(self.path), name), reason, refused=bool(found)) from None
        fut: Future = Future()
        fut.set_result(None)
        return fut

"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, safe to load, and checked on resume.

Layout of ``SAVE/``:
    iter_0000100/            a DCP checkpoint (every rank writes its shards) + megacomp.json (the run's config)
    latest_checkpointed_iteration.txt

Contents: the model (keys per pipeline stage and TP rank, so DP replicas deduplicate), the sharded
optimizer (masters, AdamW state, DP-gradient error feedback, counters; keys per stage, TP and DP rank),
and per rank one ``extra`` entry with the RNG state and the state of every traffic channel (TP-backward
and pipeline-gradient error feedback, seeded stochastic-rounding streams).

Format versions (``format_version`` in megacomp.json): 1 (no field) stored error feedback per TP layer and
per pipeline communicator and the stochastic streams in a process-wide table; 2 stores them per channel.
A checkpoint of another version is refused with a message naming both versions. A write goes to ``iter_N.tmp`` and is renamed when every rank is done, and only then does the
``latest`` file (itself replaced atomically) point at it: a run killed while saving keeps its last good
checkpoint. Loading deserialises with ``torch.load(weights_only=True)`` (no arbitrary pickles) and refuses
a checkpoint whose model shape, parallel layout, world size or codecs differ, naming the fields.
"""
from __future__ import annotations

import io
import json
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, set_element

LATEST = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 2
"""Version of the checkpoint layout this code writes and reads (see the module docstring)."""
MUST_MATCH = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size",
              "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel", "params_dtype",
              "compression_resolved", "world_size")


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor entries with weights_only=False; only allow plain data."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Unpickle one non-tensor entry with ``torch.load(weights_only=True)`` (plain data only)."""
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _state(model, optimizer, extra: bytes, groups) -> dict[str, Any]:
    where = f"pp{groups.pp_rank}_tp{groups.tp_rank}"
    return {f"model/{where}": model.state_dict(), f"optim/{where}": optimizer.state_dict(),
            f"extra/rank{dist.get_rank()}": extra}


def _pack(extra: dict) -> bytes:
    """Per-rank state of any nesting as one opaque entry (DCP only fills entries its template already has)."""
    buf = io.BytesIO()
    torch.save(extra, buf)
    return buf.getvalue()


def save_checkpoint(root: str, iteration: int, model, optimizer, extra: dict, groups, run_info: dict) -> str:
    """Write iteration ``iteration`` under ``root`` (a collective: every rank calls it)."""
    final = _iter_dir(root, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save(_state(model, optimizer, _pack(extra), groups), checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(tmp, "megacomp.json"), "w", encoding="utf-8") as f:
            json.dump({"iteration": iteration, "format_version": FORMAT_VERSION, **run_info}, f, indent=1, sort_keys=True, default=str)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = os.path.join(root, LATEST + ".tmp")
        with open(latest_tmp, "w", encoding="utf-8") as f:
            f.write(str(iteration))
        os.replace(latest_tmp, os.path.join(root, LATEST))
    dist.barrier()
    return final


def latest_iteration(root: str) -> Optional[int]:
    """The iteration ``root``'s latest file points at, or None when there is none."""
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return int(f.read().strip())


def check_compatible(saved: dict, run_info: dict, path: str) -> None:
    """Raise ValueError when the checkpoint's format version or any MUST_MATCH field differs from this run's."""
    version = saved.get("format_version", 1)
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path} has format version {version}, this megacomp reads format version "
                         f"{FORMAT_VERSION} (version 2 keeps error feedback and stochastic-rounding streams per "
                         f"traffic channel); resume it with the megacomp release that wrote it, or start a new "
                         f"--save dir")
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs this run {run_info.get(k)!r}" for k in MUST_MATCH
             if saved.get(k) != run_info.get(k)]
    if diffs:
        raise ValueError(f"checkpoint {path} was written by another configuration ({'; '.join(diffs)}); resume with "
                         f"the same model, parallel layout, world size and compression, or start a new --save dir")


def load_checkpoint(root: str, model, optimizer, groups, run_info: dict) -> tuple[int, dict]:
    """Load the latest checkpoint under ``root``; returns (iteration, this rank's extra state)."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(f"no checkpoint in {root!r} ({LATEST} missing); check --load or drop it to start fresh")
    path = _iter_dir(root, iteration)
    with open(os.path.join(path, "megacomp.json"), encoding="utf-8") as f:
        saved = json.loads(f.read())
    check_compatible(saved, run_info, path)
    optimizer.init_state()
    state = _state(model, optimizer, b"", groups)
    dcp.load(state, checkpoint_id=path, planner=SafeLoadPlanner())
    where = f"pp{groups.pp_rank}_tp{groups.tp_rank}"
    model.load_state_dict(state[f"model/{where}"])
    optimizer.load_state_dict(state[f"optim/{where}"])
    extra = torch.load(io.BytesIO(state[f"extra/rank{dist.get_rank()}"]), weights_only=True)
    return iteration, extra

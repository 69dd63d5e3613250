"""Per-iteration metrics: a concise console line and ``LOG_DIR/metrics.jsonl`` (rank 0).

Each JSON line holds at least: iteration, loss, lr, tokens_per_second, iteration_time_s, wire_bytes and
uncompressed_bytes (this iteration's traffic summed over all ranks), and ``traffic``: per traffic kind
(dp_gradient, dp_parameter, tp_forward, tp_backward, sp_all_gather, sp_reduce_scatter, pp_activation,
pp_gradient, ...) the pair [wire bytes, uncompressed bytes]. Iterations probed for compression error
(``error_probe_interval``) also hold ``probe`` (see :func:`gather_probe`). The training loop adds ``elapsed_s``,
``iterations_per_second`` and ``eta_s`` (:class:`Progress`); iterations after which the run evaluated add
``valid_loss``, ``valid_ppl`` (``test_loss``, ``test_ppl`` after the last) and the evaluation's own traffic,
``eval_wire_bytes``, ``eval_uncompressed_bytes``, ``eval_traffic``, ``eval_samples``, ``eval_time_s``
(megacomp.training.evaluation), printed as Megatron-LM's validation block (:func:`validation_lines`).
"""
from __future__ import annotations

import errno
import json
import math
import os
import time
from dataclasses import astuple
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from ..comm import probe as probe_mod


def gather_traffic() -> dict[str, list[int]]:
    """This iteration's wire statistics summed over all ranks (a collective), then reset.

    Returns ``{tag: [wire_bytes, uncompressed_bytes]}`` over the union of all ranks' tags (:func:`sum_traffic`); the
    local table is reset before the exchange. Every rank must call it, with torch.distributed initialised.
    """
    local = {k: (v.wire_bytes, v.uncompressed_bytes) for k, v in comm.stats().items()}
    comm.reset_stats()
    return sum_traffic(local)


def sum_traffic(local: dict) -> dict[str, list[int]]:
    """``{tag: (wire_bytes, uncompressed_bytes)}`` of this rank summed over all ranks (a collective): ``{tag: [wire,
    uncompressed]}`` over the union of all ranks' tags. Receive-side mirror tags (``*_recv``: the point-to-point
    receive side of the pipeline's and NoLoCo's sends) are left out so each byte is counted once."""
    local = {k: v for k, v in local.items() if not k.endswith("_recv")}
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(local))
    keys = sorted(set().union(*map(set, names)))
    vec = torch.tensor([list(local[k]) if k in local else [0, 0] for k in keys],
                       dtype=torch.int64, device=comm.comm_device()).reshape(-1, 2)
    dist.all_reduce(vec)
    return {k: [int(a), int(b)] for k, (a, b) in zip(keys, vec.cpu().tolist())}


def gather_probe(probe) -> dict:
    """The compression-error measurements of this (probed) iteration from every rank (a collective), combined per
    call (megacomp.comm.probe.combine) and summarised per path: ``{"paths": {path: [relative error, worst call's
    relative error, max crest factor, max kurtosis, calls]}, "calls": [[path, key, index, numel, relative error,
    crest, kurtosis], ...], "bytes": reference bytes sent by all ranks}``. Every rank must call it."""
    records, sent = probe.take()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ([astuple(r) for r in records], sent))
    merged = probe_mod.combine([probe_mod.ProbeRecord(*row) for rows, _ in everyone for row in rows])
    return {"paths": probe_mod.summarise(merged), "calls": probe_mod.per_call(merged),
            "bytes": sum(n for _, n in everyone)}


def duration(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded)."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Elapsed time, iterations per second and the time left to ``train_iters`` of this process's part of a run.

    The rate is this process's iterations over the wall-clock time since the loop started (evaluations,
    checkpoints and the first iteration's one-time work included, so the ETA counts them as they recur on
    average); the ETA is the iterations left at that rate (None before a first iteration completes)."""

    def __init__(self, start_iteration: int, train_iters: int) -> None:
        self.t0, self.first, self.train_iters = time.perf_counter(), start_iteration, train_iters

    def fields(self, iteration: int) -> dict:
        """``{"elapsed_s", "iterations_per_second", "eta_s"}`` after ``iteration``."""
        elapsed = time.perf_counter() - self.t0
        done = iteration - self.first
        rate = done / elapsed if done > 0 and elapsed > 0 else 0.0
        eta = max(0, self.train_iters - iteration) / rate if rate else None
        return {"elapsed_s": elapsed, "iterations_per_second": rate, "eta_s": eta}


def validation_lines(record: dict) -> list[str]:
    """Megatron-LM's block for an evaluated iteration: dashes, `` validation loss at iteration N | lm loss value:
    X | lm loss PPL: Y | `` (and the test split's line after the last iteration), then what the evaluation sent,
    apart from training's traffic, and dashes."""
    it, mb = record["iteration"], 1e6
    rows = [f" validation loss at iteration {it} | lm loss value: {record['valid_loss']:.6E} | lm loss PPL: "
            f"{record['valid_ppl']:.6E} | "]
    if "test_loss" in record:
        rows.append(f" test loss at iteration {it} | lm loss value: {record['test_loss']:.6E} | lm loss PPL: "
                    f"{record['test_ppl']:.6E} | ")
    w, u = record["eval_wire_bytes"], record["eval_uncompressed_bytes"]
    rows.append(f" evaluation: {record['eval_samples']} samples in {record['eval_time_s']:.1f} s | wire {w / mb:.2f} MB "
                f"of {u / mb:.2f} MB ({w / u if u else 1.0:.2f}x), not in training's traffic | ")
    width = max(len(r) for r in rows) + 1
    return ["-" * width, *rows, "-" * width]


class MetricsLogger:
    """Writes metrics.jsonl and prints a line per logged iteration (rank 0 only).

    Each record is one ``write`` of a whole line to a file opened for appending, unbuffered: a write that fails
    (a full disk, a file system gone read-only) is cut back to the last complete line, so the file never ends
    in half a record and a resumed run appends after whole lines. After a failure the logger writes no more
    and :meth:`close` never raises (the first error is the one reported).

    Args:
        log_dir: directory of ``metrics.jsonl`` (created); None prints without writing a file.
        enabled: False (ranks other than 0) makes every call a no-op.
        resume: append to an existing ``metrics.jsonl`` instead of overwriting it.
        trackers: TensorBoard / W&B (megacomp.training.trackers.Trackers) that receive every logged record too, and
            are closed with the logger.

    Raises:
        OSError: the directory or the file cannot be created (``filename`` is ``--log-dir DIR``, the message
            says why and what to do).
    """

    def __init__(self, log_dir: Optional[str], enabled: bool, resume: bool = False, trackers=None) -> None:
        self.enabled = enabled
        self.trackers = trackers
        self.fd: Optional[int] = None
        self.path = os.path.join(log_dir, "metrics.jsonl") if log_dir else None
        self.last_written: Optional[int] = None
        if enabled and log_dir:
            try:
                if os.path.exists(log_dir) and not os.path.isdir(log_dir):
                    raise OSError(errno.ENOTDIR, "it is a file, not a directory")
                os.makedirs(log_dir, exist_ok=True)
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if resume else os.O_TRUNC),
                                  0o644)
            except OSError as e:  # one line naming the flag and the fix (the entry point prints it)
                raise OSError(e.errno, f"cannot write metrics.jsonl there ({e.strerror or e}); point --log-dir at a "
                                       f"writable directory", f"--log-dir {log_dir}") from e

    def log(self, record: dict) -> None:
        """Print ``record`` as one console line and append it to metrics.jsonl.

        Raises:
            KeyError: ``record`` lacks iteration, loss, lr, tokens_per_second, wire_bytes, uncompressed_bytes
                or traffic.
            TypeError: a value JSON cannot encode (when a file is open).
            OSError: metrics.jsonl cannot be written (a full disk: the message names the file, the last
                iteration it holds and the fix; ``filename`` is the file).
        """
        if not self.enabled:
            return
        mb = 1e6
        kinds = " ".join(f"{k}={w / mb:.2f}/{u / mb:.2f}" for k, (w, u) in sorted(record["traffic"].items()) if u)
        ratio = record["wire_bytes"] / record["uncompressed_bytes"] if record["uncompressed_bytes"] else 1.0
        progress = ""
        if "elapsed_s" in record:  # the training loop's records; a bare record from another caller has none
            eta = duration(record["eta_s"]) if record["eta_s"] is not None else "n/a"
            progress = (f"{duration(record['elapsed_s'])} elapsed, {record['iterations_per_second']:.2f} it/s, "
                        f"ETA {eta} | ")
        print(f"iter {record['iteration']:6d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
              f"{record['tokens_per_second']:,.0f} tok/s | {progress}wire {record['wire_bytes'] / mb:.2f} MB of "
              f"{record['uncompressed_bytes'] / mb:.2f} MB ({ratio:.2f}x) | {kinds}", flush=True)
        if "probe" in record:  # a probed iteration: the compression error of every path it measured
            print("  compression error (relative, per path): " + ", ".join(
                f"{p}={v[0]:.2e} (worst call {v[1]:.2e}, crest {v[2]:.0f}, kurtosis {v[3]:.0f})"
                for p, v in record["probe"]["paths"].items()), flush=True)
        if "valid_loss" in record:
            print("\n".join(validation_lines(record)), flush=True)
        if self.trackers is not None:
            self.trackers.log(record)
        if self.fd is None:
            return
        # inf/NaN are not JSON: written as null
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        data = memoryview((json.dumps(clean, allow_nan=False) + "\n").encode())
        start = None
        try:
            start = os.lseek(self.fd, 0, os.SEEK_END)
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:  # a full disk or a lost mount: no half line, then one line naming the file
            if start is not None:
                try:
                    os.ftruncate(self.fd, start)
                except OSError:
                    pass
            self.close()
            kept = (f"it holds the records up to iteration {self.last_written}" if self.last_written is not None
                    else "it holds no record of this run")
            fix = ("free space there" if e.errno in (errno.ENOSPC, errno.EDQUOT) else
                   "check the file system (a read-only remount, a lost mount)")
            raise OSError(e.errno, f"cannot append iteration {record['iteration']} ({e.strerror or e}; {kept}); "
                                   f"{fix} or point --log-dir elsewhere", self.path) from e
        self.last_written = record["iteration"]

    def close(self) -> None:
        """Close metrics.jsonl, if one is open, and the trackers; never raises for the file (every record was written
        when it was logged)."""
        if self.trackers is not None:
            self.trackers.close()
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

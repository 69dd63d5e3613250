"""Per-iteration metrics: a concise console line and ``LOG_DIR/metrics.jsonl`` (rank 0).

Each JSON line holds at least: iteration, loss, lr, tokens_per_second, iteration_time_s, wire_bytes and
uncompressed_bytes (this iteration's traffic summed over all ranks), and ``traffic``: per traffic kind
(dp_gradient, dp_parameter, tp_forward, tp_backward, sp_all_gather, sp_reduce_scatter, pp_activation,
pp_gradient, ...) the pair [wire bytes, uncompressed bytes]. Iterations probed for compression error
(``error_probe_interval``) also hold ``probe`` (see :func:`gather_probe`).
"""
from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import astuple
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm
from ..comm import probe as probe_mod


def gather_traffic() -> dict[str, list[int]]:
    """This iteration's wire statistics summed over all ranks (a collective), then reset.

    Returns ``{tag: [wire_bytes, uncompressed_bytes]}`` over the union of all ranks' tags. Receive-side
    mirror tags (``*_recv``: the point-to-point receive side of the pipeline's and NoLoCo's sends) are left out so each byte is counted once; the local table is reset before
    the exchange. Every rank must call it, with torch.distributed initialised.
    """
    local = {k: v for k, v in comm.stats().items() if not k.endswith("_recv")}
    comm.reset_stats()
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(local))
    keys = sorted(set().union(*map(set, names)))
    vec = torch.tensor([[local[k].wire_bytes, local[k].uncompressed_bytes] if k in local else [0, 0] for k in keys],
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

    Raises:
        OSError: the directory or the file cannot be created (``filename`` is ``--log-dir DIR``, the message
            says why and what to do).
    """

    def __init__(self, log_dir: Optional[str], enabled: bool, resume: bool = False) -> None:
        self.enabled = enabled
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
        print(f"iter {record['iteration']:6d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
              f"{record['tokens_per_second']:,.0f} tok/s | wire {record['wire_bytes'] / mb:.2f} MB of "
              f"{record['uncompressed_bytes'] / mb:.2f} MB ({ratio:.2f}x) | {kinds}", flush=True)
        if "probe" in record:  # a probed iteration: the compression error of every path it measured
            print("  compression error (relative, per path): " + ", ".join(
                f"{p}={v[0]:.2e} (worst call {v[1]:.2e}, crest {v[2]:.0f}, kurtosis {v[3]:.0f})"
                for p, v in record["probe"]["paths"].items()), flush=True)
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
        """Close metrics.jsonl, if one is open; never raises (every record was written when it was logged)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

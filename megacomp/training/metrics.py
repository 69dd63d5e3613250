"""Per-iteration metrics: a concise console line and ``LOG_DIR/metrics.jsonl`` (rank 0).

Each JSON line holds at least: iteration, loss, lr, tokens_per_second, iteration_time_s, wire_bytes and
uncompressed_bytes (this iteration's traffic summed over all ranks), and ``traffic``: per traffic kind
(dp_gradient, dp_parameter, tp_forward, tp_backward, sp_all_gather, sp_reduce_scatter, pp_activation,
pp_gradient, ...) the pair [wire bytes, uncompressed bytes].
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist

from .. import comm

# stats tags that are receive-side mirrors of traffic already counted on the sender
_RECEIVE_TAGS = ("pp_activation_recv", "pp_gradient_recv")


def gather_traffic() -> dict[str, list[int]]:
    """This iteration's wire statistics summed over all ranks (a collective), then reset."""
    local = {k: v for k, v in comm.stats().items() if k not in _RECEIVE_TAGS}
    comm.reset_stats()
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(local))
    keys = sorted(set().union(*map(set, names)))
    vec = torch.tensor([[local[k].wire_bytes, local[k].uncompressed_bytes] if k in local else [0, 0] for k in keys],
                       dtype=torch.int64, device=comm.comm_device()).reshape(-1, 2)
    dist.all_reduce(vec)
    return {k: [int(a), int(b)] for k, (a, b) in zip(keys, vec.cpu().tolist())}


class MetricsLogger:
    """Writes metrics.jsonl and prints a line per logged iteration (rank 0 only)."""

    def __init__(self, log_dir: Optional[str], enabled: bool, resume: bool = False) -> None:
        self.enabled = enabled
        self.file = None
        if enabled and log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self.file = open(os.path.join(log_dir, "metrics.jsonl"), "a" if resume else "w", encoding="utf-8")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        mb = 1e6
        kinds = " ".join(f"{k}={w / mb:.2f}/{u / mb:.2f}" for k, (w, u) in sorted(record["traffic"].items()) if u)
        print(f"iter {record['iteration']:6d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
              f"{record['tokens_per_second']:,.0f} tok/s | wire {record['wire_bytes'] / mb:.2f} MB of "
              f"{record['uncompressed_bytes'] / mb:.2f} MB | {kinds}", flush=True)
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

"""Bounded waits at outer steps: a replica that died or stalled is named instead of waited for forever.

Replicas meet only every H steps, so a replica that died (a node lost, an out-of-memory kill) is noticed at
the next outer exchange, where the others would block in the collective until the backend's own timeout
(30 minutes by default) and then fail with a message that names neither the replica nor the cause.

Protocol, through the job's key-value store (the one ``init_process_group`` made; TCPStore under torchrun,
Slurm and mpirun, FileStore in the tests): each replica of an outer group owns one key,
``<prefix>/<outer ranks>/at/<replica>``, holding the number of the last exchange it reached.

    announce(n)            set this replica's key to n (no waiting)
    await_all(n, members)  poll the keys of ``members`` (default: every replica; NoLoCo passes its gossip
                           group) until each holds a number >= n; after ``timeout_s`` raise ReplicaLost
                           naming the replicas still behind, their global ranks and the fix

One key per replica, overwritten, so nothing accumulates in the store and nothing has to be deleted (a
deletion could race with a slow replica still reading it; with NoLoCo, replicas meet only pairwise and may
be several exchanges apart). The polls back off from 1 ms to 50 ms: a few store round trips every H steps.

DiLoCo announces when it starts an exchange and awaits just before it waits on the collective, so
Streaming DiLoCo's overlap is kept: a slow replica delays the others only at the point where they need its
data anyway. A replica that dies after the check, inside the collective itself, is caught by the process
group's timeout instead (``init_process_group(timeout=...)``).

Here, inside one job, the survivors stop with the error and the job is restarted from the last checkpoint
(``--load``), which holds every replica's outer state. A later watch over the same ranks in the same job finds
the previous watch's numbers, which only makes its first checks pass early.

Survivors continuing and a restarted replica rejoining: run each replica group as its own job on torchft's
quorum instead (``--fault-tolerance torchft --ft-outer-steps H``: megacomp.training.features.fault_tolerance,
megacomp.integrations.torchft). There the survivors' outer step fails within ``--ft-timeout``, is not
committed, and the next quorum holds the live replicas; a restarted replica receives the outer state from a
live peer at the next outer step (docs/guide/fault-tolerance.md).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence


class ReplicaLost(RuntimeError):
    """An outer exchange found replicas that did not arrive within the timeout (the message names them)."""


class ReplicaWatch:
    """Arrival checks of one outer group (see the module docstring).

    Args:
        outer_ranks: the global ranks of the outer group, in replica order (ReplicaGroups.outer_ranks).
        replica: this rank's replica index (its position in ``outer_ranks``).
        timeout_s: how long to wait for the other replicas at an exchange (> 0).
        store: the key-value store (default: the default process group's store).
    Raises:
        ValueError: ``timeout_s`` <= 0, or ``replica`` outside ``outer_ranks``.
    """

    def __init__(self, outer_ranks: Sequence[int], replica: int, timeout_s: float, store=None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the outer-step timeout must be > 0 seconds, got {timeout_s}")
        if not 0 <= replica < len(outer_ranks):
            raise ValueError(f"replica {replica} is not in the outer group {list(outer_ranks)}")
        if store is None:
            from torch.distributed import distributed_c10d
            store = distributed_c10d._get_default_store()  # the job's store: no private copy of the rendezvous
        self.ranks, self.replica, self.timeout_s, self.store = list(outer_ranks), replica, float(timeout_s), store
        self.prefix = "megacomp/outer/" + ",".join(map(str, self.ranks)) + "/at/"

    def announce(self, n: int) -> None:
        """Say that this replica reached exchange ``n``."""
        self.store.set(self.prefix + str(self.replica), str(n))

    def reached(self, replica: int) -> int:
        """The last exchange ``replica`` announced (-1: none yet)."""
        key = self.prefix + str(replica)
        return int(self.store.get(key)) if self.store.check([key]) else -1

    def await_all(self, n: int, members: Optional[Sequence[int]] = None) -> None:
        """Wait until every replica of ``members`` (default: all) reached exchange ``n``.

        Raises:
            ReplicaLost: replicas still behind after ``timeout_s`` (named, with their global ranks).
        """
        behind = [r for r in (range(len(self.ranks)) if members is None else members) if r != self.replica]
        deadline, pause = time.monotonic() + self.timeout_s, 0.001
        while True:
            behind = [r for r in behind if self.reached(r) < n]
            if not behind:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)
        who = ", ".join(f"replica {r} (global rank {self.ranks[r]}, last at exchange {self.reached(r)})"
                        for r in behind)
        raise ReplicaLost(
            f"outer exchange {n}: {who} did not arrive within {self.timeout_s:g} s (--outer-timeout); it stopped (see "
            f"its own log) or is stalled. The surviving replicas stop here: restart the job from the last checkpoint "
            f"with --load, or raise --outer-timeout if replicas are just slow")

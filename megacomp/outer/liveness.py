"""Bounded waits at outer steps: a replica that died or stalled is named instead of waited for forever.

Replicas meet only every H steps, so a replica that died (a node lost, an out-of-memory kill) is noticed at
the next outer exchange, where the others would block in the collective until the backend's own timeout
(30 minutes by default) and then fail with a message that names neither the replica nor the cause.

Protocol, through the job's key-value store (the one ``init_process_group`` made; TCPStore under torchrun,
Slurm and mpirun, FileStore in the tests), for each exchange ``n`` of one outer group:

    announce(n)   this replica sets the key  <prefix>/<outer ranks>/<n>/<replica>  (no waiting)
    await_all(n)  wait up to ``timeout_s`` for the keys of every replica; on timeout, read which keys are
                  missing and raise ReplicaLost naming those replicas, their global ranks and the fix;
                  then delete this replica's keys of exchanges <= n - lag, where ``lag`` is the most
                  exchanges one replica can have in flight (Streaming DiLoCo: the fragment count): every
                  replica has set key n, and a replica starts exchange n only after it finished waiting on
                  every exchange <= n - lag, so nobody reads those keys again

DiLoCo announces when it starts an exchange and awaits just before it waits on the collective, so
Streaming DiLoCo's overlap is kept: a slow replica delays the others only at the point where they need its
data anyway. A replica that dies after the check, inside the collective itself, is caught by the process
group's timeout instead (``init_process_group(timeout=...)``).

What is not implemented: the survivors continuing without the lost replica and a restarted replica
rejoining from the outer parameters (torchft's quorum). The last ``lag`` keys of a replica stay in the store
until the job ends (deleting them at exit could race with a replica still waiting on them); a later watch
over the same ranks in the same job then finds them set, which only makes its first checks pass early. Here the survivors stop with the error; the job is
restarted from the last checkpoint (``--load``), which holds every replica's outer state.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Sequence


class ReplicaLost(RuntimeError):
    """An outer exchange found replicas that did not arrive within the timeout (the message names them)."""


class ReplicaWatch:
    """Arrival checks of one outer group (see the module docstring).

    Args:
        outer_ranks: the global ranks of the outer group, in replica order (ReplicaGroups.outer_ranks).
        replica: this rank's replica index (its position in ``outer_ranks``).
        timeout_s: how long to wait for the other replicas at an exchange (> 0).
        lag: the most exchanges in flight at once on one replica (>= 1; see the module docstring).
        store: the key-value store (default: the default process group's store).
    Raises:
        ValueError: ``timeout_s`` <= 0, or ``replica`` outside ``outer_ranks``.
    """

    def __init__(self, outer_ranks: Sequence[int], replica: int, timeout_s: float, lag: int = 1, store=None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"the outer-step timeout must be > 0 seconds, got {timeout_s}")
        if not 0 <= replica < len(outer_ranks):
            raise ValueError(f"replica {replica} is not in the outer group {list(outer_ranks)}")
        if store is None:
            from torch.distributed import distributed_c10d
            store = distributed_c10d._get_default_store()  # the job's store: no private copy of the rendezvous
        self.ranks, self.replica, self.timeout_s, self.store = list(outer_ranks), replica, float(timeout_s), store
        self.lag = max(1, int(lag))
        self.prefix = "megacomp/outer/" + ",".join(map(str, self.ranks))
        self._announced: list[int] = []

    def _key(self, n: int, replica: int) -> str:
        return f"{self.prefix}/{n}/{replica}"

    def announce(self, n: int) -> None:
        """Say that this replica reached exchange ``n``."""
        self.store.set(self._key(n, self.replica), "1")
        self._announced.append(n)

    def await_all(self, n: int) -> None:
        """Wait until every replica reached exchange ``n``.

        Raises:
            ReplicaLost: replicas missing after ``timeout_s`` (named, with their global ranks).
        """
        keys = [self._key(n, r) for r in range(len(self.ranks))]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except RuntimeError:  # the store's timeout; which replicas are missing is read back below
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not missing:
                return  # they arrived just as the wait gave up
            who = ", ".join(f"replica {r} (global rank {self.ranks[r]})" for r in missing)
            raise ReplicaLost(
                f"outer exchange {n}: {who} did not arrive within {self.timeout_s:g} s (--outer-timeout); it stopped "
                f"(see its own log) or is stalled. The surviving replicas stop here: restart the job from the last "
                f"checkpoint with --load, or raise --outer-timeout if replicas are just slow") from None
        done = [m for m in self._announced if m <= n - self.lag]
        for m in done:
            self.store.delete_key(self._key(m, self.replica))
        self._announced = [m for m in self._announced if m > n - self.lag]

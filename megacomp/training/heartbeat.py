"""Liveness of a run's ranks: a heartbeat through the rendezvous store, and the one line that names a rank
that stalled (SIGSTOP, a hung node) or was lost (killed, its node gone).

Every rank runs a :class:`Heartbeat` thread that, every ``interval`` seconds, writes its beat to the default
group's store: ``megacomp/heartbeat/<rank>`` = a counter, the iteration it reached, its host, its pid, and
(once it stops) its exit status. The thread also reads the beat of one peer, its ring successor
(``rank + 1 mod world``), so every rank is watched by exactly one other and the store sees O(world) small
requests per interval, not O(world²). A beat is judged by whether its counter moves, measured on the
watcher's own monotonic clock, so the hosts' clocks need not agree.

Two ways a verdict is reached, both bounded:
  - the watcher sees its peer's counter stand still for ``timeout_s`` (``--distributed-timeout-minutes``): the
    peer is stalled or lost, whatever the others are doing; the watcher says so and ends its process, so the
    job stops within the timeout plus one interval even where a collective would wait longer;
  - a collective fails on some rank (gloo's "connection closed by peer" the moment a rank dies, or the group's
    timeout): :meth:`Heartbeat.diagnose` reads every rank's beat, waits ``3 x interval`` and reads again; the
    ranks whose counters stood still are the lost ones, a rank that stopped with an error status is the
    cause (its own line already said why).
Exactly one rank prints the verdict: the first to claim it with an atomic ``add`` on the store. A rank that
stops cleanly (or with an error it reported) writes a last beat with its exit status, so it is never taken
for a lost one. When the store itself cannot be reached, its host (rank 0's, under srun or mpirun; torchrun
keeps it in its agent) was lost: the line names rank 0 with the last beat this rank read from it, printed by
one rank per surviving node (local rank 0, or local rank 1 on rank 0's node), since no store is left to
arbitrate. After the first failed store request nothing touches the store again (each failure makes torch
print a warning with a C++ stack).

Under torchrun the thread also watches the launcher: torchrun's workers are its children, so the parent pid
recorded at start changes (the worker is re-parented) the moment torchrun dies. A worker whose launcher died
keeps training on its own gloo links, and torchrun's agent held the rendezvous store, so the store died with it:
from the first tick that sees the new parent (within one interval) the thread touches the store no more (a failed
store request makes torch print a C++ stack) and :meth:`Heartbeat.launcher_stop` names the launcher, which the
trainer polls at every iteration boundary and agrees on over all ranks (megacomp.training.signals.stop_requested):
the ranks stop at the same boundary, saving it with ``--save``. A rank that has not stopped ``timeout_s`` after
the launcher died (a peer that cannot reach the boundary) ends with the launcher's line saying nothing was saved.
A worker started under torchrun by a wrapper (``--no-python``, a shell script that does not ``exec``) has the
wrapper for its parent, which outlives torchrun: there the store's loss is the verdict, as under srun.

Failure behaviour: the thread never raises; the store unreachable for ``timeout_s`` is itself the verdict. False
verdicts need a process alive but unable to run a Python thread for ``timeout_s`` (a stopped process is exactly
that) or, in :meth:`diagnose`, for three intervals after a collective already failed.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch.distributed as dist

from ..comm.peer_exit import HEARTBEAT_PREFIX
from ..launch import detect_launch_env

PREFIX = HEARTBEAT_PREFIX  # megacomp.comm.peer_exit owns the layout: a waiting collective check reads it
VERDICT_KEY = PREFIX + "verdict"


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between beats for a collective timeout of ``timeout_s``: a twentieth of it, within [0.25, 2]
    (the diagnosis after a failed collective takes three intervals, at most 6 s)."""
    return min(2.0, max(0.25, timeout_s / 20))


@dataclass
class Beat:
    """One rank's last beat as read from the store."""

    rank: int
    """The rank that wrote it."""
    count: int
    """Beats written so far (the watcher only compares it with its previous reading)."""
    iteration: int
    """The last iteration the rank completed."""
    host: str
    """Its host name."""
    pid: int
    """Its process id."""
    exit_status: Optional[int] = None
    """Its exit status once it stopped on purpose (0, or an error it reported itself); None while it runs."""

    @classmethod
    def parse(cls, rank: int, raw: bytes) -> "Beat":
        """A beat from its stored JSON (``{"n", "it", "host", "pid", "exit"}``)."""
        d = json.loads(raw)
        return cls(rank, int(d["n"]), int(d["it"]), str(d["host"]), int(d["pid"]), d.get("exit"))


class Heartbeat:
    """This rank's heartbeat thread (see the module docstring).

    Args:
        timeout_s: how long a watched peer's beat may stand still before it is declared lost.
        progress: returns the last iteration this rank completed (read by the thread at every beat).
        on_verdict: called on the thread with the verdict line and whether this rank claimed it (it must print
            the line when it did) when the watched peer is lost; it should end the process.
        store, rank, world: the store and this rank's place (default: the default group's).
        interval: seconds between beats (default :func:`heartbeat_interval`).
        local_rank: this rank's place on its node (default: the launcher's, megacomp.launch.detect_launch_env).
        launcher_pid: the pid of the launcher whose death stops the run (its child's parent); default: this
            process's parent under torchrun (``TORCHELASTIC_RUN_ID`` set), else None (not watched).
    """

    def __init__(self, timeout_s: float, progress: Callable[[], int], on_verdict: Callable[[str, bool], None],
                 store=None, rank: Optional[int] = None, world: Optional[int] = None,
                 interval: Optional[float] = None, local_rank: Optional[int] = None,
                 launcher_pid: Optional[int] = -1) -> None:
        self.timeout_s = float(timeout_s)
        self.interval = interval if interval is not None else heartbeat_interval(self.timeout_s)
        self.progress, self.on_verdict = progress, on_verdict
        self.store = store if store is not None else dist.distributed_c10d._get_default_store()
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.local_rank = detect_launch_env().local_rank if local_rank is None else local_rank
        self.store_failed_at: Optional[float] = None  # monotonic time of the first failed store request
        self.launcher_pid = (os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None) if launcher_pid == -1 \
            else launcher_pid
        self.launcher_lost: Optional[str] = None  # why the run stops: the launcher died (set once, by the thread)
        self.launcher_lost_at: Optional[float] = None
        self.count = 0
        self.known: dict[int, Beat] = {}  # the last beat read per rank (the watched peer's and rank 0's)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's beat and stop()'s last beat never interleave
        self._thread = threading.Thread(target=self._run, name="megacomp-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        """Write the first beat and start the thread; returns self. Until :meth:`stop`, an exit handler stops the
        thread before the interpreter shuts down: a daemon thread still inside a store request then would be ended
        by a forced unwind through torch's C++ code, which aborts the process ("terminate called without an active
        exception") instead of exiting with its status."""
        self._beat()
        if self.rank != 0 and self.world > 1:
            self._learn_rank0()
        self._thread.start()
        atexit.register(self._halt)
        return self

    def _learn_rank0(self) -> None:
        """Read rank 0's first beat before training starts, waiting for it (every rank starts its heartbeat right
        after the launch rendezvous, so the wait is that skew): the line for a store lost with rank 0 names its
        host and pid, and a small run can lose rank 0 before the thread's first tick. Waits at most the
        timeout; a store already gone is the thread's to judge."""
        from datetime import timedelta
        try:
            self.store.wait([f"{PREFIX}0"], timedelta(seconds=max(1.0, self.timeout_s)))
            self.read(0)
        except Exception:  # noqa: BLE001 - rank 0 stalled or went away during start-up: the thread judges it
            pass

    def stop(self, exit_status: Optional[int] = 0) -> None:
        """Stop the thread and write a last beat with ``exit_status``, so no peer takes this rank for lost
        (call it before the process groups close). Never raises: the store may be gone already."""
        atexit.unregister(self._halt)
        self._halt()
        if self.store_failed_at is None:
            try:
                self._beat(exit_status=exit_status)
            except Exception:  # noqa: BLE001 - the store went away with its host: nobody is left to read it
                pass

    def _halt(self) -> None:
        """End the thread (waiting at most one interval and a second for a store request in flight)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 1.0)

    # -- the thread ---------------------------------------------------------------------------------------
    def _beat(self, exit_status: Optional[int] = None) -> None:
        with self._lock:
            self.count += 1
            beat = {"n": self.count, "it": int(self.progress()), "host": self.host, "pid": self.pid}
            if exit_status is not None:
                beat["exit"] = int(exit_status)
            self.store.set(f"{PREFIX}{self.rank}", json.dumps(beat))

    def read(self, rank: int) -> Optional[Beat]:
        """``rank``'s last beat, or None when it has written none yet (raises the store's error when the
        store cannot be reached)."""
        key = f"{PREFIX}{rank}"
        if not self.store.check([key]):
            return None
        beat = Beat.parse(rank, self.store.get(key))
        self.known[rank] = beat
        return beat

    def _run(self) -> None:
        peer = (self.rank + 1) % self.world
        watched = self.world > 1
        last_count, since = None, time.monotonic()
        # quick ticks until rank 0's beat was read once: the line for a store lost with rank 0 names its host and
        # pid, and a run can lose rank 0 before the first full interval
        while not self._stop.wait(self.interval if 0 in self.known or self.rank == 0 else min(self.interval, 0.5)):
            if self.launcher_lost is None and self._launcher_died():  # before any store request: it may be gone
                self.launcher_lost = f"the launcher died (torchrun pid {self.launcher_pid} on host {self.host})"
                self.launcher_lost_at = self.store_failed_at = time.monotonic()
            if self.launcher_lost is not None:  # the trainer stops at its next boundary: only the deadline is ours
                if time.monotonic() - self.launcher_lost_at > self.timeout_s and not self._stop.is_set():
                    self.on_verdict(self.launcher_line(None), self.local_rank == 0)
                    return
                continue
            if self.store_failed_at is not None:  # judged without touching the store again
                silent = time.monotonic() - self.store_failed_at
                if silent > self.timeout_s and not self._stop.is_set():
                    self.on_verdict(self.store_lost_line(), self.store_reporter())
                    return
                continue
            try:
                self._beat()
                beat = self.read(peer) if watched else None
                if peer != 0 and watched:
                    self.read(0)  # rank 0's host and iteration, for the line when the store goes with it
            except Exception:  # noqa: BLE001 - the store's host stopped answering; judged above from now on
                self.store_failed_at = self.store_failed_at or time.monotonic()
                continue
            now = time.monotonic()
            if beat is None or beat.exit_status is not None:
                if beat is not None:
                    since = now  # stopped on purpose: not lost
                elif now - since > self.timeout_s and not self._stop.is_set():
                    self._declare([Beat(peer, 0, 0, "unknown host", 0)], now - since)
                    return
                continue
            if beat.count != last_count:
                last_count, since = beat.count, now
            elif now - since > self.timeout_s and not self._stop.is_set():
                self._declare([beat], now - since)
                return

    def _launcher_died(self) -> bool:
        return self.launcher_pid is not None and os.getppid() != self.launcher_pid

    def launcher_stop(self) -> Optional[str]:
        """Why the run must stop (the launcher died), or None: what the trainer polls at each iteration boundary."""
        return self.launcher_lost

    def launcher_line(self, saved: Optional[str], reason: Optional[str] = None) -> str:
        """The line after the launcher died (``reason``, default this rank's): ``saved`` says where the ranks
        stopped and what was kept; None: they could not agree on a boundary within the timeout (or a collective
        failed), so nothing was saved."""
        what = saved or (f"the ranks could not stop together at an iteration boundary (after iteration "
                         f"{int(self.progress())}), so nothing after the last checkpoint was saved")
        return f"{reason or self.launcher_lost}: {what}; start the job again to continue"

    def _declare(self, lost: list[Beat], silent_s: float) -> None:
        self.on_verdict(lost_line(lost, silent_s, int(self.progress())), self.claim())

    def claim(self) -> bool:
        """Whether this rank is the first to claim the verdict (the one that prints it); atomic on the store.
        Without a store, :meth:`store_reporter` decides."""
        if self.store_failed_at is not None:
            return self.store_reporter()
        try:
            return self.store.add(VERDICT_KEY, 1) == 1
        except Exception:  # noqa: BLE001 - no store, no arbiter
            self.store_failed_at = time.monotonic()
            return self.store_reporter()

    def store_reporter(self) -> bool:
        """Whether this rank prints a verdict no store can arbitrate: local rank 0 of each node, and local rank 1
        on rank 0's node (whose local rank 0 is the one lost): one line per surviving node."""
        r0 = self.known.get(0)
        return self.local_rank == 0 or (self.local_rank == 1 and (r0 is None or r0.host == self.host))

    def store_lost_line(self) -> str:
        """The verdict when the store stopped answering: its host went away, with rank 0 under srun/mpirun."""
        r0 = self.known.get(0)
        it = max(r0.iteration if r0 else 0, int(self.progress()))
        if r0 is None:  # rank 0 itself (it reads no beat of its own), or no beat of rank 0 read yet
            return (f"lost the rendezvous store after iteration {it}: its host (rank 0's node, or the launcher's) was "
                    f"lost; the other ranks stop: resume from the last checkpoint")
        return (f"lost the rendezvous store, hosted with rank 0 (host {r0.host}, pid {r0.pid}) after iteration {it}: "
                f"rank 0 or its node was lost; the other ranks stop: resume from the last checkpoint")

    # -- after a failed collective ------------------------------------------------------------------------
    def diagnose(self, window_s: Optional[float] = None) -> tuple[str, list[Beat]]:
        """Which peers caused a failed collective: reads every rank's beat, waits ``window_s`` (default three
        intervals, at least one second) and reads again. Returns ``("lost", beats)`` for the ranks whose counters
        stood still (their last beats), ``("exited", beats)`` for ranks that stopped with an error status of
        their own when none is lost, ``("store", [])`` when the store cannot be reached, else ``("", [])``."""
        window_s = max(1.0, 3 * self.interval) if window_s is None else window_s
        peers = [r for r in range(self.world) if r != self.rank]
        if self.store_failed_at is not None:
            return "store", []
        try:
            first = {r: self.read(r) for r in peers}
            deadline = time.monotonic() + window_s
            while time.monotonic() < deadline:
                time.sleep(min(self.interval, max(0.0, deadline - time.monotonic())))
                self._beat()  # the thread may be the one stopped: this rank stays visibly alive meanwhile
            second = {r: self.read(r) for r in peers}
        except Exception:  # noqa: BLE001 - the store's host went away (with rank 0 under srun / mpirun)
            self.store_failed_at = self.store_failed_at or time.monotonic()
            return "store", []
        def still(r: int) -> bool:  # no beat at all, or a running rank's counter that did not move
            now, before = second[r], first[r]
            return now is None or (now.exit_status is None and before is not None and before.count == now.count)

        lost = [second[r] or Beat(r, 0, 0, "unknown host", 0) for r in peers if still(r)]
        if lost:
            return "lost", lost
        exited = [b for b in second.values() if b is not None and b.exit_status not in (None, 0)]
        return ("exited", exited) if exited else ("", [])


def lost_line(lost: list[Beat], silent_s: float, own_iteration: int = 0) -> str:
    """The verdict line for ``lost`` peers (one named in full, the others by rank). The iteration named is the
    later of the peer's last beat and ``own_iteration`` (the reporter's): ranks complete iterations in lockstep,
    so a peer the reporter waits for completed at least as many, and a beat is up to an interval old."""
    first = lost[0]
    more = f" (and {len(lost) - 1} more rank{'s' * (len(lost) > 2)}: {', '.join(str(b.rank) for b in lost[1:])})" \
        if len(lost) > 1 else ""
    return (f"rank {first.rank} (host {first.host}, pid {first.pid}) stopped responding after iteration "
            f"{max(first.iteration, own_iteration)}: no heartbeat for {silent_s:.0f} s, stalled or lost{more}; "
            f"the other ranks stop: resume from the last checkpoint")

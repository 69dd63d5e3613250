"""torchft's Lighthouse for megacomp's replica groups: running one, asking whether one answers, and torchft's logging.

The Lighthouse (torchft's ``LighthouseServer``, Rust) holds only the membership: which replica groups are alive
(their heartbeats) and the quorum it formed last. Losing it loses no training state; a Lighthouse restarted on the
same address forms the next quorum from the groups that ask it (megacomp.integrations.torchft: a quorum that
finds it gone is retried until the quorum timeout).

Logging: torchft's Rust side logs every heartbeat failure, quorum request and commit vote at INFO on stderr, and
reads its level once, from ``RUST_LOG``, when ``torchft._torchft`` is first imported. :func:`import_torchft` makes
that level WARNING unless ``RUST_LOG`` is set, and gives torchft's Python loggers the same level: set
``RUST_LOG=info`` (or debug, trace) to see torchft's own lines, from the replica groups and the Lighthouse alike.
A process that imported torchft before megacomp keeps the level it had then.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Optional

TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
QUIET = "warn"  # torchft's level unless RUST_LOG says otherwise: its errors and warnings, none of its INFO lines


def import_torchft():
    """Import torchft with its logging at ``RUST_LOG`` (WARNING when unset: see the module docstring); returns
    torchft's ``Manager`` and ``ProcessGroupGloo``.

    Raises:
        ImportError: torchft is not installed (one line, with the fix).
    """
    level = os.environ.get("RUST_LOG")
    first = "torchft._torchft" not in sys.modules
    try:
        if first and level is None:  # read once, at the extension's import: set it for that moment only
            os.environ["RUST_LOG"] = QUIET
        try:
            import torchft  # noqa: F401
            from torchft import Manager, ProcessGroupGloo
        finally:
            if first and level is None:
                os.environ.pop("RUST_LOG", None)
    except ImportError as e:  # one line, with the fix
        raise ImportError("megacomp.integrations.torchft needs torchft: pip install 'torchft==0.2.0' "
                          "(or bash scripts/install.sh test; setup.py extra 'torchft')") from e
    if first:
        _python_logging(level)
    return Manager, ProcessGroupGloo


def _python_logging(rust_log: Optional[str]) -> None:
    """torchft's Python loggers at the Rust side's level: WARNING by default; under ``RUST_LOG=info`` (debug,
    trace) at that level, on stderr unless the application gave them a handler of its own."""
    name = (rust_log or QUIET).lower()
    level = {"error": logging.ERROR, "warn": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG,
             "trace": logging.DEBUG}.get(name, logging.INFO)  # torchft's own reading: anything else is info
    for logger_name in TORCHFT_LOGGERS:
        logger = logging.getLogger(logger_name)
        logger.setLevel(level)
        if rust_log is not None and level <= logging.INFO and not logger.hasHandlers():
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] [%(name)s] - %(message)s"))
            logger.addHandler(handler)


class QuorumClient:
    """torchft's ``ManagerClient`` (one per rank, ``Manager._client``) with the two things a restarted Lighthouse needs
    from the quorum results it returns to the ``Manager``.

    torchft reconfigures its process group only when the quorum number changes, and builds the group's store prefix
    from that number: both assume the numbers of one Lighthouse, which are never reused. A restarted Lighthouse
    numbers its quorums from 1 again, so (a) a quorum of other members may come with the number the group already
    has (a group that reconnected first forms a quorum alone, numbered 1, while its group still holds the members of
    the old quorum 1): the ``Manager`` would keep the old group, whose collectives then wait out their timeout; and
    (b) a reconfigured group would meet the store keys the old quorum of that number left.

    and a group that did not take part in the new Lighthouse's first quorums may meet its old number and members
    again while the others, whose number changed, reconfigure without it.

    So, per quorum result: (a) when its number is the group's but its members (torchft's replica ids, which carry a
    per-process uuid) are not the ones the group was configured with, or this group must heal (be sent the state:
    under one Lighthouse a group falls behind its quorum only by failing a commit, and the Lighthouse gives the next
    quorum a new number after a failed commit, so behind under the same number and members means the others
    stepped under a restarted Lighthouse), the ``Manager``'s quorum number is cleared, which makes it reconfigure;
    (b) the store address gets the suffix ``/megacomp/<max step>/<digest of the
    members>``, the same on every member of the quorum (they receive the same step and members), so a group is
    never configured twice under one prefix unless the same members meet again at the same step under the same
    number. Everything else passes through unchanged.
    """

    def __init__(self, client, manager) -> None:
        self._client, self._manager = client, manager
        self._configured: Optional[tuple] = None  # (quorum number, members) the process group was configured for

    @property
    def configured(self) -> Optional[tuple]:
        """(quorum number, sorted replica ids) the process group was last configured for (None before the first)."""
        return self._configured

    def _quorum(self, *args, **kwargs):
        result = self._client._quorum(*args, **kwargs)
        members = tuple(sorted(result.replica_ids))
        if result.quorum_id == self._manager._quorum_id and ((result.quorum_id, members) != self._configured
                                                            or result.heal):
            self._manager._quorum_id = -1  # a quorum the group was not configured for: reconfigure
        if result.quorum_id != self._manager._quorum_id:  # the Manager reconfigures for this result
            self._configured = (result.quorum_id, members)
        digest = hashlib.sha1("|".join(members).encode()).hexdigest()[:16]
        return _QuorumResult(result, f"{result.store_address}/megacomp/{result.max_step}/{digest}")

    def __getattr__(self, name: str):
        return getattr(self._client, name)


class _QuorumResult:
    """torchft's QuorumResult with another store address (its fields are read-only)."""

    def __init__(self, result, store_address: str) -> None:
        self._result, self.store_address = result, store_address

    def __getattr__(self, name: str):
        return getattr(self._result, name)


def lighthouse_answers(address: str, timeout_s: float) -> bool:
    """Whether the Lighthouse at ``address`` accepts a connection within ``timeout_s`` (torchft's own client: TCP
    and the gRPC channel; no heartbeat is sent, so the Lighthouse counts no replica for it)."""
    import_torchft()
    from torchft._torchft import LighthouseClient
    try:
        LighthouseClient(address, connect_timeout=timedelta(seconds=timeout_s))
    except RuntimeError:
        return False
    return True


def local_lighthouse(min_replicas: int = 1):
    """torchft's LighthouseServer in this process on a free port (for one machine: a try-out, a test); returns the
    server (``.address()``, ``.shutdown()``). Replica groups on other machines need scripts/torchft_lighthouse.sh."""
    import_torchft()
    from torchft._torchft import LighthouseServer
    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=200, quorum_tick_ms=10,
                            heartbeat_timeout_ms=2000)


def lighthouse_main(argv: Optional[list] = None) -> None:
    """Run torchft's Lighthouse until SIGTERM/SIGINT (``python -m megacomp.integrations.torchft --help``); prints
    ``lighthouse: http://host:port`` once it listens."""
    p = argparse.ArgumentParser(prog="python -m megacomp.integrations.torchft",
                                description="torchft's Lighthouse: forms the quorum of replica groups. torchft's own "
                                            "log lines: set RUST_LOG=info (default: warnings only).")
    p.add_argument("--bind", default="[::]:29510", help="address:port to listen on (port 0: any free port)")
    p.add_argument("--min-replicas", type=int, default=1, help="smallest quorum")
    p.add_argument("--join-timeout-ms", type=int, default=1000,
                   help="how long a forming quorum waits for heartbeating replicas that have not asked yet")
    p.add_argument("--quorum-tick-ms", type=int, default=10, help="how often a forming quorum is checked")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000,
                   help="a replica silent this long is dead (bounds how long survivors wait for a new quorum)")
    a = p.parse_args(argv)
    import_torchft()
    from torchft._torchft import LighthouseServer
    server = LighthouseServer(bind=a.bind, min_replicas=a.min_replicas, join_timeout_ms=a.join_timeout_ms,
                              quorum_tick_ms=a.quorum_tick_ms, heartbeat_timeout_ms=a.heartbeat_timeout_ms)
    print(f"lighthouse: {server.address()}", flush=True)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.2)
    server.shutdown()

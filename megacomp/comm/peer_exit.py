"""Where a rank says, in the default group's store, that it stopped: read by a collective's check that waits for
its peers, so a peer that stopped before reaching the call ends the wait at once instead of at the store's timeout.

Every rank of ``megacomp-pretrain`` writes its heartbeat to ``megacomp/heartbeat/<rank>`` (megacomp.training.heartbeat:
JSON with its iteration, host, pid and, once it stops on purpose, ``"exit"``: its exit status). This module owns
that key layout, below the training layer, so that megacomp.comm.group_check can read it without importing the
trainer. A process that runs no heartbeat (the library without the pretraining loop) writes no key: nothing is
ever reported stopped, and waits end as before (at the store's timeout).

Failure behaviour: :func:`stopped_ranks` reads only keys that exist (a non-blocking ``check`` first) and never
raises for a missing or unparsable beat (that rank is simply not reported); a store that cannot be reached raises
its own error.
"""
from __future__ import annotations

import json

HEARTBEAT_PREFIX = "megacomp/heartbeat/"
"""Namespace of the heartbeat keys in the default store: ``<prefix><rank>`` holds that rank's last beat."""


def heartbeat_key(rank: int) -> str:
    """The store key of ``rank``'s beat."""
    return f"{HEARTBEAT_PREFIX}{rank}"


def stopped_ranks(store, ranks) -> dict[int, int]:
    """{rank: exit status} for those of ``ranks`` whose last beat says they stopped (status 0 included)."""
    out = {}
    for r in ranks:
        key = heartbeat_key(r)
        if not store.check([key]):
            continue
        try:
            status = json.loads(store.get(key)).get("exit")
        except (ValueError, AttributeError):
            continue
        if status is not None:
            out[r] = int(status)
    return out

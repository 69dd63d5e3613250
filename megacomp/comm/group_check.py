"""The group half of the cross-rank argument check: ranks that pass different groups to one collective all raise
the same ValueError within seconds, before any collective is issued, instead of waiting out the process-group
timeout.

Why a store: the argument check (megacomp.comm.common.validate) is a collective over the call's group. When the
ranks disagree on the group (rank 0 passes ``new_group([0, 1])``, ranks 1 and 2 the world group; or two group
objects of the same members), that collective is itself mismatched: every rank waits the process-group timeout and
raises its own gloo/NCCL error. The rendezvous store of the default group (``init_process_group``'s: a TCPStore
under torchrun, a FileStore in the tests) is shared by every rank, so the ranks meet there first. Only validated
calls (``CommOptions.validate`` or ``check_finite``) of a registered group of two or more ranks take part; with
validation off nothing here runs and the store is not touched. Process-group objects served by their own methods
(torchft's, megacomp.comm.group_ops) have no shared store and are not checked.

Protocol. Every rank counts its validated calls per group, by the group's name (torch.distributed gives every
member the same name, and two groups of the same members different ones): since collectives must be issued on a
group in the same order by all its members, call ``n`` of group ``g`` is the same call on every member.
  post: add 1 to the call's counter key ``<g>/<n>``. The member whose add makes it the group size passes (and
    deletes the counter of call ``n - 1``, which every member has left); the others poll the counter (a
    non-blocking compare-and-set read, backing off to 1/8 of the time waited, at most 0.1 s) until it is the group
    size. So a call whose members arrive together costs each rank two or three store operations.
  record: a rank that has waited 0.05 s writes ``at/<rank>`` = (g, n, members, collective) and clears it when it
    leaves the call. A rank is in one call at a time and leaves it only once its counter is complete, so a record
    read twice, unchanged, with the call's counter below the group size in between, proves that rank was stuck in
    that call throughout.
  deadlock search: the member that posted the call first (it has waited longest) searches, from 0.1 s of waiting,
    then at doubling intervals up to 2 s: it follows edges from a stuck rank to each member of that rank's call that
    is stuck in another call (such a member cannot post this call before its own completes). Edges depend only on a
    rank's call, so the first poster of any call of a cycle finds it. A cycle of stuck ranks never moves: each waits
    for the next, which waits in another call. Its calls' counters are read again (all below their group size) and
    its ranks' records once more (unchanged), so they were all stuck at once; then each call of the cycle gets a
    verdict (compare-and-set: the first wins) and its counter is raised by 2**40, which tells everyone posted to it,
    and anyone posting later, to read the verdict.
  verdict: the ValueError naming, per call of the cycle, its lowest rank and that call's group (its ranks, and its
    name where two groups have the same ranks). Every rank of those calls raises that same line. The mismatched
    calls are used up: a rank that later reaches a poisoned call it has no part in (rank 0's next world-group call
    after it raised on ``[0, 1]``) skips to the next counter, so the ranks stay aligned and the groups stay usable
    (no collective was issued on them).
Ranks in different, legitimately different groups at the same time (TP groups {0, 1} and {2, 3}) use different
keys and never meet; a rank waiting for a member busy in another group that is not stuck in a cycle just waits.

Cost: two or three store operations per validated call when the members arrive together (a fraction of the argument
all-gather that follows), a few more per rank that waits, one read per member of a call per search. Left in the
store: one counter key per group, one record key per rank that ever waited, one verdict key per mismatch.

Bound and failure behaviour: a mismatch raises on every rank of the calls involved within about 0.1-2.5 s of the
last of them arriving (the first search's delay, then the search interval). A member that never posts the call (it skipped the
collective, or called it with validation off) leaves the others waiting until the store's timeout
(``init_process_group``'s); the first to give up words a RuntimeError naming the missing ranks and poisons the call
(a compare-and-set on the counter, so a member arriving at that moment completes it instead), and every posted
member raises that line. A member whose heartbeat says it stopped (megacomp.comm.peer_exit: under megacomp-pretrain a
rank that ended on an error of its own) ends the wait the same way within 0.5 s, naming it and its exit status. Only calls from the main thread are checked: a background thread's calls (ACCO's update, the
overlapped parameter all-gather) come from the same thread on every rank and keep only the argument validation.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import group_ops, peer_exit

PREFIX = "megacomp/group_check/"
"""Namespace of this check's keys in the default store."""
POISON = 1 << 40
"""Added to a call's counter by its verdict: every count at or above it means 'read the verdict'."""
RECORD_AFTER_S = 0.05
"""A rank publishes which call it waits in after this long (deadlock searches read it)."""
FIRST_SEARCH_S = 0.1
"""Waited time before the first deadlock search; the interval then doubles up to :data:`SEARCH_EVERY_S`."""
SEARCH_EVERY_S = 2.0
"""Longest interval between two deadlock searches of a waiting rank."""
EXIT_CHECK_EVERY_S = 0.5
"""A waiting rank reads its peers' heartbeats (megacomp.comm.peer_exit) this often, from this long on."""
_PEEK = "\x00"  # compare-and-set with this expected = desired value: a read that neither blocks nor creates the key


class GroupCheck:
    """This process's validated-call counters per group and the check itself (:meth:`check`); one per process,
    rebuilt when the default process group changes (a new ``init_process_group`` has a new store)."""

    def __init__(self) -> None:
        self._pg = None
        self._store = None
        self._counters: dict[str, int] = {}
        self._lock = threading.Lock()

    def check(self, what: str, group) -> None:
        """Meet the other members of ``group`` for collective ``what`` in the store (see the module docstring).

        Raises:
            ValueError: the ranks disagree on the group (the same line on every rank of the calls involved).
            RuntimeError: a member did not reach the call within the store's timeout (naming it).
        """
        if group_ops.is_object_group(group):
            return
        g = group if group is not None else dist.group.WORLD
        ranks = group_ops.member_ranks(g)
        if len(ranks) < 2:
            return
        # only the main thread's calls meet: which thread issues a call is decided by the code path, the same on every
        # rank (ACCO's and the overlapped all-gather's background threads on all of them), so every rank counts the
        # same calls per group; skipping a call because another thread happened to be in a check would not be
        # (a rank whose count falls behind leaves its peers waiting for a call it never posts)
        if threading.current_thread() is not threading.main_thread():
            return
        with self._lock:
            self._check(what, g, ranks)

    def _check(self, what: str, g, ranks: list[int]) -> None:
        store = self._bind()
        name = _group_name(g)
        me = dist.get_rank()
        while True:
            n = self._counters.get(name, 0)
            self._counters[name] = n + 1
            verdict = _Call(store, me, what, name, n, ranks).meet()
            if verdict is None:
                return
            # a verdict on a call this rank has not raised for yet is its own; one it raised on another call of the
            # same verdict (it posted that one) is used up: this rank's call is the next one
            seen = any((c[0], c[1]) != (name, n) and me in c[2] and self._counters.get(c[0], 0) > c[1]
                       for c in verdict["calls"])
            if not seen:
                raise (RuntimeError if verdict.get("error") == "RuntimeError" else ValueError)(verdict["text"])

    def _bind(self):
        pg = c10d._get_default_group()
        if pg is not self._pg:
            self._pg, self._store, self._counters = pg, c10d._get_default_store(), {}
        return self._store


class _Call:
    """One validated call of one rank: posting, waiting, searching for a deadlock."""

    def __init__(self, store, me: int, what: str, name: str, n: int, ranks: list[int]) -> None:
        self.store, self.me, self.what, self.name, self.n, self.ranks = store, me, what, name, n, ranks
        self.key = _count_key(name, n)
        self.record = [name, n, ranks, what]
        self.recorded = False  # whether at/<me> names this call (emptied when the rank leaves it)
        self.searcher = False  # whether this rank posted the call first: it searches for a deadlock, the others wait

    def meet(self) -> Optional[dict]:
        """Post this call and wait until every member did (None) or a verdict came (the verdict)."""
        size = len(self.ranks)
        count = self.store.add(self.key, 1)
        self.searcher = count == 1
        if count == size:
            if self.n:  # every member has left call n - 1 (each posted call n after it)
                self.store.delete_key(_count_key(self.name, self.n - 1))
            return None
        try:
            return self._wait(count, size)
        finally:
            if self.recorded:
                self.store.set(_record_key(self.me), "")

    def _wait(self, count: int, size: int) -> Optional[dict]:
        start = time.monotonic()
        deadline = start + self.store.timeout.total_seconds()
        gap, search_at = FIRST_SEARCH_S, start + FIRST_SEARCH_S
        exit_check_at = start + EXIT_CHECK_EVERY_S
        while count < size:
            now = time.monotonic()
            waited = now - start
            if now >= exit_check_at:
                exit_check_at = now + EXIT_CHECK_EVERY_S
                stopped = peer_exit.stopped_ranks(self.store, [m for m in self.ranks if m != self.me])
                # a member posts a call before it can stop, so a counter still short after its stop was read is one
                # it will never complete
                if stopped and int(self.store.compare_set(self.key, _PEEK, _PEEK)) < size:
                    self._give_up(waited, stopped)
            if waited >= RECORD_AFTER_S and not self.recorded:
                self.store.set(_record_key(self.me), json.dumps(self.record))
                self.recorded = True
            if now >= search_at and self.searcher:
                self._search()
                gap = min(2 * gap, SEARCH_EVERY_S)
                search_at = time.monotonic() + gap
            elif now >= deadline:
                self._give_up(waited)
            else:
                time.sleep(min(max(5e-5, waited / 8), 0.1))
            count = int(self.store.compare_set(self.key, _PEEK, _PEEK))  # never deleted while we are in it
        if count == size:
            return None
        return json.loads(self.store.get(_verdict_key(self.name, self.n)))

    def _give_up(self, waited: float, stopped: Optional[dict] = None) -> None:
        """The store's timeout passed, or members ``stopped`` ({rank: exit status}: their processes ended without
        posting this call): post the verdict naming the members that never came (the first rank to give up words
        it, while every posted member still waits and shows its record), then poison the call unless it completed
        meanwhile (a compare-and-set on the counter's value: a member arriving now is not overruled)."""
        if stopped:
            text = (f"megacomp.comm.{self.what}: rank(s) {sorted(stopped)} of the group of ranks {self.ranks} stopped "
                    f"(exit status {', '.join(str(stopped[r]) for r in sorted(stopped))}) before reaching this call")
        else:
            recs = _records(self.store, self.ranks)
            missing = [m for m, rec in zip(self.ranks, recs)
                       if m != self.me and (rec is None or rec[:2] != self.record[:2])]
            text = (f"megacomp.comm.{self.what}: rank(s) {missing} of the group of ranks {self.ranks} did not reach "
                    f"this call within {waited:.0f} s (the store's timeout, init_process_group's); every rank of a "
                    f"group must make the same validated collective calls on it, in the same order")
        self.store.compare_set(_verdict_key(self.name, self.n), "",
                               json.dumps({"calls": [self.record[:3]], "text": text, "error": "RuntimeError"}))
        while True:
            raw = self.store.compare_set(self.key, _PEEK, _PEEK)
            count = int(raw)
            if count >= len(self.ranks):  # completed, or poisoned already
                return
            if self.store.compare_set(self.key, raw, str(count + POISON)) == str(count + POISON).encode():
                return

    def _search(self) -> None:
        """Look for a cycle of stuck ranks reachable from this one; confirm it and post its verdict."""
        calls = {self.me: self.record}  # rank -> the call it was seen stuck in
        edges: dict[int, list[int]] = {}
        todo = [self.me]
        while todo:
            a = todo.pop()
            name, n, ranks, _ = calls[a]
            others = [m for m in ranks if m != a]
            edges[a] = []
            for m, rec in zip(others, _records(self.store, others)):
                if rec is None or rec[:2] == [name, n]:
                    continue  # computing, on its way, or in this very call
                if m in calls:
                    if calls[m] == rec:
                        edges[a].append(m)
                    continue
                if _open(self.store, rec):  # stuck in another call: it cannot post this one before that completes
                    calls[m] = rec
                    edges[a].append(m)
                    todo.append(m)
        cycle = _cycle(edges, self.me)
        if not cycle:
            return
        # confirm: every call of the cycle still open, then every record unchanged (all stuck at once)
        if not all(_open(self.store, calls[r]) for r in cycle):
            return
        if _records(self.store, cycle) != [calls[r] for r in cycle]:
            return
        involved = {}
        for r in sorted(cycle):
            involved.setdefault((calls[r][0], calls[r][1]), r)
        verdict = json.dumps({"calls": [calls[r][:3] for r in involved.values()],
                              "text": _mismatch_text([calls[r] + [r] for r in involved.values()])})
        for name, n in involved:
            self.store.compare_set(_verdict_key(name, n), "", verdict)  # the first verdict on a call stays
            self.store.add(_count_key(name, n), POISON)


def _count_key(name: str, n: int) -> str:
    return f"{PREFIX}{name}/{n}"


def _verdict_key(name: str, n: int) -> str:
    return f"{PREFIX}{name}/{n}/verdict"


def _record_key(rank: int) -> str:
    return f"{PREFIX}at/{rank}"


def _group_name(g) -> str:
    return getattr(g, "group_name", None) or c10d._get_process_group_name(g)


def _records(store, ranks: list[int]) -> list[Optional[list]]:
    """Each rank's published call (None: none published, or it left it): one read of all of them once each has
    published one (a left call's record is emptied, not deleted), else one non-blocking read per rank."""
    keys = [_record_key(r) for r in ranks]
    raws = store.multi_get(keys) if store.check(keys) else [store.compare_set(k, _PEEK, _PEEK) for k in keys]
    return [json.loads(raw) if raw not in (_PEEK.encode(), b"") else None for raw in raws]


def _open(store, rec: list) -> bool:
    """Whether call ``rec`` (group name, counter, ranks, ...) still waits for members (no verdict either)."""
    raw = store.compare_set(_count_key(rec[0], rec[1]), _PEEK, _PEEK)
    return raw != _PEEK.encode() and int(raw) < len(rec[2])  # a deleted counter: the call completed long ago


def _cycle(edges: dict[int, list[int]], start: int) -> list[int]:
    """The ranks of a cycle reachable from ``start`` (smallest ranks first), or []."""
    path, on_path, done = [], set(), set()

    def visit(a: int) -> list[int]:
        path.append(a)
        on_path.add(a)
        for b in sorted(edges.get(a, ())):
            if b in on_path:
                return path[path.index(b):]
            if b not in done:
                found = visit(b)
                if found:
                    return found
        on_path.discard(path.pop())
        done.add(a)
        return []

    return visit(start)


def _mismatch_text(calls: list[list]) -> str:
    """The verdict's line: ``calls`` = [group name, counter, ranks, collective, lowest rank of the cycle in it]."""
    whats = {c[3] for c in calls}
    same_members = len({tuple(c[2]) for c in calls}) < len(calls)

    def group(c) -> str:
        return (f"the group of ranks {c[2]}" + (f" (group name {c[0]!r})" if same_members else "")
                + (f" to megacomp.comm.{c[3]}" if len(whats) > 1 else ""))

    calls = sorted(calls, key=lambda c: c[4])
    said = ", ".join(f"rank {c[4]} {'passed ' if i == 0 else ''}{group(c)}" for i, c in enumerate(calls))
    head = f"megacomp.comm.{calls[0][3]}" if len(whats) == 1 else "a collective"
    return f"ranks disagree on the group of {head}: {said}; every rank of a group must call it with that group"


CHECK = GroupCheck()
"""The process's group check (its per-group counters; megacomp.comm.collectives calls ``CHECK.check``)."""

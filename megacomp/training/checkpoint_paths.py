"""What a run's checkpoint paths name, checked before anything is built; partial saves a killed run left behind.

``--load PATH`` (:func:`resolve_load`), every rank alike:
  - PATH does not exist: a fresh start (Megatron-LM's behaviour, so one ``--save D --load D`` command serves
    every attempt of a job); the banner says so;
  - PATH is a directory holding ``latest_checkpointed_iteration.txt`` or ``iter_N`` checkpoints: resume from
    it (megacomp.training.checkpoint.select_checkpoint; ``iter_N`` directories without the latest file are
    offered as a fallback, never silently skipped);
  - PATH is an iteration directory, ``D/iter_0000010`` (it holds the manifest ``megacomp.json`` that names its
    iteration, so the choice is unambiguous): resume from exactly that checkpoint of ``D``, said in the banner,
    with no fallback to another one;
  - anything else is refused with one line naming the problem and the fix: a regular file (the latest file
    itself: use its directory), a partial save (``iter_N.tmp``) or a set-aside one (``iter_N.diverged``), a
    directory that cannot be listed or whose latest file cannot be read, a directory without checkpoints whose
    subdirectory holds some (``--load runs`` for ``runs/ck``);
  - an existing directory without any checkpoint: a fresh start, said in the banner.

``--save PATH`` (:func:`check_save_dir`): a regular file, or an iteration directory of another checkpoint root,
is refused naming the directory to use instead.

Set aside and pruned: :func:`discard_checkpoint` (a checkpoint whose weights diverged), :func:`prune_checkpoints`
(``--keep-checkpoints``).

Partial saves (:func:`remove_partial_saves`): a save writes ``iter_N.tmp`` and renames it when every rank is
done; a run killed while saving leaves it, and a resumed run that never saves iteration N again would keep it
forever. Rank 0 of a run that holds the ``--save`` lock (so no live run can be writing there) removes the
``iter_N.tmp`` directories and the ``latest`` file's own ``.tmp`` in that directory only, after the resume chose
its checkpoint.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass
from typing import Optional

from .checkpoint import LATEST, _iter_dir, _iterations, _write_latest, latest_iteration
from .checkpoint_reader import _check_iteration, _Unreadable
_ITER = re.compile(r"iter_(\d+)$")
_ASIDE = re.compile(r"iter_(\d+)\.(tmp|diverged\d*)$")
_PARTIAL = re.compile(r"iter_\d+\.tmp$")


@dataclass
class LoadTarget:
    """Where ``--load`` resumes from: the checkpoint root, the iteration it names (None: the latest, as the root
    says), whether there is anything to resume (False: start from iteration 0) and a banner clause."""

    root: Optional[str]
    iteration: Optional[int] = None
    has_checkpoint: bool = False
    note: Optional[str] = None


def _refuse(path: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"--load {path}: {problem}; {fix}")


def _is_iteration_dir(path: str) -> bool:
    return bool(_ITER.fullmatch(os.path.basename(os.path.normpath(path)))) and (
        os.path.exists(os.path.join(path, "megacomp.json")) or os.path.exists(os.path.join(path, ".metadata")))


def resolve_load(path: Optional[str]) -> LoadTarget:
    """Classify ``--load path`` (see the module docstring); raises ValueError (one line) for what cannot be
    resumed from."""
    if not path:
        return LoadTarget(None)
    try:
        os.stat(path)
    except FileNotFoundError:
        return LoadTarget(path, note=f"no checkpoint in {path} (it does not exist yet): starting from iteration 0")
    except OSError as e:  # a parent that is a file, or one that cannot be searched
        raise _refuse(path, f"cannot be read ({e.strerror or e})", "fix the path or its permissions, or drop --load "
                                                                   "to start fresh") from None
    base = os.path.basename(os.path.normpath(path))
    parent = os.path.dirname(os.path.normpath(path)) or "."
    if not os.path.isdir(path):
        if base == LATEST:
            raise _refuse(path, "is the latest-iteration file, not a checkpoint directory", f"use --load {parent}")
        raise _refuse(path, "is a file, not a checkpoint directory", "point --load at the directory --save wrote "
                      f"(it holds {LATEST} and iter_* directories), or drop --load to start fresh")
    aside = _ASIDE.fullmatch(base)
    if aside:
        what = ("a partial save (a run was stopped while writing it; it is not a checkpoint)" if aside.group(2) == "tmp"
                else "a checkpoint set aside because the run diverged right after it")
        raise _refuse(path, f"is {what}", f"use --load {parent} to resume from its latest complete checkpoint")
    if _is_iteration_dir(path):
        it = int(_ITER.fullmatch(base).group(1))
        return LoadTarget(parent, it, True, f"--load names the iteration directory {path}: resuming from exactly "
                                            f"that checkpoint (iteration {it} of {parent}), not from {parent}'s latest")
    try:
        names = os.listdir(path)
    except OSError as e:
        raise _refuse(path, f"the directory cannot be read ({e.strerror or e})", "fix its permissions (every rank "
                      "must read it), or drop --load to start fresh") from None
    latest = os.path.join(path, LATEST)
    if LATEST in names:
        if not os.path.isfile(latest):
            raise _refuse(path, f"{latest} is not a regular file", "remove it, or write the iteration to resume from "
                                                                   "into a file of that name")
        try:
            with open(latest, "rb"):
                pass
        except OSError as e:
            raise _refuse(path, f"{latest} cannot be read ({e.strerror or e})", "fix its permissions (every rank must "
                          "read it), or drop --load to start fresh") from None
        return LoadTarget(path, None, True)
    if any(_ITER.fullmatch(n) and os.path.isdir(os.path.join(path, n)) for n in names):
        return LoadTarget(path, None, True)  # no latest file: select_checkpoint names the newest that verifies
    nested = sorted(n for n in names if os.path.isfile(os.path.join(path, n, LATEST)))
    if nested:
        raise _refuse(path, f"holds no checkpoint, but {os.path.join(path, nested[0])} does",
                      f"use --load {os.path.join(path, nested[0])}")
    return LoadTarget(path, note=f"no checkpoint in {path} yet: starting from iteration 0")


def check_save_dir(path: str) -> None:
    """Refuse a ``--save`` that is a regular file or an iteration directory (one line: ValueError)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--save {path}: is a file, not a directory; point --save at a directory (it is created if "
                         f"missing)")
    if _is_iteration_dir(path):
        parent = os.path.dirname(os.path.normpath(path)) or "."
        raise ValueError(f"--save {path}: is the checkpoint of one iteration, not a checkpoint directory; use --save "
                         f"{parent}")


def remove_partial_saves(root: str) -> list[str]:
    """Remove the partial saves under ``root`` (see the module docstring; call it only while holding the
    directory's lock). Returns what was removed; a failure to remove one is skipped (the next run tries again)."""
    removed = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        try:
            if _PARTIAL.fullmatch(name) and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif name == LATEST + ".tmp" and os.path.isfile(path):
                os.remove(path)
            else:
                continue
        except OSError as e:
            if e.errno != errno.ENOENT:
                continue
        removed.append(path)
    return removed


def last_checkpoint(root: Optional[str]) -> Optional[int]:
    """The iteration ``root``'s latest file names, or None (no ``root``, no checkpoint, an unreadable file)."""
    try:
        return latest_iteration(root) if root else None
    except (ValueError, OSError):
        return None


def last_checkpoint_clause(root: Optional[str]) -> str:
    """``the last checkpoint is iteration N (ROOT/iter_N)``, or what there is instead (for a stop's line)."""
    if not root:
        return "no --save directory: nothing was checkpointed"
    it = last_checkpoint(root)
    if it is None:
        return f"there is no checkpoint under {root}"
    return f"the last checkpoint is iteration {it} ({os.path.join(root, f'iter_{it:07d}')})"


def discard_checkpoint(root: str, iteration: int) -> str:
    """Set the checkpoint of ``iteration`` under ``root`` aside (rank 0 calls it when the run diverged right
    after writing it): ``latest`` first points at the newest older complete iteration (or is removed when
    there is none), then ``iter_N`` is renamed to ``iter_N.diverged`` (``.diverged2`` ... if taken), which
    :func:`latest_iteration`, resume and pruning ignore; nothing is deleted. Returns what was done, a clause
    for the error line. Raises OSError when a file operation fails."""
    final = _iter_dir(root, iteration)
    previous = None
    for it in reversed(_iterations(root)):
        if it < iteration:
            try:
                _check_iteration(_iter_dir(root, it))
            except _Unreadable:
                continue
            previous = it
            break
    if previous is not None:
        _write_latest(root, previous)
    else:
        try:
            os.remove(os.path.join(root, LATEST))
        except FileNotFoundError:
            pass
    aside, n = final + ".diverged", 1
    while os.path.exists(aside):
        n += 1
        aside = f"{final}.diverged{n}"
    os.rename(final, aside)
    now = (f"the latest checkpoint is now iteration {previous} ({_iter_dir(root, previous)})" if previous is not None
           else f"there is no older complete checkpoint under {root}: start fresh")
    return f"moved the checkpoint of iteration {iteration} (the weights that diverged) to {aside}; {now}"


def prune_checkpoints(root: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete ``iter_*`` checkpoints under ``root`` (rank 0 calls it
    after a save; the one ``latest`` points at is always kept; ``.tmp`` and ``.diverged`` ones are not
    counted nor touched). Returns the removed directories."""
    latest = latest_iteration(root)
    done = [os.path.basename(_iter_dir(root, it)) for it in _iterations(root)]
    old = [d for d in done[:-keep] if latest is None or d != os.path.basename(_iter_dir(root, latest))]
    for d in old:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)
    return [os.path.join(root, d) for d in old]

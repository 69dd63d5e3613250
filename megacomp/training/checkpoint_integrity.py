"""What makes a checkpoint trustworthy: content digests checked before it is loaded, one writer per ``--save``
directory, and saves that fail cleanly.

Digests: after DCP wrote a checkpoint, every file in it (``.metadata`` and each ``__R_K.distcp`` shard) is hashed
with SHA-256, the ranks splitting the files between them, and the digests and sizes go into ``megacomp.json``
(the manifest) under ``files``, with ``manifest_sha256`` over the rest of the manifest. Before a resume every
rank hashes its share again and the ranks exchange what differs, so all of them refuse alike, naming the file.
A flipped byte anywhere in a file is found (SHA-256 has no known collisions); a checkpoint written before
digests existed has no ``files`` entry and is loaded with the structural checks only.

The lock (:class:`SaveDirLock`): ``SAVE/megacomp.lock`` holds the job id, host, pid and start time of the run
writing there, created with ``O_EXCL`` so that exactly one of two racing jobs gets it. A background thread
refreshes its modification time every ``HEARTBEAT_S`` seconds. A lock is stale when its holder is provably
gone: on the same host, its pid no longer exists; on another host, its heartbeat is older than ``STALE_AFTER_S``
(a host that froze for that long is treated as gone; the frozen holder then finds at its next save that the
lock is no longer its own and refuses to write). A stale lock is taken over by an atomic rename (one of two
racing takers wins), and the banner says whose lock was taken and why.

Failed saves (a full disk, a quota, an I/O error): :func:`save_failure` turns the error into one line naming
the path, the bytes the checkpoint needs and the bytes that were free; the caller removes the partial
``iter_N.tmp``, so the previous complete checkpoint and the ``latest`` file stay as they were.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from typing import Optional

LOCK_NAME = "megacomp.lock"
HEARTBEAT_S = 30.0
"""Seconds between refreshes of a held lock's modification time."""
STALE_AFTER_S = 600.0
"""A lock from another host whose heartbeat is older than this is stale (its job is gone or frozen)."""
_CHUNK = 1 << 22


def sha256_file(path: str) -> str:
    """The SHA-256 hex digest of the file at ``path`` (read in 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return h.hexdigest()
            h.update(block)


def checkpoint_files(path: str) -> list[str]:
    """The files of the checkpoint directory ``path`` that the manifest covers (all but megacomp.json), sorted."""
    return sorted(n for n in os.listdir(path) if n != "megacomp.json" and os.path.isfile(os.path.join(path, n)))


def share(names: list[str], rank: int, world: int) -> list[str]:
    """This rank's part of ``names`` when ``world`` ranks split the hashing (every ``world``-th, from ``rank``)."""
    return names[rank::world]


def digest_files(path: str, names: list[str]) -> dict[str, dict]:
    """{name: {"sha256": hex digest, "bytes": size}} for the files ``names`` of directory ``path``."""
    out = {}
    for name in names:
        file = os.path.join(path, name)
        out[name] = {"sha256": sha256_file(file), "bytes": os.path.getsize(file)}
    return out


def manifest_digest(manifest: dict) -> str:
    """SHA-256 over the manifest without its own ``manifest_sha256`` entry (sorted keys, compact JSON)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def check_manifest(manifest: dict) -> Optional[str]:
    """Why the manifest's own digest does not match (a reason clause), or None when it matches or it has none."""
    recorded = manifest.get("manifest_sha256")
    if recorded is None:
        return None
    if recorded != manifest_digest(manifest):
        return "garbled: its content does not match its manifest_sha256 (edited or corrupted after the save)"
    return None


def check_sizes(path: str, manifest: dict) -> Optional[tuple[str, str]]:
    """(file, reason) for the first file the manifest lists that is missing or of another size, else None."""
    for name, entry in sorted((manifest.get("files") or {}).items()):
        file = os.path.join(path, name)
        try:
            size = os.path.getsize(file)
        except OSError:
            return file, "missing (the manifest lists it)"
        if size != entry.get("bytes"):
            kind = "truncated" if isinstance(entry.get("bytes"), int) and size < entry["bytes"] else "extended"
            return file, f"{kind}: {size} bytes, the manifest records {entry.get('bytes')}"
    return None


def verify_share(path: str, manifest: dict, rank: int, world: int) -> Optional[tuple[str, str]]:
    """Hash this rank's share of the files the manifest lists; (file, reason) for the first mismatch, else None."""
    files = manifest.get("files") or {}
    for name in share(sorted(files), rank, world):
        file = os.path.join(path, name)
        try:
            digest = sha256_file(file)
        except OSError as e:
            return file, f"unreadable: {e.strerror or e}"
        if digest != files[name].get("sha256"):
            return file, (f"corrupt: its SHA-256 is {digest[:16]}..., the manifest records "
                          f"{str(files[name].get('sha256'))[:16]}... (bytes changed after the save)")
    return None


# -- failed saves -----------------------------------------------------------------------------------------
def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def free_bytes(path: str) -> Optional[int]:
    """Free bytes on the file system holding ``path`` (its nearest existing parent), or None if unknown."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def save_failure(target: str, err: BaseException, needed: int, free: Optional[int], previous: str) -> str:
    """The one line for a save that failed with ``err`` while writing ``target`` (see the module docstring).

    ``needed``: the checkpoint's bytes (all ranks' state); ``free``: bytes free before the save (None: unknown);
    ``previous``: a clause on what is still intact."""
    what = getattr(err, "strerror", None) or str(err) or type(err).__name__
    where = getattr(err, "filename", None) or target
    space = f"; the checkpoint needs about {_mb(needed)}" + (f", {_mb(free)} was free" if free is not None else "")
    fix = ("free space or point --save at another file system" if getattr(err, "errno", None) in
           (errno.ENOSPC, errno.EDQUOT) else "check the file system and its permissions")
    return f"cannot save the checkpoint to {where}: {what}{space}; removed the partial {target}.tmp; {previous}; {fix}"


# -- one writer per directory -------------------------------------------------------------------------------
def job_id() -> str:
    """The launcher's job id (Slurm, torchrun) or, without one, ``pid N``."""
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID"):
        if os.environ.get(var):
            return f"{var.split('_')[0].lower()} job {os.environ[var]}"
    return f"pid {os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class SaveDirLock:
    """The lock on a ``--save`` directory (see the module docstring); rank 0 of a run holds it.

    ``acquire()`` returns a banner clause when it took over a stale lock (None otherwise) and raises ValueError
    naming the holder when another live job holds it. ``check()`` raises ValueError when the lock is no longer
    this run's (taken over after this host froze). ``release()`` removes it (only if still ours).
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, LOCK_NAME)
        self.record = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "token": f"{os.getpid()}-{time.time_ns()}"}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _read(self) -> Optional[dict]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # half-written or garbled: judged by its age below

    def _stale(self, holder: dict) -> Optional[str]:
        """Why the lock ``holder`` is stale, or None when its job may be alive."""
        try:
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return "it was just released"
        if holder.get("host") == self.record["host"] and isinstance(holder.get("pid"), int):
            if holder["pid"] == os.getpid():  # an earlier run in this process that ended without release()
                return "it was left by an earlier run of this process"
            if not _pid_alive(holder["pid"]):
                return f"its process {holder['pid']} on this host no longer exists"
            return None
        if age > STALE_AFTER_S:
            return f"its heartbeat stopped {age:.0f} s ago (more than {STALE_AFTER_S:.0f} s)"
        return None

    @staticmethod
    def describe(holder: dict) -> str:
        """The holder in words: job, host, pid and start time."""
        return (f"{holder.get('job', 'an unknown job')} on host {holder.get('host', '?')} (pid {holder.get('pid', '?')}, "
                f"since {holder.get('started', '?')})")

    def acquire(self) -> Optional[str]:
        """Take the lock (see the class docstring)."""
        os.makedirs(self.root, exist_ok=True)
        took_over = None
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue  # released between the two calls: try again
                why = self._stale(holder)
                if why is None:
                    raise ValueError(
                        f"--save {self.root} is in use by {self.describe(holder)}: two runs writing one directory "
                        f"overwrite each other's checkpoints; wait for that run to end or use another --save (a "
                        f"lock left by a run that died is taken over automatically; remove {self.path} only if "
                        f"you are sure no run writes there)")
                aside = f"{self.path}.stale-{os.getpid()}"
                try:
                    os.rename(self.path, aside)  # atomic: of two racing takers, one renames it
                except FileNotFoundError:
                    continue
                os.remove(aside)
                took_over = f"took over the lock of {self.describe(holder)} on {self.root}: {why}"
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.record, f)
            self._thread = threading.Thread(target=self._beat, name="megacomp-save-lock", daemon=True)
            self._thread.start()
            return took_over
        raise ValueError(f"could not take the lock {self.path}: other runs keep creating it; use another --save")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (self._read() or {}).get("token") == self.record["token"]:
                    os.utime(self.path)
            except OSError:
                pass  # the next save's check() reports a lock that is gone

    def check(self) -> None:
        """Raise ValueError when the lock file is no longer this run's."""
        holder = self._read()
        if not holder or holder.get("token") != self.record["token"]:
            now = f"it is now held by {self.describe(holder)}" if holder else "it is gone"
            raise ValueError(f"lost the lock on --save {self.root} ({now}; this run stalled for more than "
                             f"{STALE_AFTER_S:.0f} s or the file was removed): not writing, so the other run's "
                             f"checkpoints stay intact; resume from the last checkpoint with one run per --save")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this run's. Never raises: on a file system
        that turned read-only (or went away) the file stays, and the next run takes it over as stale (its pid
        no longer exists); the error that stopped this run is the one reported."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if (self._read() or {}).get("token") == self.record["token"]:
            try:
                os.remove(self.path)
            except OSError:
                pass

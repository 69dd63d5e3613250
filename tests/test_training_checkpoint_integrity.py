"""Checkpoints that cannot silently go wrong (megacomp.training.checkpoint_integrity), as a user meets them.

- Flipped bytes inside a shard (the file keeps its size) are refused before anything is loaded, on every rank
  alike, naming the file and the newest checkpoint that verifies; with ``--load-fallback`` the run resumes from
  that one and continues exactly as an uninterrupted run does from there.
- One writer per ``--save`` directory: a second run refuses in one line naming the holder (job, host, pid); a
  lock whose process is gone, or whose host stopped its heartbeat, is taken over and the banner says so; a run
  whose lock was taken over writes nothing.
- A full disk while saving: one line (path, bytes needed and free), a non-zero exit, the partial ``.tmp``
  removed, the previous checkpoint intact and resumable. Tested on a real tmpfs of a few megabytes (needs root
  for ``mount``, as CI has).
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from distributed import RankFailure, run_ranks
from megacomp.training import checkpoint_integrity as integrity
from megacomp.training.checkpoint import latest_iteration
from test_training_failures import _train_body, base, error_lines, launch, megacomp_traceback  # noqa: F401 (base: a fixture)

WORLD = 2


def _losses(rank, world, cfg):
    return [loss for loss, _skipped in _train_body(rank, world, cfg)]


# -- digests ---------------------------------------------------------------------------------------------
def test_manifest_records_every_file_and_its_own_digest(tmp_path):
    (tmp_path / "a.distcp").write_bytes(b"x" * 10)
    (tmp_path / ".metadata").write_bytes(b"index")
    names = integrity.checkpoint_files(str(tmp_path))
    assert names == [".metadata", "a.distcp"]
    parts = [integrity.digest_files(str(tmp_path), integrity.share(names, r, 2)) for r in range(2)]
    files = {k: v for p in parts for k, v in p.items()}
    assert files["a.distcp"] == {"sha256": integrity.sha256_file(str(tmp_path / "a.distcp")), "bytes": 10}
    manifest = {"iteration": 3, "files": files}
    manifest["manifest_sha256"] = integrity.manifest_digest(manifest)
    assert integrity.check_manifest(manifest) is None and integrity.check_sizes(str(tmp_path), manifest) is None
    assert integrity.verify_share(str(tmp_path), manifest, 0, 1) is None
    assert "garbled" in integrity.check_manifest({**manifest, "iteration": 4})
    with open(tmp_path / "a.distcp", "r+b") as f:  # one flipped byte, same size
        f.seek(4)
        f.write(b"y")
    bad, why = integrity.verify_share(str(tmp_path), manifest, 0, 1)
    assert bad == str(tmp_path / "a.distcp") and why.startswith("corrupt: its SHA-256 is ")
    (tmp_path / ".metadata").write_bytes(b"ind")
    assert integrity.check_sizes(str(tmp_path), manifest) == (str(tmp_path / ".metadata"),
                                                             "truncated: 3 bytes, the manifest records 5")


def _flip(shard, nbytes=4096):
    """Flip ``nbytes`` bytes in the middle of ``shard`` (its size unchanged)."""
    data = bytearray(shard.read_bytes())
    start = len(data) // 2 - nbytes // 2
    data[start:start + nbytes] = bytes(b ^ 0xFF for b in data[start:start + nbytes])
    shard.write_bytes(bytes(data))


@pytest.mark.slow
def test_flipped_bytes_are_refused_and_fallback_resumes_exactly(tmp_path, base):
    save = tmp_path / "ck"
    full = run_ranks(_losses, WORLD, replace(base, save=str(save), save_interval=1))[0]
    assert latest_iteration(str(save)) == 4
    shard = max((save / "iter_0000004").glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    _flip(shard)
    assert shard.stat().st_size == size
    with pytest.raises(RankFailure) as info:
        run_ranks(_losses, WORLD, replace(base, load=str(save), train_iters=6), timeout=90)
    last = {r: e.strip().splitlines()[-1] for r, e in info.value.errors.items()}
    assert sorted(last) == list(range(WORLD)) and len(set(last.values())) == 1, last  # every rank, alike
    assert last[0].startswith(f"ValueError: checkpoint file {shard} is unreadable (corrupt: its SHA-256 is "), last[0]
    assert "iteration 3 is the newest checkpoint that verifies: add --load-fallback" in last[0]
    # the fallback resumes from iteration 3 and continues exactly as the uninterrupted run did
    rest = run_ranks(_losses, WORLD, replace(base, load=str(save), load_fallback=True))[0]
    assert rest == full[3:]


# -- the lock --------------------------------------------------------------------------------------------
def _write_lock(root, **holder):
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, integrity.LOCK_NAME)
    with open(path, "w") as f:
        json.dump({"job": "slurm job 42", "started": "earlier", "token": "theirs", **holder}, f)
    return path


def test_a_live_holder_is_refused_by_name_and_a_dead_one_taken_over(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, host=integrity.socket.gethostname(), pid=sleeper.pid)
        with pytest.raises(ValueError, match=f"--save {tmp_path} is in use by slurm job 42 on host "
                                             f"{integrity.socket.gethostname()} \\(pid {sleeper.pid}, since earlier\\)"):
            integrity.SaveDirLock(str(tmp_path)).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    lock = integrity.SaveDirLock(str(tmp_path))
    took = lock.acquire()  # the same holder, now dead: taken over
    assert "took over the lock of slurm job 42" in took and f"its process {sleeper.pid} on this host" in took
    lock.check()
    second = integrity.SaveDirLock(str(tmp_path))  # a later run in this process (the first was never released)
    assert "it was left by an earlier run of this process" in second.acquire()
    with pytest.raises(ValueError, match="lost the lock"):
        lock.check()
    lock.release()  # not its lock any more: left in place
    assert os.path.exists(os.path.join(tmp_path, integrity.LOCK_NAME))
    second.release()
    assert not os.path.exists(os.path.join(tmp_path, integrity.LOCK_NAME))


def test_another_hosts_lock_is_stale_only_after_its_heartbeat_stops(tmp_path):
    path = _write_lock(tmp_path, host="node-that-froze", pid=1)
    with pytest.raises(ValueError, match="on host node-that-froze"):
        integrity.SaveDirLock(str(tmp_path)).acquire()  # fresh heartbeat: may be alive
    old = time.time() - integrity.STALE_AFTER_S - 5
    os.utime(path, (old, old))
    lock = integrity.SaveDirLock(str(tmp_path))
    assert "its heartbeat stopped" in lock.acquire()
    # the frozen run wakes up: its next save finds the lock is not its own and writes nothing
    frozen = integrity.SaveDirLock(str(tmp_path))
    frozen.record["token"] = "theirs"
    with pytest.raises(ValueError, match=f"lost the lock on --save {tmp_path} \\(it is now held by"):
        frozen.check()
    lock.release()


@pytest.mark.slow
def test_a_second_run_on_the_same_save_dir_is_one_line(tmp_path, base):
    save = tmp_path / "ck"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:  # a live run of another job on this host holds the directory
        _write_lock(save, host=integrity.socket.gethostname(), pid=sleeper.pid)
        status, out, err = launch(tmp_path, base, 2, "--save", str(save), "--load", str(save))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert status != 0, err  # the rank's status is 2; torchrun reports a failed child as 1
    [line] = error_lines(err)
    assert f"--save {save} is in use by slurm job 42" in line and f"pid {sleeper.pid}" in line, line
    assert not megacomp_traceback(err)
    assert not any(p.name.startswith("iter_") for p in save.iterdir())


# -- a full disk -----------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of 8 MB (root only: mount)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}): needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(disk, leave: int):
    """Fill ``disk`` up to ``leave`` bytes free."""
    free = integrity.free_bytes(str(disk))
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "while"])
def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, base, small_disk, when):
    """``before``: less space free than the previous checkpoint in --save takes (refused before writing);
    ``while``: a resumed run saving into a new --save directory on the same disk, with 8 kB less free than a
    checkpoint takes: the space runs out inside DCP's write."""
    save = small_disk / "ck"
    run_ranks(_losses, WORLD, replace(base, save=str(save), train_iters=2))
    previous = sum(p.stat().st_size for p in (save / "iter_0000002").iterdir())
    _fill(small_disk, previous // 2 if when == "before" else previous - 8192)
    target = save if when == "before" else small_disk / "ck2"
    status, out, err = launch(tmp_path, base, 2, "--save", str(target), "--load", str(save), "--train-iters", "3")
    assert status != 0, err
    [line] = error_lines(err)
    assert line.startswith("megacomp-pretrain: error: cannot save the checkpoint to ") and "iter_0000003" in line, line
    assert "the checkpoint needs about " in line and " MB was free" in line, line
    intact = (f"the latest checkpoint (iteration 2, {save / 'iter_0000002'}) is untouched" if when == "before"
              else "no earlier checkpoint was affected")
    assert (f"removed the partial {target / 'iter_0000003'}.tmp; {intact}; free space or point --save at another "
            f"file system") in line, line
    assert ("less space free than the checkpoint of iteration 2 takes" if when == "before"
            else "No space left on device") in line, line
    assert not megacomp_traceback(err)
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert not target.exists() or not list(target.glob("iter_0000003*"))
    (small_disk / "filler").unlink()  # space again: the previous checkpoint resumes
    rest = run_ranks(_losses, WORLD, replace(base, load=str(save), train_iters=3))[0]
    assert len(rest) == 1

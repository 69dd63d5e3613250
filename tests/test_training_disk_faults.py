"""File systems that fail under a running pretraining job: real tmpfs mounts (root only; skipped otherwise).

- ``--save`` on a file system remounted read-only mid-run: the failed save is one line naming the path and
  that the last checkpoint is intact, exit status 2 on rank 0 (torchrun's summary), no traceback from the lock's
  release or at exit, nothing printed after the line by the other rank.
- ``--log-dir`` on a full file system: one line naming metrics.jsonl, the iteration and the last one it holds;
  every rank stops at that iteration's boundary after saving it (with ``--save`` elsewhere), so no training is
  lost; metrics.jsonl ends with a whole line (the failed record is cut back), status 2.
"""
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

from megacomp.training.checkpoint import latest_iteration


@pytest.fixture(scope="module")
def base(long_tiny_config):
    return long_tiny_config



@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs mounted at ``tmp_path/mnt`` (unmounted after the test); skips where mounting is not allowed."""
    def mount(size: str):
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt
    mounted = []
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def launch_until(tmp_path, base, flags, at, action, nproc=2, timeout=240):
    """torchrun ``nproc`` workers on the tiny config; ``action()`` once rank 0 logged iteration ``at`` (None: never).
    Returns (status, stdout, stderr)."""
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(base, name) for name in base.explicit}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megacomp.pretrain", "--config", str(cfg_file), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGACOMP_DEBUG", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    out, err = [], []
    readers = [threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True)
               for s, into in ((proc.stdout, out), (proc.stderr, err))]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + timeout
        if at is not None:
            while not any(line.startswith(f"iter {at:6d} |") for line in list(out)):
                assert proc.poll() is None and time.monotonic() < deadline, "".join(err)
                time.sleep(0.01)
            action()
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        for t in readers:
            t.join(timeout=10)
    return proc.returncode, "".join(out), "".join(err)


def error_lines(err: str) -> list:
    return [ln for ln in err.splitlines() if ln.startswith("megacomp-pretrain: error:")]


def no_traceback(err: str) -> bool:
    """No traceback through megacomp's code, none at exit (torchrun's own report of a failed worker is not ours)."""
    return not re.search(r'File ".*megacomp/', err) and "Exception ignored" not in err and "[rank" not in err


def test_a_save_directory_that_turns_read_only_is_one_line_and_status_2(tmp_path, base, tmpfs):
    mnt = tmpfs("32m")
    ck = mnt / "ck"
    status, out, err = launch_until(
        tmp_path, base, ["--save", str(ck), "--save-interval", "2", "--log-dir", str(tmp_path / "logs")], 3,
        lambda: subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True))
    assert status != 0
    [line] = error_lines(err)
    assert re.fullmatch(rf"megacomp-pretrain: error: cannot save the checkpoint to {ck}/iter_\d{{7}}\S*: Read-only file "
                        rf"system; .*; the latest checkpoint \(iteration \d+, {ck}/iter_\d{{7}}\) is untouched; check "
                        rf"the file system and its permissions", line), line
    assert "exitcode  : 2" in err and no_traceback(err), err
    assert latest_iteration(str(ck)) >= 2
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["iteration"] >= 3


def test_a_full_log_dir_stops_after_saving_and_keeps_whole_lines(tmp_path, base, tmpfs):
    mnt = tmpfs("8k")
    ck, logs = tmp_path / "ck", mnt / "logs"
    status, out, err = launch_until(tmp_path, base, ["--save", str(ck), "--log-dir", str(logs)], None, None)
    assert status != 0
    [line] = error_lines(err)
    m = re.fullmatch(rf"megacomp-pretrain: error: {logs}/metrics.jsonl: cannot append iteration (\d+) \(No space left "
                     rf"on device; it holds the records up to iteration (\d+)\); free space there or point --log-dir "
                     rf"elsewhere; saved this iteration first; the last checkpoint is iteration (\d+) \({ck}/iter_\d{{7}}"
                     rf"\)", line)
    assert m, line
    failed, held, saved = map(int, m.groups())
    assert held == failed - 1 and saved == failed == latest_iteration(str(ck))
    text = (logs / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(x)["iteration"] for x in text.splitlines()] == list(range(1, failed))
    assert "exitcode  : 2" in err and no_traceback(err), err

"""The launcher killed, its workers alive (megacomp.training.heartbeat's launcher watch): real torchrun, real SIGKILL.

torchrun's workers are its children; killing torchrun alone (SIGKILL: it cannot forward anything) leaves them
training on their own gloo links while the rendezvous store, which torchrun's agent held, is gone. They notice
within one heartbeat interval (their parent changed), stop together at the next iteration boundary, save it, and
one line names the launcher; no C++ stack from a store request, exit status 4. The workers' statuses are read by
a small parent that adopts them (a child subreaper), as the init process would reap them on a real node.
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from megacomp.training.checkpoint import latest_iteration
from megacomp.training.heartbeat import Heartbeat

# Runs torchrun, kills it once rank 0 logged iteration 3, then reaps the orphaned workers (this process adopts them
# as a child subreaper) and prints {"statuses": [...], "seconds": from the kill to the last worker's exit}.
ADOPT_AND_KILL = r"""
import ctypes, json, os, signal, subprocess, sys, threading, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
for line in proc.stdout:
    sys.stdout.write(line)
    if line.startswith("iter      3 |"):
        break
kill = time.monotonic()
os.kill(proc.pid, signal.SIGKILL)
pump = threading.Thread(target=lambda: sys.stdout.writelines(proc.stdout), daemon=True)
pump.start()
statuses = []
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if pid != proc.pid:
        statuses.append(os.waitstatus_to_exitcode(status))
seconds = time.monotonic() - kill
pump.join(timeout=10)
sys.stdout.flush()
print("\nRESULT " + json.dumps({"statuses": statuses, "seconds": seconds}), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="adopting orphans needs Linux's child subreaper")
def test_killing_torchrun_stops_its_workers_at_the_next_boundary_with_one_line(tmp_path, long_tiny_config):
    base = long_tiny_config
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(base, name) for name in base.explicit}))
    ck = tmp_path / "ck"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "-m", "megacomp.pretrain", "--config", str(cfg_file), "--save", str(ck),
                "--distributed-timeout-minutes", "0.5"]  # a 1.5 s heartbeat; the old verdict came after 30 s
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGACOMP_DEBUG", None)
    res = subprocess.run([sys.executable, "-c", ADOPT_AND_KILL, *torchrun], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=240)
    out, err = res.stdout, res.stderr
    result = json.loads(out.rsplit("RESULT ", 1)[1])
    assert result["statuses"] == [4, 4] and result["seconds"] < 15, (result, err[-3000:])
    [stop] = re.findall(r"megacomp-pretrain: stopped at iteration (\d+) because the launcher died \(torchrun pid "
                        r"\d+ on host [^)]+\):", out)
    assert latest_iteration(str(ck)) == int(stop) >= 3, out[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("megacomp-pretrain:")]
    assert len(lines) == 1 and re.fullmatch(
        rf"megacomp-pretrain: error: the launcher died \(torchrun pid \d+ on host [^)]+\): every rank stopped at "
        rf"iteration {stop}, the last checkpoint is iteration {stop} \({re.escape(str(ck))}/iter_\d{{7}}\); start the "
        rf"job again to continue", lines[0]), err[-3000:]
    # nothing else: no C++ stack from a store request, no blame on rank 0, no traceback
    assert "frame #" not in err and "rank 0 or its node" not in err and "Traceback" not in err, err[-3000:]


def test_a_rank_that_cannot_reach_the_boundary_after_the_launcher_died_says_nothing_was_saved():
    """The watch in-process: a launcher pid that is not this process's parent reads as a launcher that died. The
    store is not touched after that (its counter stands still), and ``timeout_s`` later the verdict says the ranks
    could not stop together and nothing was saved."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    verdicts = []
    hb = Heartbeat(0.6, progress=lambda: 12, on_verdict=lambda line, claimed: verdicts.append((line, claimed)),
                   store=store, rank=0, world=1, interval=0.1, local_rank=0, launcher_pid=os.getppid() + 1)
    hb.start()
    try:
        deadline = time.monotonic() + 10
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.05)
        first_beat = json.loads(store.get("megacomp/heartbeat/0"))["n"]
    finally:
        hb.stop()
    assert hb.launcher_stop() == f"the launcher died (torchrun pid {os.getppid() + 1} on host {hb.host})"
    assert first_beat == 1  # only the beat start() wrote: the thread saw the new parent before any store request
    assert verdicts == [(f"{hb.launcher_stop()}: the ranks could not stop together at an iteration boundary (after "
                         f"iteration 12), so nothing after the last checkpoint was saved; start the job again to "
                         f"continue", True)]
    assert Heartbeat(1.0, progress=lambda: 0, on_verdict=print, store=store, rank=0, world=1,
                     local_rank=0).launcher_pid == (os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None)

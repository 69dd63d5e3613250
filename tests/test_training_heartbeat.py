"""megacomp.training.heartbeat: a process that ends without stopping its heartbeat still exits with its own status
(the liveness verdicts themselves are tested in test_training_failures.py)."""
import os
import subprocess
import sys

EXIT_WITHOUT_STOP = r"""
import time, torch.distributed as dist
from megacomp.training.heartbeat import Heartbeat
store = dist.TCPStore("127.0.0.1", 0, 1, True)
Heartbeat(60.0, progress=lambda: 0, on_verdict=lambda line, claimed: None, store=store, rank=0, world=1,
          interval=0.0, local_rank=0).start()   # beats (store requests) back to back
time.sleep(0.3)
"""


def test_a_process_that_never_stops_its_heartbeat_exits_cleanly():
    """The thread is stopped by an exit handler before the interpreter shuts down; a daemon thread caught inside a
    store request at shutdown aborted the process ("terminate called without an active exception", exit -6)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    res = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_STOP], env=env, capture_output=True, text=True,
                         timeout=120)  # without the handler it aborted 6 of 6 times
    assert res.returncode == 0, f"exit status {res.returncode}: {res.stderr[-2000:]}"

"""A torchft Lighthouse that goes away under ``megacomp-pretrain --fault-tolerance torchft``: real replica groups
(``python -m megacomp.pretrain``, one rank each), a real Lighthouse (torchft's Rust ``LighthouseServer``).

- Killed (SIGKILL) and restarted on the same address within ``--ft-quorum-timeout``: the replica groups wait in
  their quorum and continue, committing steps in a quorum of both (torchft's ManagerServer retries the Lighthouse
  call until the quorum timeout instead of giving up at the first failure: megacomp.integrations.torchft). The
  group that reconnects first may form a quorum alone, numbered as the old Lighthouse's quorum of both was, and the
  other heals from it at the next quorum; without megacomp's QuorumClient the first kept the old two-member group
  and stalled in its collective past the other's quorum timeout.
- Gone for good: every group saves its last committed iteration under ``--save`` and ends with exit status 4 and
  one line naming the Lighthouse's address, the timeout flag and the fix (restart it, resume with ``--load``).
- ``--load`` of that checkpoint continues from its iteration (the quorum's counters are in the checkpoint).
- torchft's own INFO lines (a heartbeat failure every few hundred ms while the Lighthouse is down) stay out of
  the output unless ``RUST_LOG`` asks for them.
"""
import json
import os
import re
import socket
import subprocess
import sys
import time

from dataclasses import replace

import pytest
import yaml
from distributed import run_ranks
from training_runs import train_losses

from megacomp.integrations.torchft import QUORUM_RETRY_S, lighthouse_answers, quorum_retries
from megacomp.integrations.torchft_lighthouse import import_torchft
from megacomp.pretrain import EXIT_REPLICA_LOST
from megacomp.training.checkpoint import latest_iteration

try:
    import_torchft()  # torchft's logging quiet in this process too (the restarted Lighthouse runs here)
except ImportError:
    pytest.skip("torchft is not installed", allow_module_level=True)

QUORUM_TIMEOUT_S = 6  # --ft-quorum-timeout: the outage a replica group survives, and how long it waits for a dead one
FT_TIMEOUT_S = 2  # --ft-timeout: a collective, a commit vote, a state transfer
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _server(port: int):
    """torchft's Lighthouse in this process, on ``port`` (binds at once: the restart of a killed one)."""
    from torchft._torchft import LighthouseServer
    return LighthouseServer(bind=f"[::]:{port}", min_replicas=1, join_timeout_ms=300, quorum_tick_ms=10,
                            heartbeat_timeout_ms=1000)


def _records(path) -> list:
    """The records of a metrics.jsonl being written (a line still being written is left out)."""
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path).read().splitlines() if line.endswith("}")]


def _wait(pred, timeout, what, procs=()):
    end = time.time() + timeout
    while not pred():
        dead = [p.args[-1] for p in procs if p.poll() is not None]
        assert not dead and time.time() < end, f"timed out waiting for {what} (ended: {dead})"
        time.sleep(0.05)


def test_quorum_retries_cover_the_quorum_timeout_and_a_closed_port_does_not_answer():
    # torchft sleeps timeout / (R + 1) between tries: about QUORUM_RETRY_S, until the clients' deadline
    for timeout in (0.5, 6, 60, 300):
        r = quorum_retries(timeout)
        assert r >= 1 and timeout / (r + 1) <= QUORUM_RETRY_S and r * QUORUM_RETRY_S >= timeout
    server = _server(0)
    try:
        assert lighthouse_answers(f"http://localhost:{server.address().rsplit(':', 1)[1]}", 1.0)
    finally:
        server.shutdown()
    assert not lighthouse_answers(f"http://localhost:{_free_port()}", 0.2)


def test_a_restarted_lighthouse_is_survived_and_a_lost_one_ends_each_group_in_one_line_after_saving(
        tmp_path, long_tiny_config):
    base = long_tiny_config
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(base, name) for name in base.explicit}))
    port = _free_port()
    address = f"http://localhost:{port}"
    first = subprocess.Popen([sys.executable, "-m", "megacomp.integrations.torchft", "--bind", f"[::]:{port}",
                              "--join-timeout-ms", "300", "--heartbeat-timeout-ms", "1000"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    assert first.stdout.readline().startswith("lighthouse: "), "the Lighthouse did not start"

    outs = []

    def group(rid: int, env: dict):
        outs.append(out := open(tmp_path / f"r{rid}.out", "w"))
        cmd = [sys.executable, "-m", "megacomp.pretrain", "--config", str(cfg_file), "--fault-tolerance", "torchft",
               "--ft-lighthouse", address, "--ft-replica-id", str(rid), "--ft-timeout", str(FT_TIMEOUT_S),
               "--ft-quorum-timeout", str(QUORUM_TIMEOUT_S), "--save", str(tmp_path / f"ck{rid}"),
               "--log-dir", str(tmp_path / f"r{rid}")]
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)

    env = {k: v for k, v in os.environ.items() if k not in ("RUST_LOG", "MEGACOMP_DEBUG")}
    env["OMP_NUM_THREADS"] = "1"
    groups = [group(0, {**env, "RUST_LOG": "info"}), group(1, env)]  # group 0 asks for torchft's own lines
    metrics = [tmp_path / f"r{r}" / "metrics.jsonl" for r in range(2)]
    restarted = None
    try:
        both = lambda since: all(any(x["ft_replicas"] == 2 and x["ft_committed"] and x["ft_time"] > since  # noqa: E731
                                     for x in _records(m)) for m in metrics)
        _wait(lambda: both(0), 120, "both groups in one quorum", groups)
        first.kill()  # SIGKILL: the Lighthouse's host lost
        first.wait()
        killed = time.time()
        time.sleep(1.0)
        restarted = _server(port)  # the same address, well within the quorum timeout
        _wait(lambda: both(killed + 1.0), 3 * QUORUM_TIMEOUT_S, "both groups to continue after the restart", groups)
        back = [[x for x in _records(m) if x["ft_time"] > killed] for m in metrics]
        restarted.shutdown()  # now gone for good
        restarted, lost = None, time.time()
        for p in groups:
            p.wait(timeout=QUORUM_TIMEOUT_S + 30)
        took = time.time() - lost
    finally:
        for p in [first, *groups]:
            if p.poll() is None:
                p.kill()
                p.wait()
        if restarted is not None:
            restarted.shutdown()
        for out in outs:
            out.close()
    # survived: steps committed by both groups together after the outage, no group restarted (its records go on)
    for rows in back:
        assert rows and rows[0]["iteration"] > 1 and any(x["ft_replicas"] == 2 and x["ft_committed"] for x in rows)
    texts = [open(tmp_path / f"r{r}.out").read() for r in range(2)]
    for r, (p, text) in enumerate(zip(groups, texts)):
        assert p.returncode == EXIT_REPLICA_LOST, text[-3000:]
        last = _records(metrics[r])[-1]["iteration"]  # the last committed iteration (per step: the record's count)
        errors = [line for line in text.splitlines() if line.startswith("megacomp-pretrain: error")]
        assert errors == [f"megacomp-pretrain: error: the torchft Lighthouse at {address} did not answer for "
                          f"{QUORUM_TIMEOUT_S} s (--ft-quorum-timeout); restart it (scripts/torchft_lighthouse.sh), "
                          f"then every replica group with --load {tmp_path / f'ck{r}'}; the last checkpoint is "
                          f"iteration {last} ({tmp_path / f'ck{r}' / f'iter_{last:07d}'})"], text[-3000:]
        assert latest_iteration(str(tmp_path / f"ck{r}")) == last  # saved at the last good boundary, before the exit
        assert not re.search(r'File ".*megacomp/', text), text[-3000:]  # no traceback through megacomp
    assert took < QUORUM_TIMEOUT_S + 25
    assert "torchft::" not in texts[1] and "[INFO]" not in texts[1]  # quiet by default
    assert "Failed to send heartbeat to lighthouse" in texts[0]  # RUST_LOG=info shows torchft's own lines
    # the advice works: --load continues from the saved iteration (the quorum's counters come with the checkpoint)
    resume = replace(base, fault_tolerance="torchft", ft_lighthouse="local", ft_replica_id="1",
                     load=str(tmp_path / "ck1"), train_iters=last + 2)
    [(losses, reached)] = run_ranks(train_losses, 1, resume, timeout=300, start_method="spawn")
    assert len(losses) == 2 and reached == last + 2

"""Ctrl-C (SIGINT) on a pretraining run, as a user meets it: real processes, real signals (megacomp.training.signals).

- SIGINT to torchrun (what Ctrl-C in its terminal does: torchrun's workers run in sessions of their own, torchrun
  forwards it to them once): every rank stops at the same iteration boundary and saves it; rank 0 says so as
  the signal arrives and once at the end; no traceback from megacomp (torchrun prints its own report of the
  signal it got, which is not ours to change); ``--load`` resumes from that iteration.
- A single process (no launcher): the same, exit status 0.
- A second Ctrl-C more than 2 s after the first stops at once without saving: one line naming the iteration
  and the last checkpoint, exit status 130; under torchrun the second Ctrl-C reaches the workers as torchrun's
  SIGTERM, and counts the same.
- The handlers themselves: a SIGINT within the window is the same key press; a SIGINT started ignored stays
  ignored.
"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from distributed import run_ranks
from megacomp.training import signals as signals_mod
from megacomp.training.checkpoint import latest_iteration

ACK = "megacomp-pretrain: Ctrl-C: stopping at the end of this iteration"
# a model whose iteration takes seconds on one CPU thread, so that a second Ctrl-C lands before the boundary
SLOW = ["--hidden-size", "512", "--num-layers", "4", "--seq-length", "256", "--micro-batch-size", "8",
        "--global-batch-size", "16"]


@pytest.fixture(scope="module")
def base(long_tiny_config):
    return long_tiny_config



def megacomp_traceback(text: str) -> bool:
    return bool(re.search(r'File ".*megacomp/', text)) or "KeyboardInterrupt" in text


@contextlib.contextmanager
def _runs_see_ctrl_c():
    """Runs launched inside start with SIGINT's default disposition, as under a terminal. A suite started in the
    background (``cmd &`` without job control) ignores SIGINT, and exec keeps an ignored signal (pretraining then
    rightly leaves it ignored); a caught one is reset at exec, so it is caught here while the run is launched."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def hit(tmp_path, base, flags, steps, at=3, nproc=2, timeout=240):
    """Launch pretraining (torchrun with ``nproc`` workers, or one plain process for ``nproc=0``) in a session of its
    own, as a terminal runs it; once rank 0 logged iteration ``at`` run ``steps`` (("sleep", s) or ("int", None):
    SIGINT to the launched process, as Ctrl-C sends it). Returns (status, stdout, stderr)."""
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(base, name) for name in base.explicit}))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc
                else [sys.executable])
    cmd = [*launcher, "-m", "megacomp.pretrain", "--config", str(cfg_file), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGACOMP_DEBUG", None)
    with _runs_see_ctrl_c():
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=tmp_path, start_new_session=True)
    out, err = [], []
    readers = [threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True)
               for s, into in ((proc.stdout, out), (proc.stderr, err))]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(f"iter {at:6d} |") for line in list(out)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(err)
            time.sleep(0.02)
        for what, value in steps:
            if what == "sleep":
                time.sleep(value)
            elif proc.poll() is None:
                os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for t in readers:
            t.join(timeout=10)
    return proc.returncode, "".join(out), "".join(err)


def test_ctrl_c_under_torchrun_saves_at_the_next_boundary_and_says_so_once(tmp_path, base):
    ck = tmp_path / "ck"
    status, out, err = hit(tmp_path, base, ["--save", str(ck)], [("int", None)], at=5)
    stops = re.findall(r"megacomp-pretrain: stopped by SIGINT \(Ctrl-C\) at iteration (\d+):", out)
    assert len(stops) == 1, out + err
    stop = int(stops[0])
    assert stop >= 5 and latest_iteration(str(ck)) == stop
    assert out.count(f"megacomp-pretrain: saved checkpoint to {ck}/iter_{stop:07d}") == 1
    assert err.count(ACK) == 1 and f"saving a checkpoint under {ck}" in err
    assert "error:" not in out + err and not megacomp_traceback(err), err
    # torchrun reports the signal it got (its own traceback); its workers exited with status 0
    assert "exitcode" not in err and "SignalException" in err
    # the save is an ordinary checkpoint: test_training_failures.py resumes one written at a signal bit for bit


def test_ctrl_c_on_a_single_process_exits_0_after_saving(tmp_path, base):
    ck = tmp_path / "ck"
    status, out, err = hit(tmp_path, base, ["--save", str(ck)], [("int", None)], nproc=0)
    assert status == 0, err
    [stop] = re.findall(r"stopped by SIGINT \(Ctrl-C\) at iteration (\d+):", out)
    assert latest_iteration(str(ck)) == int(stop) and not megacomp_traceback(err) and err.count(ACK) == 1


def _second_interrupt_steps(first_after=0.1, window=signals_mod.REPEAT_WINDOW_S):
    """Ctrl-C inside the next iteration, then again every half second from just past the window on."""
    return [("sleep", first_after), ("int", None), ("sleep", window + 0.3)] + [("int", None), ("sleep", 0.5)] * 12


SECOND = (r"megacomp-pretrain: second interrupt: stopped at iteration (\d+)(?: without saving|, after its checkpoint "
          r"was written); the last checkpoint is iteration (\d+) \(.*/ck/iter_\d{7}\)")


def test_a_second_ctrl_c_stops_at_once_without_saving_with_status_130(tmp_path, base):
    ck = tmp_path / "ck"
    status, out, err = hit(tmp_path, base, ["--save", str(ck), "--save-interval", "2", *SLOW],
                           _second_interrupt_steps(), nproc=0)
    assert status == signals_mod.EXIT_INTERRUPTED, (out, err)
    [line] = [ln for ln in err.splitlines() if ln.startswith("megacomp-pretrain: second")]
    it, last = map(int, re.fullmatch(SECOND, line).groups())
    assert latest_iteration(str(ck)) == last and last in (2, it) and it >= 3
    assert "stopped by SIGINT" not in out and not megacomp_traceback(err), err


@pytest.mark.slow
def test_a_second_ctrl_c_under_torchrun_stops_the_workers_at_once(tmp_path, base):
    """torchrun turns the second Ctrl-C into a SIGTERM to its workers: after a first SIGINT it stops them at once,
    one line from rank 0, no megacomp traceback; torchrun's summary names exit status 130."""
    ck = tmp_path / "ck"
    # two micro-batches per rank, as the single process has: the iteration outlasts the 2 s window
    status, out, err = hit(tmp_path, base, ["--save", str(ck), "--save-interval", "2", *SLOW[:-1], "32"],
                           _second_interrupt_steps()[:4])
    assert status != 0
    [line] = [ln for ln in err.splitlines() if ln.startswith("megacomp-pretrain: second")]
    _, last = map(int, re.fullmatch(SECOND, line).groups())
    assert latest_iteration(str(ck)) == last and not megacomp_traceback(err), err
    assert "stopped by SIGINT" not in out


def _handlers_body(rank, world):
    """In a fresh process: two SIGINTs within the window are one Ctrl-C (the flag, no exception); one after the
    window goes to the handler installed before (Python's default: KeyboardInterrupt). A SIGINT ignored before
    stays ignored."""
    out = {}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sig = signals_mod.ExitSignals(save_dir=None)
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    out["received"] = sig.received
    sig._interrupted_at -= signals_mod.REPEAT_WINDOW_S + 0.1  # as if the first came longer ago than the window
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        out["second"] = None
    except KeyboardInterrupt:
        out["second"] = "KeyboardInterrupt"
    sig.restore()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sig = signals_mod.ExitSignals()
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    out["ignored"] = (sig.received, signal.getsignal(signal.SIGINT) == signal.SIG_IGN)
    sig.restore()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return out


def test_a_repeated_sigint_within_the_window_is_one_ctrl_c_and_an_ignored_sigint_stays_ignored():
    [out] = run_ranks(_handlers_body, 1)
    assert out == {"received": "SIGINT", "second": "KeyboardInterrupt", "ignored": (None, True)}


def _agreement_body(rank, world):
    """stop_requested skips its collective alike on every rank when nothing can ask for a stop; a watch's reason on
    one rank stops every rank, for that reason."""
    import torch
    import torch.distributed as dist

    cpu = torch.device("cpu")
    if rank == 0:  # only rank 0 asks: an all-reduce here would pair with rank 1's below and fail or corrupt it
        for _ in range(3):
            assert signals_mod.stop_requested(signals_mod.ExitSignals((), None), None, cpu, log_file=False) == \
                (False, None)
            assert signals_mod.stop_requested(None, None, cpu, log_file=False) == (False, None)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    watched = signals_mod.ExitSignals((), None, watch=lambda: "the launcher died (rank 1's)" if rank == 1 else None)
    stop = signals_mod.stop_requested(watched, None, cpu, log_file=False)
    return total.item(), stop, watched.stopped(5)


def test_no_stop_collective_when_nothing_can_ask_for_a_stop_and_a_watch_stops_every_rank():
    for out in run_ranks(_agreement_body, 2, timeout=60, pg_timeout=15):
        assert out == (3.0, (True, None), "stopped at iteration 5 because the launcher died (rank 1's)")


def _interrupt_at_start_up(tmp_path, base, when, flags=()):
    """Start ``python -m megacomp.pretrain`` and send SIGINT once ``when(pid, stderr so far)`` holds; (status, stderr)."""
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(base, name) for name in base.explicit}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGACOMP_DEBUG", None)
    with _runs_see_ctrl_c():
        proc = subprocess.Popen([sys.executable, "-m", "megacomp.pretrain", "--config", str(cfg_file), *flags],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                                start_new_session=True)
    err = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not when(proc.pid, "".join(err)):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(err)
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
    return proc.returncode, "".join(err)


def _importing_torch(pid, err):
    with open(f"/proc/{pid}/maps") as f:  # torch's library is mapped early in `import torch`, seconds before its end
        return "libtorch" in f.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc to see torch being imported")
def test_ctrl_c_during_start_up_is_one_line_and_status_130(tmp_path, base):
    """Before the trainer's handlers exist: while the imports run (before the flags are parsed) and while the data is
    prepared (a fresh --data-cache-dir: the tokenizer is trained and the files tokenized)."""
    status, err = _interrupt_at_start_up(tmp_path, base, _importing_torch)
    assert status == signals_mod.EXIT_INTERRUPTED == 128 + signal.SIGINT, err
    assert err == "megacomp-pretrain: interrupted during start-up: stopped without saving\n", err
    status, err = _interrupt_at_start_up(tmp_path, base, lambda pid, err: "megacomp: training the tokenizer" in err,
                                         ["--data-cache-dir", str(tmp_path / "fresh-cache"), "--save", str(tmp_path / "ck")])
    lines = [ln for ln in err.splitlines() if not ln.startswith("megacomp: ")]  # the data preparation's own lines
    assert status == signals_mod.EXIT_INTERRUPTED and lines == [
        f"megacomp-pretrain: interrupted during start-up: stopped without saving; there is no checkpoint under "
        f"{tmp_path / 'ck'}"], err

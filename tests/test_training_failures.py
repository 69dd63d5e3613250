"""Pretraining runs that go wrong, as a user meets them: real ranks, real launches.

- A diverging run (``--lr 1e6``) stops at the same iteration on every rank with one line on stderr,
  a non-zero status, and no checkpoint of the diverged state; skipped steps are tolerated up to
  ``--max-skipped-steps`` and the metrics record null for the loss and grad norm they cannot have.
- Bad input (a missing ``--config``, a bad ``--data-path``) is one ``megacomp-pretrain: error:`` line,
  printed once, status 2, no traceback.
- ``--save D --load D`` starts fresh when D has no checkpoint (and says so) and resumes when it has one.
- An exit signal (SIGUSR1, as Slurm's ``--signal=USR1@120`` sends) on one rank of a 4-rank run: every
  rank saves at the same iteration boundary and returns normally, and ``--load`` continues the same loss
  curve bit for bit.
- A lost rank (kill -9) or a stalled one (SIGSTOP) under torchrun: one survivor names it (rank, host, last
  iteration) in one line, exit status 4, within the timeout, no gloo tracebacks; the last checkpoint stays.
  The heartbeat's verdicts themselves on real gloo ranks (megacomp.training.heartbeat).
- Bad numbers and flags are refused naming the flag (one line, once, status 2); a --log-dir that cannot be
  written is one line with no tracebacks from the other ranks after it.
- A resumed iteration records the traffic an uninterrupted one does.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch.distributed as dist
import yaml

from distributed import run_ranks
from megacomp.training import Trainer, TrainingDiverged
from megacomp.training.checkpoint import latest_iteration
from megacomp.training.guard import DivergenceGuard


@pytest.fixture(scope="module")
def base(tiny_config):
    """The tiny config at 4 iterations, its data cache with the tokenizer and tokens already built (so each launch
    below takes seconds)."""
    cfg = replace(tiny_config, train_iters=4)
    run_ranks(_train_body, 1, replace(cfg, train_iters=1))
    return cfg


def _train_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        return [(h["loss"], h["skipped"]) for h in trainer.train()]
    finally:
        trainer.close()


def launch(tmp_path, base, nproc, *flags, config=None, timeout=240):
    """``torchrun --standalone --nproc-per-node N -m megacomp.pretrain`` on the tiny config (the settings ``base``
    was given, as a YAML file); (status, out, err)."""
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(base, name) for name in base.explicit}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megacomp.pretrain", "--config", str(config or cfg_file), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGACOMP_DEBUG", None)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    return out.returncode, out.stdout, out.stderr


def megacomp_traceback(err: str) -> bool:
    """Whether a rank printed a traceback through megacomp's code (torchrun's own failure report, which
    follows any non-zero worker exit, is not ours to change)."""
    return bool(re.search(r'File ".*megacomp/', err))


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("megacomp-pretrain: error:")]


def test_divergence_stops_every_rank_once_without_a_checkpoint(tmp_path, base):
    status, out, err = launch(tmp_path, base, 2, "--lr", "1e6", "--train-iters", "6", "--save", str(tmp_path / "ck"),
                              "--log-dir", str(tmp_path / "logs"))
    assert status != 0
    [line] = error_lines(err)
    assert "training diverged at iteration 2" in line and "--loss-divergence-factor" in line and "--lr" in line
    assert not megacomp_traceback(err)
    assert not (tmp_path / "ck").exists() or not any(p.name.startswith("iter_") for p in (tmp_path / "ck").iterdir())
    assert "megacomp-pretrain: diverged" in out  # the summary says what happened
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]


def test_divergence_sets_aside_the_checkpoint_of_the_diverged_weights(tmp_path, base):
    """--save-interval 1: iteration 1's checkpoint holds the weights whose loss diverged at iteration 2; it is
    renamed to iter_0000001.diverged (not deleted), the latest file no longer names it, and the line says so."""
    ck = tmp_path / "ck"
    status, out, err = launch(tmp_path, base, 2, "--lr", "1e6", "--train-iters", "6", "--save", str(ck),
                              "--save-interval", "1")
    assert status != 0, err  # 3 on the ranks; torchrun reports 1
    [line] = error_lines(err)
    assert "training diverged at iteration 2" in line
    assert f"moved the checkpoint of iteration 1 (the weights that diverged) to {ck}/iter_0000001.diverged" in line
    assert "no older complete checkpoint" in line and not megacomp_traceback(err)
    assert f"saved checkpoint to {ck}/iter_0000001" in out
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("iter_")) == ["iter_0000001.diverged"]
    assert latest_iteration(str(ck)) is None  # a later --save D --load D starts fresh


def _guard_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        trainer.train()
        return trainer.iteration, trainer.guard.state_dict()
    except TrainingDiverged as e:
        return trainer.iteration, str(e)
    finally:
        trainer.close()


def test_guard_state_round_trips_and_divergence_falls_back_to_the_previous_checkpoint(tmp_path, base):
    ck = str(tmp_path / "ck")
    cfg = replace(base, train_iters=2, save=ck, save_interval=1, max_skipped_steps=0)
    losses = run_ranks(_train_body, 2, cfg)[0]
    # resume with nothing left to train: the guard is the one the checkpoint of iteration 2 saved
    [(it, state)] = {(it, tuple(sorted(s.items()))) for it, s in run_ranks(_guard_body, 2, replace(cfg, load=ck))}
    assert it == 2 and dict(state) == {"best_loss": min(loss for loss, _ in losses), "consecutive": 0,
                                       "skipped_total": 0}
    # a resumed run at --lr 1e6: step 3 ruins the weights, iteration 4's loss diverges, iter 3 is set aside
    results = run_ranks(_guard_body, 2, replace(cfg, load=ck, train_iters=6, lr=1e6))
    assert {it for it, _ in results} == {4}  # every rank stopped there; rank 0 set the checkpoint aside and says so
    assert f"to {ck}/iter_0000003.diverged; the latest checkpoint is now iteration 2" in results[0][1]
    assert latest_iteration(ck) == 2 and os.path.isdir(os.path.join(ck, "iter_0000002"))
    assert not os.path.exists(os.path.join(ck, "iter_0000003"))


def test_guard_state_of_an_older_checkpoint_loads_as_fresh():
    guard = DivergenceGuard()
    guard.load_state_dict({})
    assert (guard.best_loss, guard.consecutive, guard.skipped_total) == (float("inf"), 0, 0)
    guard.load_state_dict({"best_loss": 2.5, "consecutive": 1, "skipped_total": 3})
    with pytest.raises(TrainingDiverged, match="lowest loss so far \\(2.5\\)"):
        guard.observe(5, 30.0, True, 1e-3)


def test_an_exploding_loss_stops_even_when_its_gradients_overflowed_too():
    """lr 1e6 gives a finite loss of ~1e12 together with inf gradients: the loss rule decides, not the skip
    counter (which would tolerate it for max_skipped_steps more iterations)."""
    guard = DivergenceGuard()
    assert guard.observe(1, 6.2, True, 1e6) is None
    with pytest.raises(TrainingDiverged, match="iteration 2: loss 4.3e\\+12 is more than"):
        guard.observe(2, 4.3e12, False, 1e6)
    tolerant = DivergenceGuard(loss_divergence_factor=0.0)  # the loss rule off: a skipped step, tolerated
    tolerant.observe(1, 6.2, True, 1e6)
    assert "step skipped (inf/NaN gradients)" in tolerant.observe(2, 4.3e12, False, 1e6)


def test_a_step_a_quorum_did_not_commit_is_said_and_not_counted_as_a_bad_step():
    """A fault-tolerance quorum that did not commit a step (a replica group lost or joining) excuses it: the note says
    why, and however many in a row, the run is not called diverged (the gradients were not at fault)."""
    guard = DivergenceGuard(max_skipped_steps=1)
    why = "not committed: the torchft quorum changed during the step; it is retried"
    for it in range(1, 5):
        assert guard.observe(it, 6.0, False, 1e-3, why) == f"iteration {it}: step not taken ({why})"
    assert (guard.consecutive, guard.skipped_total) == (0, 0)
    assert "step skipped (non-finite loss)" in guard.observe(5, float("nan"), False, 1e-3, why)  # a NaN still counts


def test_skipped_steps_are_tolerated_up_to_the_limit(base):
    """Inf/NaN gradients skip the step; more than max_skipped_steps in a row stop the run, on every rank."""
    cfg = replace(base, train_iters=6, lr=1e6, loss_divergence_factor=0.0, max_skipped_steps=2)
    results = run_ranks(_diverge_body, 2, cfg)
    for res in results:
        assert res[0] == "diverged" and "3 consecutive steps skipped" in res[1] and "--max-skipped-steps 2" in res[1]
    assert results[0][2] == results[1][2]  # the same iteration on every rank


def _diverge_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        trainer.train()
        return ("finished", "", trainer.iteration)
    except TrainingDiverged as e:
        return ("diverged", str(e), trainer.iteration)
    finally:
        trainer.close()


def test_bad_input_is_one_line_once(tmp_path, base):
    status, _, err = launch(tmp_path, base, 2, config=tmp_path / "missing.yaml")
    assert status != 0 and error_lines(err) == [f"megacomp-pretrain: error: cannot read {tmp_path / 'missing.yaml'}: "
                                                f"No such file or directory"]
    assert not megacomp_traceback(err)
    status, _, err = launch(tmp_path, base, 2, "--data-path", str(tmp_path / "nope"))
    [line] = error_lines(err)
    assert status != 0 and "nope" in line
    assert not megacomp_traceback(err)
    # a size the world cannot hold is found after the process group is up (the flags parse alone raise before it,
    # as the missing file above; their messages are checked in-process: test_every_number_is_checked_and_named_by_its_flag)
    status, _, err = launch(tmp_path, base, 2, "--tensor-model-parallel-size", "3")
    [line] = error_lines(err)
    assert status != 0 and "does not divide the world size 2" in line and not megacomp_traceback(err), err


def test_truncated_metadata_on_load_is_one_line_once(tmp_path, base):
    ck = tmp_path / "ck"
    status, _, err = launch(tmp_path, base, 2, "--save", str(ck), "--train-iters", "1")
    assert status == 0, err
    metadata = ck / "iter_0000001" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:40])
    status, _, err = launch(tmp_path, base, 2, "--load", str(ck), "--train-iters", "2")
    assert status != 0, err
    [line] = error_lines(err)
    assert f"checkpoint file {metadata} is unreadable (truncated or garbled" in line
    assert "no older complete checkpoint" in line and not megacomp_traceback(err)


def test_an_error_on_another_rank_waits_for_rank_0_then_names_its_rank(monkeypatch, capsys):
    """Rank 0 prints at once. Another rank waits out the grace period first (so that a launcher which stops
    the job at the first exit cannot kill rank 0 before it printed), then prints the error with its rank."""
    from megacomp import pretrain
    monkeypatch.setenv("RANK", "0")
    pretrain._say("bad thing")
    assert capsys.readouterr().err == "megacomp-pretrain: error: bad thing\n"
    slept = []
    monkeypatch.setattr(pretrain.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MEGACOMP_ERROR_GRACE", "7.5")
    pretrain._say("a file missing on this node")
    assert slept == [7.5] and capsys.readouterr().err == "megacomp-pretrain: error: rank 1: a file missing on this node\n"


def test_save_and_load_the_same_directory_starts_fresh_then_resumes(tmp_path, base):
    ck = str(tmp_path / "ck")
    status, out, err = launch(tmp_path, base, 2, "--save", ck, "--load", ck, "--train-iters", "2")
    assert status == 0, err
    assert f"no checkpoint in {ck} yet: starting from iteration 0" in out
    assert f"megacomp-pretrain: saved checkpoint to {ck}/iter_0000002" in out
    status, out, err = launch(tmp_path, base, 2, "--save", ck, "--load", ck, "--train-iters", "3",
                              "--keep-checkpoints", "1")
    assert status == 0, err
    assert f"resumed from {ck} at iteration 2" in out and "iter      3 |" in out and "iter      2 |" not in out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("iter_")) == ["iter_0000003"]


def _signal_body(rank, world, cfg, signal_rank):
    trainer = Trainer(cfg)
    if rank == signal_rank:  # Slurm's warning signal reaches this rank while it trains
        def send():
            while trainer.iteration < 2:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGUSR1)
        threading.Thread(target=send, daemon=True).start()
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return [h["loss"] for h in history], trainer.iteration


def test_exit_signal_saves_at_the_next_boundary_and_resume_continues_bit_for_bit(tmp_path, base):
    # TP 2 on 2 ranks: the signalled rank's stop is agreed over the whole world, whatever the layout
    cfg = replace(base, train_iters=6, tensor_model_parallel_size=2, compression="all")
    full = run_ranks(_train_body, 2, cfg)[0]
    ck = str(tmp_path / "ck")
    first = run_ranks(_signal_body, 2, replace(cfg, save=ck), 1)
    stops = {it for _, it in first}
    assert len(stops) == 1, stops  # every rank stopped at the same iteration boundary
    [stop] = stops
    assert 2 <= stop < 6
    assert os.path.isdir(os.path.join(ck, f"iter_{stop:07d}"))
    rest = run_ranks(_train_body, 2, replace(cfg, load=ck))[0]
    assert first[0][0] + [loss for loss, _ in rest] == [loss for loss, _ in full]


# ---- lost and stalled ranks ------------------------------------------------------------------------------------
def _workers(launcher_pid: int) -> dict:
    """{rank: pid} of torchrun's worker processes (its children that carry a RANK)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except (OSError, ValueError):
            continue
        if parent == launcher_pid and b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            found[int(env[b"RANK"])] = int(pid)
    return found


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _launch_and_hit(tmp_path, base, nproc, victim, sig, flags, until_line=None, timeout=240):
    """Launch a long run, send ``sig`` to rank ``victim`` once rank 0 logged iteration 3; returns (status, out,
    err, seconds from the signal to the first megacomp error line, or to the job's end without one)."""
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(base, name) for name in base.explicit}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megacomp.pretrain", "--config", str(cfg_file), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGACOMP_DEBUG", None)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    out, err, hit = [], [], {}

    def read(stream, into, watch):
        for line in stream:
            into.append(line)
            if watch and "hit" in hit and "line" not in hit and line.startswith("megacomp-pretrain: error:"):
                hit["line"] = time.monotonic()
                if sig == signal.SIGSTOP:  # the verdict is out: torchrun's SIGTERM cannot end a stopped process
                    _kill_quietly(hit["victim"])

    readers = [threading.Thread(target=read, args=(proc.stdout, out, False), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, err, True), daemon=True)]
    for t in readers:
        t.start()
    victim_pid = None
    try:
        deadline = time.monotonic() + timeout
        while not any(line.startswith("iter      3 |") for line in out):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(err)
            time.sleep(0.1)
        victim_pid = hit["victim"] = _workers(proc.pid)[victim]
        hit["hit"] = time.monotonic()
        os.kill(victim_pid, sig)
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
        if victim_pid is not None and sig == signal.SIGSTOP:
            _kill_quietly(victim_pid)
        for t in readers:
            t.join(timeout=10)
    return proc.returncode, "".join(out), "".join(err), hit.get("line", time.monotonic()) - hit["hit"]


LOST_LINE = (r"megacomp-pretrain: error: rank 1 \(host [^,]+, pid \d+\) stopped responding after iteration (\d+): "
             r"no heartbeat for \d+ s, stalled or lost; the other ranks stop: resume from the last checkpoint")


@pytest.mark.slow
def test_a_lost_rank_is_named_once_and_the_others_stop_with_status_4(tmp_path, base):
    """kill -9 of rank 1 in a 2-rank run: rank 0's collective fails at once (connection closed); it reads the
    heartbeats, names rank 1 with its host and iteration in one line, and exits with status 4 within a few
    heartbeat intervals; no gloo traceback follows; the checkpoint written before stays loadable."""
    ck = tmp_path / "ck"
    status, out, err, waited = _launch_and_hit(
        tmp_path, base, 2, 1, signal.SIGKILL,
        ["--train-iters", "100000", "--distributed-timeout-minutes", "0.5", "--save", str(ck), "--save-interval", "2"])
    assert status != 0
    [line] = error_lines(err)
    assert re.fullmatch(LOST_LINE, line) and int(re.fullmatch(LOST_LINE, line).group(1)) >= 3, line
    assert waited < 20, waited  # three 1.5 s heartbeat intervals, on a loaded machine
    assert "exitcode  : 4" in err  # rank 0's status in torchrun's summary
    assert not megacomp_traceback(err) and "Connection closed by peer" not in err and "gloo" not in err.lower()
    assert latest_iteration(str(ck)) >= 2  # nothing of value lost


@pytest.mark.slow
def test_a_stalled_rank_is_named_within_the_timeout(tmp_path, base):
    """SIGSTOP of rank 1: its heartbeat stands still, rank 0 names it within --distributed-timeout-minutes (15 s)
    plus a heartbeat interval and exits with status 4 (the stopped rank is then killed by the test: torchrun's own
    SIGTERM cannot end a stopped process, it would wait 30 s more)."""
    from megacomp.training.heartbeat import heartbeat_interval

    timeout_s = 15.0
    status, out, err, waited = _launch_and_hit(
        tmp_path, base, 2, 1, signal.SIGSTOP,
        ["--train-iters", "100000", "--distributed-timeout-minutes", str(timeout_s / 60)])
    assert status != 0
    [line] = error_lines(err)
    assert re.fullmatch(LOST_LINE, line), line
    # not before the timeout less a beat's age and the collective that was already waiting (an iteration, < 1 s);
    # at most the timeout, an interval, and slack for a loaded machine after it
    interval = heartbeat_interval(timeout_s)
    assert timeout_s - interval - 1.0 <= waited <= timeout_s + interval + 10, waited
    assert "exitcode  : 4" in err and not megacomp_traceback(err) and "gloo" not in err.lower()


def _heartbeat_body(rank, world):
    """Rank 0 stops rank 1 (SIGSTOP) and asks the heartbeat; its watcher thread reaches the same verdict after
    the 1 s timeout. Then rank 1 stops its heartbeat with status 2 (an error it reported) and rank 0's diagnosis
    says so instead of calling it lost."""
    from megacomp.training.heartbeat import Heartbeat

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    verdicts = []
    hb = Heartbeat(1.0, progress=lambda: 7, on_verdict=lambda line, claimed: verdicts.append((line, claimed)),
                   interval=0.1).start()
    out = {"rank0_known_at_start": hb.known.get(0)}  # before any tick: the line for a lost store names rank 0
    dist.barrier()
    if rank == 0:
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGSTOP)
        try:
            out["stalled"] = hb.diagnose()
            deadline = time.monotonic() + 10
            while not verdicts and time.monotonic() < deadline:
                time.sleep(0.05)
            out["verdicts"] = list(verdicts)
        finally:
            os.kill(pids[1], signal.SIGCONT)
    dist.barrier()
    if rank == 1:
        hb.stop(2)
    dist.barrier()
    if rank == 0:
        out["exited"] = hb.diagnose(window_s=0.3)
        hb.stop(0)
    return out


def test_the_heartbeat_names_a_stopped_rank_and_tells_an_exited_one_apart():
    from megacomp.training.heartbeat import lost_line

    out, out1 = run_ranks(_heartbeat_body, 2)
    first = out1["rank0_known_at_start"]  # rank 1 read rank 0's first beat in start(), before its first tick
    assert out["rank0_known_at_start"] is None and (first.rank, first.count, first.iteration) == (0, 1, 7)
    kind, [beat] = out["stalled"]
    assert kind == "lost" and (beat.rank, beat.iteration, beat.exit_status) == (1, 7, None)
    [(line, claimed)] = out["verdicts"]  # the watcher thread, once, and it was the first to claim
    assert claimed and line.startswith(f"rank 1 (host {beat.host}, pid {beat.pid}) stopped responding after "
                                       f"iteration 7: no heartbeat for 1 s, stalled or lost")
    kind, [beat] = out["exited"]
    assert kind == "exited" and beat.exit_status == 2
    assert "(and 1 more rank: 3)" in lost_line([beat, beat.__class__(3, 1, 2, "h", 9)], 5.0)


# ---- bad numbers and flags, unwritable directories --------------------------------------------------------------
def test_every_number_is_checked_and_named_by_its_flag():
    from megacomp.training import parse_args

    for flags, message in [(("--train-iters", "0"), "--train-iters must be >= 1, got 0"),
                           (("--train-iters", "-5"), "--train-iters must be >= 1, got -5"),
                           (("--micro-batch-size", "0"), "--micro-batch-size must be >= 1, got 0"),
                           (("--lr", "-1"), "--lr must be >= 0, got -1.0"),
                           (("--lr", "nan"), "--lr must be a finite number >= 0, got nan"),
                           (("--adam-beta2", "1"), "--adam-beta2 must be in [0, 1), got 1.0"),
                           (("--distributed-timeout-minutes", "0"), "--distributed-timeout-minutes must be > 0"),
                           (("--trian-iters", "5"), "unrecognized arguments: --trian-iters 5 (--trian-iters: did "
                                                    "you mean '--train-iters'?); megacomp-pretrain --help lists"),
                           (("--train-iters", "x"), "argument --train-iters: invalid int value: 'x'")]:
        with pytest.raises(ValueError) as e:
            parse_args(list(flags))
        assert str(e.value).startswith(message) and "\n" not in str(e.value), (flags, str(e.value))


def test_size_and_choice_checks_name_the_flags_the_docs_promise(monkeypatch):
    """The checks that relate settings (batch sizes, parallel sizes, choices) name them by flag, as the numbers'
    checks do, and every flag a message names is one the command line takes."""
    from megacomp.training import parse_args
    from megacomp.training.arguments import build_parser

    known = set(build_parser()._option_string_actions)
    monkeypatch.setenv("WORLD_SIZE", "4")
    for flags, message in [
            (("--global-batch-size", "6", "--micro-batch-size", "2"),
             "--global-batch-size 6 is not a multiple of --micro-batch-size 2 x data-parallel size 4"),
            (("--tensor-model-parallel-size", "3"),
             "--tensor-model-parallel-size (3) x --pipeline-model-parallel-size (1) = 3 does not divide the world "
             "size 4"),
            (("--hidden-size", "30", "--num-attention-heads", "4"),
             "--hidden-size 30 must be divisible by --num-attention-heads 4"),
            (("--optimizer", "sgd"), "--optimizer must be one of"),
            (("--dp-collectives", "ring"), "--dp-collectives must be auto"),
            (("--pipeline-model-parallel-size", "4", "--num-layers", "2", "--global-batch-size", "16",
              "--micro-batch-size", "1"), "4 pipeline stages (--pipeline-model-parallel-size) for 2 layers "
                                          "(--num-layers): every stage needs at least one layer")]:
        with pytest.raises(ValueError) as e:
            parse_args(list(flags))
        text = str(e.value)
        assert text.startswith(message) and "\n" not in text, (flags, text)
        named = set(re.findall(r"--[a-z][a-z0-9-]*", text))
        assert named and named <= known, (text, named - known)


def test_an_unknown_nested_key_is_one_short_line_with_the_closest_key(tmp_path):
    from megacomp.training import parse_args

    path = tmp_path / "typo.yaml"
    path.write_text("training: {trian_iters: 5}\n")
    with pytest.raises(ValueError) as e:
        parse_args(["--config", str(path)])
    assert str(e.value) == (f"{path}: unknown key training.trian_iters (did you mean 'train_iters'?); "
                            f"megacomp-pretrain --help lists every key")


@pytest.mark.slow
def test_bad_flags_and_numbers_are_one_line_once_under_torchrun(tmp_path, base):
    """argparse's own refusal (a misspelt flag) is one line from rank 0, without the usage block; a number out of
    range is refused by the same path (parse_args, before the process group) as the missing file of
    test_bad_input_is_one_line_once, so one launch covers it."""
    status, out, err = launch(tmp_path, base, 2, "--trian-iters", "5")
    [line] = error_lines(err)
    assert status != 0 and "did you mean '--train-iters'?" in line and "usage:" not in err, err
    assert not megacomp_traceback(err)


@pytest.mark.slow
def test_an_unwritable_log_dir_is_one_line_without_tracebacks_after_it(tmp_path, base):
    """Only rank 0 writes --log-dir: its error ends its process, and rank 1's collective then fails. Rank 1 reads
    rank 0's last heartbeat (it stopped on an error it reported) and exits with the same status, silently."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    status, out, err = launch(tmp_path, base, 2, "--log-dir", str(blocker / "logs"), "--train-iters", "2")
    [line] = error_lines(err)
    assert status != 0 and line == (f"megacomp-pretrain: error: --log-dir {blocker / 'logs'}: cannot write "
                                    f"metrics.jsonl there (Not a directory); point --log-dir at a writable directory")
    assert not megacomp_traceback(err) and "gloo" not in err.lower() and "exitcode  : 1 " not in err, err
    assert "SIGKILL" not in err, err  # rank 1 ended on its own: its wait for rank 0 read rank 0's last beat


# ---- accounting -------------------------------------------------------------------------------------------------
def _traffic_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        return [(h["iteration"], h["traffic"]) for h in trainer.train()]
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_resumed_iteration_records_the_traffic_of_an_uninterrupted_one(tmp_path, base):
    """Loading a checkpoint all-gathers the parameters once; those bytes belong to no iteration, so iteration 3
    of a run resumed at 2 records exactly what iteration 3 of an uninterrupted run does (dp_parameter was twice)."""
    cfg = replace(base, train_iters=3)
    full = run_ranks(_traffic_body, 2, cfg)[0]
    ck = str(tmp_path / "ck")
    run_ranks(_traffic_body, 2, replace(cfg, train_iters=2, save=ck))
    [resumed] = run_ranks(_traffic_body, 2, replace(cfg, load=ck))[0]
    assert resumed == full[-1] and resumed[1]["dp_parameter"][0] > 0


@pytest.mark.slow
def test_losing_rank_0_with_the_store_under_srun_is_one_line_and_status_4(tmp_path, base):
    """srun-style launch (SLURM_* variables, no torchrun): rank 0 hosts the rendezvous store, so kill -9 of rank 0
    takes the store with it. Rank 1 names rank 0 from the last beat it read and exits with status 4 at once."""
    from megacomp.launch import free_port

    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(base, name) for name in base.explicit}))
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
               "SLURM_LOCALID": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env.pop("MEGACOMP_DEBUG", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "megacomp.pretrain", "--config", str(cfg_file),
                                       "--train-iters", "100000", "--distributed-timeout-minutes", "0.5"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path))
    try:
        for line in procs[0].stdout:
            if line.startswith("iter      3 |"):
                break
        procs[0].kill()
        start = time.monotonic()
        _, err = procs[1].communicate(timeout=120)
        waited = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == 4 and waited < 20, (procs[1].returncode, waited, err)
    [line] = error_lines(err)
    assert re.fullmatch(r"megacomp-pretrain: error: lost the rendezvous store, hosted with rank 0 \(host [^,]+, pid "
                        rf"{procs[0].pid}\) after iteration \d+: rank 0 or its node was lost; the other ranks stop: "
                        r"resume from the last checkpoint", line), line
    assert not megacomp_traceback(err)

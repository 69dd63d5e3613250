"""What ``--load`` and ``--save`` name, on real directories (megacomp.training.checkpoint_paths).

- ``--load`` at a regular file, at the latest-iteration file, at a partial (``iter_N.tmp``) or set-aside save, at a
  directory that cannot be read (a real permission fault, as an unprivileged user), at a directory whose
  subdirectory holds the checkpoints, at a latest file that is a directory: one line naming the problem and the
  fix, exit status 2, never a silent start from iteration 0.
- ``--load D/iter_N`` resumes from exactly that checkpoint and the banner says so; iter_N directories without
  the latest file are not skipped silently.
- A ``--load`` that does not exist is a fresh start (Megatron-LM's behaviour), said in the banner.
- ``--save`` at a file or at an iteration directory: one line naming the directory to use; a ``--log-dir`` or
  ``--data-cache-dir`` that is a file: one line, before anything starts.
"""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from distributed import run_ranks
from training_runs import train_losses
from megacomp.training import Trainer
from megacomp.training.checkpoint_paths import LATEST, check_save_dir, resolve_load


@pytest.fixture(scope="module")
def ck(tiny_config, tmp_path_factory):
    """A checkpoint directory with iterations 1 and 2 (latest 2) of the tiny config."""
    root = tmp_path_factory.mktemp("paths") / "ck"
    run_ranks(train_losses, 2, replace(tiny_config, train_iters=2, save=str(root), save_interval=1))
    return root



def _start_body(rank, world, cfg):
    """Build the trainer only: (iteration it starts at, None) or (None, the error's line)."""
    try:
        trainer = Trainer(cfg)
    except (ValueError, OSError) as e:
        return None, str(e)
    trainer.close()
    return trainer.iteration, None


def test_load_paths_that_hold_no_resumable_checkpoint_are_refused_naming_the_fix(ck, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("hello")
    (tmp_path / "runs" / "ck").mkdir(parents=True)
    (tmp_path / "runs" / "ck" / LATEST).write_text("7")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / LATEST).mkdir()
    partial = tmp_path / "iter_0000003.tmp"
    partial.mkdir()
    cases = {str(a_file): "is a file, not a checkpoint directory; point --load at the directory --save wrote",
             str(ck / LATEST): f"is the latest-iteration file, not a checkpoint directory; use --load {ck}",
             str(partial): f"is a partial save (a run was stopped while writing it; it is not a checkpoint); use "
                           f"--load {tmp_path}",
             str(tmp_path / "runs"): f"holds no checkpoint, but {tmp_path / 'runs' / 'ck'} does; use --load "
                                     f"{tmp_path / 'runs' / 'ck'}",
             str(tmp_path / "odd"): "is not a regular file",
             str(a_file / "sub"): "cannot be read (Not a directory)"}
    for path, words in cases.items():
        with pytest.raises(ValueError) as e:
            resolve_load(path)
        assert str(e.value).startswith(f"--load {path}: ") and words in str(e.value), str(e.value)


def test_load_paths_that_start_fresh_or_resume(ck, tmp_path):
    missing = resolve_load(str(tmp_path / "new"))
    assert not missing.has_checkpoint and "(it does not exist yet): starting from iteration 0" in missing.note
    (tmp_path / "empty").mkdir()
    assert resolve_load(str(tmp_path / "empty")).note == f"no checkpoint in {tmp_path / 'empty'} yet: starting from " \
                                                         f"iteration 0"
    assert (resolve_load(str(ck)).root, resolve_load(str(ck)).iteration) == (str(ck), None)
    named = resolve_load(str(ck / "iter_0000001"))
    assert (named.root, named.iteration, named.has_checkpoint) == (str(ck), 1, True)
    assert "resuming from exactly that checkpoint (iteration 1" in named.note


def _unreadable_body(path):
    os.setgid(65534)
    os.setuid(65534)  # nobody: the permission bits apply (root reads anything)
    try:
        resolve_load(path)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_load_directory_that_cannot_be_read_is_refused(ck):
    """A real permission fault: a world-readable copy of the path, its checkpoint directory mode 000, read as user
    nobody (in a forked child: the test itself runs as root, which reads anything)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    import multiprocessing as mp
    import pathlib
    import shutil
    import tempfile

    top = pathlib.Path(tempfile.mkdtemp(prefix="megacomp-perm-"))  # pytest's own tmp tree is closed to others
    try:
        os.chmod(top, 0o755)
        (top / "ck").mkdir()
        (top / "ck" / LATEST).write_text("2")
        os.chmod(top / "ck", 0)
        with mp.get_context("fork").Pool(1) as pool:
            line = pool.apply(_unreadable_body, (str(top / "ck"),))
    finally:
        shutil.rmtree(top)
    assert line == (f"--load {top / 'ck'}: the directory cannot be read (Permission denied); fix its permissions "
                    f"(every rank must read it), or drop --load to start fresh"), line


def test_a_named_iteration_directory_resumes_exactly_there(ck, tiny_config):
    """--load ck/iter_0000001 while ck's latest is 2: the run resumes at 1 (the first iteration it trains is 2) and
    continues as the uninterrupted run did."""
    full, _ = run_ranks(train_losses, 2, replace(tiny_config, train_iters=2))[0]
    losses, it = run_ranks(train_losses, 2, replace(tiny_config, train_iters=2, load=str(ck / "iter_0000001")))[0]
    assert it == 2 and losses == full[1:]


def test_iterations_without_a_latest_file_are_not_skipped(ck, tiny_config, tmp_path):
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(ck, copy)
    os.remove(copy / LATEST)
    [(it, line)] = {r for r in run_ranks(_start_body, 2, replace(tiny_config, load=str(copy)))}
    assert it is None and f"checkpoint file {copy / LATEST} is unreadable (missing, although there are iter_* " \
                          f"checkpoints); iteration 2 is the newest checkpoint that verifies: add --load-fallback" in line
    [(it, line)] = {r for r in run_ranks(_start_body, 2, replace(tiny_config, load=str(copy), load_fallback=True))}
    assert it == 2 and line is None


def test_save_paths_that_are_files_or_one_iteration_are_refused(ck, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory; point --save at a directory"):
        check_save_dir(str(a_file))
    with pytest.raises(ValueError, match=f"is the checkpoint of one iteration, not a checkpoint directory; use --save "
                                         f"{ck}$"):
        check_save_dir(str(ck / "iter_0000002"))
    check_save_dir(str(ck))
    check_save_dir(str(tmp_path / "new"))


def test_bad_paths_under_the_entry_point_are_one_line_and_status_2(ck, tiny_config, tmp_path):
    """One process, no launcher: each bad path is one ``megacomp-pretrain: error:`` line and exit status 2. The cases
    run through megacomp.pretrain.main in one interpreter (the imports are paid once), a marker line between them."""
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(tiny_config, name) for name in tiny_config.explicit}))
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    (tmp_path / "ck" / "iter_0000001.tmp").mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGACOMP_DEBUG", None)
    cases = [(("--load", str(a_file)), f"--load {a_file}: is a file, not a checkpoint directory"),
             (("--save", str(a_file)), f"--save {a_file}: is a file, not a directory"),
             (("--log-dir", str(a_file)), f"--log-dir {a_file}: is a file, not a directory"),
             (("--data-cache-dir", str(a_file)), f"--data-cache-dir {a_file}: is a file, not a directory"),
             (("--load", str(tmp_path / "ck" / "iter_0000001.tmp")), "is a partial save")]
    driver = ("import json, sys\nfrom megacomp.pretrain import main\n"
              "for flags in json.loads(sys.argv[1]):\n"
              "    status = main(['--config', sys.argv[2], *flags])\n"
              "    print(f'STATUS {status}', flush=True)\n"
              "    print('--- next case', file=sys.stderr, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", driver, json.dumps([flags for flags, _ in cases]), str(cfg_file)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert [x for x in out.stdout.splitlines() if x.startswith("STATUS")] == ["STATUS 2"] * len(cases), out.stdout
    parts = out.stderr.split("--- next case\n")
    assert len(parts) == len(cases) + 1, out.stderr
    for (flags, line), err in zip(cases, parts):
        errors = [x for x in err.splitlines() if x.startswith("megacomp-pretrain: error:")]
        assert len(errors) == 1 and line in errors[0], (flags, err)
    assert 'File "' not in out.stderr and "iter      1 |" not in out.stdout


def test_a_partial_save_left_by_a_killed_run_is_removed_when_the_next_run_resumes(tiny_config, tmp_path):
    """kill -9 while iteration 4 is being saved leaves ck/iter_0000004.tmp; the resumed run (--keep-checkpoints 1,
    3 iterations: it never saves iteration 4 again) removes it once it chose its checkpoint (iteration 2), says so in
    the banner, and takes over the dead run's lock."""
    import signal
    import time

    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(yaml.safe_dump({name: getattr(tiny_config, name) for name in tiny_config.explicit}))
    ck = tmp_path / "ck"
    # a model whose save takes about a second on one CPU thread, so that the kill lands inside it
    flags = ["--config", str(cfg_file), "--save", str(ck), "--save-interval", "2", "--hidden-size", "512",
             "--num-layers", "4", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MEGACOMP_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "megacomp.pretrain", *flags, "--train-iters", "100"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
    partial = ck / "iter_0000004.tmp"
    try:
        deadline = time.monotonic() + 180
        while not partial.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.002)
        time.sleep(0.05)  # DCP is writing its shards
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert partial.is_dir() and (ck / LATEST).read_text() == "2"
    out = subprocess.run([sys.executable, "-m", "megacomp.pretrain", *flags, "--load", str(ck), "--train-iters", "3",
                          "--keep-checkpoints", "1"], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"resumed from {ck} at iteration 2" in out.stdout
    assert f"removed 1 partial save(s) an interrupted run left: {partial}" in out.stdout
    assert "took over the lock of pid" in out.stdout
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("iter_")) == ["iter_0000003"]

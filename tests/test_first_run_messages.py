"""A first run that explains itself and a data cache that cannot run code.

- The CPU kernels' build says so on stderr before and after (only when a build will happen, only from
  local rank 0); tested with the builder stubbed at ``build.load`` (no real one-minute compile) and with
  ``build.build_needed`` on an empty TORCH_EXTENSIONS_DIR.
- Training the tokenizer and tokenizing the corpus say so once, from the process that does the work, and
  nothing is said when everything comes from the cache.
- A truncated or garbled cached tokenizer model or token-file index raises a ValueError naming the file
  (and the pipeline's entry points rebuild it, saying so); the data pipeline never unpickles a cache file.
- Plotting the run's metrics writes next to the run and gives the byte ratio as the trainer does.
"""
import importlib.util
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from megacomp.data import (TokenDataset, Tokenizer, build_token_file, collect_files, default_corpus_files,
                           prepare_data, read_index, train_tokenizer)
from megacomp.data import dataset as dataset_module

REPO = Path(__file__).resolve().parent.parent
VOCAB = 512
CORPUS_BYTES = 150_000


def _kernels_of_this_checkout(name):
    """A fresh copy of this checkout's megacomp/kernels/ package under its own name: its own ``_cpu`` state (the
    shared ``megacomp.kernels`` keeps its built module), and this checkout's code even where an editable
    install elsewhere supplies ``megacomp.kernels``."""
    folder = REPO / "megacomp" / "kernels"
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fresh_kernels(monkeypatch):
    for var in ("MEGACOMP_KERNELS", "RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                "PMI_RANK", "MPI_LOCALRANKID", "PMIX_RANK", "PMIX_LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    name = "_megacomp_kernels_under_test"
    kernels = _kernels_of_this_checkout(name)
    build = importlib.import_module(name + ".cpu.build")
    yield kernels, build
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def _lines(text):
    return [line for line in text.splitlines() if line.startswith("megacomp:")]


# ---- the CPU kernels' build ---------------------------------------------------------------------------


def test_kernel_build_is_announced_before_and_after(fresh_kernels, monkeypatch, capsys):
    kernels, build = fresh_kernels
    module = object()
    calls = []
    monkeypatch.setattr(build, "build_needed", lambda: True)
    monkeypatch.setattr(build, "build_directory", lambda: "/cache/megacomp_codec_kernels")
    monkeypatch.setattr(build, "load", lambda: calls.append(1) or module)
    assert kernels.cpu_kernels() is module and kernels.cpu_kernels() is module and calls == [1]
    lines = _lines(capsys.readouterr().err)
    assert lines[0] == ("megacomp: building the CPU codec kernels (one time, about a minute; cached in "
                        "/cache/megacomp_codec_kernels)")
    assert re.fullmatch(r"megacomp: built the CPU codec kernels in \d+\.\d s", lines[1]) and len(lines) == 2


def test_kernel_load_from_cache_is_quiet_and_unknown_says_building_or_loading(fresh_kernels, monkeypatch, capsys):
    kernels, build = fresh_kernels
    monkeypatch.setattr(build, "build_needed", lambda: False)
    monkeypatch.setattr(build, "load", lambda: "module")
    assert kernels.cpu_kernels() == "module"
    assert capsys.readouterr().err == ""

    monkeypatch.setattr(kernels, "_cpu", None)
    monkeypatch.setattr(build, "build_needed", lambda: None)
    monkeypatch.setattr(build, "build_directory", lambda: None)
    assert kernels.cpu_kernels() == "module"
    lines = _lines(capsys.readouterr().err)
    assert lines[0] == "megacomp: building or loading the CPU codec kernels (one time, about a minute when it builds)"
    assert re.fullmatch(r"megacomp: CPU codec kernels ready after \d+\.\d s", lines[1]) and len(lines) == 2


@pytest.mark.parametrize("env, speaks", [({"RANK": "0", "LOCAL_RANK": "0"}, True),
                                         ({"RANK": "5", "LOCAL_RANK": "1"}, False),
                                         ({"RANK": "4", "LOCAL_RANK": "0"}, True),   # local rank 0 of node 2
                                         ({"RANK": "3"}, False), ({"RANK": "0"}, True),
                                         ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, False),
                                         ({"SLURM_PROCID": "1", "SLURM_LOCALID": "1"}, False), ({}, True)])
def test_kernel_build_message_only_from_local_rank_0(fresh_kernels, monkeypatch, capsys, env, speaks):
    kernels, build = fresh_kernels
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(build, "build_needed", lambda: True)
    monkeypatch.setattr(build, "load", lambda: "module")
    assert kernels.cpu_kernels() == "module"
    assert bool(_lines(capsys.readouterr().err)) is speaks


def test_kernel_build_failure_still_falls_back_with_one_warning(fresh_kernels, monkeypatch, capsys, caplog):
    kernels, build = fresh_kernels
    monkeypatch.setattr(build, "build_needed", lambda: True)

    def broken():
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(build, "load", broken)
    with caplog.at_level(logging.WARNING, logger="megacomp"):
        assert kernels.cpu_kernels() is None and kernels.cpu_kernels() is None
    assert len(caplog.records) == 1 and "no compiler here" in caplog.text and "eager reference" in caplog.text
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("megacomp: building the CPU codec kernels")


def test_build_needed_on_an_empty_or_foreign_extension_cache(fresh_kernels, monkeypatch, tmp_path):
    """The real check, without compiling: nothing cached, or a cache built from other flags, is a build."""
    kernels, build = fresh_kernels
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.build_needed() is True
    assert build.build_directory() == str(tmp_path / build.NAME)
    folder = tmp_path / build.NAME
    (folder / "build.ninja").write_text("cflags = -O2\nbuild x.o: compile /elsewhere/codec_kernels.cpp\n")
    (folder / (build.NAME + ".so")).write_bytes(b"")
    assert build.build_needed() is True


# ---- the data pipeline --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """~150 KB of the standard library's sources (as in test_data_pipeline.py, smaller)."""
    root = tmp_path_factory.mktemp("corpus")
    total = 0
    for i, src in enumerate(default_corpus_files()):
        dst = root / f"{i:04d}_{os.path.basename(src)}"
        shutil.copyfile(src, dst)
        total += dst.stat().st_size
        if total > CORPUS_BYTES:
            break
    return str(root)


def test_first_prepare_data_says_what_it_does_once(corpus_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGACOMP_DATA_CACHE", str(tmp_path / "cache"))
    files = collect_files([corpus_dir])
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    tokenizer, ds = prepare_data([corpus_dir], vocab_size=VOCAB, seq_length=32)
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 4, lines
    assert lines[0] == (f"megacomp: training the tokenizer on {len(files)} files ({mb:.1f} MB) -> "
                        f"{tokenizer.model_path} (one time)")
    assert tokenizer.model_path.startswith(str(tmp_path / "cache"))
    assert re.fullmatch(rf"megacomp: trained the tokenizer \({VOCAB} pieces\) in \d+\.\d s", lines[1])
    assert lines[2] == f"megacomp: tokenizing {len(files)} files ({mb:.1f} MB) -> {ds.prefix}.bin (one time)"
    assert re.fullmatch(rf"megacomp: tokenized {len(files)} files into {ds.num_tokens:,} tokens in \d+\.\d s",
                        lines[3])
    # second call: everything from the cache, nothing said
    again, ds2 = prepare_data([corpus_dir], vocab_size=VOCAB, seq_length=32)
    assert not again.trained and ds2.prefix == ds.prefix
    assert _lines(capsys.readouterr().err) == []


def _prepare_quietly(rank, world, corpus_dir, cache_dir):
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        prepare_data([corpus_dir], vocab_size=VOCAB, seq_length=32, cache_dir=cache_dir)
    return err.getvalue()


def test_only_the_rank_that_builds_says_so(corpus_dir, tmp_path):
    from distributed import run_ranks

    r0, r1 = run_ranks(_prepare_quietly, 2, corpus_dir, str(tmp_path / "cache"))
    assert len(_lines(r0)) == 4 and "training the tokenizer" in r0 and "tokenizing" in r0
    assert r1 == ""


def test_tokenizer_message_says_how_much_is_read(corpus_dir, tmp_path, capsys):
    files = collect_files([corpus_dir])
    total = sum(os.path.getsize(f) for f in files)
    train_tokenizer(files, VOCAB, str(tmp_path), max_bytes=100_000)
    line = _lines(capsys.readouterr().err)[0]
    assert f"on {len(files)} files (0.1 MB of {total / 1e6:.1f} MB read) -> " in line


def test_tokenizing_reports_progress(corpus_dir, tmp_path, monkeypatch, capsys):
    files = collect_files([corpus_dir])
    tokenizer = train_tokenizer(files, VOCAB, str(tmp_path / "tok"))
    monkeypatch.setattr(dataset_module, "_PROGRESS_SECONDS", 0.0)
    docs = files * (200 // len(files) + 1)  # > 3 batches of 64 documents
    build_token_file(docs, tokenizer, str(tmp_path / "t"))
    progress = [line for line in _lines(capsys.readouterr().err) if line.startswith("megacomp: tokenizing: ")]
    assert progress and re.fullmatch(rf"megacomp: tokenizing: 64/{len(docs)} files \(\d+%\), [\d,]+ tokens, \d+ s",
                                     progress[0])


@pytest.mark.parametrize("damage", ["truncate", "empty", "garble"])
def test_truncated_tokenizer_model_raises_naming_the_file_and_is_retrained(corpus_dir, tmp_path, capsys, damage):
    files = collect_files([corpus_dir])
    tokenizer = train_tokenizer(files, VOCAB, str(tmp_path))
    path = tokenizer.model_path
    data = Path(path).read_bytes()
    Path(path).write_bytes({"truncate": data[:len(data) // 2], "empty": b"",
                            "garble": bytes(b ^ 0x5A for b in data)}[damage])
    with pytest.raises(ValueError, match=re.escape(repr(path)) + r" is truncated or corrupt .*delete it"):
        Tokenizer(path)
    capsys.readouterr()
    again = train_tokenizer(files, VOCAB, str(tmp_path))  # the pipeline trains it again, and says so
    assert again.trained and again.fingerprint == tokenizer.fingerprint and Path(path).read_bytes() == data
    lines = _lines(capsys.readouterr().err)
    assert lines[0].startswith(f"megacomp: tokenizer model {path!r} is truncated or corrupt") and \
        lines[0].endswith("; training it again") and "delete" not in lines[0]
    assert lines[1].startswith("megacomp: training the tokenizer on")


@pytest.mark.parametrize("damage", ["truncate", "not_an_object", "bad_dtype", "missing_field"])
def test_corrupt_token_index_raises_naming_the_file_and_is_rebuilt(corpus_dir, tmp_path, monkeypatch, capsys,
                                                                     damage):
    monkeypatch.setenv("MEGACOMP_DATA_CACHE", str(tmp_path / "cache"))
    _, ds = prepare_data([corpus_dir], vocab_size=VOCAB, seq_length=32)
    idx = ds.prefix + ".idx.json"
    text = Path(idx).read_text()
    Path(idx).write_text({"truncate": text[:len(text) // 2], "not_an_object": "[1, 2]",
                          "bad_dtype": text.replace('"dtype": "uint16"', '"dtype": "object"'),
                          "missing_field": text.replace('"num_tokens"', '"num_tokenz"')}[damage])
    for load in (lambda: read_index(ds.prefix), lambda: TokenDataset(ds.prefix, 32)):
        with pytest.raises(ValueError, match=re.escape(repr(idx)) + r".* delete .*\.\* and run again to rebuild it"):
            load()
    capsys.readouterr()
    _, rebuilt = prepare_data([corpus_dir], vocab_size=VOCAB, seq_length=32)
    lines = _lines(capsys.readouterr().err)
    assert lines[0].startswith(f"megacomp: token file index {idx!r} is ") or lines[0].startswith(f"megacomp: {idx!r}")
    assert lines[0].endswith("; building the token file again") and "delete" not in lines[0]
    assert lines[1].startswith("megacomp: tokenizing ") and len(lines) == 3  # the tokenizer came from the cache
    assert rebuilt.num_tokens == ds.num_tokens and (rebuilt[3] == ds[3]).all()


def test_the_data_pipeline_unpickles_nothing():
    for f in sorted((REPO / "megacomp" / "data").glob("*.py")):
        text = f.read_text(encoding="utf-8")
        for call in ("pickle.load", "torch.load", "allow_pickle", "np.load", "numpy.load", "marshal", "eval("):
            assert call not in text, f"{f.name} uses {call}"


def test_a_slow_build_says_what_may_hold_it_up(fresh_kernels, monkeypatch, capsys, tmp_path):
    """A load still running after LOCK_HINT_AFTER_S makes the announcing rank name the cache folder, the
    flock file another builder holds and how to see a compiler; a load that finishes in time says nothing."""
    import time
    kernels, build = fresh_kernels
    monkeypatch.setattr(build, "build_needed", lambda: False)
    monkeypatch.setattr(build, "build_directory", lambda: str(tmp_path))
    monkeypatch.setattr(kernels, "LOCK_HINT_AFTER_S", 0.05)
    monkeypatch.setattr(build, "load", lambda: time.sleep(0.5) or "module")
    assert kernels.cpu_kernels() == "module"
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and str(tmp_path) in lines[0] and build.FLOCK_NAME in lines[0] and "ps aux" in lines[0]

    monkeypatch.setattr(kernels, "_cpu", None)
    monkeypatch.setattr(kernels, "LOCK_HINT_AFTER_S", 5.0)
    monkeypatch.setattr(build, "load", lambda: "module")
    assert kernels.cpu_kernels() == "module" and capsys.readouterr().err == ""


def _build_and_die(build, folder, started):
    """A builder that takes the flock, creates torch's lock file as torch's loader does, then hangs."""
    import time

    def hang():
        open(os.path.join(folder, "lock"), "w").close()
        started.set()
        time.sleep(600)
    build.build_directory = lambda: folder
    build._load_unlocked = hang
    build.load()


def test_a_killed_build_does_not_hang_the_next_load(fresh_kernels, monkeypatch, capsys, tmp_path):
    """The CI hang this guards against: torch's loader waits forever while its ``lock`` file exists, and a
    killed build leaves it. A live builder holds the flock (the next load waits for it, not on the lock
    file); once it is killed (SIGKILL: no cleanup runs) the next load removes the left-over file, says so
    and loads."""
    import multiprocessing as mp
    import threading
    kernels, build = fresh_kernels
    folder = str(tmp_path)
    ctx = mp.get_context("fork")
    started = ctx.Event()
    builder = ctx.Process(target=_build_and_die, args=(build, folder, started), daemon=True)
    builder.start()
    try:
        assert started.wait(30), "the builder did not start"
        seen = []
        monkeypatch.setattr(build, "build_directory", lambda: folder)
        monkeypatch.setattr(build, "_load_unlocked",
                            lambda: seen.append(os.path.exists(os.path.join(folder, "lock"))) or "module")
        waiter = threading.Thread(target=lambda: seen.append(build.load()))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and seen == [], "a load ran while another process held the build flock"
        builder.kill()
        builder.join(10)
        waiter.join(30)
        assert not waiter.is_alive() and seen == [False, "module"]
    finally:
        if builder.is_alive():
            builder.kill()
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and os.path.join(folder, "lock") in lines[0] and "did not finish" in lines[0]
    assert not os.path.exists(os.path.join(folder, "lock"))


def test_without_flock_the_load_leaves_torchs_lock_alone(fresh_kernels, monkeypatch, capsys, tmp_path):
    """Where the file system refuses flock (some network mounts) nothing tells a live build from a dead one,
    so torch's lock file is left to torch's loader, as before, and nothing is printed."""
    kernels, build = fresh_kernels
    (tmp_path / "lock").write_text("")

    def no_flock(fd, op):
        raise OSError(37, "No locks available")
    monkeypatch.setattr(build.fcntl, "flock", no_flock)
    monkeypatch.setattr(build, "build_directory", lambda: str(tmp_path))
    monkeypatch.setattr(build, "_load_unlocked", lambda: "module")
    assert build.load() == "module"
    assert (tmp_path / "lock").exists() and capsys.readouterr().err == ""


# ---- plotting the first run's metrics --------------------------------------------------------------------------


def test_plot_metrics_writes_next_to_the_run_and_gives_the_trainers_ratio(tmp_path, monkeypatch, capsys):
    """``python -m benchmarks.plot_metrics runs/quickstart`` from anywhere: the PNGs land in runs/quickstart/ (not
    in the current directory) and the summary's ratio is sent / uncompressed, as the trainer prints it (0.25x for
    1,000 of 4,000 bytes per iteration)."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    import json

    from benchmarks import plot_metrics

    run = tmp_path / "runs" / "quickstart"
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for it in range(1, 6):
            f.write(json.dumps({"iteration": it, "loss": 7.0 - 0.1 * it, "wire_bytes": 1000,
                                "uncompressed_bytes": 4000, "traffic": {"dp_gradient": [1000, 4000]}}) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert plot_metrics.main([str(run)]) == 0
    assert sorted(p.name for p in run.glob("*.png")) == ["loss_vs_iteration.png", "loss_vs_wire_bytes.png"]
    assert list(elsewhere.iterdir()) == []
    text = capsys.readouterr().out
    assert "wire 0.01 MB of 0.02 MB (0.25x)" in text, text

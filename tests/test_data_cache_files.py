"""The shared data cache (megacomp.data.cache_files) with real processes: files a killed build leaves are removed by
the next one, concurrent jobs build a token file once and their readers never fail to open it, and cache files get
a new file's usual permissions (not 0600), so other users of a shared cache can read them."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megacomp.data import Tokenizer, build_token_file, collect_files, default_corpus_files, read_index, train_tokenizer
from megacomp.data.cache_files import atomic_write

BUILD = ("import sys; from megacomp.data import Tokenizer, build_token_file, collect_files; "
         "build_token_file(collect_files([sys.argv[1]]), Tokenizer(sys.argv[2]), sys.argv[3])")
READ = ("import sys, time; from megacomp.data import TokenDataset\n"
        "opened = failed = 0\n"
        "while not __import__('os').path.exists(sys.argv[2]): time.sleep(0.001)\n"
        "while not __import__('os').path.exists(sys.argv[3]):\n"
        "    try: TokenDataset(sys.argv[1], 16); opened += 1\n"
        "    except Exception as e: failed += 1; print(repr(e), file=sys.stderr)\n"
        "print(opened, failed)")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 3 MB of the standard library's sources (a build takes a few seconds), and a tokenizer trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    total = 0
    for i, src in enumerate(default_corpus_files()):
        shutil.copyfile(src, root / f"{i:04d}_{os.path.basename(src)}")
        total += os.path.getsize(src)
        if total > 3_000_000:
            break
    files = collect_files([str(root)])
    tok = train_tokenizer(files, 512, str(tmp_path_factory.mktemp("tok")), max_bytes=300_000)
    return str(root), tok


def _build(corpus_dir, tok, prefix) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD, corpus_dir, tok.model_path, str(prefix)],
                            stderr=subprocess.PIPE, text=True)


def test_new_cache_files_are_readable_by_others(tmp_path, corpus):
    old = os.umask(0o022)
    try:
        atomic_write(str(tmp_path / "x.json"), b"{}")
        build_token_file(collect_files([corpus[0]])[:5], corpus[1], str(tmp_path / "t"))
    finally:
        os.umask(old)
    for name in ("x.json", "t.bin", "t.idx.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
    assert oct(os.stat(corpus[1].model_path).st_mode & 0o044) != "0o0"  # the tokenizer model too


def test_a_killed_build_leaves_no_temporary_behind(tmp_path, corpus):
    prefix = tmp_path / "tokens"
    proc = _build(*corpus, prefix)
    deadline = time.time() + 60
    while not list(tmp_path.glob("tokens.bin.*.tmp")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.002)
    assert proc.poll() is None, "the build finished before it could be killed"
    proc.send_signal(signal.SIGKILL)  # a kill no handler sees: the lock is dropped by the kernel, the .tmp stays
    proc.wait()
    assert list(tmp_path.glob("tokens.bin.*.tmp"))
    build_token_file(collect_files([corpus[0]]), corpus[1], str(prefix))  # must not wait on the dead job's lock
    assert not list(tmp_path.glob("*.tmp"))
    assert read_index(str(prefix))["num_tokens"] > 0


def test_concurrent_jobs_build_once_and_readers_never_fail(tmp_path, corpus):
    prefix, done = tmp_path / "tokens", tmp_path / "done"
    reader = subprocess.Popen([sys.executable, "-c", READ, str(prefix), str(prefix) + ".idx.json", str(done)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    builders = [_build(*corpus, prefix) for _ in range(2)]
    said = [b.communicate(timeout=300)[1] for b in builders]
    assert all(b.returncode == 0 for b in builders), said
    time.sleep(0.5)  # the reader keeps opening what the builders left
    done.touch()
    out, err = reader.communicate(timeout=60)
    opened, failed = map(int, out.split())
    assert opened > 0 and failed == 0, err[-2000:]
    assert sum("tokenizing" in s for s in said) == 1  # the second job waited, then found it built

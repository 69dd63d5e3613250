import os

# One intra-op thread per process: ranks share two cores, and forked ranks must not inherit an
# OpenMP pool (libgomp is not fork-safe once a parallel region ran).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory):
    """The tiny pretraining config the training tests start from: a 2-layer GPT of width 32 (4 heads, 32 tokens
    per sample, a 512-piece tokenizer trained on at most 400 kB), micro batch 2, global batch 8, 3 iterations at
    lr 3e-3 after 2 warm-up iterations, a metrics line every iteration, on the first 40 files of
    megacomp.data.default_corpus_files().

    The data cache is one temporary directory for the whole session: the tokenizer and token files are built by
    the first test that trains and are found there by every later one (the cache is keyed by the corpus and the
    tokenizer settings, so configs that change those still get their own entries).

    Derive a test's config with ``dataclasses.replace(tiny_config, <what differs>)`` (flat names); never change
    this object in place, it is shared by every test of the session.
    """
    from megacomp.data import default_corpus_files
    from megacomp.training import PretrainConfig

    cache = tmp_path_factory.mktemp("data-cache")
    return PretrainConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=512,
                          micro_batch_size=2, global_batch_size=8, train_iters=3, lr=3e-3, lr_warmup_iters=2,
                          data_path=default_corpus_files()[:40], data_cache_dir=str(cache), tokenizer_max_bytes=400_000,
                          log_interval=1)



@pytest.fixture(scope="session")
def long_tiny_config(tiny_config):
    """The tiny config at 100,000 iterations, its data cache built: for runs that a signal, a fault or a test's own
    stop ends (never derive a run that should finish from it)."""
    from dataclasses import replace

    from distributed import run_ranks
    from training_runs import train_losses

    run_ranks(train_losses, 1, replace(tiny_config, train_iters=1))
    return replace(tiny_config, train_iters=100000)

# The quick subset, `pytest -m "not slow" tests`: the tests listed in tests/slow_tests.txt (measured slow) and any
# test marked @pytest.mark.slow carry the `slow` marker. The list names a test by its file and function, so a module
# renamed after it was written still matches by function name. test_quick_subset.py checks from what is stashed
# here that every module keeps a quick test.
import fnmatch  # noqa: E402

import pytest  # noqa: E402

SLOW_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")
# {test module file name: [its tests that are not slow, all its tests]} for every module this run collected (one
# skipped whole has [0, 0]), counted before -m and -k deselect any
TESTS_BY_MODULE = pytest.StashKey[dict]()


def slow_entries(path=SLOW_TESTS):
    """{(file, function): [id pattern, or None for every case]} from the slow list."""
    entries = {}
    with open(path) as f:
        for line in f:
            entry = line.split("  #")[0].strip()
            if not entry or entry.startswith("#"):
                continue
            file, _, test = entry.partition("::")
            function, bracket, ids = test.partition("[")
            entries.setdefault((file, function), []).append(ids[:-1] if bracket else None)
    return entries


def _listed_slow(item, entries, files_of):
    function = getattr(item, "originalname", item.name)
    file = item.path.name
    patterns = entries.get((file, function))
    if patterns is None:
        # A listed file that is gone was renamed: its functions match where exactly one module defines them
        patterns = [
            p
            for (listed, name), ps in entries.items()
            if name == function and files_of[function] == {file}
            and not os.path.exists(os.path.join(os.path.dirname(SLOW_TESTS), listed))
            for p in ps
        ]
    callspec = getattr(item, "callspec", None)
    case = callspec.id if callspec is not None else None
    return any(p is None or case is None or p == case or fnmatch.fnmatchcase(case, p) for p in patterns)


def pytest_collectstart(collector):
    if isinstance(collector, pytest.Module):
        collector.config.stash.setdefault(TESTS_BY_MODULE, {}).setdefault(collector.path.name, [0, 0])


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect, so that the stash counts every collected test
def pytest_collection_modifyitems(config, items):
    entries = slow_entries()
    files_of = {}
    for item in items:
        files_of.setdefault(getattr(item, "originalname", item.name), set()).add(item.path.name)
    counts = config.stash.setdefault(TESTS_BY_MODULE, {})
    for item in items:
        if item.get_closest_marker("slow") is None and _listed_slow(item, entries, files_of):
            item.add_marker(pytest.mark.slow)
        count = counts.setdefault(item.path.name, [0, 0])
        count[0] += item.get_closest_marker("slow") is None
        count[1] += 1

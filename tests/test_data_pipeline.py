"""The data pipeline (megacomp.data): corpus files, the cached sentencepiece tokenizer, the memory-mapped
token file, samples, deterministic data-parallel sampling, and prepare_data on two ranks."""
import os
import pickle
import shutil
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from distributed import run_ranks
from megacomp.data import (DistributedBatchSampler, TokenDataset, build_token_file, collect_files,
                           default_corpus_files, get_batch, prepare_data, read_index, token_dtype, train_tokenizer)
from megacomp.data.corpus import read_text

VOCAB = 1024
CORPUS_BYTES = 400_000
ROUND_TRIP = ["def f(x):\n\treturn x  +  1\r\n", "  leading and trailing  ", "", " ", "\n\n\n",
              "héllo wörld — 世界 🎉 ∑ ℕ", "a ▁ b ▁▁x", "\x00\x01\x7f control", "\ufeffBOM and\u2028separator",
              "fullwidth ＡＢＣ and ligature ﬁ (NFKC would change these)"]


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    """~400 KB of the standard library's sources copied into a tree of our own (so tests may touch files)."""
    root = tmp_path_factory.mktemp("corpus")
    total = 0
    for i, src in enumerate(default_corpus_files()):
        dst = root / f"sub{i % 3}" / f"{i:04d}_{os.path.basename(src)}"
        dst.parent.mkdir(exist_ok=True)
        shutil.copyfile(src, dst)
        total += dst.stat().st_size
        if total > CORPUS_BYTES:
            break
    return str(root)


@pytest.fixture(scope="session")
def files(corpus_dir):
    return collect_files([corpus_dir])


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(scope="session")
def tokenizer(files, tok_dir):
    return train_tokenizer(files, VOCAB, tok_dir)


@pytest.fixture(scope="session")
def token_prefix(files, tokenizer, tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("tokens") / "corpus")
    build_token_file(files, tokenizer, prefix)
    return prefix


# ---- corpus -------------------------------------------------------------------------------------------


def test_default_corpus_is_the_stdlib_sources():
    a, b = default_corpus_files(), default_corpus_files()
    assert a == b == sorted(a) and len(a) > 100
    assert all(os.path.isabs(f) and f.endswith(".py") for f in a)
    parts = {p for f in a for p in f.split(os.sep)}
    assert not parts & {"test", "tests", "site-packages"}
    assert any(f.endswith(os.sep + "json" + os.sep + "decoder.py") for f in a)


def test_collect_files_walks_sorts_and_filters(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zeta")
    (tmp_path / "a.md").write_text("alpha")
    (tmp_path / "b" / "bin.dat").write_bytes(b"\xff\xfe\x00binary")   # not UTF-8: skipped inside a directory
    (tmp_path / "empty.txt").write_text("")                           # empty: contributes nothing
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main")    # hidden: skipped
    expected = [str(tmp_path / "a.md"), str(tmp_path / "b" / "z.txt")]
    assert collect_files(str(tmp_path)) == expected
    assert collect_files([tmp_path / "b" / "z.txt", tmp_path, str(tmp_path / "a.md")]) == expected  # deduplicated


def test_corpus_errors(tmp_path):
    missing = str(tmp_path / "no-such-dir")
    with pytest.raises(FileNotFoundError, match="no-such-dir.*does not exist"):
        collect_files([missing])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    for paths in ([str(tmp_path / "empty")], []):
        with pytest.raises(ValueError, match="corpus is empty"):
            collect_files(paths)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        collect_files([str(tmp_path / "latin1.txt")])
    with pytest.raises(ValueError, match="corpus is empty"):
        train_tokenizer([], VOCAB, str(tmp_path))


# ---- tokenizer ----------------------------------------------------------------------------------------


def test_tokenizer_round_trips_any_text(tokenizer, files):
    assert tokenizer.trained and tokenizer.vocab_size == VOCAB
    assert len({tokenizer.eos_id, tokenizer.bos_id, tokenizer.unk_id}) == 3
    for text in ROUND_TRIP + [read_text(files[0])]:
        ids = tokenizer.encode(text)
        assert all(0 <= i < VOCAB for i in ids)
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(torch.tensor(ids)) == text
    assert tokenizer.encode_batch(ROUND_TRIP) == [tokenizer.encode(t) for t in ROUND_TRIP]
    code = read_text(files[1])
    assert len(tokenizer.encode(code)) < len(code.encode()) / 2  # it learned merges, not just bytes
    assert pickle.loads(pickle.dumps(tokenizer)).encode(code) == tokenizer.encode(code)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200))
def test_tokenizer_round_trips_arbitrary_unicode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_cache_hit_does_not_retrain(tokenizer, files, tok_dir):
    mtime = os.stat(tokenizer.model_path).st_mtime_ns
    again = train_tokenizer(files, VOCAB, tok_dir)
    assert not again.trained and again.model_path == tokenizer.model_path
    assert os.stat(tokenizer.model_path).st_mtime_ns == mtime and again.fingerprint == tokenizer.fingerprint
    assert not [f for f in os.listdir(tok_dir) if f.endswith(".tmp")]


def test_tokenizer_is_deterministic_and_keyed_by_settings_and_corpus(tokenizer, files, tmp_path):
    same = train_tokenizer(files, VOCAB, str(tmp_path / "elsewhere"))
    assert same.trained and same.fingerprint == tokenizer.fingerprint  # byte-identical model
    other = train_tokenizer(files, VOCAB, str(tmp_path / "elsewhere"), max_bytes=100_000)
    assert other.trained and other.model_path != same.model_path
    # an edited corpus file changes the fingerprint: retrain
    edited = tmp_path / "edited.py"
    shutil.copyfile(files[0], edited)
    first = train_tokenizer([str(edited)] + files[1:], VOCAB, str(tmp_path / "c"))
    with open(edited, "a") as f:
        f.write("\n# edited\n")
    os.utime(edited, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = train_tokenizer([str(edited)] + files[1:], VOCAB, str(tmp_path / "c"))
    assert first.trained and second.trained and second.model_path != first.model_path


def test_tokenizer_vocab_errors(files, tmp_path):
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_tokenizer(files[:1], 100, str(tmp_path))
    with pytest.raises(ValueError, match="vocab_size=60000 does not fit this corpus.*Change vocab_size"):
        train_tokenizer(files[:1], 60000, str(tmp_path))
    assert not os.listdir(tmp_path)  # nothing half-written


# ---- token file and dataset ---------------------------------------------------------------------------


def test_token_file_round_trip(token_prefix, tokenizer, files):
    meta = read_index(token_prefix)
    assert meta["dtype"] == "uint16" and meta["num_docs"] == len(files) and meta["doc_paths"] == files
    assert meta["tokenizer_fingerprint"] == tokenizer.fingerprint
    assert os.path.getsize(token_prefix + ".bin") == 2 * meta["num_tokens"] == 2 * meta["doc_offsets"][-1]
    ds = TokenDataset(token_prefix, 64)
    for i, path in enumerate(files):
        assert tokenizer.decode(ds.document(i)) == read_text(path)
        assert ds.tokens[meta["doc_offsets"][i + 1] - 1] == tokenizer.eos_id  # EOS closes every document
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_token_file_is_reused_and_rebuilt_on_change(token_prefix, tokenizer, files, tmp_path):
    mtime = os.stat(token_prefix + ".bin").st_mtime_ns
    assert build_token_file(files, tokenizer, token_prefix) == read_index(token_prefix)
    assert os.stat(token_prefix + ".bin").st_mtime_ns == mtime
    # a subset of the corpus (a different fingerprint) written to the same prefix replaces it
    prefix = str(tmp_path / "t")
    full = build_token_file(files, tokenizer, prefix)
    part = build_token_file(files[:2], tokenizer, prefix)
    assert part["num_docs"] == 2 and part["num_tokens"] < full["num_tokens"]
    assert os.path.getsize(prefix + ".bin") == 2 * part["num_tokens"]
    assert sorted(os.listdir(tmp_path)) == ["t.bin", "t.idx.json"]  # no temporary files left


def test_dataset_samples_and_batches(token_prefix):
    s = 64
    ds = TokenDataset(token_prefix, s)
    assert len(ds) == (ds.num_tokens - 1) // s
    for i in (0, 1, len(ds) - 1):
        x = ds[i]
        assert x.dtype == torch.int64 and x.shape == (s + 1,)
        assert torch.equal(x, torch.from_numpy(ds.tokens[i * s:i * s + s + 1].astype(np.int64)))
    assert ds[0][-1] == ds[1][0] and torch.equal(ds[-1], ds[len(ds) - 1])
    with pytest.raises(IndexError):
        ds[len(ds)]
    tokens, labels = get_batch(ds, [3, 0, 7])
    assert tokens.shape == labels.shape == (3, s) and tokens.dtype == labels.dtype == torch.int64
    assert torch.equal(tokens[0], ds[3][:-1]) and torch.equal(labels[0], ds[3][1:])
    assert torch.equal(labels[:, :-1], tokens[:, 1:])
    blob = pickle.dumps(ds)
    assert len(blob) < os.path.getsize(token_prefix + ".bin") // 4  # the memmap is not copied into the pickle
    assert torch.equal(pickle.loads(blob)[5], ds[5])


def test_dataset_errors(token_prefix, tmp_path):
    n = read_index(token_prefix)["num_tokens"]
    TokenDataset(token_prefix, n - 1)  # exactly one sample
    with pytest.raises(ValueError, match=f"has {n} tokens, fewer than seq_length \\+ 1 = {n + 1}"):
        TokenDataset(token_prefix, n)
    with pytest.raises(FileNotFoundError, match="build_token_file"):
        TokenDataset(str(tmp_path / "nothing"), 8)


# ---- sampler ------------------------------------------------------------------------------------------


def _stream(n, **kw):
    it = iter(DistributedBatchSampler(**kw))
    return [next(it) for _ in range(n)]


def test_sampler_shards_are_disjoint_and_cover_the_global_batch():
    num, mbs, dp = 103, 4, 3
    samplers = [DistributedBatchSampler(num, mbs, r, dp, seed=7) for r in range(dp)]
    per_epoch = samplers[0].batches_per_epoch
    assert per_epoch == 103 // 12
    for it in range(3 * per_epoch):
        shards = [s.batch(it) for s in samplers]
        assert all(len(b) == mbs for b in shards)
        flat = [i for b in shards for i in b]
        assert flat == samplers[0].global_batch(it) and len(set(flat)) == dp * mbs
    for epoch in range(3):  # within an epoch every sample is used at most once
        seen = [i for it in range(epoch * per_epoch, (epoch + 1) * per_epoch) for i in samplers[0].global_batch(it)]
        assert len(seen) == len(set(seen)) == per_epoch * dp * mbs
    assert samplers[0].global_batch(0) != samplers[0].global_batch(per_epoch)  # reshuffled each epoch


def test_sampler_is_deterministic_and_resumes_exactly():
    kw = dict(num_samples=50, micro_batch_size=3, dp_rank=1, dp_size=2, seed=11)
    full = _stream(40, **kw)  # crosses several epochs (8 batches each)
    assert full == _stream(40, **kw)
    assert full != _stream(40, **{**kw, "seed": 12})
    for k in (1, 7, 8, 21):
        resumed = DistributedBatchSampler(**kw, start_iteration=k)
        assert resumed.consumed_samples == k * 6
        it = iter(resumed)
        assert [next(it) for _ in range(40 - k)] == full[k:]


def test_sampler_errors():
    with pytest.raises(ValueError, match="dp_rank=2 is not in"):
        DistributedBatchSampler(100, 2, 2, 2)
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        DistributedBatchSampler(7, 4, 0, 2)


# ---- prepare_data on two ranks ------------------------------------------------------------------------


def _prepare_body(rank, world, corpus_dir, cache_dir):
    tokenizer, ds = prepare_data([corpus_dir], vocab_size=VOCAB, seq_length=32, cache_dir=cache_dir)
    try:
        prepare_data([corpus_dir + "-missing"], vocab_size=VOCAB, seq_length=32, cache_dir=cache_dir)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return tokenizer.trained, tokenizer.fingerprint, ds.prefix, ds[0], ds[len(ds) - 1], error


def test_prepare_data_two_ranks_rank0_builds(corpus_dir, tmp_path):
    cache = str(tmp_path / "cache")
    r0, r1 = run_ranks(_prepare_body, 2, corpus_dir, cache)
    assert r0[0] is True and r1[0] is False  # rank 0 trained; rank 1 only loaded what rank 0 built
    assert r0[1:3] == r1[1:3] and torch.equal(r0[3], r1[3]) and torch.equal(r0[4], r1[4])
    assert r0[5].startswith("FileNotFoundError") and "-missing" in r0[5]
    assert r1[5].startswith("DataPreparationFailed: rank 0 failed") and "-missing" in r1[5]
    # single process, same cache: everything is loaded, nothing rebuilt
    tokenizer, ds = prepare_data([corpus_dir], vocab_size=VOCAB, seq_length=32, cache_dir=cache)
    assert not tokenizer.trained and ds.prefix == r0[2] and torch.equal(ds[0], r0[3])


# ---- JSON-lines corpus files ----------------------------------------------------------------------------


def test_jsonl_files_hold_one_document_per_line_and_key(tokenizer, files, tmp_path):
    import json

    from megacomp.data import corpus_fingerprint, iter_documents
    from megacomp.data.tokenizer import training_lines

    rows = [{"text": read_text(f)[:300], "title": f"doc {i}"} for i, f in enumerate(files[:5])]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 2 else "") for i, r in enumerate(rows)))
    assert [t for _, t in iter_documents(str(path))] == [r["text"] for r in rows]  # blank line skipped
    both = list(iter_documents(str(path), ["text", "title"]))
    assert both[:2] == [(f"{path}:1:text", rows[0]["text"]), (f"{path}:1:title", "doc 0")] and len(both) == 10
    lines = [line for line in rows[0]["text"].split("\n") if line]
    assert list(training_lines([str(path)], 10**6))[:2] == lines[:2]  # the text, not JSON
    # plain files keep their fingerprint; a JSON-lines corpus's depends on the keys
    assert corpus_fingerprint(files) == corpus_fingerprint(files, ["title"])
    assert corpus_fingerprint([str(path)]) != corpus_fingerprint([str(path)], ["title"])
    prefix = str(tmp_path / "t")
    meta = build_token_file([files[0], str(path)], tokenizer, prefix)
    assert meta["num_docs"] == 6 and meta["doc_paths"][:2] == [files[0], f"{path}:1"]
    ds = TokenDataset(prefix, 16)
    assert tokenizer.decode(ds.document(3)) == rows[2]["text"]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a JSON list, not an object"):
        build_token_file([str(tmp_path / "bad.jsonl")], tokenizer, str(tmp_path / "b"))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": 3}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'text' holds a int, not text"):
        list(iter_documents(str(tmp_path / "bad.jsonl")))
    with pytest.raises(ValueError, match="--json-keys must name one or more keys"):
        list(iter_documents(str(path), []))

"""Megatron indexed data through megacomp: files written by megatron-core's IndexedDatasetBuilder (directly, and by
megacomp-preprocess-data) read back as samples, weighted blends, --split by document, the bad-input lines, and
build_datasets as the Trainer calls it."""
import json
import os
import pickle
import sys

import numpy as np
import pytest
import torch

from data_files import stdlib_texts, train_byte_level_bpe, write_indexed, write_jsonl
from megacomp.data import (BlendedDataset, DistributedBatchSampler, IndexedTokenDataset, build_datasets,
                           build_tokenizer, get_batch, parse_data_path, parse_split, split_documents)
from megacomp.data.blend import blend_order
from megacomp.data.indexed import check_vocab
from megacomp.preprocess_data import main as preprocess_main


def _docs(seed, count, max_len=60, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(0, max_len))).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return train_byte_level_bpe(tmp_path_factory.mktemp("bpe"), stdlib_texts(30))


def test_indexed_samples_are_the_builders_tokens(tmp_path):
    docs = _docs(0, 40)  # includes empty documents (no sequence)
    prefix = write_indexed(tmp_path / "d", docs)
    flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
    s = 16
    ds = IndexedTokenDataset(prefix, s)
    assert ds.num_tokens == len(flat) and len(ds) == (len(flat) - 1) // s and ds.num_docs == 40
    for i in range(len(ds)):
        assert torch.equal(ds[i], torch.from_numpy(flat[i * s:i * s + s + 1]))
    assert torch.equal(ds[-1], ds[len(ds) - 1]) and ds.max_token_id() == flat.max()
    with pytest.raises(IndexError):
        ds[len(ds)]
    # a document range: the tokens of those documents only (the unit of --split)
    part = IndexedTokenDataset(prefix, 8, range(10, 25))
    sub = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs[10:25]])
    assert part.num_tokens == len(sub) and torch.equal(part[2], torch.from_numpy(sub[16:25]))
    # the sampler and get_batch work unchanged; pickling reopens the files
    sampler = iter(DistributedBatchSampler(len(ds), 2, dp_rank=1, dp_size=2, seed=3))
    tokens, labels = get_batch(pickle.loads(pickle.dumps(ds)), next(sampler))
    assert tokens.shape == labels.shape == (2, s) and torch.equal(labels[:, :-1], tokens[:, 1:])


def test_indexed_bad_input_is_one_line(tmp_path, monkeypatch):
    prefix = write_indexed(tmp_path / "d", _docs(1, 5))
    os.rename(prefix + ".idx", prefix + ".idx.away")
    with pytest.raises(ValueError, match=r"has no .*d\.idx; --data-path takes the prefix"):
        IndexedTokenDataset(prefix, 4)
    os.rename(prefix + ".idx.away", prefix + ".idx")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 2)
    with pytest.raises(ValueError, match="d.bin has .* bytes, its index lists"):
        IndexedTokenDataset(prefix, 4)
    (tmp_path / "junk.idx").write_bytes(b"not an index")
    (tmp_path / "junk.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="junk.idx is not a Megatron index"):
        IndexedTokenDataset(str(tmp_path / "junk"), 4)
    with pytest.raises(ValueError, match="empty.bin is empty: the dataset holds no tokens"):
        IndexedTokenDataset(write_indexed(tmp_path / "empty", [[], []]), 4)
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.indexed_dataset", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "megatron.core.datasets", None)
    with pytest.raises(ValueError, match="^Megatron indexed data .* pip install megatron-core$"):
        IndexedTokenDataset(prefix, 4)


def test_vocab_mismatch_is_one_line(tmp_path, bpe_dir):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", bpe_dir)
    fits = IndexedTokenDataset(write_indexed(tmp_path / "ok", _docs(2, 10, vocab=tokenizer.vocab_size)), 8)
    check_vocab(fits, tokenizer.vocab_size, "t")
    other = IndexedTokenDataset(write_indexed(tmp_path / "big", _docs(2, 10, vocab=5000)), 8)
    with pytest.raises(ValueError, match=f"holds token id {other.max_token_id()}, but the tokenizer .* has "
                                         f"{tokenizer.vocab_size} ids: the data was preprocessed with another"):
        build_datasets([other.prefix], 8, tokenizer_type="HuggingFaceTokenizer", tokenizer_model=bpe_dir)
    with pytest.raises(ValueError, match="indexed data .* give the tokenizer it was preprocessed with"):
        build_datasets([other.prefix], 8)


def test_blend_draws_in_the_weights_proportions(tmp_path):
    weights = [0.5, 0.3, 0.2]
    sets = [IndexedTokenDataset(write_indexed(tmp_path / f"d{k}", _docs(10 + k, 30 * (k + 1))), 4) for k in range(3)]
    blend = BlendedDataset(sets, [5, 3, 2], seed=7)  # normalised
    n, d = len(blend), len(weights)
    assert n == sum(len(s) for s in sets)
    # the interleave's bound after every prefix: |c_k - n w_k| <= 1/2 + w_k D / 2 (blend.py's derivation)
    for k, w in enumerate(weights):
        counts = np.cumsum(blend.which == k)
        assert np.all(np.abs(counts - np.arange(1, n + 1) * w) <= 0.5 + w * d / 2 + 1e-9)
    # each dataset's draws walk over its samples: all distinct until it wraps around
    for k, size in enumerate(blend.sizes):
        samples = [blend.source(i)[1] for i in np.flatnonzero(blend.which == k)]
        assert len(set(samples[:size])) == min(size, len(samples))
    assert torch.equal(blend[5], sets[blend.source(5)[0]][blend.source(5)[1]])
    again, other = BlendedDataset(sets, weights, seed=7), BlendedDataset(sets, weights, seed=8)
    assert [again.source(i) for i in range(n)] == [blend.source(i) for i in range(n)]
    assert [other.source(i) for i in range(n)] != [blend.source(i) for i in range(n)]
    # what training sees: the sampler's first 10 global batches of 8 (a random draw without replacement from the
    # blend) hold each dataset within 4 standard deviations of the hypergeometric count (deterministic: seeded)
    sampler = DistributedBatchSampler(n, 8, seed=1)
    seen = np.array([blend.source(i)[0] for it in range(10) for i in sampler.global_batch(it)])
    m = len(seen)
    for k, w in enumerate(weights):
        p = np.mean(blend.which == k)
        sd = np.sqrt(m * p * (1 - p) * (n - m) / (n - 1))
        assert abs(np.sum(seen == k) - m * p) <= 4 * sd


def test_blend_order_bound_for_skewed_weights():
    for weights in ([0.99, 0.01], [0.01, 0.01, 0.98], [1 / 3] * 3):
        which, draws = blend_order(weights, 3000)
        for k, w in enumerate(weights):
            mine = which == k
            assert np.array_equal(draws[mine], np.arange(mine.sum()))  # draws count up per dataset
            counts = np.cumsum(mine)
            assert np.all(np.abs(counts - np.arange(1, 3001) * w) <= 0.5 + w * len(weights) / 2 + 1e-9)


def test_data_path_syntax(tmp_path):
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.7", "a", "3", "b"]) == (["a", "b"], [0.7, 3.0])
    (tmp_path / "2024").mkdir()  # a folder named like a number is a path
    assert parse_data_path([str(tmp_path / "2024")]) == ([str(tmp_path / "2024")], None)
    for values, message in ((["0.7", "a", "0.3"], "3 entries with weights among them cannot pair up"),
                            (["0.7", "a", "x", "b"], "weight 'x' is not a number"),
                            (["0", "a", "1", "b"], "weight '0' must be a finite number > 0"),
                            (["inf", "a"], "weight 'inf' must be a finite number > 0"),
                            (["0.5", "a", "1", "2"], "the number '2' where a prefix belongs"),
                            ([], "--data-path is empty")):
        with pytest.raises(ValueError, match=message) as info:
            parse_data_path(values)
        assert "\n" not in str(info.value)


def test_split_matches_megatron_core():
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)

    for split in ("969,30,1", "98,2,0", "100,0,0", "1", "7,3", "0.8 0.1 0.1", "1,1,1"):
        fractions = parse_split(split)
        assert np.allclose(fractions, parse_and_normalize_split(split))
        matrix = convert_split_vector_to_split_matrix(list(fractions))
        for n in (0, 1, 7, 100, 12345):
            ranges = split_documents(n, fractions)
            assert ranges[0].start == 0 and ranges[-1].stop == n
            for r, bounds in zip(ranges, matrix):  # megatron-core's cut: round(bound * n)
                expected = (range(0) if bounds is None else
                            range(int(round(bounds[0] * n)), int(round(bounds[1] * n))))
                assert len(r) == len(expected) and (not len(r) or r == expected)
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0,0", "nan"):
        with pytest.raises(ValueError, match="must be 1 to 3 non-negative numbers"):
            parse_split(bad)


def test_preprocess_end_to_end_then_train_valid_test(tmp_path, bpe_dir, capsys):
    texts = stdlib_texts(24, 1500)
    rows = [{"text": t, "title": t[:20]} for t in texts]
    write_jsonl(tmp_path / "a.jsonl", rows)
    write_jsonl(tmp_path / "b.jsonl", rows[:12])
    common = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe_dir, "--append-eod"]
    assert preprocess_main(["--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "a"),
                            "--json-keys", "text", "title", "--workers", "2", *common]) == 0
    assert preprocess_main(["--input", str(tmp_path / "b.jsonl"), "--output-prefix", str(tmp_path / "b"),
                            *common]) == 0
    assert "wrote" in capsys.readouterr().err
    tokenizer = build_tokenizer("HuggingFaceTokenizer", bpe_dir)
    a = IndexedTokenDataset(str(tmp_path / "a_text_document"), 32)
    for i, text in enumerate(texts):  # the builder's documents: the tokenizer's ids and the end-of-document id
        assert a.indexed[i].tolist() == tokenizer.encode(text) + [tokenizer.eos_id]
    title = IndexedTokenDataset(str(tmp_path / "a_title_document"), 4)
    assert title.indexed[3].tolist() == tokenizer.encode(texts[3][:20]) + [tokenizer.eos_id]
    # a weighted blend of the two, split by document as Megatron does
    flags = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=bpe_dir)
    data = build_datasets(["0.75", str(tmp_path / "a_text_document"), "0.25", str(tmp_path / "b_text_document")],
                          32, split="8,1,1", seed=3, **flags)
    assert data.documents == {"train": 19 + 10, "valid": 3 + 1, "test": 2 + 1}
    assert isinstance(data.train, BlendedDataset) and data.train.weights == [0.75, 0.25]
    assert data.samples["valid"] == len(data.valid) > 0 and data.require("valid", "--eval-interval 5") is data.valid
    assert data.tokenizer.vocab_size == tokenizer.vocab_size
    # no split: every document trains, no validation set; asking for one is one line naming --split
    whole = build_datasets([str(tmp_path / "b_text_document")], 32, **flags)
    assert whole.valid is None and whole.test is None and len(whole.train) == len(
        IndexedTokenDataset(str(tmp_path / "b_text_document"), 32))
    with pytest.raises(ValueError, match="--eval-interval 5 needs a validation set, but without --split"):
        whole.require("valid", "--eval-interval 5")
    empty = build_datasets([str(tmp_path / "b_text_document")], 32, split="100,0,0", **flags)
    with pytest.raises(ValueError, match="--split 100,0,0 leaves it 0 of 12 documents and no sample of 33 tokens"):
        empty.require("valid", "--eval-interval 5")


def test_preprocess_bad_input_is_one_line(tmp_path, bpe_dir, capsys):
    write_jsonl(tmp_path / "ok.jsonl", [{"text": "hello"}])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    base = ["--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "HuggingFaceTokenizer"]
    for argv, message in (
            (["--input", str(tmp_path / "bad.jsonl"), *base, "--tokenizer-model", bpe_dir],
             r"bad.jsonl:2: no key 'text' \(keys: 'body'\); name the key"),
            (["--input", str(tmp_path / "missing.jsonl"), *base, "--tokenizer-model", bpe_dir],
             "--input .*missing.jsonl: no such file"),
            (["--input", str(tmp_path / "ok.jsonl"), *base, "--tokenizer-model", str(tmp_path / "none.json")],
             "none.json: no such file"),
            (["--input", str(tmp_path / "ok.jsonl"), *base, "--tokenizer-model", bpe_dir, "--split-sentences"],
             "--split-sentences .* not supported")):
        assert preprocess_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("megacomp-preprocess-data: error: ")
        assert __import__("re").search(message, err), err
    assert not [f for f in os.listdir(tmp_path) if f.startswith("out")]  # nothing half-written


def test_corpus_paths_with_a_tokenizer_from_files_and_split(tmp_path, bpe_dir):
    texts = stdlib_texts(20, 2000)
    write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    data = build_datasets([str(tmp_path / "c.jsonl")], 32, cache_dir=str(tmp_path / "cache"), split="90,10,0",
                          tokenizer_type="GPT2BPETokenizer", vocab_file=os.path.join(bpe_dir, "vocab.json"),
                          merge_file=os.path.join(bpe_dir, "merges.txt"))
    assert data.documents == {"train": 18, "valid": 2, "test": 0} and data.test is None
    tokenizer = data.tokenizer
    first = tokenizer.encode(texts[0]) + [tokenizer.eos_id]
    assert data.train[0].tolist() == first[:33]
    valid_tokens = sum(len(tokenizer.encode(t)) + 1 for t in texts[18:])
    assert len(data.valid) == (valid_tokens - 1) // 32
    assert data.valid[0].tolist()[:5] == tokenizer.encode(texts[18])[:5]
    meta = json.loads((tmp_path / "cache" / "tokens").glob("*.idx.json").__next__().read_text())
    assert meta["doc_paths"][1] == f"{tmp_path / 'c.jsonl'}:2" and meta["num_docs"] == 20


def _trainer_body(rank, world, cfg):
    from megacomp.training import Trainer

    trainer = Trainer(cfg)
    try:
        losses = [h["loss"] for h in trainer.train()]
        return (losses, trainer.gpt.vocab_size, trainer.tokenizer.vocab_size, len(trainer.dataset),
                trainer.data.samples, trainer.test_dataset is None, type(trainer.dataset).__name__)
    finally:
        trainer.close()


def test_trainer_trains_on_a_weighted_indexed_blend_with_split(tmp_path, bpe_dir, tiny_config):
    from dataclasses import replace

    from distributed import run_ranks

    texts = stdlib_texts(40, 3000)
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts[::-1]])
    for name in ("a", "b"):
        assert preprocess_main(["--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix", str(tmp_path / name),
                                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe_dir,
                                "--append-eod"]) == 0
    cfg = replace(tiny_config, data_path=["0.6", str(tmp_path / "a_text_document"), "0.4",
                                          str(tmp_path / "b_text_document")],
                  split="90,10,0", tokenizer_type="HuggingFaceTokenizer", tokenizer_model=bpe_dir, train_iters=2)
    r0, r1 = run_ranks(_trainer_body, 2, cfg)
    assert r0 == r1  # both data-parallel ranks see the same datasets and the same (all-reduced) losses
    losses, model_vocab, vocab, train_samples, samples, no_test, kind = r0
    assert vocab == build_tokenizer("HuggingFaceTokenizer", bpe_dir).vocab_size
    assert model_vocab == -(-vocab // 8) * 8  # the model's vocabulary follows the tokenizer's, padded for TP
    assert kind == "BlendedDataset" and samples["train"] == train_samples and samples["valid"] > 0 and no_test
    assert len(losses) == 2 and all(np.isfinite(losses))

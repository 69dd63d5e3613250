"""Tokenizers from a Megatron-LM user's files (megacomp.data.tokenizer_files), each built here from real files: a
byte-level BPE trained with the tokenizers package (tokenizer.json; GPT-2's vocab.json / merges.txt of the same
model) and a sentencepiece model."""
import json
import os
import pickle
import shutil

import pytest
import torch

from data_files import stdlib_texts, train_byte_level_bpe, train_sentencepiece
from megacomp.data import TOKENIZER_TYPES, Tokenizer, TokenizerLike, build_tokenizer
from megacomp.data.tokenizer_files import SentencePieceTokenizer

TEXT = "def f(x):\n    return x + 1  # héllo wörld, 世界 🎉\n\n"


@pytest.fixture(scope="module")
def texts():
    return stdlib_texts(30)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, texts):
    return train_byte_level_bpe(tmp_path_factory.mktemp("bpe"), texts)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, texts):
    return train_sentencepiece(tmp_path_factory.mktemp("sp"), texts)


def test_huggingface_tokenizer_from_file_or_folder(bpe_dir, tmp_path):
    by_folder = build_tokenizer("HuggingFaceTokenizer", bpe_dir)
    by_file = build_tokenizer("HuggingFaceTokenizer", os.path.join(bpe_dir, "tokenizer.json"))
    assert isinstance(by_folder, TokenizerLike) and by_folder.fingerprint == by_file.fingerprint
    ids = by_folder.encode(TEXT)
    assert ids == by_file.encode(TEXT) and by_folder.decode(ids) == TEXT and by_folder.decode(torch.tensor(ids)) == TEXT
    with open(os.path.join(bpe_dir, "vocab.json")) as f:
        assert by_folder.vocab_size == len(json.load(f))
    assert by_folder.eos_id == by_folder.hf.token_to_id("<|endoftext|>")
    assert by_folder.encode_batch([TEXT, "x"]) == [ids, by_folder.encode("x")]
    assert pickle.loads(pickle.dumps(by_folder)).encode(TEXT) == ids
    # tokenizer_config.json's eos_token decides (transformers' rule); one naming a token the file lacks is refused
    folder = tmp_path / "with-config"
    shutil.copytree(bpe_dir, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert build_tokenizer("HuggingFaceTokenizer", str(folder)).eos_id == by_folder.eos_id
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="names eos_token '</s>', which is not in"):
        build_tokenizer("HuggingFaceTokenizer", str(folder))


def test_gpt2_bpe_from_vocab_and_merges_matches_the_same_model(bpe_dir):
    hf = build_tokenizer("HuggingFaceTokenizer", bpe_dir)
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=os.path.join(bpe_dir, "vocab.json"),
                           merge_file=os.path.join(bpe_dir, "merges.txt"))
    for text in (TEXT, *stdlib_texts(3, 500)):
        assert gpt2.encode(text) == hf.encode(text) and gpt2.decode(gpt2.encode(text)) == text
    assert (gpt2.vocab_size, gpt2.eos_id) == (hf.vocab_size, hf.eos_id)
    assert gpt2.fingerprint != hf.fingerprint
    assert pickle.loads(pickle.dumps(gpt2)).encode(TEXT) == gpt2.encode(TEXT)


def test_sentencepiece_tokenizer_adds_megatrons_special_tokens(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    n = sp.get_piece_size()
    tok = build_tokenizer("SentencePieceTokenizer", sp_model)
    # <CLS> <SEP> <EOD> <MASK> then <PAD> (the model has no pad piece) after the pieces; <s>, </s> are the model's
    assert tok.special == {"<CLS>": n, "<SEP>": n + 1, "<EOD>": n + 2, "<MASK>": n + 3, "<PAD>": n + 4,
                           "<s>": sp.bos_id(), "</s>": sp.eos_id()}
    assert tok.vocab_size == n + 5 and tok.eos_id == n + 2
    assert tok.encode("a<EOD>b") == sp.encode_as_ids("a") + [n + 2] + sp.encode_as_ids("b")
    assert tok.decode(sp.encode_as_ids("ab") + [n + 2]) == sp.decode_ids(sp.encode_as_ids("ab")) + " <EOD> "
    assert tok.encode(TEXT) == sp.encode_as_ids(TEXT) and tok.encode_batch([TEXT]) == [tok.encode(TEXT)]
    plain = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    assert (plain.vocab_size, plain.eos_id) == (n, sp.eos_id()) and plain.encode(TEXT) == sp.encode_as_ids(TEXT)
    assert plain.decode(plain.encode("hello world")) == "hello world"
    assert pickle.loads(pickle.dumps(tok)).special == tok.special
    assert isinstance(tok, TokenizerLike) and isinstance(plain, TokenizerLike)


def test_the_trained_tokenizer_offers_the_same_interface(sp_model):
    assert isinstance(Tokenizer(sp_model), TokenizerLike)  # the class train_tokenizer returns
    assert build_tokenizer(None) is None  # no type: megacomp trains its own


def test_bad_tokenizer_files_are_one_line(bpe_dir, sp_model, tmp_path):
    cases = [
        (("HuggingFaceTokenizer", None), "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
        (("HuggingFaceTokenizer", str(tmp_path / "nope.json")), "nope.json: no such file"),
        (("HuggingFaceTokenizer", str(tmp_path)), "no tokenizer.json in this folder"),
        (("HuggingFaceTokenizer", sp_model), "is not a tokenizer.json the tokenizers package can read"),
        (("SentencePieceTokenizer", os.path.join(bpe_dir, "tokenizer.json")), "is not a sentencepiece model"),
        (("GPTSentencePieceTokenizer", str(tmp_path / "x.model")), "x.model: no such file"),
        (("SentencePieceTokenizer", bpe_dir), "is a folder"),
        (("GPT2BPETokenizer", None, os.path.join(bpe_dir, "vocab.json"), None), "needs --merge-file"),
        (("GPT2BPETokenizer", None, os.path.join(bpe_dir, "merges.txt"), os.path.join(bpe_dir, "merges.txt")),
         "are not GPT-2's vocab.json and merges.txt"),
        (("GPT2Tokenizer",), "not supported \\(did you mean GPT2BPETokenizer\\?\\)"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            build_tokenizer(*args)
        assert "\n" not in str(info.value)
    # a vocab.json without GPT-2's end-of-document token
    with open(os.path.join(bpe_dir, "vocab.json")) as f:
        vocab = json.load(f)
    del vocab["<|endoftext|>"]
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match="has no <\\|endoftext\\|>"):
        build_tokenizer("GPT2BPETokenizer", None, str(tmp_path / "vocab.json"), os.path.join(bpe_dir, "merges.txt"))
    assert set(TOKENIZER_TYPES) == {"HuggingFaceTokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer",
                                    "GPTSentencePieceTokenizer"}
    assert isinstance(SentencePieceTokenizer(sp_model), TokenizerLike)

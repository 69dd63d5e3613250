"""The English text corpus of the validation-loss study (benchmarks/validation_quality.py): GCIDE, the Collaborative
International Dictionary of English (Webster's 1913 with later additions, GPL), as Debian's ``dict-gcide`` package
ships it (about 40 MB of English prose: definitions, etymologies and quotations; no program source).

    apt-get install dict-gcide          # /usr/share/dictd/gcide.dict.dz (dictzip, which gzip reads)
    # or without the dictd server it depends on:
    apt-get download dict-gcide && dpkg-deb -x dict-gcide_*.deb /tmp/gcide   # /tmp/gcide/usr/share/dictd/...
    python -m benchmarks.validation_corpus --corpus /usr/share/dictd/gcide.dict.dz --work results/validation_quality

:func:`prepare` turns it into what a Megatron-LM user brings: ``corpus.jsonl`` (one ``{"text": ...}`` document per
dictionary entry, its wrapped lines joined, paragraphs kept), a byte-level BPE ``tokenizer/tokenizer.json`` trained
on it with Hugging Face ``tokenizers``, and the indexed ``gcide_text_document.bin/.idx`` written by
``megacomp-preprocess-data`` with that tokenizer (as scripts/ci_pretrain_llama.sh does for the docs). Each step is
skipped when its output exists (its inputs unchanged are the caller's to ensure: a new ``--vocab`` needs a new
``--work``).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

DEFAULT_CORPUS = "/usr/share/dictd/gcide.dict.dz"
INSTALL_HINT = ("apt-get install dict-gcide (or apt-get download dict-gcide && dpkg-deb -x dict-gcide_*.deb DIR, "
                "then --corpus DIR/usr/share/dictd/gcide.dict.dz)")
PREFIX = "gcide_text_document"  # megacomp-preprocess-data's name for --output-prefix gcide, key text


def entries(path: Path) -> list[str]:
    """The dictionary's entries as documents: blocks separated by blank lines, each block's wrapped lines joined by
    one space (the layout's indentation is not language), dictd's own ``00-database-*`` header entries left out.
    Raises ValueError (one line, naming the install command) when the file is missing or holds no entry."""
    if not path.is_file():
        raise ValueError(f"{path}: no such corpus file; install it with {INSTALL_HINT}")
    opener = gzip.open if path.suffix in (".dz", ".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read()
    docs = []
    for entry in re.split(r"\n(?=\S)", text):  # an entry starts at a line without indentation
        if entry.startswith("00-database") or not entry.strip():
            continue
        paragraphs = [" ".join(line.strip() for line in p.splitlines() if line.strip())
                      for p in re.split(r"\n\s*\n", entry)]
        docs.append("\n".join(p for p in paragraphs if p))
    if not docs:
        raise ValueError(f"{path}: no dictionary entries found; expected dictd's gcide.dict.dz ({INSTALL_HINT})")
    return docs


def prepare(corpus: Path, work: Path, vocab: int = 8192, workers: int = 2) -> tuple[Path, Path]:
    """Write ``work/corpus.jsonl``, ``work/tokenizer/tokenizer.json`` (byte-level BPE of ``vocab`` pieces, with
    ``<|endoftext|>``) and the indexed ``work/gcide_text_document`` pair; returns (the data prefix, the tokenizer
    folder). Steps whose output exists are reused."""
    work.mkdir(parents=True, exist_ok=True)
    jsonl, tok_dir, prefix = work / "corpus.jsonl", work / "tokenizer", work / PREFIX
    if not jsonl.exists():
        docs = entries(corpus)
        tmp = jsonl.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for text in docs:
                f.write(json.dumps({"text": text}) + "\n")
        tmp.replace(jsonl)
        print(f"validation_corpus: {len(docs)} documents, {jsonl.stat().st_size / 1e6:.1f} MB -> {jsonl}", flush=True)
    if not (tok_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        def texts():
            with open(jsonl, encoding="utf-8") as f:
                for line in f:
                    yield json.loads(line)["text"]

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(texts(), trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok_dir.mkdir(exist_ok=True)
        tok.save(str(tok_dir / "tokenizer.json"))
        print(f"validation_corpus: tokenizer of {tok.get_vocab_size()} pieces -> {tok_dir}", flush=True)
    if not Path(f"{prefix}.idx").exists():
        cmd = [sys.executable, "-m", "megacomp.preprocess_data", "--input", str(jsonl), "--json-keys", "text",
               "--append-eod", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tok_dir),
               "--output-prefix", str(work / "gcide"), "--workers", str(workers), "--log-interval", "1000000"]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return prefix, tok_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="dictd's gcide.dict.dz (package dict-gcide)")
    p.add_argument("--work", default="results/validation_quality", help="where the corpus files are written")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    a = p.parse_args(argv)
    try:
        prefix, tok = prepare(Path(a.corpus), Path(a.work), a.vocab)
    except ValueError as e:
        raise SystemExit(f"validation_corpus: {e}") from None
    print(f"validation_corpus: --data-path {prefix} --tokenizer-model {tok}")


if __name__ == "__main__":
    main()

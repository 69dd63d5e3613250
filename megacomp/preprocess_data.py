"""Tokenize a JSON-lines corpus into Megatron's indexed format, with Megatron-LM's tools/preprocess_data.py flags:

    python -m megacomp.preprocess_data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model path/to/tokenizer.json \\
        --json-keys text --append-eod --workers 8
    # -> data/corpus_text_document.bin / .idx   (train with --data-path data/corpus_text_document)

(console script: ``megacomp-preprocess-data``). Each line of ``--input`` is a JSON object; each key of
``--json-keys`` gives one document per line, written to ``OUTPUT_PREFIX_KEY_document.bin/.idx`` by megatron-core's
own ``IndexedDatasetBuilder`` (one sequence per document, token dtype ``DType.optimal_dtype(vocab_size)``), as
Megatron's script writes them; ``--append-eod`` ends every non-empty document with the tokenizer's
end-of-document id. The tokenizers are megacomp.data.tokenizer_files' (``--tokenizer-type``, local files only).
``--workers N`` tokenizes chunks of lines in N processes, each holding one tokenizer; the output keeps the input's
order. Both files are written under temporary names and renamed when complete (the ``.bin`` first), so a reader
never finds a partial pair. Blank lines are skipped.

Not supported (one line saying so): ``--split-sentences`` / ``--keep-newlines`` (nltk sentence splitting).
``--partitions``, ``--keep-sequential-samples`` and ``--lang`` are accepted for Megatron's command lines; the output
does not depend on them here.

Exit status: 0 when written; 2 for bad input (flags, a missing or malformed file, a tokenizer that cannot be
loaded), one line ``megacomp-preprocess-data: error: ...``; 1 for anything else (a traceback).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import sys
import threading
import time
import types
from typing import Iterator, Optional, Sequence

EXIT_BAD_INPUT = 2
_CHUNK_LINES = 256  # lines per task of a worker process


class Encoder:
    """Encodes JSON lines into per-key documents of token ids (pickles as its tokenizer's files)."""

    def __init__(self, tokenizer, json_keys: Sequence[str], append_eod: bool):
        self.tokenizer = tokenizer
        self.json_keys = tuple(json_keys)
        self.append_eod = append_eod

    def encode_lines(self, lines: Sequence[tuple[int, str]], where: str) -> list[list[list[int]]]:
        """Per line ``(number, text)``: one list of ids per key (EOS appended to a non-empty document under
        ``append_eod``), blank lines left out. Raises ValueError (``where:LINE``) as
        :func:`megacomp.data.corpus.json_line_texts`."""
        from megacomp.data.corpus import json_line_texts

        out = []
        for number, line in lines:
            if not line.strip():
                continue
            docs = []
            for text in json_line_texts(line, self.json_keys, f"{where}:{number}"):
                ids = list(self.tokenizer.encode(text))
                if ids and self.append_eod:
                    ids.append(self.tokenizer.eos_id)
                docs.append(ids)
            out.append(docs)
        return out

    def serve(self, tasks, results, where: str) -> None:
        """A worker process's loop: ``(index, lines)`` from ``tasks`` until None, ``(index, documents or the
        error)`` to ``results``."""
        for index, lines in iter(tasks.get, None):
            try:
                results.put((index, self.encode_lines(lines, where)))
            except Exception as e:  # sent back: the parent raises it in order
                results.put((index, e))


def _chunks(path: str) -> Iterator[list[tuple[int, str]]]:
    with open(path, "r", encoding="utf-8", newline="") as f:
        chunk = []
        for number, line in enumerate(f, start=1):
            chunk.append((number, line))
            if len(chunk) == _CHUNK_LINES:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def _in_workers(encoder: Encoder, path: str, workers: int) -> Iterator[list[list[list[int]]]]:
    """The encoded chunks of ``path`` in order, encoded by ``workers`` processes (each builds its tokenizer once)."""
    ctx = multiprocessing.get_context()
    tasks, results = ctx.Queue(maxsize=2 * workers), ctx.Queue()
    procs = [ctx.Process(target=encoder.serve, args=(tasks, results, path), daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    state = types.SimpleNamespace(total=None, error=None)  # set by the feeder when the input is read

    def feed() -> None:
        count = 0
        try:
            for chunk in _chunks(path):
                tasks.put((count, chunk))
                count += 1
        except Exception as e:  # an unreadable file: raised after the chunks before it
            state.error = e
        finally:
            state.total = count
            for _ in procs:
                tasks.put(None)

    threading.Thread(target=feed, daemon=True).start()
    try:
        pending, want = {}, 0
        while state.total is None or want < state.total:
            if want in pending:
                yield _raise_or(pending.pop(want))
                want += 1
                continue
            try:
                index, value = results.get(timeout=1.0)
            except queue.Empty:  # the workers may have died (killed, out of memory)
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a tokenizing worker died (exit code {dead[0]})") from None
                continue
            pending[index] = value
        if state.error is not None:
            raise state.error
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()


def _raise_or(value):
    if isinstance(value, Exception):
        raise value
    return value


def _encoded(encoder: Encoder, path: str, workers: int) -> Iterator[list[list[int]]]:
    """Each non-blank line's per-key documents, in input order."""
    if workers <= 1:
        for chunk in _chunks(path):
            yield from encoder.encode_lines(chunk, path)
    else:
        for docs in _in_workers(encoder, path, workers):
            yield from docs


def preprocess(input_path: str, output_prefix: str, tokenizer, json_keys: Sequence[str] = ("text",),
               append_eod: bool = False, workers: int = 1, log_interval: int = 0) -> dict[str, dict]:
    """Write ``OUTPUT_PREFIX_KEY_document.bin/.idx`` per key of ``json_keys`` (see the module docstring); returns
    ``{key: {"prefix", "documents", "tokens"}}``.

    Raises:
        ValueError: a malformed line (``FILE:LINE``), megatron-core missing, ``workers`` < 1.
        OSError: the input cannot be read or the output written.
    """
    from megacomp.data.cache_files import new_temporary
    from megacomp.data.corpus import check_json_keys
    from megacomp.data.indexed import megatron_indexed

    keys = check_json_keys(json_keys)
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if not os.path.isfile(input_path):
        raise ValueError(f"--input {input_path}: no such file; give a JSON-lines file (one {{\"text\": ...}} object "
                         f"per line)")
    module = megatron_indexed()
    dtype = module.DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    outputs = {key: f"{output_prefix}_{key}_document" for key in keys}
    temporaries, builders = {}, {}
    stats = {key: {"prefix": outputs[key], "documents": 0, "tokens": 0} for key in keys}
    try:
        for key, prefix in outputs.items():
            names = []
            for suffix in (".bin", ".idx"):
                fd, tmp = new_temporary(prefix + suffix)
                os.close(fd)
                names.append(tmp)
            temporaries[key] = names
            builders[key] = module.IndexedDatasetBuilder(names[0], dtype=dtype)
        began = last = time.perf_counter()
        done = 0
        for docs in _encoded(Encoder(tokenizer, keys, append_eod), input_path, workers):
            for key, ids in zip(keys, docs):
                builders[key].add_document(ids, [len(ids)] if ids else [])
                stats[key]["documents"] += 1
                stats[key]["tokens"] += len(ids)
            done += 1
            if log_interval and done % log_interval == 0:
                now = time.perf_counter()
                _say(f"processed {done} lines ({log_interval / max(now - last, 1e-9):.0f} lines/s, "
                     f"{now - began:.0f} s)")
                last = now
        for key, (tmp_bin, tmp_idx) in temporaries.items():
            builders[key].finalize(tmp_idx)
            os.replace(tmp_bin, outputs[key] + ".bin")
            os.replace(tmp_idx, outputs[key] + ".idx")
    finally:
        for names in temporaries.values():
            for tmp in names:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    return stats


def _say(message: str) -> None:
    print(f"megacomp-preprocess-data: {message}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's tools/preprocess_data.py flags (the subset listed in the module docstring)."""
    from megacomp.data.tokenizer_files import TOKENIZER_TYPES

    p = argparse.ArgumentParser(prog="megacomp-preprocess-data", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON-lines file, one object per line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text to tokenize (default: text)")
    g.add_argument("--split-sentences", action="store_true", help="not supported (nltk sentence splitting)")
    g.add_argument("--keep-newlines", action="store_true", help="not supported (goes with --split-sentences)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES, help="the tokenizer's kind")
    g.add_argument("--tokenizer-model", help="tokenizer.json (or its folder), or a sentencepiece .model")
    g.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document id")
    g.add_argument("--lang", default="english", help="accepted (sentence splitting only)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX_KEY_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    g.add_argument("--partitions", type=int, default=1, help="accepted; the output does not depend on it")
    g.add_argument("--log-interval", type=int, default=1000, help="a progress line every this many lines (0: none)")
    g.add_argument("--keep-sequential-samples", action="store_true", help="accepted; the input order is kept")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse the flags, write the indexed files, return the exit status (see the module docstring).

    Raises:
        SystemExit: ``--help`` or flags argparse rejects (status 2, with the usage).
    """
    args = build_parser().parse_args(argv)
    from megacomp.data.tokenizer_files import build_tokenizer

    try:
        if args.split_sentences or args.keep_newlines:
            raise ValueError("--split-sentences / --keep-newlines (nltk sentence splitting) are not supported; "
                             "preprocess without them (one sequence per document, what GPT pretraining reads)")
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
        began = time.perf_counter()
        stats = preprocess(args.input, args.output_prefix, tokenizer, args.json_keys, args.append_eod, args.workers,
                           args.log_interval)
    except (ValueError, OSError) as e:
        where = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else str(e)
        print(f"megacomp-preprocess-data: error: {where}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    for s in stats.values():
        _say(f"wrote {s['prefix']}.bin/.idx: {s['documents']} documents, {s['tokens']:,} tokens "
             f"({time.perf_counter() - began:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

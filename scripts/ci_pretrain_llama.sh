#!/usr/bin/env bash
# CI: a Megatron-LM user's pipeline end to end on the tiny Llama model. A JSON-lines corpus (the repository's own
# documentation, one document per Markdown section), a Hugging Face tokenizer.json trained on it locally with the
# `tokenizers` package, megacomp-preprocess-data writing Megatron's indexed format with it, then
# scripts/pretrain_llama.sh on TP 2 x DP 2 (4 CPU ranks) with all_int8 compression, --split 98,2,0
# --eval-interval 10 --eval-iters 4 and --tensorboard-dir. The TensorBoard event file is read back: the validation
# loss at iterations 10, 20 and 30 and the wire bytes of every iteration must be there, the bytes compressed below
# their uncompressed size, and the training loss must fall.
#   bash scripts/ci_pretrain_llama.sh            # work files under results/ci-llama (WORK=... elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=${WORK:-$REPO/results/ci-llama}
PY=${PYTHON:-python}
rm -rf "$WORK" && mkdir -p "$WORK"
export OMP_NUM_THREADS=1

echo "ci_pretrain_llama.sh: corpus and tokenizer under $WORK"
"$PY" - "$WORK" <<'EOF'
import json, pathlib, re, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

work, repo = pathlib.Path(sys.argv[1]), pathlib.Path(".")
docs = []
for page in sorted([repo / "README.md", *repo.glob("docs/*.md"), *repo.glob("docs/guide/*.md")]):
    for section in re.split(r"\n(?=#)", page.read_text(encoding="utf-8")):
        if section.strip():
            docs.append(section.strip())
with open(work / "corpus.jsonl", "w", encoding="utf-8") as f:
    for text in docs:
        f.write(json.dumps({"text": text}) + "\n")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
(work / "tokenizer").mkdir()
tok.save(str(work / "tokenizer" / "tokenizer.json"))
print(f"ci_pretrain_llama.sh: {len(docs)} documents, tokenizer of {tok.get_vocab_size()} pieces")
EOF

"$PY" -m megacomp.preprocess_data --input "$WORK/corpus.jsonl" --json-keys text --append-eod \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$WORK/tokenizer" --output-prefix "$WORK/docs"  # writes docs_text_document.bin/.idx, as Megatron-LM names them

DATA_PATH="$WORK/docs_text_document" TOKENIZER_MODEL="$WORK/tokenizer" TP=2 NPROC=4 COMPRESSION=all_int8 \
  TRAIN_ITERS=30 LOG_DIR="$WORK/logs" TENSORBOARD_LOGS_PATH="$WORK/tb" MEGACOMP_DATA_CACHE="$WORK/cache" \
  bash scripts/pretrain_llama.sh --split 98,2,0 --eval-interval 10 --eval-iters 4

"$PY" - "$WORK/tb" <<'EOF'
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
tags = set(acc.Tags()["scalars"])
valid = {e.step: e.value for e in acc.Scalars("lm loss validation")}
assert sorted(valid) == [10, 20, 30], f"validation loss at {sorted(valid)}, expected iterations 10, 20, 30"
wire = {e.step: e.value for e in acc.Scalars("wire-bytes/total")}
raw = {e.step: e.value for e in acc.Scalars("uncompressed-bytes/total")}
assert sorted(wire) == list(range(1, 31)), f"wire bytes at {sorted(wire)}"
assert all(0 < wire[s] < raw[s] for s in wire), "all_int8 sent no fewer bytes than uncompressed"
loss = [e.value for e in acc.Scalars("lm loss")]
assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5, f"the training loss did not fall: {loss}"
assert valid[30] < valid[10], f"the validation loss did not fall: {valid}"
links = sorted(t for t in tags if t.startswith("wire-bytes-per-link/"))
print(f"ci_pretrain_llama.sh: TensorBoard holds validation loss {valid}, wire bytes of 30 iterations "
      f"({sum(wire.values()) / 1e6:.2f} MB, {sum(wire.values()) / sum(raw.values()):.2f} of uncompressed), {links}")
print("ci_pretrain_llama.sh: passed")
EOF

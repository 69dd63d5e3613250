#!/usr/bin/env bash
# Llama-style pretraining on Megatron indexed data, in the style of Megatron-LM's examples/llama scripts: the same
# argument arrays and flag names (a Megatron-LM user's DATA_ARGS, MODEL_ARGS and EVAL_AND_LOGGING_ARGS carry over),
# launched with torchrun, plus megacomp's --compression.
#
#   DATA_PATH=data/corpus_text_document TOKENIZER_MODEL=tok/tokenizer.json bash scripts/pretrain_llama.sh
#   TP=2 COMPRESSION=all_int8 NPROC=4 TRAIN_ITERS=30 DATA_PATH=... TOKENIZER_MODEL=... \
#       TENSORBOARD_LOGS_PATH=runs/tb bash scripts/pretrain_llama.sh --split 98,2,0 --eval-interval 10 --eval-iters 4
#   MODEL_SIZE=8b NPROC=8 NNODES=16 NODE_RANK=$i MASTER_ADDR=node0 DATA_PATH="0.7 web 0.3 code" ... (on each node)
#   DRY_RUN=1 bash scripts/pretrain_llama.sh                      # print the command, run nothing
#
# Data: DATA_PATH is what --data-path takes (a prefix of a .bin/.idx pair written by megacomp-preprocess-data or
# Megatron-LM's tools/preprocess_data.py, or a blend "W1 PREFIX1 W2 PREFIX2 ..."); TOKENIZER_TYPE
# [HuggingFaceTokenizer] with TOKENIZER_MODEL (tokenizer.json or its folder; a sentencepiece .model with
# SentencePieceTokenizer); SPLIT [98,2,0]. The tokenizer must be the one the data was tokenized with.
# Model: MODEL_SIZE [tiny] picks the shapes below (tiny: 4 x 64 for CPU ranks; 1b: Llama 3.2 1B; 8b: Llama 3 8B);
# the Llama options (RoPE, SwiGLU, RMSNorm, GQA, no biases, untied output) are Megatron-LM's flags.
# Environment (defaults in brackets): NPROC [4] processes per node, NNODES [1], NODE_RANK [0], MASTER_ADDR
# [127.0.0.1], MASTER_PORT [29500], TP [1], PP [1], COMPRESSION [none] (a preset of configs/compression/ or a
# YAML file), TRAIN_ITERS, MICRO_BATCH [4], GLOBAL_BATCH [16], LR [3e-3], CHECKPOINT_PATH (--save and --load),
# TENSORBOARD_LOGS_PATH, LOG_DIR [results/runs/llama-<size>-<date>], TORCHRUN, OMP_NUM_THREADS [1].
# Arguments after the script name are appended to megacomp.pretrain's flags (they win over the above).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

: "${DATA_PATH:?set DATA_PATH to an indexed dataset prefix (megacomp-preprocess-data --output-prefix) or a blend}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the tokenizer the data was tokenized with (tokenizer.json or a folder)}"
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
SPLIT=${SPLIT:-98,2,0}
MODEL_SIZE=${MODEL_SIZE:-tiny}
NPROC=${NPROC:-4}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-1}
PP=${PP:-1}
COMPRESSION=${COMPRESSION:-none}
MICRO_BATCH=${MICRO_BATCH:-4}
GLOBAL_BATCH=${GLOBAL_BATCH:-16}
LR=${LR:-3e-3}
LOG_DIR=${LOG_DIR:-$REPO/results/runs/llama-$MODEL_SIZE-$(date +%Y%m%d-%H%M%S)}

if [ -n "${TORCHRUN:-}" ]; then
  read -r -a LAUNCHER <<<"$TORCHRUN"
elif command -v torchrun >/dev/null 2>&1; then
  LAUNCHER=(torchrun)
else
  LAUNCHER=("${PYTHON:-python}" -m torch.distributed.run)
fi
if [ "$NNODES" = 1 ]; then
  DISTRIBUTED_ARGS=(--standalone --nproc-per-node "$NPROC")
else
  DISTRIBUTED_ARGS=(--nproc-per-node "$NPROC" --nnodes "$NNODES" --node-rank "$NODE_RANK"
                    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi

case "$MODEL_SIZE" in
  tiny) SHAPE_ARGS=(--num-layers 4 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4
                    --num-query-groups 2 --seq-length 64 --max-position-embeddings 64 --rotary-base 10000)
        TRAIN_ITERS=${TRAIN_ITERS:-60} ;;
  1b)   SHAPE_ARGS=(--num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32
                    --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --rotary-base 500000)
        TRAIN_ITERS=${TRAIN_ITERS:-12000} ;;
  8b)   SHAPE_ARGS=(--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
                    --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --rotary-base 500000)
        TRAIN_ITERS=${TRAIN_ITERS:-50000} ;;
  *) echo "pretrain_llama.sh: MODEL_SIZE must be tiny, 1b or 8b (got $MODEL_SIZE)" >&2; exit 2 ;;
esac

MODEL_ARGS=("${SHAPE_ARGS[@]}"
  --position-embedding-type rope --swiglu --normalization RMSNorm --group-query-attention
  --disable-bias-linear --untie-embeddings-and-output-weights)
[ "$MODEL_SIZE" = tiny ] || MODEL_ARGS+=(--bf16)
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP")
[ "$TP" -gt 1 ] && [ "$MODEL_SIZE" != tiny ] && MODEL_PARALLEL_ARGS+=(--sequence-parallel)
TRAINING_ARGS=(--micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
  --lr "$LR" --min-lr "$(python3 -c "print($LR / 10)")" --lr-warmup-iters 5 --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0)
DATA_ARGS=(--data-path $DATA_PATH --tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL"
  --split "$SPLIT")
EVAL_AND_LOGGING_ARGS=(--log-interval 1 --log-dir "$LOG_DIR")
[ -n "${TENSORBOARD_LOGS_PATH:-}" ] && EVAL_AND_LOGGING_ARGS+=(--tensorboard-dir "$TENSORBOARD_LOGS_PATH")
CHECKPOINT_ARGS=()
[ -n "${CHECKPOINT_PATH:-}" ] && CHECKPOINT_ARGS+=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH")
COMPRESSION_ARGS=(--compression "$COMPRESSION")

CMD=("${LAUNCHER[@]}" "${DISTRIBUTED_ARGS[@]}" -m megacomp.pretrain "${MODEL_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}"
     "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}"
     "${COMPRESSION_ARGS[@]}" "$@")
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
echo "pretrain_llama.sh: ${CMD[*]}"
exec "${CMD[@]}"

#!/usr/bin/env bash
# GPT pretraining with torchrun, Megatron-LM example style (bash arrays of flags, env overrides).
#
#   bash scripts/pretrain_gpt.sh                                  # configs/gpt_tiny.yaml on 4 local CPU ranks
#   TP=2 PP=2 COMPRESSION=all TRAIN_ITERS=50 bash scripts/pretrain_gpt.sh --log-interval 1
#   CONFIG=configs/gpt_1.3b.yaml NPROC=8 NNODES=4 NODE_RANK=$i MASTER_ADDR=node0 \
#       bash scripts/pretrain_gpt.sh --data-path /data/corpus     # on each of 4 GPU nodes
#   DRY_RUN=1 bash scripts/pretrain_gpt.sh                        # print the command, run nothing
#
# Environment (defaults in brackets; empty TP/PP/COMPRESSION/TRAIN_ITERS keep the config file's value):
#   NPROC [4]        processes (GPUs, or CPU ranks) per node      NNODES [1]   NODE_RANK [0]
#   MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]  (multi-node only; NNODES=1 uses --standalone)
#   CONFIG [<repo>/configs/gpt_tiny.yaml]  TP  PP  COMPRESSION (preset of configs/compression/ or a YAML file)
#   TRAIN_ITERS  LOG_DIR [<repo>/results/runs/<config>[-tpN][-ppN][-<compression>]-<date>]
#   SAVE  LOAD  (checkpoint directories)
#   TORCHRUN [torchrun, else python -m torch.distributed.run]  OMP_NUM_THREADS [1]
#   MEGACOMP_DATA_CACHE: where the tokenizer/token files are cached (shared by all ranks of a node).
# Arguments after the script name are appended to megacomp.pretrain's flags (they win over the above).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# relative paths (CONFIG, LOG_DIR, SAVE, LOAD, --data-path) are taken from the current directory; the
# repository goes on PYTHONPATH so `-m megacomp.pretrain` works from anywhere, installed or not
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

NPROC=${NPROC:-4}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
CONFIG=${CONFIG:-$REPO/configs/gpt_tiny.yaml}
TP=${TP:-}
PP=${PP:-}
COMPRESSION=${COMPRESSION:-}
TRAIN_ITERS=${TRAIN_ITERS:-}
RUN_NAME=$(basename "$CONFIG" .yaml)${TP:+-tp$TP}${PP:+-pp$PP}${COMPRESSION:+-$(basename "$COMPRESSION" .yaml)}
LOG_DIR=${LOG_DIR:-$REPO/results/runs/$RUN_NAME-$(date +%Y%m%d-%H%M%S)}
SAVE=${SAVE:-}
LOAD=${LOAD:-}
# One thread per rank unless told otherwise: ranks x threads beyond the core count only slows down.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# See scripts/pretrain_gpt.sbatch for why Megatron-style TP wants this on GPUs (no effect on CPU).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

[ -f "$CONFIG" ] || { echo "pretrain_gpt.sh: config file $CONFIG not found (from $(pwd))" >&2; exit 2; }

if [ -n "${TORCHRUN:-}" ]; then
  read -r -a LAUNCHER <<<"$TORCHRUN"
elif command -v torchrun >/dev/null 2>&1; then
  LAUNCHER=(torchrun)
else
  LAUNCHER=("${PYTHON:-python}" -m torch.distributed.run)
fi

if [ "$NNODES" = 1 ]; then
  # one node: torchrun picks a free port itself (no clash with other jobs on this machine)
  DISTRIBUTED_ARGS=(--standalone --nproc-per-node "$NPROC")
else
  DISTRIBUTED_ARGS=(
    --nproc-per-node "$NPROC"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
  )
fi

# shellcheck source=scripts/pretrain_args.sh
source "$REPO/scripts/pretrain_args.sh"
build_pretrain_args

CMD=("${LAUNCHER[@]}" "${DISTRIBUTED_ARGS[@]}" -m megacomp.pretrain "${PRETRAIN_ARGS[@]}" "$@")

if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
echo "pretrain_gpt.sh: ${CMD[*]}"
exec "${CMD[@]}"

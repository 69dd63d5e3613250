# Sourced by the launchers (pretrain_gpt.sh, pretrain_gpt.sbatch, pretrain_gpt_mpirun.sh): turns the
# environment overrides into `python -m megacomp.pretrain` arguments, Megatron-style argument arrays.
#   CONFIG (required), TP, PP, TRAIN_ITERS, COMPRESSION, LOG_DIR (required), SAVE, LOAD
# Empty or unset variables keep the config file's value. Result: the array PRETRAIN_ARGS.
build_pretrain_args() {
  GPT_MODEL_ARGS=(--config "$CONFIG")   # layers, hidden size, heads, sequence length, vocabulary: in the YAML
  MODEL_PARALLEL_ARGS=()
  [ -n "${TP:-}" ] && MODEL_PARALLEL_ARGS+=(--tensor-model-parallel-size "$TP")
  [ -n "${PP:-}" ] && MODEL_PARALLEL_ARGS+=(--pipeline-model-parallel-size "$PP")
  TRAINING_ARGS=()
  [ -n "${TRAIN_ITERS:-}" ] && TRAINING_ARGS+=(--train-iters "$TRAIN_ITERS")
  COMPRESSION_ARGS=()
  [ -n "${COMPRESSION:-}" ] && COMPRESSION_ARGS+=(--compression "$COMPRESSION")
  LOGGING_ARGS=(--log-dir "$LOG_DIR")
  CHECKPOINT_ARGS=()
  [ -n "${SAVE:-}" ] && CHECKPOINT_ARGS+=(--save "$SAVE")
  [ -n "${LOAD:-}" ] && CHECKPOINT_ARGS+=(--load "$LOAD")
  PRETRAIN_ARGS=("${GPT_MODEL_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}"
                 "${COMPRESSION_ARGS[@]}" "${LOGGING_ARGS[@]}" "${CHECKPOINT_ARGS[@]}")
  return 0
}

#!/usr/bin/env bash
# CI: run every example under examples/ for real with torchrun on 2 CPU ranks (gloo). Each example checks
# itself (compression off bit-identical to the engine it plugs into, the compressed run trains, resume is
# bit-identical) and exits non-zero otherwise; this script stops at the first failure.
#   bash scripts/run_examples.sh            # all
#   bash scripts/run_examples.sh fsdp2_gpt  # some, by name
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
NAMES=("$@")
[ ${#NAMES[@]} -eq 0 ] && NAMES=(megatron_gpt megatron_gpt_off fsdp2_gpt ddp_gpt)
[ "$#" -eq 0 ] && NAMES+=(lightning_gpt accelerate_gpt torchtitan_llama3)
for name in "${NAMES[@]}"; do
  case "$name" in
    megatron_gpt_off) cmd=(examples/megatron_gpt.py --codec none) ;;  # megacomp installed, compression off
    torchtitan_llama3) cmd=(--nproc-per-node 4 examples/torchtitan_llama3.py) ;;  # TP 2 x FSDP 2: 4 ranks (the last --nproc-per-node counts)
    *) cmd=("examples/$name.py") ;;
  esac
  echo "== examples: $name (torchrun, 2 ranks)"
  t0=$SECONDS
  # a limit per example (EXAMPLE_TIMEOUT s, default 600; each takes well under a minute here), so that a
  # hang fails CI with the example's name instead of holding it until its own limit
  timeout --kill-after=20 "${EXAMPLE_TIMEOUT:-600}" python -m torch.distributed.run --standalone --nproc-per-node 2 "${cmd[@]}" 2>&1 \
    | grep -v -E "^W[0-9]{4} |warnings.warn|UserWarning" || { echo "examples: $name FAILED" >&2; exit 1; }
  echo "== examples: $name ok ($((SECONDS - t0)) s)"
done
echo "examples: all ok"

#!/usr/bin/env bash
# CI: resume a checkpoint at another parallel layout with torchrun and check that the loss curve continues.
#
#   bash scripts/ci_reshard.sh
#
# Runs (scripts/pretrain_gpt.sh, configs/gpt_tiny.yaml, CI_ITERS iterations, a metrics line every iteration):
#   source   TP 2 x DP 2 on 4 ranks, saves at iteration CI_ITERS/2 and stops there (--exit-interval)
#   same     resumes it at TP 2 x DP 2 (the reference curve: a same-layout resume is bit-identical to an
#            uninterrupted run)
#   dp4      resumes it at TP 1 x DP 4 (4 ranks)
#   tp1      resumes it at TP 1 x DP 2 on 2 ranks (another world size)
# Checks: every run exits 0; each resumed run's banner says it resharded; its first logged iteration is the one
# after the checkpoint and its last CI_ITERS; at every resumed iteration its loss is within one iteration's progress
# of the reference (the mean |loss change| per iteration of the source and reference runs): the layouts sum in
# other orders, so the losses differ by round-off, while a resume that lost or misplaced state lands at least one
# iteration's progress away (a fresh model would restart near the first loss). Prints a table; exit status 1
# when anything failed.
#
# Environment: CI_ITERS [8]; CI_OUT [results/ci_reshard/<date>]; CI_RUN_TIMEOUT [300] s per run;
# MEGACOMP_DATA_CACHE (tokenizer/token cache, reused between runs).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
ITERS=${CI_ITERS:-8}
HALF=$((ITERS / 2))
RUN_TIMEOUT=${CI_RUN_TIMEOUT:-300}
OUT=${CI_OUT:-$REPO/results/ci_reshard/$(date +%Y%m%d-%H%M%S)}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=1 PYTHON
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CKPT=$OUT/ckpt
FAILED=0
T_START=$SECONDS

run() {  # run NAME NPROC TP [extra flags...]: one launch, its console in $OUT/NAME.log, metrics in $OUT/NAME/
  local name=$1 nproc=$2 tp=$3
  shift 3
  echo "ci_reshard: $name (TP $tp on $nproc ranks)"
  NPROC=$nproc TP=$tp TRAIN_ITERS=$ITERS LOG_DIR=$OUT/$name \
    timeout "$RUN_TIMEOUT" bash scripts/pretrain_gpt.sh --log-interval 1 "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "ci_reshard: $name exited with status $rc; the last lines of $OUT/$name.log:" >&2
    tail -n 5 "$OUT/$name.log" >&2
    FAILED=1
  fi
}

run source 4 2 --save "$CKPT" --save-interval "$HALF" --exit-interval "$HALF"
run same 4 2 --load "$CKPT"
run dp4 4 1 --load "$CKPT"
run tp1 2 1 --load "$CKPT"

"$PYTHON" - "$OUT" "$HALF" "$ITERS" <<'EOF' || FAILED=1
import json, os, sys
out, half, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def losses(name):
    path = os.path.join(out, name, "metrics.jsonl")
    try:
        return {r["iteration"]: r["loss"] for r in map(json.loads, open(path, encoding="utf-8")) if "loss" in r}
    except FileNotFoundError:
        return {}

source, same = losses("source"), losses("same")
curve = {**source, **same}
ok = sorted(source) == list(range(1, half + 1)) and sorted(same) == list(range(half + 1, iters + 1))
step = sum(abs(curve[i + 1] - curve[i]) for i in range(1, iters)) / (iters - 1) if ok else float("nan")
print(f"ci_reshard: reference curve {'ok' if ok else 'MISSING'}; one iteration's progress: {step:.4f}")
print(f"{'run':6} {'iteration':>9} {'loss':>9} {'reference':>9} {'|diff|':>9}  result")
failed = not ok
for name in ("dp4", "tp1"):
    got = losses(name)
    banner = open(os.path.join(out, f"{name}.log"), encoding="utf-8", errors="replace").read()
    if "resharded" not in banner or sorted(got) != list(range(half + 1, iters + 1)):
        print(f"{name:6} {'-':>9} {'-':>9} {'-':>9} {'-':>9}  FAILED (iterations {sorted(got)}; "
              f"{'no' if 'resharded' not in banner else 'a'} reshard line in the banner)")
        failed = True
        continue
    for i, loss in sorted(got.items()):
        diff = abs(loss - curve[i])
        bad = not diff < step
        failed |= bad
        print(f"{name:6} {i:9d} {loss:9.4f} {curve[i]:9.4f} {diff:9.2e}  {'FAILED' if bad else 'ok'}")
sys.exit(1 if failed else 0)
EOF
echo "ci_reshard: $((SECONDS - T_START)) s, output in $OUT: $([ $FAILED -eq 0 ] && echo passed || echo FAILED)"
exit $FAILED

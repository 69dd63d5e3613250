#!/usr/bin/env bash
# CI: fault-injection launches of `megacomp-pretrain --fault-tolerance torchft` (docs/guide/fault-tolerance.md).
#
#   bash scripts/ci_fault_tolerance.sh            # processes: three replica groups started by hand (below)
#   bash scripts/ci_fault_tolerance.sh slurm      # Slurm: scripts/pretrain_gpt_ft.sbatch, one group's step killed
#
# slurm: scripts/slurm_up.sh (a local Slurm; left running, scripts/slurm_down.sh stops it), then
# `sbatch scripts/pretrain_gpt_ft.sbatch`: the Lighthouse on the job's node and 2 replica groups of 2 ranks (torchrun,
# DP 2, ZeRO-1) as job steps, int8 + error feedback across the groups, steps committed only with both groups
# (MIN_REPLICAS=2, so the survivor waits for the relaunch however fast it would step alone). Once group 1 has logged
# KILL_AT [5] iterations its job step is killed (`scancel --signal=KILL JOBID.STEP`, as a lost node ends it); the
# batch script must relaunch it, the relaunched group must heal from group 0 (first record healed, past iteration 1,
# quorum of 2), both groups must reach the last iteration (CI_ITERS [20]) with a falling loss, and the job must end
# with exit code 0. Output under $CI_OUT/slurm. About 1-2 minutes on 2 busy CPU cores.
#
# processes: a Lighthouse (scripts/torchft_lighthouse.sh), three replica groups of the tiny GPT with int8 + error
# feedback on the cross-replica gradients, one of them killed with SIGKILL mid-run and restarted with the same
# command.
#
# Checks (exit status 1 when one fails; a summary line per check):
#   - the survivors keep stepping without a restart: their metrics show the quorum drop to 2 replica groups and
#     every one of their iterations up to the last one logged;
#   - the quorum recovers: the restarted group's first record says it was healed from a live peer, and the
#     survivors' last records show 3 replica groups again;
#   - the loss falls (last < first) on every replica group; the restarted group's first loss is nearer the
#     survivors' loss at that iteration than the untrained model's (it continued from the received state; each
#     group logs the loss of its own data, so the values differ; bit-equal parameters are tested in
#     tests/test_integrations_torchft.py);
#   - the restarted group's log starts at the survivors' iteration (it received the iteration, not 0).
#
# Environment: CI_ITERS [120] iterations (enough for the survivors to still be training when the restarted
# group has started up); KILL_AT [8] the killed group's iteration; CI_OUT
# [results/ci_fault_tolerance/<date>]; CI_RUN_TIMEOUT [600] s for the whole launch; PYTHON [python];
# MEGACOMP_DATA_CACHE (tokenizer/token cache, reused between runs). Runtime on 2 busy CPU cores: see the report
# printed at the end (about 2-4 minutes).
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
MODE=${1:-processes}
case "$MODE" in
  processes|slurm) ;;
  *) echo "ci_fault_tolerance: unknown mode '$MODE' (processes, slurm)" >&2; exit 2 ;;
esac
if [ "$MODE" = slurm ]; then
  ITERS=${CI_ITERS:-20}
  KILL_AT=${KILL_AT:-5}
else
  ITERS=${CI_ITERS:-120}
  KILL_AT=${KILL_AT:-8}
fi
RUN_TIMEOUT=${CI_RUN_TIMEOUT:-600}
OUT=${CI_OUT:-$REPO/results/ci_fault_tolerance/$(date +%Y%m%d-%H%M%S)}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
T0=$SECONDS
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; }
trap cleanup EXIT

# ---- slurm: scripts/pretrain_gpt_ft.sbatch on a local Slurm ------------------------------------------------
iters_of() { [ -f "$1/metrics.jsonl" ] && wc -l <"$1/metrics.jsonl" || echo 0; }
if [ "$MODE" = slurm ]; then
  bash scripts/slurm_up.sh >"$OUT/slurm_up.log" 2>&1 || { echo "ci_fault_tolerance: scripts/slurm_up.sh failed:";
    cat "$OUT/slurm_up.log"; exit 1; }
  export SLURM_CONF=${SLURM_DIR:-/tmp/megacomp-slurm}/slurm.conf
  RUN=$OUT/slurm
  mkdir -p "$RUN"
  JOB=$(LOG_DIR="$RUN" TRAIN_ITERS="$ITERS" NPROC_PER_GROUP=2 MIN_REPLICAS=2 RESTART_DELAY=2 COMPRESSION=dp_int8 \
    PYTHON="$PYTHON" sbatch --parsable --job-name=megacomp-ci-ft --nodes=1 --ntasks=2 --cpus-per-task=2 \
    --time=00:10:00 --chdir="$REPO" --output="$RUN/job-%j.out" scripts/pretrain_gpt_ft.sbatch --log-interval 1 \
    --lr-warmup-iters 2 --ft-codec int8 --ft-error-feedback ef --ft-timeout 10 --ft-quorum-timeout 120) \
    || { echo "ci_fault_tolerance: sbatch failed"; exit 1; }
  trap 'scancel "$JOB" 2>/dev/null' EXIT
  echo "ci_fault_tolerance: job $JOB, 2 replica groups of 2 ranks, $ITERS iterations, group 1's job step killed at" \
       "iteration $KILL_AT; output in $RUN"
  until [ "$(iters_of "$RUN/r1")" -ge "$KILL_AT" ]; do
    squeue -h -j "$JOB" 2>/dev/null | grep -q . || { echo "ci_fault_tolerance: the job ended before the kill";
      cat "$RUN/job-$JOB.out"; tail -n 20 "$RUN/r1.out"; exit 1; }
    [ $((SECONDS - T0)) -gt "$RUN_TIMEOUT" ] && { echo "ci_fault_tolerance: timed out before the kill"; exit 1; }
    sleep 0.2
  done
  STEP=$(squeue -h -s -j "$JOB" -o "%i %j" | awk '$2 == "replica-1" {print $1}' | head -n1)
  [ -n "$STEP" ] || { echo "ci_fault_tolerance: no job step named replica-1"; squeue -s -j "$JOB"; exit 1; }
  scancel --signal=KILL "$STEP"
  KILLED=$SECONDS
  while squeue -h -j "$JOB" 2>/dev/null | grep -q .; do
    [ $((SECONDS - T0)) -gt "$RUN_TIMEOUT" ] && { echo "ci_fault_tolerance: the job did not end within" \
      "${RUN_TIMEOUT} s"; cat "$RUN/job-$JOB.out"; exit 1; }
    sleep 0.5
  done
  trap - EXIT
  CODE=$(scontrol show job "$JOB" 2>/dev/null | grep -o ' ExitCode=[0-9:]*' | head -n1 | tr -d ' ')
  sed 's/^/  | /' "$RUN/job-$JOB.out"
  "$PYTHON" - "$RUN" "$ITERS" "$STEP" "${CODE:-unknown}" "$RUN/job-$JOB.out" <<'EOF'
import json, os, sys
run, iters, step, code, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], open(sys.argv[5]).read()
def rows(name):
    path = f"{run}/{name}/metrics.jsonl"
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []
r0, r1, back = rows("r0"), rows("r1"), rows("r1.restart1")
checks = {
    "job ended with exit code 0": code == "ExitCode=0:0",
    "the killed group's job step was relaunched": "replica group 1: its job step ended" in out and bool(back),
    "the killed group stopped before the end": bool(r1) and r1[-1]["iteration"] < iters,
    "relaunched group healed from group 0 at its iteration": bool(back) and back[0]["ft_healed"]
        and back[0]["iteration"] > 1 and back[0]["ft_replicas"] == 2,
    "both groups reached the last iteration in a quorum of 2": bool(r0) and bool(back)
        and r0[-1]["iteration"] == iters == back[-1]["iteration"] and r0[-1]["ft_replicas"] == 2,
    "loss falls on both groups": bool(r0) and bool(back) and r0[-1]["loss"] < r0[0]["loss"]
        and back[-1]["loss"] < r0[0]["loss"],
}
for name, ok in checks.items():
    print(f"ci_fault_tolerance: {'ok  ' if ok else 'FAIL'} {name}")
if r0 and back:
    print(f"ci_fault_tolerance: step {step} killed after iteration {r1[-1]['iteration'] if r1 else '-'}; group 1 "
          f"rejoined at iteration {back[0]['iteration']}; loss {r0[0]['loss']:.4f} -> {r0[-1]['loss']:.4f}")
sys.exit(0 if all(checks.values()) else 1)
EOF
  RC=$?
  echo "ci_fault_tolerance slurm: $([ $RC = 0 ] && echo passed || echo FAILED) in $((SECONDS - T0)) s (kill at" \
       "$((KILLED - T0)) s)"
  exit $RC
fi

PORT=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])")
BIND="[::]:$PORT" MIN_REPLICAS=2 HEARTBEAT_TIMEOUT_MS=2000 bash scripts/torchft_lighthouse.sh >"$OUT/lighthouse.log" 2>&1 &
PIDS+=($!)
LIGHTHOUSE=http://localhost:$PORT
for _ in $(seq 1 600); do grep -q "^lighthouse:" "$OUT/lighthouse.log" && break; sleep 0.1; done
grep -q "^lighthouse:" "$OUT/lighthouse.log" || { echo "ci_fault_tolerance: the Lighthouse did not start"; cat "$OUT/lighthouse.log"; exit 1; }

replica() {  # replica ID LOGDIR: one replica group (one rank) in the background
  "$PYTHON" -m megacomp.pretrain --config configs/gpt_tiny.yaml --train-iters "$ITERS" --log-interval 1 \
    --lr-warmup-iters 2 --compression dp_int8 --ft-codec int8 --ft-error-feedback ef \
    --fault-tolerance torchft --ft-lighthouse "$LIGHTHOUSE" --ft-replica-id "$1" --ft-timeout 10 --ft-min-replicas 2 --ft-quorum-timeout 120 \
    --log-dir "$2" >"$2.out" 2>&1 &
  PIDS+=($!)
}

for r in 0 1 2; do replica "$r" "$OUT/r$r"; done
VICTIM=${PIDS[3]}
echo "ci_fault_tolerance: 3 replica groups on $LIGHTHOUSE, $ITERS iterations, replica 2 killed at iteration $KILL_AT; output in $OUT"
while [ "$(iters_of "$OUT/r2")" -lt "$KILL_AT" ]; do
  kill -0 "$VICTIM" 2>/dev/null || { echo "ci_fault_tolerance: replica 2 ended early"; tail -5 "$OUT/r2.out"; exit 1; }
  [ $((SECONDS - T0)) -gt "$RUN_TIMEOUT" ] && { echo "ci_fault_tolerance: timed out before the kill"; exit 1; }
  sleep 0.2
done
kill -9 "$VICTIM"
KILLED=$SECONDS
SURVIVOR_AT=$(iters_of "$OUT/r0")
while [ "$(iters_of "$OUT/r0")" -lt $((SURVIVOR_AT + 3)) ]; do  # the survivors step on without it
  [ $((SECONDS - T0)) -gt "$RUN_TIMEOUT" ] && { echo "ci_fault_tolerance: the survivors did not continue"; exit 1; }
  sleep 0.2
done
replica 2 "$OUT/r2-restarted"  # the same command: it rejoins and receives the live state
FAILED=0
for p in "${PIDS[@]:1}"; do
  [ "$p" = "$VICTIM" ] && continue
  remaining=$((RUN_TIMEOUT - (SECONDS - T0)))
  timeout "$((remaining > 1 ? remaining : 1))" tail --pid="$p" -f /dev/null || { echo "ci_fault_tolerance: timed out"; FAILED=1; }
  wait "$p" || { echo "ci_fault_tolerance: a replica group exited with an error ($p)"; FAILED=1; }
done

"$PYTHON" - "$OUT" "$ITERS" <<'EOF' || FAILED=1
import json, sys
out, iters = sys.argv[1], int(sys.argv[2])
def rows(name):
    return [json.loads(line) for line in open(f"{out}/{name}/metrics.jsonl")]
r0, r1, r2, back = rows("r0"), rows("r1"), rows("r2"), rows("r2-restarted")
at = {x["iteration"]: x["loss"] for x in r0 if x["ft_committed"]}  # the survivor's loss per committed iteration
checks = {
    "survivors reached the last iteration": all(r[-1]["iteration"] == iters for r in (r0, r1)),
    "quorum dropped to 2 while replica 2 was down": any(x["ft_replicas"] == 2 for x in r0),
    "restarted replica healed from a live peer": back[0]["ft_healed"] and back[0]["iteration"] > 1,
    "quorum recovered to 3": r0[-1]["ft_replicas"] == 3 and back[-1]["iteration"] == iters,
    "loss falls on every replica group": all(r[-1]["loss"] < r[0]["loss"] for r in (r0, r1, back)),
    "restarted replica continued from the trained model": back[0]["loss"] < (r0[0]["loss"] + at[back[0]["iteration"]]) / 2,
}
for name, ok in checks.items():
    print(f"ci_fault_tolerance: {'ok  ' if ok else 'FAIL'} {name}")
print(f"ci_fault_tolerance: loss {r0[0]['loss']:.4f} -> {r0[-1]['loss']:.4f}; replica 2 rejoined at iteration "
      f"{back[0]['iteration']}; quorum sizes of replica 0: {[x['ft_replicas'] for x in r0]}")
sys.exit(0 if all(checks.values()) else 1)
EOF
echo "ci_fault_tolerance: $([ $FAILED = 0 ] && echo passed || echo FAILED) in $((SECONDS - T0)) s (kill at ${KILLED:+$((KILLED - T0))} s)"
exit $FAILED

#!/usr/bin/env bash
# CI: one fault-injection launch of `megacomp-pretrain --fault-tolerance torchft` (docs/guide/fault-tolerance.md):
# a Lighthouse (scripts/torchft_lighthouse.sh), three replica groups of the tiny GPT with int8 + error feedback on
# the cross-replica gradients, one of them killed with SIGKILL mid-run and restarted with the same command.
#
#   bash scripts/ci_fault_tolerance.sh
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
ITERS=${CI_ITERS:-120}
KILL_AT=${KILL_AT:-8}
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
iters_of() { [ -f "$1/metrics.jsonl" ] && wc -l <"$1/metrics.jsonl" || echo 0; }

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

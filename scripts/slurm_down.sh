#!/usr/bin/env bash
# Stop the single-node Slurm cluster that scripts/slurm_up.sh started.
#
#   bash scripts/slurm_down.sh           # cancel jobs, stop slurmd then slurmctld (by their pid files)
#   bash scripts/slurm_down.sh --purge   # ... and delete $SLURM_DIR (config, state, logs, job ids)
#
# Only the processes whose ids slurm_up.sh recorded are signalled (TERM, then KILL after 10 s).
# Idempotent: with nothing running it says so and exits 0.
set -euo pipefail

SLURM_DIR=${SLURM_DIR:-/tmp/megacomp-slurm}
CONF=$SLURM_DIR/slurm.conf
PURGE=0
case "${1:-}" in
  --purge) PURGE=1 ;;
  "") ;;
  *) echo "usage: $0 [--purge]" >&2; exit 2 ;;
esac
export PATH=$PATH:/usr/sbin:/usr/bin

say() { echo "slurm_down: $*"; }

alive() {  # alive PID NAME
  [ -n "$1" ] && [ -d "/proc/$1" ] && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ]
}

pid_of() { [ -s "$SLURM_DIR/$1.launch.pid" ] && cat "$SLURM_DIR/$1.launch.pid" || true; }

ctld=$(pid_of slurmctld)
if alive "$ctld" slurmctld && [ -f "$CONF" ] && command -v scancel >/dev/null 2>&1; then
  # cancel what is left so no job step outlives its slurmd
  jobs=$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null || true)
  if [ -n "$jobs" ]; then
    say "cancelling job(s): $(echo $jobs)"
    # shellcheck disable=SC2086
    SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
    for _ in $(seq 1 30); do
      [ -z "$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null || true)" ] && break
      sleep 0.5
    done
  fi
fi

stopped=0
for name in slurmd slurmctld; do
  pid=$(pid_of "$name")
  if alive "$pid" "$name"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do
      alive "$pid" "$name" || break
      sleep 0.25
    done
    if alive "$pid" "$name"; then
      say "$name (pid $pid) ignored TERM for 10 s; sending KILL"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.2
    fi
    say "stopped $name (pid $pid)"
    stopped=$((stopped + 1))
  fi
  rm -f "$SLURM_DIR/$name.launch.pid"
done
[ "$stopped" = 0 ] && say "nothing running (no live pid in $SLURM_DIR/*.launch.pid)"

if [ "$PURGE" = 1 ] && [ -d "$SLURM_DIR" ]; then
  rm -rf "$SLURM_DIR"
  say "removed $SLURM_DIR"
fi
exit 0

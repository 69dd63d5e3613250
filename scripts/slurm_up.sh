#!/usr/bin/env bash
# Start a single-node Slurm cluster on this machine (a test bed for scripts/pretrain_gpt.sbatch).
#
#   bash scripts/slurm_up.sh                 # install if missing, write the config, start, wait for "idle"
#   export SLURM_CONF=/tmp/megacomp-slurm/slurm.conf     # then: sinfo, sbatch, srun, squeue, scontrol
#   bash scripts/slurm_down.sh               # stop it again
#
# What it does:
#   1. installs the Debian packages slurmctld slurmd slurm-client when `slurmctld` is missing
#      (apt-get update + apt-get install --no-install-recommends; needs root),
#   2. writes $SLURM_DIR/slurm.conf: one node named `hostname -s` at 127.0.0.1, partition "debug",
#      AuthType=auth/none (no munge daemon), CPUs=$SLURM_CPUS (default 8, advertised even on a
#      smaller machine thanks to SlurmdParameters=config_overrides, so 4 tasks x 2 CPUs fit),
#   3. starts slurmctld and slurmd in the foreground mode (-D) as background processes, each in its own
#      session, with logs and pid files in $SLURM_DIR (no systemd needed; nothing is written to /etc),
#   4. waits until `sinfo` reports the node idle (timeout $SLURM_UP_TIMEOUT s, default 60).
# Idempotent: when both daemons from an earlier call are alive and the node answers, it only says so.
# The state directory is kept between runs (so job ids keep increasing); `slurm_down.sh --purge` wipes it.
#
# Environment: SLURM_DIR (default /tmp/megacomp-slurm), SLURM_CPUS (8), SLURM_MEM_MB (16000),
# SLURMCTLD_PORT (6817), SLURMD_PORT (6818), SLURM_UP_TIMEOUT (60).
set -euo pipefail

SLURM_DIR=${SLURM_DIR:-/tmp/megacomp-slurm}
SLURM_CPUS=${SLURM_CPUS:-8}
SLURM_MEM_MB=${SLURM_MEM_MB:-16000}
SLURMCTLD_PORT=${SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SLURMD_PORT:-6818}
TIMEOUT=${SLURM_UP_TIMEOUT:-60}
CONF=$SLURM_DIR/slurm.conf
NODE=$(hostname -s)

die() { echo "slurm_up: error: $*" >&2; exit 1; }
say() { echo "slurm_up: $*"; }

alive() {  # alive PIDFILE NAME -> 0 when the pid in PIDFILE is a running NAME process
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1")
  [ -d "/proc/$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

node_state() { SLURM_CONF=$CONF sinfo -h -N -n "$NODE" -o %t 2>/dev/null | head -n1; }

[ "$(id -u)" = 0 ] || die "this test cluster runs slurmctld/slurmd as root (SlurmUser=root, task launch" \
  "needs it); run as root, or use a real cluster's Slurm"

# ---- 1. packages -----------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null 2>&1 && [ ! -x /usr/sbin/slurmctld ]; then
  command -v apt-get >/dev/null 2>&1 || die "Slurm is not installed and there is no apt-get here; install" \
    "slurmctld, slurmd and slurm-client with this system's package manager"
  say "installing slurmctld slurmd slurm-client (apt-get) ..."
  apt-get update -qq || die "apt-get update failed (no network or no package mirror?)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client \
    >"${TMPDIR:-/tmp}/megacomp-slurm-apt.log" 2>&1 \
    || { tail -n 20 "${TMPDIR:-/tmp}/megacomp-slurm-apt.log" >&2; die "apt-get install of Slurm failed (log above)"; }
fi
export PATH=$PATH:/usr/sbin:/usr/bin
for tool in slurmctld slurmd sinfo scontrol sbatch srun; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found after installation (package slurmctld/slurmd/slurm-client)"
done

# ---- already running? ------------------------------------------------------------------------------
if alive "$SLURM_DIR/slurmctld.launch.pid" slurmctld && alive "$SLURM_DIR/slurmd.launch.pid" slurmd; then
  state=$(node_state || true)
  case "$state" in
    idle*|mix*|alloc*)
      say "already running (slurmctld pid $(cat "$SLURM_DIR/slurmctld.launch.pid"), slurmd pid" \
          "$(cat "$SLURM_DIR/slurmd.launch.pid"), node $NODE $state)"
      echo "export SLURM_CONF=$CONF"
      exit 0 ;;
  esac
  die "daemons from an earlier slurm_up are running but node $NODE is '${state:-unreachable}';" \
      "run scripts/slurm_down.sh first (logs: $SLURM_DIR/slurmctld.log, $SLURM_DIR/slurmd.log)"
fi
if alive "$SLURM_DIR/slurmctld.launch.pid" slurmctld || alive "$SLURM_DIR/slurmd.launch.pid" slurmd; then
  die "only one of slurmctld/slurmd from an earlier slurm_up is alive; run scripts/slurm_down.sh, then retry"
fi
for port in "$SLURMCTLD_PORT" "$SLURMD_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    die "port $port is already in use (another Slurm?); stop it or set SLURMCTLD_PORT/SLURMD_PORT"
  fi
done

# ---- 2. configuration ------------------------------------------------------------------------------
mkdir -p "$SLURM_DIR"/{state,spool,jobs}
cat >"$CONF" <<EOF
# Written by megacomp scripts/slurm_up.sh: a single-node test cluster (root daemons, no authentication).
ClusterName=megacomp
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort=$SLURMCTLD_PORT
SlurmdPort=$SLURMD_PORT
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool
SlurmctldPidFile=$SLURM_DIR/slurmctld.pid
SlurmdPidFile=$SLURM_DIR/slurmd.pid
SlurmctldLogFile=$SLURM_DIR/slurmctld.log
SlurmdLogFile=$SLURM_DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
InactiveLimit=0
KillWait=5
SlurmdTimeout=60
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$SLURM_CPUS RealMemory=$SLURM_MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=60 State=UP OverSubscribe=YES
EOF

# ---- 3. daemons ------------------------------------------------------------------------------------
start() {  # start NAME: foreground daemon in its own session, stdio to a file, pid recorded
  local name=$1
  # The stdout file is appended across runs; a header marks where this start's output begins.
  echo "=== slurm_up: starting $name at $(date '+%F %T')" >>"$SLURM_DIR/$name.stdout"
  setsid "$name" -D -f "$CONF" </dev/null >>"$SLURM_DIR/$name.stdout" 2>&1 &
  local pid=$! i
  echo "$pid" >"$SLURM_DIR/$name.launch.pid"
  # $! is the forked shell, which only becomes $name once setsid has exec'd it; checking
  # /proc/$pid/comm before that reads "bash" or "setsid" and would report a live daemon as exited
  # (a CI run failed on exactly that). Wait for the exec, or for the process to go away.
  for ((i = 0; i < 100; i++)); do
    [ -d "/proc/$pid" ] || return 0
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] && return 0
    sleep 0.05
  done
}
export SLURM_CONF=$CONF
start slurmctld
sleep 0.3
start slurmd

# ---- 4. wait for the node --------------------------------------------------------------------------
t0=$SECONDS
state=""
while (( SECONDS - t0 < TIMEOUT )); do
  for name in slurmctld slurmd; do
    if ! alive "$SLURM_DIR/$name.launch.pid" "$name"; then
      echo "--- $SLURM_DIR/$name.stdout" >&2; tail -n 15 "$SLURM_DIR/$name.stdout" >&2 || true
      echo "--- $SLURM_DIR/$name.log" >&2; tail -n 15 "$SLURM_DIR/$name.log" >&2 || true
      bash "$(dirname "${BASH_SOURCE[0]}")/slurm_down.sh" >/dev/null 2>&1 || true
      die "$name exited during start-up (its output is above)"
    fi
  done
  state=$(node_state || true)
  case "$state" in
    idle*) break ;;
    down*|drain*|drng*|fail*) SLURM_CONF=$CONF scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
  esac
  sleep 0.5
done
if [[ "$state" != idle* ]]; then
  echo "--- $SLURM_DIR/slurmctld.log" >&2; tail -n 15 "$SLURM_DIR/slurmctld.log" >&2 || true
  echo "--- $SLURM_DIR/slurmd.log" >&2; tail -n 15 "$SLURM_DIR/slurmd.log" >&2 || true
  die "node $NODE is '${state:-unreachable}' after ${TIMEOUT}s, not idle (logs above);" \
      "scripts/slurm_down.sh stops the daemons"
fi
say "up in $((SECONDS - t0))s: node $NODE idle, $SLURM_CPUS CPUs, partition debug (slurmctld pid" \
    "$(cat "$SLURM_DIR/slurmctld.launch.pid"), slurmd pid $(cat "$SLURM_DIR/slurmd.launch.pid"))"
echo "export SLURM_CONF=$CONF"

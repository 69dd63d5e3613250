#!/usr/bin/env bash
# Start torchft's Lighthouse, which forms the quorum of replica groups for `megacomp-pretrain --fault-tolerance
# torchft` (megacomp.integrations.torchft; docs/guide/fault-tolerance.md). Runs in the foreground until SIGTERM /
# Ctrl-C; prints `lighthouse: http://host:port` once it listens.
#
#   bash scripts/torchft_lighthouse.sh                    # [::]:29510, quorum of >= 1 replica group
#   PORT=29600 MIN_REPLICAS=2 bash scripts/torchft_lighthouse.sh
#   bash scripts/torchft_lighthouse.sh & export TORCHFT_LIGHTHOUSE=http://$(hostname):29510
#
# Then start each replica group as its own job, with its own name, e.g. two groups of 2 ranks under torchrun:
#   REPLICA_ID=0 torchrun --standalone --nproc-per-node 2 -m megacomp.pretrain --config configs/gpt_tiny.yaml \
#       --fault-tolerance torchft --ft-lighthouse "$TORCHFT_LIGHTHOUSE" --log-dir logs/r0
#   REPLICA_ID=1 torchrun --rdzv-endpoint localhost:29401 --rdzv-backend c10d --nnodes 1 --nproc-per-node 2 \
#       -m megacomp.pretrain --config configs/gpt_tiny.yaml --fault-tolerance torchft --log-dir logs/r1
# (each torchrun job needs its own rendezvous port: `--standalone` picks a free one). Under Slurm: run this script
# in one job step (or on the login node) and one `srun torchrun ...` job step per replica group with its own
# REPLICA_ID. A replica group that dies is restarted with the same command: it rejoins and receives the live state.
#
# Environment: BIND [[::]:$PORT], PORT [29510], MIN_REPLICAS [1], JOIN_TIMEOUT_MS [1000] (a forming quorum waits
# this long for replica groups that heartbeat but have not asked yet), HEARTBEAT_TIMEOUT_MS [2000] (a silent
# group is dead after this: the survivors' next quorum forms then), QUORUM_TICK_MS [10].
# The Lighthouse holds only the membership: if it dies, start it again with the same PORT within the groups'
# --ft-quorum-timeout and they continue (docs/guide/fault-tolerance.md, "A lost Lighthouse"). torchft's own INFO
# lines (every quorum) are off unless RUST_LOG is set, e.g. RUST_LOG=info bash scripts/torchft_lighthouse.sh.
# (torchft's own `torchft_lighthouse` command of torchft 0.2.0 did not listen on its port on our machine, so this
# runs the same LighthouseServer from Python.)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-29510}
exec "${PYTHON:-python}" -m megacomp.integrations.torchft --bind "${BIND:-[::]:$PORT}" \
  --min-replicas "${MIN_REPLICAS:-1}" --join-timeout-ms "${JOIN_TIMEOUT_MS:-1000}" \
  --heartbeat-timeout-ms "${HEARTBEAT_TIMEOUT_MS:-2000}" --quorum-tick-ms "${QUORUM_TICK_MS:-10}"

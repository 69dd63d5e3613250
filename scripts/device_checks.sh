#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one command, within 8 minutes on one H100 or H200; one results page.
#
#   OUT=/tmp/gpu bash scripts/device_checks.sh      # from the repository root; logs, tables and README.md in $OUT
#
# Steps (each with its own time limit, all within DEVICE_CHECKS_BUDGET_S, default 470 s; a slow or failing step
# does not stop the others; a step that would start with under 15 s left is skipped and says so):
#   triton  tests/test_kernels_triton.py -k cuda: the compiled Triton codec kernels bit for bit against the eager
#           reference on the GPU (the sign codec's NaN-scale fix among them)
#   bench   benchmarks/bench_kernels_gpu.py: int8, int4, int2, fp8_e4m3 and sign encode, decode, decode-accumulate
#           and the fused error-feedback step at 16M and 256M elements, fp32 and bf16, against the measured
#           device-to-device copy bandwidth (bytes read + written)
#   sync    benchmarks/sync_check.py --strict: compressed all-reduce / reduce-scatter / all-gather with error
#           feedback and ZeRO steps under torch.cuda.set_sync_debug_mode, NCCL at world size 1 and 2 gloo ranks
#           sharing the GPU; every synchronisation with its stack
#   e2e     benchmarks/gpu_e2e.py: the 125M GPT in bf16, 2 DP gloo ranks on the GPU, compression off and on:
#           tokens/s, MFU, compute / codec / wire per iteration, the losses; a torch.profiler trace (side stream)
# then benchmarks/gpu_report.py writes $OUT/README.md (device name, this command, every table). Copy it to
# benchmarks/results/<folder>/README.md with the trace beside it.
# Optional steps (DEVICE_CHECKS_STEPS="triton bench sync e2e megatron zero_alloc memory" for all): megatron-core's
# sequence-parallel tests on CUDA, ZeRO-1 vs ZeRO-2 allocator statistics, memory_bench --device cuda (the checks of
# benchmarks/results/gpu_checks/README.md).
#
# Without a GPU: one line says so and the exit status is 77 (skipped). DEVICE_CHECKS_CPU=1 runs the same steps on
# CPU with tiny sizes (a dry run of this script and of the page writer: tests/test_scripts_device_checks.py).
# Exit status: 0 every step passed, 1 a step failed, timed out or was skipped for time, 77 skipped (no GPU).
# Needs torch with triton, pytest; wheels in .whl/ are installed to /tmp/site first (a machine without an index).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_checks}
CPU=${DEVICE_CHECKS_CPU:-0}
BUDGET=${DEVICE_CHECKS_BUDGET_S:-470}
STEPS=${DEVICE_CHECKS_STEPS:-triton bench sync e2e}
COMMAND="OUT=$OUT${DEVICE_CHECKS_CPU:+ DEVICE_CHECKS_CPU=$CPU}${DEVICE_CHECKS_STEPS:+ DEVICE_CHECKS_STEPS=\"$STEPS\"} bash scripts/device_checks.sh"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if [ "$CPU" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_checks: installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$CPU" != 1 ] && ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "device_checks: skipped: no CUDA GPU here (torch.cuda.is_available() is False); DEVICE_CHECKS_CPU=1 is the CPU dry run"
  exit 77
fi
mkdir -p "$OUT"
start=$(date +%s)
: >"$OUT/steps.tsv"
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  [ "$CPU" = 1 ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - "$CPU" <<'EOF'
import sys, torch
cpu = sys.argv[1] == "1"
dev = "CPU (DEVICE_CHECKS_CPU=1 dry run)" if cpu else torch.cuda.get_device_name(0)
cap = "" if cpu else f" capability {torch.cuda.get_device_capability(0)}"
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda, "| device", dev,
      "|" + cap)
for mod in ("triton", "pytest"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "missing:", e)
EOF
  if [ -f SNAPSHOT_COMMIT ]; then echo "snapshot of commit $(cat SNAPSHOT_COMMIT)"; else git log -1 --format="commit %H %s" 2>/dev/null; fi
} 2>&1 | tee "$OUT/env.txt"

fail=0
step() {  # name, limit in seconds, log file, command...
  local name=$1 limit=$2 log=$3; shift 3
  local t0 left; t0=$(date +%s); left=$(( BUDGET - (t0 - start) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "=== $name: skipped, the budget of $BUDGET s is spent"
    printf '%s\tskipped\t0\t0\n' "$name" >>"$OUT/steps.tsv"; fail=1; return
  fi
  echo "=== $name (limit $limit s, $(( t0 - start )) s in)"
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  tail -n 25 "$log"
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 )) s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >>"$OUT/steps.tsv"
  [ "$rc" = 0 ] || fail=1
}
wants() { case " $STEPS " in *" $1 "*) return 0;; *) return 1;; esac; }

if [ "$CPU" = 1 ]; then
  DEV=cpu; SIZES=16k,64k; BENCH_EXTRA="--check 8k --repeats 2 --warmup 1"; SYNC_EXTRA="--numel 64k --worlds ranks"
  E2E_EXTRA="--config configs/gpt_tiny.yaml --micro-batch 2 --seq-length 32 --iters 1 --warmup 1"
else
  DEV=cuda; SIZES=16M,256M; BENCH_EXTRA="--repeats 10 --warmup 2"; SYNC_EXTRA="--numel 4M --strict"
  E2E_EXTRA="--config configs/gpt_125m.yaml --micro-batch 4 --seq-length 1024 --iters 8 --warmup 3"
fi

wants triton && step "triton kernel tests" 110 "$OUT/triton.log" \
  python3 -m pytest -v --tb=short -p no:cacheprovider tests/test_kernels_triton.py -k cuda
for dt in fp32 bf16; do
  wants bench && step "codec kernels $dt" 100 "$OUT/bench_$dt.log" \
    python3 -m benchmarks.bench_kernels_gpu --device $DEV --dtype $dt --numel $SIZES \
      --codecs int8,int4,int2,fp8_e4m3,sign --ef $BENCH_EXTRA --json "$OUT/bench_$dt.json"
done
wants sync && step "host synchronisations" 70 "$OUT/sync_check.log" \
  python3 -m benchmarks.sync_check --device $DEV --ranks 2 $SYNC_EXTRA --out "$OUT"
wants e2e && step "end to end" 130 "$OUT/e2e.log" \
  python3 -m benchmarks.gpu_e2e --device $DEV --ranks 2 $E2E_EXTRA --out "$OUT"

# optional: the earlier checks of benchmarks/results/gpu_checks/README.md
wants megatron && step "megatron-core SP on CUDA" 200 "$OUT/megatron.log" \
  python3 -m pytest -q -rs -p no:cacheprovider tests/test_integrations_megatron.py -k cuda
if wants zero_alloc; then
  cat >/tmp/dc_zero_alloc.py <<'EOF'
"""ZeRO-1 vs ZeRO-2 with torch.cuda's allocator statistics: DP ranks (gloo) on one GPU, each in its own process.
Per rank and stage: allocated at the iteration's start, the peak of forward / backward (the buckets'
reduce-scatters start in backward) / optimizer step, the iteration's peak and its growth over the start."""
import argparse, multiprocessing as mp, os, sys, tempfile, traceback
from datetime import timedelta

sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "benchmarks"), os.path.join(os.getcwd(), "scripts")]
import torch
import torch.distributed as dist

MiB = 2.0 ** 20


def rank_main(rank, world, init_file, stage, args, q):
    try:
        torch.set_num_threads(1)
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        from memory_bench import _groups, model_config
        from megacomp import parallel_state
        from megacomp.config import ModelParallelConfig
        from megacomp.models.gpt import GPTModel
        from megacomp.optimizer import DistributedOptimizer
        from megacomp.tensor_parallel import vocab_parallel_cross_entropy

        dev = torch.device("cuda", torch.cuda.current_device())
        groups = parallel_state.initialize_model_parallel(1)
        gpt, _ = model_config(args)
        model = GPTModel(gpt, ModelParallelConfig(params_dtype=torch.float32, process_groups=groups)).to(dev)
        opt = DistributedOptimizer(_groups(model, 0.1), torch.optim.AdamW, groups.dp, max_grad_norm=1.0, lr=1e-4,
                                   betas=(0.9, 0.95), zero_stage=stage, bucket_size=1 << 22)
        gen = torch.Generator().manual_seed(1000 + rank)
        ids = torch.randint(0, gpt.vocab_size, (1, args.seq_length), generator=gen).to(dev)
        labels = torch.randint(0, gpt.vocab_size, (1, args.seq_length), generator=gen).to(dev)

        def loss_fn():
            logits = model(ids)
            return vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(),
                                                tp_group=model.tp_group).mean()
        for _ in range(2):  # warm-up: optimizer state and ZeRO-1's buffers exist after the first step
            loss_fn().backward()
            opt.step()
        cu = torch.cuda
        cu.synchronize(); cu.reset_peak_memory_stats()
        r = {"rank": rank, "start": cu.memory_allocated()}
        loss = loss_fn()
        cu.synchronize(); r["fwd"] = cu.max_memory_allocated(); cu.reset_peak_memory_stats()
        loss.backward()
        cu.synchronize(); r["bwd"] = cu.max_memory_allocated(); cu.reset_peak_memory_stats()
        opt.step()
        cu.synchronize(); r["step"] = cu.max_memory_allocated(); r["end"] = cu.memory_allocated()
        r["reserved"] = cu.max_memory_reserved()
        r["peak"] = max(r["fwd"], r["bwd"], r["step"])
        r["params"] = sum(p.numel() * p.element_size() for p in model.parameters())
        r["buffers_total"] = sum(b.padded * 4 for b in opt.buckets)
        r["largest_bucket"] = max(b.padded * 4 for b in opt.buckets)
        r["loss"] = loss.item()
        parallel_state.destroy_model_parallel()
        q.put((rank, True, r))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(stage, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="dc-zero-")
    os.close(fd); os.unlink(init_file)
    procs = [ctx.Process(target=rank_main, args=(r, args.dp, init_file, stage, args, q)) for r in range(args.dp)]
    for p in procs:
        p.start()
    out = [q.get(timeout=400) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    bad = [v for _, ok, v in out if not ok]
    if bad:
        raise RuntimeError("\n".join(bad))
    return sorted((v for _, _, v in out), key=lambda r: r["rank"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/gpt_125m.yaml")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    args = ap.parse_args()
    rows = {s: launch(s, args) for s in (1, 2)}
    r1 = rows[1][0]
    print(f"\nGPT {args.config}, {r1['params'] / MiB:,.1f} MiB of fp32 parameters; DP {args.dp} gloo ranks on "
          f"{torch.cuda.get_device_name(0)}; micro-batch 1 x seq {args.seq_length}; clip 1.0; AdamW; 4M-element "
          f"buckets: all buffers {r1['buffers_total'] / MiB:,.1f} MiB, largest {r1['largest_bucket'] / MiB:,.1f} MiB\n")
    print("| stage | rank | allocated at start | peak forward | peak backward | peak step | **peak** | peak - start "
          "| allocated at end | max reserved | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s, rs in rows.items():
        for r in rs:
            c = [r[k] / MiB for k in ("start", "fwd", "bwd", "step", "peak")]
            print(f"| ZeRO-{s} | {r['rank']} | {c[0]:,.1f} | {c[1]:,.1f} | {c[2]:,.1f} | {c[3]:,.1f} | **{c[4]:,.1f}** | "
                  f"{c[4] - c[0]:,.1f} | {r['end'] / MiB:,.1f} | {r['reserved'] / MiB:,.1f} | {r['loss']:.6f} |")
    z1, z2 = rows[1][0], rows[2][0]
    quarter = z1["buffers_total"] / args.dp + z1["largest_bucket"]
    print(f"\nrank 0: ZeRO-1 peak - ZeRO-2 peak = {(z1['peak'] - z2['peak']) / MiB:,.1f} MiB; allocated at start "
          f"differs by {(z1['start'] - z2['start']) / MiB:,.1f} MiB (ZeRO-1's full-size buffers "
          f"{z1['buffers_total'] / MiB:,.1f} MiB live between steps); ZeRO-1's buffers / DP + largest bucket = "
          f"{quarter / MiB:,.1f} MiB")
    same = all(a["loss"] == b["loss"] for a, b in zip(rows[1], rows[2]))
    print(f"losses of the measured iteration equal between the stages on every rank: {same}")


if __name__ == "__main__":
    main()
EOF
  step "ZeRO-1 vs ZeRO-2 allocator statistics" 180 "$OUT/zero_alloc.md" python3 /tmp/dc_zero_alloc.py
fi
if wants memory; then
  step "memory_bench --device cuda zero1,zero2" 200 "$OUT/memory_bench.log" \
    python3 benchmarks/memory_bench.py --device cuda --dp 4 --methods zero1,zero2 --out /tmp/dc_zero2 --timeout 190
  cp /tmp/dc_zero2/table.md "$OUT/zero2_table.md" 2>/dev/null
fi

python3 -m benchmarks.gpu_report "$OUT" --command "$COMMAND" || fail=1
echo "=== device_checks: done in $(( $(date +%s) - start )) s, $( [ $fail = 0 ] && echo 'every step passed' || echo 'a step FAILED or was skipped'); the page: $OUT/README.md"
exit $fail

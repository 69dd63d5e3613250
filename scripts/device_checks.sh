#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (the last results: benchmarks/results/gpu_checks/README.md).
#
#   OUT=/tmp/gpu bash scripts/device_checks.sh      # from the repository root; logs and tables land in $OUT
#
# 1. tests/test_kernels_triton.py: the compiled Triton codec kernels against the eager reference on the GPU
#    (skipped without CUDA), with the interpreter tests beside them.
# 2. tests/test_integrations_megatron.py -k cuda: stock megatron-core's sequence-parallel path (which allocates
#    on CUDA, so it cannot run on a CPU-only torch) against MegatronCompression with compression off (bit for
#    bit) and int8 (within the codec bound), TP 2 on spawned gloo ranks sharing the GPU; TP 1 without SP.
# 3. ZeRO-1 against ZeRO-2 at DP 4 (the 125M config, fp32, micro-batch 1 x seq 128, 4 gloo ranks on the one
#    GPU): torch.cuda allocator statistics of an untracked iteration, per phase (inline script below).
# 4. memory_bench.py --device cuda: the same two methods with the dispatch-mode tracker's split and its
#    "CUDA max allocated" column (measured inside the tracked iteration).
#
# Needs a CUDA GPU, torch with triton, pytest, matplotlib; megatron-core==0.16.1 for step 2 (its tests skip
# without it). Wheels in .whl/ are installed to /tmp/site first (a machine that cannot reach a package index).
# Each step has its own time limit and a failing step does not stop the others; the exit status is 1 when any
# step failed. Steps 1 and 2-4 run side by side (different processes; allocator statistics are per process).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_checks: installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
MB=benchmarks/memory_bench.py
[ -f "$MB" ] || MB=scripts/memory_bench.py
start=$(date +%s)
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - <<'EOF'
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))
for mod in ("triton", "megatron.core", "pytest"):
    try:
        m = __import__(mod, fromlist=["x"])
        print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "missing:", e)
EOF
  if [ -f SNAPSHOT_COMMIT ]; then echo "snapshot of commit $(cat SNAPSHOT_COMMIT)"; else git log -1 --format="commit %H %s"; fi
} 2>&1 | tee "$OUT/env.txt"

# the C++ CPU codec kernels, built once in the background (the interpreter tests' CPU dispatch may use them)
python3 -c "from megacomp import kernels; print('CPU codec kernels:', kernels.backend_name('cpu'))" >/tmp/dc_build.log 2>&1 &

# 1. Triton kernels (beside the rest)
( timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_triton.py >"$OUT/triton.log" 2>&1
  echo $? >/tmp/dc_triton.rc ) &
triton_pid=$!

fail=0
step() {  # name, limit in seconds, log file, command...
  local name=$1 limit=$2 log=$3; shift 3
  echo "=== $name ($(( $(date +%s) - start )) s in)"
  timeout "$limit" "$@" 2>&1 | tee "$log"
  local rc=$?
  echo "=== $name: exit $rc"
  [ "$rc" = 0 ] || fail=1
}

# 2. megatron-core sequence parallelism on CUDA
step "megatron-core SP on CUDA" 200 "$OUT/megatron.log" \
  python3 -m pytest -q -rs -p no:cacheprovider tests/test_integrations_megatron.py -k cuda

# 3. allocator statistics, ZeRO-1 vs ZeRO-2, DP 4 on one GPU
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

# 4. memory_bench's tracked split with its CUDA column (only the tables come back)
step "memory_bench --device cuda zero1,zero2" 200 "$OUT/memory_bench.log" \
  python3 "$MB" --device cuda --dp 4 --methods zero1,zero2 --out /tmp/dc_zero2 --timeout 190
cp /tmp/dc_zero2/table.md "$OUT/zero2_table.md" 2>/dev/null
cp /tmp/dc_zero2/results.json "$OUT/zero2_results.json" 2>/dev/null

echo "=== waiting for the Triton tests ($(( $(date +%s) - start )) s in)"
wait "$triton_pid"
trc=$(cat /tmp/dc_triton.rc 2>/dev/null || echo missing)
tail -n 30 "$OUT/triton.log"
echo "=== Triton kernel tests: exit $trc"
[ "$trc" = 0 ] || fail=1
wait
cat /tmp/dc_build.log
echo "=== device_checks: done in $(( $(date +%s) - start )) s, $( [ $fail = 0 ] && echo 'every step passed' || echo 'a step FAILED')"
exit $fail

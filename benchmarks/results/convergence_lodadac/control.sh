#!/bin/bash
# The control row of README.md: LoDAdaC K=50 ring (uncompressed) with AdamW's bias correction and decoupled weight
# decay put back, on the suite's tokens, seeds and iterations (python -m benchmarks.convergence --suites lodadac
# --iters 300 passes the same flags to megacomp.pretrain). Run from the repository root.
export OMP_NUM_THREADS=1
for seed in 1 2 3; do
  d=results/convergence_runs/lodadac_control/seed$seed; mkdir -p $d
  echo "min_compress_numel: 4096" > $d/compression.yaml
  torchrun --standalone --nproc-per-node 4 -m megacomp.pretrain --compression $d/compression.yaml --log-interval 1 \
    --config configs/gpt_tiny.yaml --train-iters 300 --lr-warmup-iters 15 --log-dir $d --outer-algorithm lodadac \
    --num-replicas 4 --outer-steps 50 --lodadac-bias-correction --lodadac-weight-decay --seed $seed > $d/stdout.txt 2>&1
  echo "seed $seed rc $?"
done

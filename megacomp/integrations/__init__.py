"""Drop-in use of megacomp's compressed communication inside other engines.

- ``megacomp.integrations.megatron``: megatron-core's tensor-parallel layers (``MegatronCompression``).
- ``megacomp.integrations.fsdp``: PyTorch FSDP2's reduce-scatter and all-gather (``compress_fsdp``).
- ``megacomp.integrations.megatron_ddp``: megatron-core's own DDP and DistributedOptimizer (through
  ``MegatronCompression``; ``megatron_ddp_cpu`` runs them on a CPU-only torch).
- ``megacomp.integrations.dtensor_tp`` / ``torchtitan``: DTensor tensor parallelism and a torchtitan model.
- ``megacomp.integrations.lightning`` / ``accelerate``: the DDP hook and FSDP2 in those trainers, state in their
  checkpoints (``rank_state`` gathers every rank's).
- ``megacomp.integrations.torchft``: megacomp channels on torchft's quorum across replica groups.
- torch DDP: ``megacomp.optimizer.compressed_allreduce_hook`` (a communication hook).

Each submodule imports its engine only when used (the ``torchft`` and ``frameworks`` extras install them), so
``import megacomp`` never needs any of them.
"""

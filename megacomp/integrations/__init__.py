"""Drop-in use of megacomp's compressed communication inside other engines.

- ``megacomp.integrations.megatron``: megatron-core's tensor-parallel layers (``MegatronCompression``).
- ``megacomp.integrations.fsdp``: PyTorch FSDP2's reduce-scatter and all-gather (``compress_fsdp``).
- torch DDP: ``megacomp.optimizer.compressed_allreduce_hook`` (a communication hook).

Each submodule imports its engine only when used, so ``import megacomp`` never needs megatron-core.
"""

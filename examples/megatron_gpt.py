"""megatron-core's GPTModel at TP 2, then at DP 2 under its own DistributedDataParallel and DistributedOptimizer,
with the tensor-parallel and then the data-parallel traffic compressed by megacomp.

    torchrun --standalone --nproc-per-node 2 examples/megatron_gpt.py [--codec int8] [--steps 20]

The model is megatron-core's own (``megatron.core.models.gpt.GPTModel`` with its local, Transformer-Engine-free
layer spec). One swap makes it run on CPU: megatron-core's ``DotProductAttention`` allocates its score buffer
on CUDA, so the spec's core attention is megacomp's ``TorchSDPA`` (megacomp.integrations.megatron_ddp_cpu; the same causal softmax attention, through
``torch.nn.functional.scaled_dot_product_attention``); on GPUs leave the spec alone. Sequence parallelism
needs apex's or Transformer Engine's LayerNorm in megatron-core (its torch norm refuses it), so on CPU it is
tested on the layers only (tests/test_integrations_megatron.py).

It trains a few steps on counting sequences twice from the same initialisation, without megacomp and with
``MegatronCompression`` (int8 on tp_forward / sp paths, int8 + error feedback on tp_backward), and prints
both losses and the TP bytes megacomp put on the wire. With ``--codec none`` both runs match bit for bit.

Then the same model at TP 1 x DP 2 (each rank its own batches) under megatron-core's ``DistributedDataParallel``
(overlap_grad_reduce, overlap_param_gather) and ``DistributedOptimizer`` (Adam), again twice: stock, and with
``MegatronCompression`` on dp_gradient (the codec + LoCo error feedback per bucket) and dp_parameter (the codec).
megatron-core allocates their buffers on CUDA, so this CPU example runs that part inside ``megatron_on_cpu()``
(megacomp.integrations.megatron_ddp_cpu: the buffers' device, 'cuda' scalars and CUDA type names, nothing else);
on GPU ranks leave that out and put the model on the GPU.
"""
from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist

from megacomp.integrations.megatron_ddp_cpu import TorchSDPA, megatron_on_cpu

warnings.filterwarnings("ignore", module="megatron")  # "Apex / Transformer Engine not installed" notices


def build(vocab: int, seq: int, tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = TorchSDPA
    torch.manual_seed(0)  # every TP rank draws the same full weights and keeps its shard
    return GPTModel(cfg, spec, vocab_size=vocab, max_sequence_length=seq)


def train(steps: int, vocab: int, seq: int) -> list[float]:
    model = build(vocab, seq, tp=dist.get_world_size())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)  # the same batch on every TP rank
        # sequences that count up from a random start: the next token is learnable from the current one
        ids = (torch.randint(0, vocab, (4, 1), generator=g) + torch.arange(seq)) % vocab
        pos = torch.arange(seq).unsqueeze(0).expand(4, -1)
        loss = model(ids, pos, None, labels=torch.roll(ids, -1, 1)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_data_parallel(steps: int, vocab: int, seq: int, config) -> list[float]:
    """megatron-core's DDP + distributed optimizer training step, under ``MegatronCompression(config)``
    (``None``: stock megatron-core); the losses averaged over the DP ranks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megacomp.integrations.megatron import MegatronCompression

    model = build(vocab, seq, tp=1)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=40_000), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, use_distributed_optimizer=True,
                                                 clip_grad=1.0), [ddp])
    comp = MegatronCompression(config).register(ddp) if config else None
    losses = []
    if comp is not None:
        comp.install()
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(step * dist.get_world_size() + dist.get_rank())  # each DP rank its own
            ids = (torch.randint(0, vocab, (4, 1), generator=g) + torch.arange(seq)) % vocab
            pos = torch.arange(seq).unsqueeze(0).expand(4, -1)
            ddp.zero_grad_buffer()
            opt.zero_grad()
            loss = ddp(ids, pos, None, labels=torch.roll(ids, -1, 1)).mean()
            loss.backward()
            ddp.finish_grad_sync()  # the last bucket groups' reduce-scatters complete here
            opt.step()  # its parameter all-gather is dispatched by the next forward (overlap_param_gather)
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / dist.get_world_size())
    finally:
        if comp is not None:
            comp.uninstall()
    return losses



def report(steps: int, plain: list, compressed: list, codec, engine: str) -> None:
    """Print the two runs' losses and this run's wire bytes per path; check that compression off matched
    ``engine`` bit for bit and that the compressed run trained."""
    from megacomp import comm

    for step in (0, steps // 2, steps - 1):
        print(f"step {step + 1:3d}  loss megatron-core {plain[step]:.5f}  with megacomp {compressed[step]:.5f}")
    for path, s in sorted(comm.stats().items()):
        print(f"  {path:18s} {s.calls:5d} calls  {s.wire_bytes / 1e6:8.3f} MB on the wire  "
              f"({s.ratio:.3f} of {s.uncompressed_bytes / 1e6:.3f} MB uncompressed)")
    if codec is None:
        assert plain == compressed, f"compression off must match {engine} bit for bit"
        print(f"compression off: bit-identical to {engine}")
    assert compressed[-1] < compressed[0], "the compressed run must train"

def main() -> None:
    from megatron.core import parallel_state as ps

    from megacomp import comm
    from megacomp.integrations.megatron import MegatronCompression

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", default="int8", help="codec of every TP path (none: compression off)")
    p.add_argument("--steps", type=int, default=20)

    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    vocab, seq = 256, 32
    plain = train(args.steps, vocab, seq)
    codec = None if args.codec == "none" else args.codec
    config = {"tp_forward": codec, "tp_backward": codec, "sp_all_gather": codec, "sp_reduce_scatter": codec,
              "tp_backward_error_feedback": "ef" if codec else None, "min_compress_numel": 1024}
    comm.reset_stats()
    with MegatronCompression(config) as comp:
        compressed = train(args.steps, vocab, seq)
    if dist.get_rank() == 0:
        print(comp)
        report(args.steps, plain, compressed, codec, "megatron-core")
    ps.destroy_model_parallel()

    with megatron_on_cpu():  # megatron-core's DDP buffers on the CPU (see the module docstring)
        ps.initialize_model_parallel()  # TP 1: every rank is a data-parallel replica
        plain = train_data_parallel(args.steps, vocab, seq, None)
        dp_config = {"dp_gradient": codec, "dp_gradient_error_feedback": "loco" if codec else None,
                     "dp_parameter": codec, "min_compress_numel": 1024}
        comm.reset_stats()
        compressed = train_data_parallel(args.steps, vocab, seq, dp_config)
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        print(f"data parallel (megatron-core DDP + DistributedOptimizer, DP {dist.get_world_size()}): {dp_config}")
        report(args.steps, plain, compressed, codec, "megatron-core's DDP and distributed optimizer")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

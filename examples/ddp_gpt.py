"""torch DDP training megacomp's GPT with megacomp's compressed all-reduce as DDP's communication hook.

    torchrun --standalone --nproc-per-node 2 examples/ddp_gpt.py [--steps 20] [--codec int4] [--dp-collectives flat]
    torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --master-addr HOST examples/ddp_gpt.py   # on each of 2 nodes

Two runs from the same initialisation on counting sequences: DDP with megacomp's hook and codec None (DDP's
default averaging, bit for bit, but counted), and DDP with int4 + LoCo error feedback per bucket. The hook
state's channel owns the error-feedback state (``state.channel.state_dict()`` checkpoints it). It prints
the losses and the bytes on the wire.

On several nodes with several ranks each (``--dp-collectives auto``, the default), the hook state gets the topology
megacomp.placement.detect_topology finds from the launcher, and each bucket's all-reduce runs hop by hop:
uncompressed inside a node (counted under ``dp_gradient@intra_node``), compressed between nodes (``dp_gradient``), so
the slow link carries each node's gradients once. ``--dp-collectives flat`` all-reduces over all ranks at once.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

VOCAB, SEQ = 256, 32


def train(codec, error_feedback, count: int, topology=None) -> list[float]:
    from megacomp import parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.models.gpt import GPTConfig, GPTModel
    from megacomp.optimizer import CompressedHookState, compressed_allreduce_hook

    groups = parallel_state.initialize_model_parallel(1, 1)
    cfg = GPTConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, num_layers=2, vocab_size=VOCAB,
                    max_seq_length=SEQ, seed=1)
    model = DDP(GPTModel(cfg, ModelParallelConfig(process_groups=groups)), bucket_cap_mb=1)
    state = CompressedHookState(codec=codec, error_feedback=error_feedback, min_compress_numel=4096, topology=topology)
    model.register_comm_hook(state, compressed_allreduce_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(count):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # each rank its own batch
        ids = (torch.randint(0, VOCAB, (4, 1), generator=g) + torch.arange(SEQ)) % VOCAB
        loss = model(ids, torch.roll(ids, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().reshape(1)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        losses.append(t.item())
    parallel_state.destroy_model_parallel()
    return losses


def main() -> None:
    from megacomp import comm
    from megacomp.placement import detect_topology

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--codec", default="int4")
    p.add_argument("--dp-collectives", choices=("auto", "flat"), default="auto",
                   help="auto: hop by hop where the ranks span several nodes with several ranks on each")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topology = detect_topology() if args.dp_collectives == "auto" else None  # a collective: every rank calls it
    for name, codec, ef in (("uncompressed (codec None)", None, None), (f"{args.codec} + LoCo", args.codec, "loco")):
        comm.reset_stats()
        losses = train(codec, ef, args.steps, topology)
        wire = comm.stats()
        if dist.get_rank() == 0:
            counted = ", ".join(f"{tag} {s.wire_bytes / 1e6:.2f} MB ({s.ratio:.3f} of uncompressed)"
                                for tag, s in sorted(wire.items()) if tag.startswith("dp_gradient"))
            print(f"{name:26s} loss {losses[0]:.4f} -> {losses[-1]:.4f}   {counted} on the wire "
                  f"(the first 2 iterations are uncompressed)")
        assert losses[-1] < losses[0], f"{name} must train"
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

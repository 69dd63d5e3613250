"""PyTorch FSDP2 (``fully_shard``) training megacomp's GPT with megacomp's codecs as FSDP's collectives.

    torchrun --standalone --nproc-per-node 2 examples/fsdp2_gpt.py [--steps 20] [--ckpt /tmp/fsdp2_ckpt] [--dp-collectives flat]
    torchrun --nnodes 2 --node-rank N --nproc-per-node 2 --master-addr HOST examples/fsdp2_gpt.py   # on each of 2 nodes

Three runs from the same initialisation on counting sequences: stock FSDP2; FSDP2 with megacomp's
collectives and compression off (must match stock bit for bit); FSDP2 with LoCo int4 gradients and int8
parameter all-gathers. The last run is checkpointed halfway with torch.distributed.checkpoint (the
``FSDPCompression`` object is a DCP Stateful: each rank's error-feedback residuals) and resumed in a fresh
model, which must continue bit for bit. It prints the losses and the bytes on the wire.

On several nodes with several ranks each (``--dp-collectives auto``, the default), ``FSDPCompression`` gets the
topology megacomp.placement.detect_topology finds from the launcher, and every unit's reduce-scatter and all-gather
run hop by hop: uncompressed inside a node (``dp_*@intra_node``), compressed between nodes (``dp_gradient`` /
``dp_parameter``), so the slow link carries each node's bytes once. ``--dp-collectives flat``: over all ranks at once.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

LOSSY = {"dp_gradient": "int4", "dp_gradient_error_feedback": "loco", "dp_parameter": "int8",
         "min_compress_numel": 4096}
VOCAB, SEQ = 256, 32


def build(compression, topology=None):
    from megacomp import parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.integrations.fsdp import FSDPCompression
    from megacomp.models.gpt import GPTConfig, GPTModel

    groups = parallel_state.initialize_model_parallel(1, 1)
    cfg = GPTConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, num_layers=2, vocab_size=VOCAB,
                    max_seq_length=SEQ, seed=1)
    model = GPTModel(cfg, ModelParallelConfig(process_groups=groups))
    for block in model.layers:  # one FSDP unit per transformer layer, plus the root (embeddings, final norm)
        fully_shard(block)
    fully_shard(model)
    comp = FSDPCompression(compression, topology=topology).apply(model) if compression is not None else None
    return model, comp, torch.optim.AdamW(model.parameters(), lr=3e-3)


def steps(model, opt, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # each rank its own batch
        ids = (torch.randint(0, VOCAB, (4, 1), generator=g) + torch.arange(SEQ)) % VOCAB
        loss = model(ids, torch.roll(ids, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().reshape(1)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        losses.append(t.item())
    return losses


def main() -> None:
    from megacomp import comm, parallel_state
    from megacomp.placement import detect_topology

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: a temporary one)")
    p.add_argument("--dp-collectives", choices=("auto", "flat"), default="auto",
                   help="auto: hop by hop where the ranks span several nodes with several ranks on each")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topology = detect_topology() if args.dp_collectives == "auto" else None  # a collective: every rank calls it
    rank, half = dist.get_rank(), args.steps // 2
    results = {}
    for name, compression in (("stock FSDP2", None), ("megacomp, compression off", {}), ("LoCo int4 + int8 params", LOSSY)):
        model, comp, opt = build(compression, topology)
        comm.reset_stats()
        results[name] = steps(model, opt, 0, args.steps)
        wire = comm.stats()
        parallel_state.destroy_model_parallel()
        if rank == 0:
            counted = ", ".join(f"{p}: {s.wire_bytes / 1e6:.2f} MB ({s.ratio:.3f} of uncompressed)"
                                for p, s in sorted(wire.items()) if p.startswith("dp_"))
            print(f"{name:28s} loss {results[name][0]:.4f} -> {results[name][-1]:.4f}   {counted or 'not counted (torch)'}")
    assert results["stock FSDP2"] == results["megacomp, compression off"], "compression off must match stock FSDP2"

    # checkpoint the lossy run halfway, resume in a fresh model, compare with the straight run
    box = [args.ckpt or (tempfile.mkdtemp(prefix="fsdp2_ckpt_") if rank == 0 else None)]
    dist.broadcast_object_list(box)
    model, comp, opt = build(LOSSY, topology)
    steps(model, opt, 0, half)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "megacomp": comp}, checkpoint_id=box[0])
    parallel_state.destroy_model_parallel()
    model, comp, opt = build(LOSSY, topology)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "megacomp": comp}
    dcp.load(state, checkpoint_id=box[0])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = steps(model, opt, half, args.steps - half)
    parallel_state.destroy_model_parallel()
    assert resumed == results["LoCo int4 + int8 params"][half:], "resume must continue bit for bit"
    if rank == 0:
        print(f"compression off: bit-identical to stock FSDP2; resumed at step {half} from {box[0]}: bit-identical")
        if args.ckpt is None:
            shutil.rmtree(box[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""Hugging Face Accelerate training megacomp's GPT with megacomp's compressed DDP hook, resumed from
``Accelerator.save_state``.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_gpt.py [--steps 16]

On 2 CPU ranks (gloo; Accelerate's MULTI_CPU mode wraps the prepared model in DDP), counting sequences:
- uncompressed: megacomp's hook with codec None (DDP's default averaging, counted), which must equal
  Accelerate's DDP without megacomp bit for bit;
- int4 + LoCo error feedback per bucket (``compress_ddp``), ``accelerator.save_state`` halfway;
- a fresh model, optimizer, hook state and Accelerator resuming with ``accelerator.load_state``.
It checks that the loss falls, prints the wire bytes (``wire_megabytes``, as ``accelerator.log`` would take
them) and that the resumed run continues the straight one bit for bit (the hook reduces the fresh DDP's first
iteration in the saved bucket layout; megacomp.optimizer.ddp_hook).

FSDP2: ``compress_fsdp2`` needs Accelerate running FSDP2, which it does on accelerators only (on CPU it
ignores an FSDP plugin and wraps the model in DDP), so this CPU example runs the DDP path; the FSDP2
compression itself is megacomp.integrations.fsdp (examples/fsdp2_gpt.py, examples/lightning_gpt.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH = 256, 32, 4


def run(codec, steps: int, save_at: int | None = None, resume_from: str | None = None,
        ckpt: str | None = None) -> list[float]:
    """One Accelerate run of ``steps`` steps (from the checkpoint's step when resuming); returns this rank's losses."""
    from accelerate import Accelerator

    from megacomp import comm, parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.integrations.accelerate import compress_ddp
    from megacomp.models.gpt import GPTConfig, GPTModel
    from megacomp.optimizer import CompressedHookState

    accelerator = Accelerator(cpu=True)
    groups = parallel_state.initialize_model_parallel(1, 1)
    cfg = GPTConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, num_layers=2, vocab_size=VOCAB,
                    max_seq_length=SEQ, seed=1)
    model = GPTModel(cfg, ModelParallelConfig(process_groups=groups))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = accelerator.prepare(model, opt)
    if codec != "stock":  # "stock": Accelerate's DDP as it comes, without megacomp
        compress_ddp(accelerator, model, CompressedHookState(codec=codec, error_feedback="loco" if codec else None,
                                                             min_compress_numel=4096))
    first = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        first = save_at
    comm.reset_stats()
    losses = []
    for step in range(first, steps):
        g = torch.Generator().manual_seed(1000 * step + accelerator.process_index)  # each rank its own batch
        ids = (torch.randint(0, VOCAB, (BATCH, 1), generator=g) + torch.arange(SEQ)) % VOCAB
        loss = model(ids, torch.roll(ids, -1, 1))
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if save_at is not None and resume_from is None and step + 1 == save_at:
            accelerator.save_state(ckpt)
    parallel_state.destroy_model_parallel()
    return losses


def main() -> None:
    from megacomp.integrations.accelerate import wire_megabytes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # Accelerate finds it initialised and uses it
    rank, half = dist.get_rank(), args.steps // 2
    box = [tempfile.mkdtemp(prefix="accelerate_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(box)
    exact = run(None, args.steps)
    assert exact == run("stock", args.steps), "megacomp's hook with codec None must equal Accelerate's DDP bit for bit"
    straight = run("int4", args.steps, save_at=half, ckpt=box[0])
    wire = wire_megabytes()
    resumed = run("int4", args.steps, save_at=half, resume_from=box[0])
    assert straight[-1] < straight[0], f"the loss must fall ({straight[0]:.4f} -> {straight[-1]:.4f})"
    ok = torch.tensor([int(resumed == straight[half:])])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    how = "bit-identical; codec None equals stock Accelerate DDP bit for bit"
    if rank == 0:
        print(f"accelerate ddp: uncompressed loss {exact[0]:.4f} -> {exact[-1]:.4f}; int4 + LoCo {straight[0]:.4f} -> "
              f"{straight[-1]:.4f}; wire: " + ", ".join(f"{k} {v:.3f}" for k, v in wire.items()))
        print(f"accelerate ddp: resumed from accelerator.save_state at step {half}: {how}")
    assert ok.item(), f"resume must continue the straight run ({how})"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

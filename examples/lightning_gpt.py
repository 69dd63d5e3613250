"""PyTorch Lightning training megacomp's GPT with megacomp's compressed communication, resumed from Lightning's
own checkpoint.

    torchrun --standalone --nproc-per-node 2 examples/lightning_gpt.py [--epochs 4] [--strategy ddp|fsdp2|both]

Two parts, each on 2 CPU ranks (gloo), counting sequences, ``--epochs`` epochs of 4 steps:
- DDP (``DDPStrategy``): megacomp's DDP communication hook with int4 + LoCo error feedback per bucket,
  registered by ``MegacompCallback(ddp_hook=...)``;
- FSDP2 (``ModelParallelStrategy``): ``fully_shard`` per transformer layer in ``configure_model`` and
  ``FSDPCompression`` (LoCo int4 gradient reduce-scatter, int8 parameter all-gather), checkpointed by
  ``MegacompCallback(fsdp=...)``.
Each part runs straight through, saving a Lightning checkpoint (``ModelCheckpoint``) at every epoch's end,
then a fresh model, optimizer and megacomp state resume with ``trainer.fit(..., ckpt_path=<halfway>)``. It
checks that the loss falls and prints the wire bytes (also logged as ``megacomp/dp_gradient_MB``). Resume:
both parts' resumed losses must equal the straight run's bit for bit (DDP: the hook reduces the fresh DDP's first
iteration in the saved bucket layout; megacomp.optimizer.ddp_hook). DDP also runs a third time with codec None,
which must equal a fourth, stock Lightning DDP without megacomp, bit for bit.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH, STEPS_PER_EPOCH = 256, 32, 4, 4
FSDP_LOSSY = {"dp_gradient": "int4", "dp_gradient_error_feedback": "loco", "dp_parameter": "int8",
              "min_compress_numel": 4096}


class Counting(torch.utils.data.Dataset):
    """Counting sequences mod VOCAB from a random start; item i is the same in every run."""

    def __len__(self) -> int:
        return BATCH * STEPS_PER_EPOCH * dist.get_world_size()

    def __getitem__(self, i: int) -> torch.Tensor:
        start = torch.randint(0, VOCAB, (1,), generator=torch.Generator().manual_seed(i))
        return (start + torch.arange(SEQ)) % VOCAB


def make_module(fsdp: bool):
    """A LightningModule around megacomp's GPT; with ``fsdp`` it shards and compresses in ``configure_model``."""
    import lightning as L
    from torch.distributed.fsdp import fully_shard

    from megacomp import parallel_state
    from megacomp.config import ModelParallelConfig
    from megacomp.integrations.fsdp import FSDPCompression
    from megacomp.models.gpt import GPTConfig, GPTModel

    class GPTModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(1, 1)
            cfg = GPTConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, num_layers=2,
                            vocab_size=VOCAB, max_seq_length=SEQ, seed=1)
            self.gpt = GPTModel(cfg, ModelParallelConfig(process_groups=parallel_state.get_process_groups()))
            self.fsdp, self.losses = None, []

        def configure_model(self) -> None:
            if fsdp and self.fsdp is None:
                mesh = self.device_mesh["data_parallel"]
                for block in self.gpt.layers:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.gpt, mesh=mesh)
                self.fsdp = FSDPCompression(FSDP_LOSSY).apply(self.gpt)

        def training_step(self, ids, _):
            loss = self.gpt(ids, torch.roll(ids, -1, 1))
            self.losses.append(loss.item())  # this rank's loss, compared bit for bit after resume
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.gpt.parameters(), lr=3e-3)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Counting(), batch_size=BATCH, shuffle=False)

    return GPTModule()


def fit(strategy_name: str, epochs: int, ckpt_dir: str, resume_from: str | None = None, codec="int4") -> list[float]:
    """One Lightning run; returns this rank's losses (from the resumed step on, when resuming). ``codec="stock"``:
    plain Lightning DDP, without megacomp."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from megacomp import comm
    from megacomp.integrations.lightning import MegacompCallback
    from megacomp.optimizer import CompressedHookState

    module = make_module(fsdp=strategy_name == "fsdp2")
    if strategy_name == "ddp":
        hook = CompressedHookState(codec=None if codec == "stock" else codec, error_feedback="loco" if codec not in
                                   (None, "stock") else None, min_compress_numel=4096)
        strategy, megacomp = DDPStrategy(process_group_backend="gloo"), MegacompCallback(ddp_hook=hook)
        if codec == "stock":
            megacomp = None
    else:
        strategy = ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1,
                                         save_distributed_checkpoint=True, process_group_backend="gloo")
        megacomp = MegacompCallback(fsdp=lambda: module.fsdp)
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_epochs=epochs,
                        callbacks=[c for c in (megacomp, saver) if c is not None], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=True)
    comm.reset_stats()
    trainer.fit(module, ckpt_path=resume_from)
    return module.losses


def main() -> None:
    from megacomp import comm

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--strategy", choices=("ddp", "fsdp2", "both"), default="both")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # Lightning finds it initialised and uses it
    rank, half = dist.get_rank(), args.epochs // 2
    for name in (("ddp", "fsdp2") if args.strategy == "both" else (args.strategy,)):
        box = [tempfile.mkdtemp(prefix=f"lightning_{name}_") if rank == 0 else None]
        dist.broadcast_object_list(box)
        straight = fit(name, args.epochs, box[0])
        wire = comm.stats()
        assert straight[-1] < straight[0], f"{name}: the loss must fall ({straight[0]:.4f} -> {straight[-1]:.4f})"
        ckpt = os.path.join(box[0], f"epoch={half - 1}.ckpt")
        resumed = fit(name, args.epochs, box[0] + "_resumed", resume_from=ckpt)
        tail = straight[half * STEPS_PER_EPOCH:]
        same, how = resumed == tail, "bit-identical"
        if name == "ddp":  # and megacomp's hook with codec None is stock Lightning DDP, bit for bit
            exact = fit(name, args.epochs, box[0] + "_exact", codec=None)
            stock = fit(name, args.epochs, box[0] + "_stock", codec="stock")
            assert exact == stock, "megacomp's hook with codec None must equal stock Lightning DDP bit for bit"
            how += "; codec None equals stock Lightning DDP bit for bit"
        outcome = torch.tensor([int(same)])
        dist.all_reduce(outcome, op=dist.ReduceOp.MIN)
        if rank == 0:
            counted = ", ".join(f"{path} {s.wire_bytes / 1e6:.3f} MB ({s.ratio:.3f} of uncompressed)"
                                for path, s in sorted(wire.items()) if path.startswith("dp_"))
            print(f"lightning {name}: loss {straight[0]:.4f} -> {straight[-1]:.4f}; wire: {counted}")
            print(f"lightning {name}: resumed from {ckpt} at step {half * STEPS_PER_EPOCH}: {how}")
        assert outcome.item(), f"{name}: resume must continue the straight run ({how})"
        dist.barrier()
        if rank == 0:
            for suffix in ("", "_resumed", "_exact", "_stock"):
                shutil.rmtree(box[0] + suffix, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""megacomp.integrations.lightning (and .rank_state) with Lightning 2.6 on gloo, CPU.

- The callback's checkpoint entry holds every rank's hook state (gathered) and gives each rank its own back after
  real DDP steps with int4 + LoCo.
- Resume is bit for bit: a real Trainer (DDPStrategy, gloo) fitting 2 epochs equals one fitting 1 epoch, saving
  a Lightning checkpoint and a fresh Trainer, module and hook resuming from it for the second (losses and
  parameters, torch.equal), with int4 + LoCo (slow: int8 + EF) and with compression off.
- Bad input: a checkpoint without megacomp state, one saved with another world size.

The example (examples/lightning_gpt.py: DDP hook and FSDP2 in a real Trainer, loss falls, resume continues the curve)
runs in CI through scripts/run_examples.sh, not here (about 2 minutes).
"""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

pytest.importorskip("lightning")

from distributed import run_ranks  # noqa: E402
from megacomp.integrations.lightning import CHECKPOINT_KEY, MegacompCallback  # noqa: E402
from megacomp.optimizer import CompressedHookState  # noqa: E402



def test_loading_a_checkpoint_without_megacomp_state_says_so():
    cb = MegacompCallback(ddp_hook=CompressedHookState(codec="int4", error_feedback="loco"))
    with pytest.raises(ValueError, match="no megacomp state for \\['ddp_hook'\\]"):
        cb.on_load_checkpoint(None, None, {"state_dict": {}})
    MegacompCallback().on_load_checkpoint(None, None, {})  # nothing to restore: nothing asked


def _hook(rank):
    return CompressedHookState(codec="int4", error_feedback="loco", min_compress_numel=0)


def _round_trip_body(rank, world):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)))
    hook = _hook(rank)
    hook.register(model)
    for it in range(5):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(100 * it + rank))
        model(x).square().mean().backward()
    cb = MegacompCallback(ddp_hook=hook)
    checkpoint = {}
    cb.on_save_checkpoint(None, None, checkpoint)  # a collective, as Lightning calls it on every rank
    saved = checkpoint[CHECKPOINT_KEY]["ddp_hook"]
    assert saved["world"] == world and len(saved["ranks"]) == world
    fresh = _hook(rank)
    MegacompCallback(ddp_hook=fresh).on_load_checkpoint(None, None, checkpoint)
    mine, back = hook.error_feedback.state_dict(), fresh.error_feedback.state_dict()
    assert fresh.iteration == hook.iteration == 5 and fresh.start_iter == hook.start_iter  # nothing run uncompressed
    assert fresh.layout == hook.layout  # the fresh DDP's first iteration is reduced in this layout
    assert len(_tensors(mine)) == len(_tensors(back)) and all(
        torch.equal(a, b) for a, b in zip(_tensors(mine), _tensors(back)))
    assert any(t.abs().sum() > 0 for t in _tensors(back))  # LoCo residuals really were saved
    checkpoint[CHECKPOINT_KEY]["ddp_hook"] = {**saved, "world": world + 1}
    with pytest.raises(ValueError, match=f"state of {world + 1} ranks, this run has {world}"):
        MegacompCallback(ddp_hook=_hook(rank)).on_load_checkpoint(None, None, checkpoint)
    return [t.clone() for t in _tensors(back)]


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def test_callback_saves_every_ranks_hook_state_and_restores_each_its_own():
    per_rank = run_ranks(_round_trip_body, 2, timeout=120)
    # each rank compressed its own gradients: their residuals differ, so a rank-0-only checkpoint would lose rank 1's
    assert any(not torch.equal(a, b) for a, b in zip(per_rank[0], per_rank[1]))


STEPS_PER_EPOCH, BATCH = 4, 8
HOOKS = {"off": dict(codec=None), "int4+loco": dict(codec="int4", error_feedback="loco", min_compress_numel=1000),
         "int8+ef": dict(codec="int8", error_feedback="ef", min_compress_numel=1000)}


def _fit(rank, world, hook_kwargs, epochs, ckpt_dir, resume_from=None):
    """One real Lightning DDP run on the existing gloo group; returns this rank's losses and final parameters."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128),
                                           torch.nn.Tanh(), torch.nn.Linear(128, 4))
            self.losses = []

        def training_step(self, batch, _):
            x, y = batch
            loss = ((self.net(x) - y) ** 2).mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(3)
            x = torch.randn(BATCH * STEPS_PER_EPOCH * world, 16, generator=g)
            data = torch.utils.data.TensorDataset(x, torch.tanh(x @ torch.randn(16, 4, generator=g)))
            return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)

    module = Regression()
    saver = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                        max_epochs=epochs, callbacks=[MegacompCallback(ddp_hook=CompressedHookState(**hook_kwargs)),
                                                      saver], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=True, num_sanity_val_steps=0)
    trainer.fit(module, ckpt_path=resume_from)
    return module.losses, [p.detach().clone() for p in module.parameters()]


def _resume_body(rank, world, names, tmp):
    import os

    from megacomp import comm

    # Lightning finds the group initialised and uses it; these name this process's place in it
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")
    out = {}
    for name in names:
        ckpt = os.path.join(tmp, name)
        comm.reset_stats()
        straight, params = _fit(rank, world, HOOKS[name], 2, ckpt)
        s = comm.stats().get("dp_gradient")
        ratio = s.wire_bytes / s.uncompressed_bytes if s is not None else None
        resumed, again = _fit(rank, world, HOOKS[name], 2, ckpt + "_resumed",
                              resume_from=os.path.join(ckpt, "epoch=0.ckpt"))
        out[name] = (len(straight), straight[STEPS_PER_EPOCH:] == resumed,
                     all(torch.equal(a, b) for a, b in zip(params, again)), ratio)
    return out


def _check_resume(names, tmp_path):
    for res in run_ranks(_resume_body, 2, names, str(tmp_path), timeout=600):
        for name in names:
            steps, losses_equal, params_equal, ratio = res[name]
            assert steps == 2 * STEPS_PER_EPOCH and losses_equal and params_equal, (name, res[name])
            if name != "off":  # compression really was on (int4/int8 of the large buckets after 2 plain steps)
                assert ratio < 0.6, (name, ratio)


def test_a_resumed_trainer_continues_bit_for_bit(tmp_path):
    """trainer.fit(ckpt_path=...) from the first epoch's checkpoint equals the uninterrupted 2-epoch fit exactly,
    with int4 + LoCo (the fresh DDP's first iteration is reduced in the saved bucket layout) and without."""
    _check_resume(["int4+loco", "off"], tmp_path)


@pytest.mark.slow
def test_a_resumed_trainer_continues_bit_for_bit_with_int8_ef(tmp_path):
    _check_resume(["int8+ef"], tmp_path)

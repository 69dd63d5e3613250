"""megacomp.integrations.lightning (and .rank_state) with Lightning 2.6 on gloo, CPU.

- The callback's checkpoint entry holds every rank's hook state (gathered) and gives each rank its own back after
  real DDP steps with int4 + LoCo; a resumed hook averages its first iteration uncompressed (start_iter moved).
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
from megacomp.optimizer import CompressedHookState, compressed_allreduce_hook  # noqa: E402



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
    model.register_comm_hook(hook, compressed_allreduce_hook)
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
    assert fresh.iteration == hook.iteration == 5 and fresh.start_iter == 6  # the fresh DDP's first step is exact
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

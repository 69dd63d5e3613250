"""Pretraining with ``--zero-stage 2`` (megacomp.training): the same losses as ZeRO-1, deferred parameters (tied
embeddings over PP, sequence-parallel norms), checkpoints across stages, and the flags it refuses."""
from dataclasses import replace

import pytest
import torch

from distributed import run_ranks
from megacomp.training import Trainer
from megacomp.training.arguments import check


@pytest.fixture(scope="module")
def base(tiny_config):
    return replace(tiny_config, global_batch_size=4)


def _losses_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        deferred = sum(b.deferred for b in trainer.optimizer.buckets)
    finally:
        trainer.close()
    return [h["loss"] for h in history], [h["traffic"].get("dp_gradient", [0, 0])[0] for h in history], deferred


def test_one_micro_batch_gives_zero1_losses_bit_for_bit(base):
    """TP 2 x DP 2, one micro-batch per DP rank and iteration: the same reductions, so the same losses."""
    cfg = replace(base, tensor_model_parallel_size=2)
    z1 = run_ranks(_losses_body, 4, cfg)
    z2 = run_ranks(_losses_body, 4, replace(cfg, zero_stage=2))
    assert [r[:2] for r in z1] == [r[:2] for r in z2]
    assert z1[0][0][-1] < z1[0][0][0]


@pytest.mark.parametrize("tp,pp,sp", [(1, 2, False), (2, 1, True)], ids=["pp2-tied-embedding", "tp2-sp"])
def test_micro_batches_and_deferred_parameters(base, tp, pp, sp):
    """Two micro-batches per DP rank with deferred buckets (PP 2: the tied word embedding, summed over the
    embedding group first; TP 2 with SP: the norms, summed over TP first): ZeRO-1's losses to fp32 summation order
    (the layout test's tolerance); twice its gradient bytes, less the deferred buckets' (reduced once per step in
    both stages)."""
    cfg = replace(base, global_batch_size=8, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  sequence_parallel=sp)
    z1 = run_ranks(_losses_body, 4, cfg)
    z2 = run_ranks(_losses_body, 4, replace(cfg, zero_stage=2))
    for (l1, w1, d1), (l2, w2, d2) in zip(z1, z2):
        torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=2e-5, atol=0)
        assert all(a < b <= 2 * a for a, b in zip(w1, w2)) and d1 == d2
    assert any(d for _, _, d in z2)  # some rank keeps a deferred bucket whole


def test_checkpoint_of_zero1_resumes_under_zero2(base, tmp_path):
    """int4 + LoCo gradients, one micro-batch: a ZeRO-1 run stopped at iteration 3 and resumed with --zero-stage 2
    continues the uninterrupted ZeRO-1 curve exactly (the optimizer state is the same; zero_stage is not a
    field a resume must match)."""
    cfg = replace(base, train_iters=6, compression="loco4", save=str(tmp_path / "ckpt"))
    full = run_ranks(_losses_body, 2, replace(cfg, save=None))[0][0]
    first = run_ranks(_losses_body, 2, replace(cfg, exit_interval=3))[0][0]
    rest = run_ranks(_losses_body, 2, replace(cfg, zero_stage=2, load=str(tmp_path / "ckpt")))[0][0]
    assert len(first) == 3 and first + rest == full


@pytest.mark.parametrize("change,match", [
    (dict(zero_stage=3), "zero_stage must be 1"),
    (dict(shard_optimizer=False), "drop --no-shard-optimizer"),
    (dict(optimizer="lomo", global_batch_size=2), "use --zero-stage 1"),
    (dict(optimizer="onebit_adam"), "use --zero-stage 1"),
    (dict(optimizer="demo"), "use --zero-stage 1"),
    (dict(compression="powersgd4"), "use --zero-stage 1"),
])
def test_zero_stage_2_refusals_name_the_fix(base, change, match):
    with pytest.raises(ValueError, match=match):
        check(replace(replace(base, zero_stage=2), **change), world_size=2)
    check(replace(base, zero_stage=2, compression="loco4"), world_size=2)  # a value codec is fine

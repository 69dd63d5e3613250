"""LoQT in pretraining (megacomp.training.features.loqt_weights, ``--loqt-rank``) on real ranks.

- TP2 x DP2 with int4 base weights and int4 + LoCo gradients: the loss falls, merge iterations take no optimizer
  step, only the trainable parameters cross the DP group (fewer dp_gradient bytes than the same run without
  LoQT), and a resume across a merge gives the uninterrupted run's losses bit for bit (quantised payloads,
  projections, factors, the schedule position and the optimizer's masters are all in the checkpoint).
- LoQT with AdaLomo trains.
- Bad settings are refused with the fix in the message.
"""
from dataclasses import replace

import pytest

from distributed import run_ranks
from megacomp.training import Trainer
from megacomp.training.arguments import check

INT4_BASE = "{name: int4, block_size: 16}"


@pytest.fixture(scope="module")
def base(tiny_config):
    return replace(tiny_config, micro_batch_size=4, train_iters=6, lr=1e-2, lr_warmup_iters=1, loqt_rank=4,
                   loqt_codec=INT4_BASE, loqt_update_interval=2, tensor_model_parallel_size=2)


def _body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return [(h["loss"], h["loqt_merge"], h["grad_norm"], h["traffic"]) for h in history]


def test_loqt_tp2_dp2_trains_sends_only_the_factors_and_resumes_across_a_merge(base, tmp_path):
    comp = {"dp_gradient": {"name": "int4", "block_size": 32}, "dp_gradient_error_feedback": "loco",
            "min_compress_numel": 0}
    cfg = replace(base, compression=comp, save=str(tmp_path / "c"))
    full = run_ranks(_body, 4, replace(cfg, save=None))[0]
    losses = [h[0] for h in full]
    assert losses[-1] < losses[0]
    assert [h[1] for h in full] == [True, False, True, False, False, False]  # merges at 0 and tau = 2 (then 5 + 2 >= 6)
    assert all(h[2] is None for h in full if h[1]) and all(h[2] is not None for h in full if not h[1])
    plain = run_ranks(_body, 4, replace(cfg, save=None, loqt_rank=0))[0]
    assert full[-1][3]["dp_gradient"][1] < 0.7 * plain[-1][3]["dp_gradient"][1]  # only factors, biases, norms, embeddings
    assert full[0][3]["loqt_merge"][0] > 0 and full[0][3]["loqt_merge_tp"][0] > 0  # the merge gradients, counted
    first = [h[0] for h in run_ranks(_body, 4, replace(cfg, exit_interval=4))[0]]
    rest = [h[0] for h in run_ranks(_body, 4, replace(cfg, load=str(tmp_path / "c")))[0]]
    assert first + rest == losses


def test_loqt_with_adalomo_trains(base):
    cfg = replace(base, optimizer="adalomo", lr=0.1, clip_grad=0.0, tensor_model_parallel_size=1, train_iters=8)
    per_rank = run_ranks(_body, 2, cfg)
    losses = [h[0] for h in per_rank[0]]
    assert losses[-1] < losses[0] and all([h[0] for h in r] == losses for r in per_rank)


def test_fp16_overflow_on_a_merge_step_defers_the_merge(base):
    """fp16 LOMO from a loss scale of 2^24: the first iterations overflow, iteration 0's merge among them; each is a
    skipped step that merges nothing, and the first clean iteration merges instead; training then goes on."""
    cfg = replace(base, optimizer="lomo", params_dtype="float16", initial_loss_scale=2.0 ** 24, lr=0.05,
                  tensor_model_parallel_size=1, train_iters=12, loqt_update_interval=8, max_skipped_steps=20,
                  loqt_codec="{name: int8, block_size: 32}")
    per_rank = run_ranks(_body, 2, cfg)
    hist = per_rank[0]
    skipped = [h[2] is None and not h[1] for h in hist]  # skipped steps: no grad norm and no merge
    first = skipped.index(False)
    assert first >= 1 and hist[first][1]  # the deferred first merge happens at the first clean iteration
    assert not any(h[1] for h in hist[:first]) and all(h[0] == h[0] for h in hist)  # finite losses throughout
    assert [h[0] for h in hist] == [h[0] for h in per_rank[1]]
    assert hist[-1][0] < hist[first][0]


def test_bad_loqt_settings_are_refused(base):
    with pytest.raises(ValueError, match="runs with --optimizer adamw, lomo or adalomo"):
        check(replace(base, optimizer="onebit_adam"))
    with pytest.raises(ValueError, match="loqt_update_interval >= 1"):
        check(replace(base, loqt_update_interval=0))
    with pytest.raises(AssertionError, match="block_size must divide the local weight rows"):
        run_ranks(_body, 2, replace(base, loqt_codec="{name: int8, block_size: 24}"))


def test_merge_optimizer_step_steps_on_merge_iterations(base):
    """--loqt-merge-optimizer-step (sebulo/LoQT's head): a merge iteration merges and also takes the optimizer step
    (its record has a gradient norm); without it (the first commit) that iteration's gradients are dropped, so the
    runs part after the first merge iteration and not before."""
    cfg = replace(base, tensor_model_parallel_size=1, train_iters=3)
    stepped = run_ranks(_body, 2, replace(cfg, loqt_merge_optimizer_step=True))[0]
    dropped = run_ranks(_body, 2, cfg)[0]
    assert [h[1] for h in stepped] == [h[1] for h in dropped] == [True, False, False]
    assert stepped[0][2] is not None and dropped[0][2] is None
    assert stepped[0][0] == dropped[0][0] and stepped[1][0] != dropped[1][0]
    with pytest.raises(ValueError, match="loqt_merge_optimizer_step needs --optimizer adamw"):
        check(replace(base, optimizer="lomo", loqt_merge_optimizer_step=True))

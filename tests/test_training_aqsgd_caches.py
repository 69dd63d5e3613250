"""Pretraining with AQ-SGD activation deltas (``pp_activation_delta``) on real ranks, a small set for epochs.

- Codec off (pp_activation none + AQ-SGD): losses bit-identical to the plain pipeline (the sampler's fixed
  shards give the default order at DP 1).
- int4 deltas, PP2 x DP2 with the interleaved schedule: the run completes its epochs with the loss falling,
  pp_activation bytes below direct int4 after the warm-up epoch, and a run killed and resumed continues bit
  for bit (the caches are checkpointed).
- Refusals: AQ-SGD without pipeline parallelism; a dataset_samples outside the corpus.
- The reference's options (3-bit channel deltas, raw gradients in warm-up): bytes per iteration as wire_bytes.
"""
from dataclasses import replace

import pytest

from distributed import run_ranks
from megacomp.training import Trainer


@pytest.fixture(scope="module")
def base(tiny_config):
    return replace(tiny_config, num_layers=4, train_iters=6, pipeline_model_parallel_size=2, dataset_samples=16)


def _train_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return [(h["loss"], h["traffic"]) for h in history]


def losses(history):
    return [h[0] for h in history]


def test_codec_off_equals_the_plain_pipeline(base):
    plain = run_ranks(_train_body, 2, base)[0]
    aq = run_ranks(_train_body, 2, replace(base, compression={"pp_activation_delta": True}))[0]
    assert losses(aq) == losses(plain)


def test_int4_deltas_resume_bit_identically_and_send_fewer_bytes(base, tmp_path):
    comp = {"pp_activation": "int4", "pp_activation_delta": True, "min_compress_numel": 0}
    cfg = replace(base, train_iters=8, global_batch_size=16, num_layers_per_virtual_pipeline_stage=1,
                  compression=comp, save=str(tmp_path / "ckpt"))
    full = run_ranks(_train_body, 4, replace(cfg, save=None))[0]
    assert losses(full)[-1] < losses(full)[0]
    # 16 samples over 2 DP ranks: each rank's shard of 8 is one iteration (4 micro-batches of 2), so the
    # first iteration (the warm-up epoch) goes uncompressed and the later ones send int4 deltas
    act = [h[1]["pp_activation"] for h in full]
    assert act[0][0] == act[0][1] and act[1][0] < act[1][1]
    direct = replace(cfg, save=None, compression={"pp_activation": "int4", "min_compress_numel": 0})
    act_direct = run_ranks(_train_body, 4, direct)[0][-1][1]["pp_activation"]
    assert act[-1][0] == act_direct[0] < act[-1][1]  # the same wire size as direct int4, after warm-up
    first = run_ranks(_train_body, 4, replace(cfg, exit_interval=5))[0]
    rest = run_ranks(_train_body, 4, replace(cfg, load=str(tmp_path / "ckpt")))[0]
    assert losses(first) + losses(rest) == losses(full)


def test_refusals(base):
    with pytest.raises(AssertionError, match="pipeline_model_parallel_size >= 2"):
        run_ranks(_train_body, 1, replace(base, pipeline_model_parallel_size=1, compression={"pp_activation_delta": True}))
    with pytest.raises(AssertionError, match=r"dataset_samples 10000000 must be in \[1, "):
        run_ranks(_train_body, 2, replace(base, dataset_samples=10_000_000))


def test_finetune_loads_only_the_model_weights(base, tmp_path):
    """--finetune: a run with other compression (AQ-SGD) and batch starts from the checkpoint's weights at
    iteration 0; a requeued fine-tuning job resumes from its own --save bit for bit; a checkpoint of another
    model shape, a --load without a checkpoint and --save equal to --load are refused."""
    from megacomp.training.arguments import check
    pre = replace(base, dataset_samples=None, train_iters=4, save=str(tmp_path / "pre"))
    first = losses(run_ranks(_train_body, 2, pre)[0])
    tuned = replace(base, load=str(tmp_path / "pre"), finetune=True, train_iters=4, lr=1e-3,
                    compression={"pp_activation": "int4", "pp_activation_delta": True, "min_compress_numel": 0})
    after = losses(run_ranks(_train_body, 2, tuned)[0])
    assert len(after) == 4 and after[0] < first[0] - 0.05  # starts from trained weights, not from scratch
    job = replace(tuned, save=str(tmp_path / "ft"))
    part = losses(run_ranks(_train_body, 2, replace(job, exit_interval=2))[0])
    rest = losses(run_ranks(_train_body, 2, job)[0])  # the same command again: resumes from --save
    assert part + rest == after
    with pytest.raises(AssertionError, match="hidden_size: checkpoint 32 vs this run 64"):
        run_ranks(_train_body, 2, replace(tuned, hidden_size=64))
    with pytest.raises(AssertionError, match="no checkpoint in .* to fine-tune from"):
        run_ranks(_train_body, 2, replace(tuned, load=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="give it with --load"):
        check(replace(base, finetune=True), world_size=2)
    with pytest.raises(ValueError, match="save the fine-tuning run to its own directory"):
        check(replace(tuned, save=str(tmp_path / "pre")), world_size=2)


def test_reference_options_train_with_their_wire_bytes(base):
    """pp_activation_delta_bits 3 and the reference's warm-up with int8 gradients at PP 2: 16 samples, 2 iterations
    an epoch; the first epoch sends activations and gradients raw, later ones 3-bit channel deltas (wire_bytes) and
    int8 gradients, and the loss falls."""
    from megacomp.compression import make_codec
    from megacomp.compression.channel_max import ChannelMaxQuantizer
    comp = {"pp_activation_delta": True, "pp_activation_delta_bits": 3, "pp_activation_delta_warmup_full_gradients": True,
            "pp_gradient": "int8", "min_compress_numel": 0}
    hist = run_ranks(_train_body, 2, replace(base, compression=comp))[0]
    assert losses(hist)[-1] < losses(hist)[0]
    numel, M = base.seq_length * base.micro_batch_size * base.hidden_size, base.global_batch_size // base.micro_batch_size
    for it, (_, traffic) in enumerate(hist):
        act, grad = traffic["pp_activation"], traffic["pp_gradient"]
        raw = M * numel * 4
        assert act[1] == grad[1] == raw
        assert act[0] == (raw if it < 2 else M * ChannelMaxQuantizer(3, base.hidden_size).wire_bytes(numel)), it
        assert grad[0] == (raw if it < 2 else M * make_codec("int8").wire_bytes(numel)), it

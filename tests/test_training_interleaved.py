"""Pretraining with the interleaved schedule (``num_layers_per_virtual_pipeline_stage``) on real ranks.

- Compression off: the losses of every iteration are bit-identical to the non-interleaved schedule's at
  PP2 x VP2, at TP2 x PP2 x VP2 with sequence parallelism and at PP2 x VP2 x DP2 (gradient clipping on).
- Compressed (every kind, error feedback on PP and DP gradients): a run killed and resumed continues the
  same curve bit for bit (the per-virtual-boundary error feedback is checkpointed); the same checkpoint resumes
  without virtual stages too (resharded).
- Bad settings are refused with the fix.
"""
import math
from dataclasses import replace

import pytest

from distributed import run_ranks
from megacomp.config import load_yaml
from megacomp.training import Trainer
from megacomp.training.arguments import REPO_CONFIGS, check


@pytest.fixture(scope="module")
def base(tiny_config):
    return replace(tiny_config, num_layers=4, clip_grad=0.5)


def _train_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return [(h["loss"], h["traffic"]) for h in history]


def losses(history):
    return [h[0] for h in history]


@pytest.mark.parametrize("world,tp,sp,gbs", [(2, 1, False, 8), (4, 2, True, 8), (4, 1, False, 16)],
                         ids=["pp2xvp2", "tp2xpp2xvp2-sp", "pp2xvp2xdp2"])
def test_interleaved_losses_equal_the_non_interleaved_schedule(base, world, tp, sp, gbs):
    cfg = replace(base, tensor_model_parallel_size=tp, pipeline_model_parallel_size=2, sequence_parallel=sp,
                  global_batch_size=gbs)
    plain = run_ranks(_train_body, world, cfg)
    inter = run_ranks(_train_body, world, replace(cfg, num_layers_per_virtual_pipeline_stage=1))
    assert all(losses(h) == losses(plain[0]) for h in plain + inter)
    assert losses(plain[0])[-1] < losses(plain[0])[0]
    act_plain, act_inter = plain[0][-1][1]["pp_activation"], inter[0][-1][1]["pp_activation"]
    assert act_inter[1] == 3 * act_plain[1]  # PP2 x VP2: 3 boundaries cross a rank instead of 1


def test_compressed_interleaved_run_resumes_bit_identically(base, tmp_path):
    everything = {**load_yaml(str(REPO_CONFIGS / "compression" / "all.yaml")), "min_compress_numel": 0}
    cfg = replace(base, train_iters=4, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
                  compression=everything, save=str(tmp_path / "ckpt"))
    full = losses(run_ranks(_train_body, 2, replace(cfg, save=None))[0])
    first = losses(run_ranks(_train_body, 2, replace(cfg, exit_interval=2))[0])
    rest = run_ranks(_train_body, 2, replace(cfg, load=str(tmp_path / "ckpt")))[0]
    assert first + losses(rest) == full
    assert rest[-1][1]["pp_gradient"][0] < rest[-1][1]["pp_gradient"][1]  # really compressed
    # without virtual stages the same checkpoint reshards onto the plain 1F1B layout (megacomp.training.reshard):
    # the schedule crosses other stage boundaries with compressed activations, so the losses continue within the
    # codecs' error, not bit for bit
    plain = replace(cfg, num_layers_per_virtual_pipeline_stage=None, load=str(tmp_path / "ckpt"), save=None,
                    train_iters=6)  # the checkpoint holds iteration 4
    resharded = losses(run_ranks(_train_body, 2, plain)[0])
    assert len(resharded) == 2 and all(math.isfinite(x) for x in resharded)


def test_bad_interleaving_settings_are_refused(base):
    with pytest.raises(ValueError, match="needs pipeline_model_parallel_size >= 2"):
        check(replace(base, num_layers_per_virtual_pipeline_stage=1), world_size=2)
    with pytest.raises(ValueError, match="divisible by pipeline size x layers per virtual stage"):
        check(replace(base, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3), world_size=2)
    with pytest.raises(ValueError, match="leave one chunk"):
        check(replace(base, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2), world_size=2)
    check(replace(base, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1), world_size=2)

"""--compression auto in pretraining: a ladder of one codec trains bit for bit as that static setting, a resumed run
switches when the uninterrupted one does and reproduces its losses, and families whose channels do not follow a
switch are refused in one line."""
from dataclasses import replace

import pytest

from distributed import run_ranks
from megacomp.training import Trainer
from megacomp.training.arguments import check

INT8 = {"name": "int8", "block_size": 128}


def _records(rank, world, cfg):
    """(loss, codec per laddered path) of every iteration of this run."""
    trainer = Trainer(cfg)
    try:
        return [(h["loss"], h.get("auto_codec")) for h in trainer.train()]
    finally:
        trainer.close()


@pytest.fixture
def base(tiny_config):
    return replace(tiny_config, train_iters=6)


def test_auto_refuses_families_whose_channels_keep_their_own_codecs(base):
    for family in (dict(optimizer="demo"), dict(overlap_optimizer="acco")):
        with pytest.raises(ValueError, match="--compression auto .* does not combine with") as err:
            check(replace(base, compression="auto", **family), 2)
        assert "\n" not in str(err.value)


def test_a_ladder_of_one_codec_trains_bit_for_bit_as_that_static_codec(base):
    cfg = replace(base, train_iters=3)
    static = {"dp_gradient": INT8, "dp_gradient_error_feedback": "ef", "min_compress_numel": 1024}
    auto = {"auto": {"ladder": {"dp_gradient": [INT8]}, "interval": 1}, "dp_gradient_error_feedback": "ef",
            "min_compress_numel": 1024}
    fixed = run_ranks(_records, 2, replace(cfg, compression=static))[0]
    laddered = run_ranks(_records, 2, replace(cfg, compression=auto))[0]
    assert [loss for loss, _ in laddered] == [loss for loss, _ in fixed]
    assert {c["dp_gradient"] for _, c in laddered} == {"int8/b128"}


def test_a_resumed_run_switches_when_the_uninterrupted_one_does_with_the_same_losses(base, tmp_path):
    # an unreachable step-time target: every decision picks int8, and with patience 2 the switch comes at the
    # second decision (after iteration 4): a resume at 3 must carry the first decision's pending count
    comp = {"auto": {"ladder": {"dp_gradient": ["none", INT8]}, "interval": 2, "step_time_target_s": 1e-6},
            "dp_gradient_error_feedback": "ef", "min_compress_numel": 1024}
    cfg = replace(base, compression=comp)
    whole = run_ranks(_records, 2, cfg)[0]
    assert [c["dp_gradient"] for _, c in whole] == ["none"] * 4 + ["int8/b128"] * 2
    root = str(tmp_path / "ckpt")
    first = run_ranks(_records, 2, replace(cfg, save=root, exit_interval=3))[0]
    second = run_ranks(_records, 2, replace(cfg, load=root, save=root))[0]
    assert first + second == whole

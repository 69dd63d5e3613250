"""megacomp.comm.make_channel: the one factory of traffic-path channels. It picks the class from the setting,
applies the "PowerSGD keeps its own error feedback" rule, and the channels answer the questions their owners ask
(instead of the owners testing their class). No process group is needed to build a channel."""
from __future__ import annotations

import pytest

from megacomp.comm import AccordionChannel, Channel, CommOptions, LowRankChannel, StatsTable, make_channel
from megacomp.compression import make_codec

PSGD = {"name": "powersgd", "rank": 2}
ACC_PSGD = {"name": "accordion", "low": {"name": "powersgd", "rank": 4}, "high": {"name": "powersgd", "rank": 1}}
ACC_CODECS = {"name": "accordion", "low": "int8", "high": "int4"}


@pytest.mark.parametrize("spec", [None, "none", "int4", {"name": "sign", "block_size": 0}, make_codec("bf16")])
def test_value_codecs_give_a_channel(spec):
    ch = make_channel("dp_momentum", spec)
    assert type(ch) is Channel and ch.name == "dp_momentum" and ch.codec == make_codec(spec)
    assert (ch.keeps_own_error_feedback, ch.reduces_whole_buckets, ch.low_rank, ch.adaptive) == (False,) * 4
    assert ch.levels == (ch,) and ch.level_for("k") is ch


def test_powersgd_gives_a_low_rank_channel_that_keeps_its_own_error_feedback():
    ch = make_channel("dp_gradient", PSGD, min_compress_numel=7)
    assert type(ch) is LowRankChannel and ch.codec.rank == 2 and ch.min_compress_numel == 7
    assert ch.error_feedback is not None  # PowerSGD's own (its settings' error_feedback field)
    assert (ch.keeps_own_error_feedback, ch.reduces_whole_buckets, ch.low_rank, ch.adaptive) == (True, True, True, False)
    assert ch.levels == (ch,) and ch.level_for("k") is ch
    with pytest.raises(ValueError, match="'dp_gradient': powersgd2\\+ef keeps its own error feedback.*leave "
                                         "dp_gradient_error_feedback at None"):
        make_channel("dp_gradient", PSGD, error_feedback="loco", error_feedback_arg="dp_gradient_error_feedback")


def test_accordion_gives_an_accordion_channel_with_its_levels():
    ch = make_channel("dp_gradient", ACC_PSGD)
    assert type(ch) is AccordionChannel and isinstance(ch.low, LowRankChannel)
    assert (ch.keeps_own_error_feedback, ch.reduces_whole_buckets, ch.low_rank, ch.adaptive) == (True, True, True, True)
    assert ch.levels == (ch.low, ch.high) and ch.level_for("new key") is ch.low  # a new key starts critical
    with pytest.raises(ValueError, match="keeps its own error feedback"):
        make_channel("dp_gradient", ACC_PSGD, error_feedback="ef")
    codecs = make_channel("dp_gradient", ACC_CODECS, error_feedback="loco")
    assert type(codecs.low) is Channel and codecs.low.error_feedback is codecs.high.error_feedback is not None
    assert (codecs.keeps_own_error_feedback, codecs.reduces_whole_buckets, codecs.low_rank, codecs.adaptive) == \
        (False, True, False, True)


def test_settings_reach_the_channel():
    opts, stats = CommOptions(validate=False, segment_numel=0), StatsTable()
    for spec in (None, "int4", PSGD, ACC_CODECS):
        ch = make_channel("outer", spec, group=None, min_compress_numel=3, options=opts, stats=stats)
        for level in ch.levels:
            assert level.options == opts and level.stats is stats and level.min_compress_numel == 3


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="needs a lossy codec"):
        make_channel("outer", None, error_feedback="ef")
    with pytest.raises(ValueError, match="int5"):
        make_channel("outer", "int5")
    with pytest.raises(TypeError):
        make_channel("outer", 3)

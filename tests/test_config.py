"""megacomp.config.CommCompressionConfig's feature paths (dp_momentum, outer, loqt_merge, loqt_merge_tp, replicas): unset stays
unset through construction and from_dict / to_dict, an explicit 'none' is the identity, keys are validated, and
configs that do not set them are recorded exactly as before; build_channels / channel() use the one factory."""
from __future__ import annotations

import pytest

from megacomp.comm import AccordionChannel, Channel, LowRankChannel
from megacomp.compression import ErrorFeedbackConfig, make_codec
from megacomp.config import ALL_TRAFFIC_PATHS, FEATURE_PATHS, TRAFFIC_PATHS, CommCompressionConfig

NEW_KEYS = set(FEATURE_PATHS) | {"dp_momentum_error_feedback", "outer_error_feedback", "replicas_error_feedback"}


def test_the_path_tuples():
    assert TRAFFIC_PATHS == ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter", "pp_activation",
                             "pp_gradient", "dp_gradient", "dp_parameter")
    assert FEATURE_PATHS == ("dp_momentum", "outer", "loqt_merge", "loqt_merge_tp", "replicas")
    assert ALL_TRAFFIC_PATHS == TRAFFIC_PATHS + FEATURE_PATHS


def test_unset_stays_unset_and_is_not_recorded():
    cfg = CommCompressionConfig()
    assert all(getattr(cfg, k) is None for k in NEW_KEYS)
    assert all(getattr(cfg, p).is_identity for p in TRAFFIC_PATHS)  # the old paths normalise None to the identity
    assert not NEW_KEYS & set(cfg.to_dict())  # records written before these fields existed stay equal
    again = CommCompressionConfig.from_dict(cfg.to_dict())
    assert again == cfg and all(getattr(again, k) is None for k in NEW_KEYS)
    assert not cfg.enabled


@pytest.mark.parametrize("path", FEATURE_PATHS)
def test_explicit_none_is_the_identity_and_round_trips(path):
    cfg = CommCompressionConfig(**{path: "none"})
    assert getattr(cfg, path) == make_codec("none")
    assert cfg.to_dict()[path] == "none"
    assert CommCompressionConfig.from_dict(cfg.to_dict()) == cfg
    assert not cfg.enabled


def test_codecs_and_error_feedback_round_trip():
    cfg = CommCompressionConfig.from_dict({
        "dp_momentum": "{name: sign, block_size: 0}", "dp_momentum_error_feedback": False,
        "outer": {"name": "int2", "k": 64, "chunk": 4096}, "loqt_merge": "bf16", "loqt_merge_tp": "int8",
        "dp_gradient": "{name: int4, block_size: 64}", "dp_gradient_error_feedback": "loco"})
    assert cfg.dp_momentum == make_codec("sign", block_size=0) and cfg.dp_momentum_error_feedback is False
    assert cfg.outer == make_codec("int2", k=64, chunk=4096) and cfg.outer_error_feedback is None
    assert cfg.loqt_merge == make_codec("bf16") and cfg.loqt_merge_tp == make_codec("int8")
    assert cfg.dp_gradient == make_codec("int4", block_size=64) and cfg.enabled
    data = cfg.to_dict()
    assert "outer_error_feedback" not in data and data["dp_momentum_error_feedback"] is False
    again = CommCompressionConfig.from_dict(data)
    assert again == cfg and again.to_dict() == data
    loco = CommCompressionConfig(outer="int4", outer_error_feedback="loco")
    assert loco.outer_error_feedback == ErrorFeedbackConfig(beta=0.8, reset_interval=512)
    assert CommCompressionConfig.from_dict(loco.to_dict()) == loco
    assert CommCompressionConfig(dp_momentum_error_feedback=True).dp_momentum is None  # unset codec: the default's
    seeded = CommCompressionConfig(outer={"name": "int4", "rounding": "stochastic", "seed": 3})
    assert seeded.for_rank(2).outer.seed == 3  # feature paths keep their seeds


def test_unbiased_outer_codecs_and_the_replicas_path_round_trip():
    """LoCoDL's unbiased compressors are set under ``outer`` like any codec; ``replicas`` (torchft's cross-replica
    traffic) is one more feature path with its own error feedback."""
    from megacomp.compression.unbiased import make_unbiased_codec

    cfg = CommCompressionConfig.from_dict({"outer": "{name: randk, k: 64}", "replicas": "int8",
                                           "replicas_error_feedback": "loco"})
    assert cfg.outer == make_unbiased_codec({"name": "randk", "k": 64}) and cfg.enabled
    assert cfg.replicas == make_codec("int8")
    assert cfg.replicas_error_feedback == ErrorFeedbackConfig(beta=0.8, reset_interval=512)
    data = cfg.to_dict()
    assert data["outer"] == {"name": "randk", "k": 64, "chunk": 4096}
    assert CommCompressionConfig.from_dict(data) == cfg
    assert CommCompressionConfig(outer="usq4").outer == make_unbiased_codec("usq4")


@pytest.mark.parametrize("data,match", [
    ({"dp_momentum_codec": "sign"}, "unknown CommCompressionConfig key"),
    ({"outer_error_feedback": "ef"}, "outer_error_feedback needs a lossy outer codec"),
    ({"outer": "none", "outer_error_feedback": "ef"}, "error feedback needs a lossy codec"),
    ({"dp_momentum": "none", "dp_momentum_error_feedback": True}, "dp_momentum is 'none'"),
    ({"dp_momentum_error_feedback": "ef"}, "must be true, false or unset"),
    ({"dp_momentum": {"name": "int4", "k": 8}}, "dp_momentum: codec .* needs a value codec"),
    ({"loqt_merge": "powersgd"}, "powersgd"),
    ({"outer": "{name: int4"}, "not a valid YAML mapping"),
    ({"dp_gradient": "powersgd", "dp_gradient_error_feedback": "ef"}, "leave dp_gradient_error_feedback at None"),
    ({"outer": "usq4", "outer_error_feedback": "ef"}, "unbiased outer codec usq4: LoCoDL's control variates"),
    ({"outer": {"name": "randk", "k": 90, "chunk": 64}}, "k=90 is larger than the chunk of 64"),
    ({"replicas_error_feedback": "ef"}, "replicas_error_feedback needs a lossy replicas codec"),
    ({"replicas": "none", "replicas_error_feedback": "loco"}, "error feedback needs a lossy codec"),
    ({"replicas": "randk"}, "unknown codec 'randk'"),
])
def test_bad_values_raise_naming_the_key(data, match):
    with pytest.raises(ValueError, match=match):
        CommCompressionConfig.from_dict(data)


def test_channels_come_from_the_factory():
    cfg = CommCompressionConfig(dp_gradient={"name": "powersgd", "rank": 2}, min_compress_numel=5)
    channels = cfg.build_channels()
    assert type(channels.dp_gradient) is LowRankChannel and type(channels.tp_forward) is Channel
    acc = CommCompressionConfig(dp_gradient={"name": "accordion", "low": "int8", "high": "int4"},
                                dp_gradient_error_feedback="ef").build_channels().dp_gradient
    assert type(acc) is AccordionChannel and acc.error_feedback is not None
    ch = cfg.channel("dp_momentum", "sign", error_feedback="ef")
    assert type(ch) is Channel and ch.name == "dp_momentum" and ch.min_compress_numel == 5
    assert ch.options == cfg.options() and ch.error_feedback is not None
    with pytest.raises(ValueError, match="unknown traffic path 'dp_moment'"):
        cfg.channel("dp_moment", "sign")
    with pytest.raises(ValueError, match="leave outer_error_feedback at None"):
        cfg.channel("outer", "powersgd", error_feedback="ef")

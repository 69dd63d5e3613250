"""megacomp.compression.parse_codec_arg (the one parser of codec arguments) and make_compressor's rule on error
feedback: every accepted form gives what make_codec accepts; bad input raises one ValueError line."""
from __future__ import annotations

import pytest

from megacomp.compression import (Accordion, PowerSGD, check_own_error_feedback, keeps_own_error_feedback, make_codec,
                                  make_compressor, parse_codec_arg)


@pytest.mark.parametrize("value,expected", [
    (None, None),
    ("int4", "int4"),
    ("  int4 ", "int4"),
    ({"name": "int4", "block_size": 0}, {"name": "int4", "block_size": 0}),
    ("{name: int4, block_size: 0}", {"name": "int4", "block_size": 0}),
    (" {name: int2, k: 64, chunk: 4096}", {"name": "int2", "k": 64, "chunk": 4096}),
])
def test_each_form_parses_to_what_make_codec_accepts(value, expected):
    parsed = parse_codec_arg(value)
    assert parsed == expected
    assert make_codec(parsed) == make_codec(expected)


def test_codecs_and_settings_pass_through_and_mappings_are_copied():
    codec = make_codec("sign", block_size=0)
    assert parse_codec_arg(codec) is codec
    psgd = make_compressor({"name": "powersgd", "rank": 2})
    assert parse_codec_arg(psgd) is psgd
    spec = {"name": "int8"}
    parsed = parse_codec_arg(spec)
    parsed["block_size"] = 0
    assert spec == {"name": "int8"}


@pytest.mark.parametrize("value,match", [
    (5, "codec argument 5 \\(int\\): expected None, a codec name"),
    (["int4"], "codec argument \\['int4'\\] \\(list\\)"),
    ("{name: int4", "is not a valid YAML mapping"),
    ("{name: [int4}", "is not a valid YAML mapping"),
])
def test_bad_input_raises_one_clear_line(value, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_codec_arg(value)
    assert "\n" not in str(info.value)


def test_unknown_names_are_left_to_make_codec():
    with pytest.raises(ValueError, match="int5"):
        make_codec(parse_codec_arg("{name: int5}"))


def test_make_compressor_picks_the_kind_and_the_error_feedback_rule_is_stated_once():
    assert make_compressor(None).is_identity
    assert make_compressor("int4") == make_codec("int4")
    assert isinstance(make_compressor("powersgd"), PowerSGD)
    psgd_levels = make_compressor({"name": "accordion", "low": {"name": "powersgd", "rank": 4},
                                   "high": {"name": "powersgd", "rank": 1}})
    codec_levels = make_compressor({"name": "accordion", "low": "int8", "high": "int4"})
    assert isinstance(psgd_levels, Accordion) and isinstance(codec_levels, Accordion)
    assert keeps_own_error_feedback(make_compressor("powersgd")) and keeps_own_error_feedback(psgd_levels)
    assert not keeps_own_error_feedback(codec_levels) and not keeps_own_error_feedback(make_codec("int4"))
    check_own_error_feedback(codec_levels, "ef", "here")  # codec levels share the error feedback they are given
    check_own_error_feedback(make_compressor("powersgd"), None, "here")
    with pytest.raises(ValueError, match="here: powersgd4\\+ef keeps its own error feedback.*leave my_ef at None"):
        check_own_error_feedback(make_compressor("powersgd"), "ef", "here", "my_ef")

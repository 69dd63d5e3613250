"""One parser for a codec given as an argument: on the command line, in YAML, or in Python.

A flag's value arrives as a string, and a codec with options is then a YAML mapping inside that string
(``--outer-codec "{name: int2, k: 64, chunk: 4096}"``); YAML and Python callers pass the mapping itself.
:func:`parse_codec_arg` turns every accepted form into what ``make_codec`` (and ``make_compressor``, for
PowerSGD / Accordion settings) accepts, without building the codec, so the caller keeps its own
defaults for None and its own checks of the kind of codec.

Failure behaviour: a value of another type, a string that opens a mapping (``{``) but is not valid YAML,
or YAML that is not a mapping, raise ValueError with one line naming the value and the accepted forms.
Unknown names and options are left to ``make_codec``, which names them.
"""
from __future__ import annotations

from typing import Any, Mapping

from .codecs import Codec
from .low_rank import StructuredCompressor

_FORMS = ("None, a codec name (int4), a mapping ({name: int4, block_size: 0}), a string holding such a YAML "
          "mapping, or a Codec")


def parse_codec_arg(value: Any) -> Any:
    """``value`` as ``make_codec`` accepts it:

    - None stays None (the caller's default: identity, or a feature's own codec);
    - a ``Codec`` (or PowerSGD / Accordion settings) is returned as is;
    - a mapping is returned as a plain dict (a copy);
    - a string starting with ``{`` is read as a YAML mapping (``"{name: int4, block_size: 0}"``) into a dict;
    - any other string is a name (surrounding spaces removed).

    Raises:
        ValueError: another type, malformed YAML, or YAML that is not a mapping (one line, see the module
            docstring).
    """
    if value is None or isinstance(value, (Codec, StructuredCompressor)):
        return value
    if isinstance(value, Mapping):
        return dict(value)
    if not isinstance(value, str):
        raise ValueError(f"codec argument {value!r} ({type(value).__name__}): expected {_FORMS}")
    text = value.strip()
    if not text.startswith("{"):
        return text
    import yaml  # only a mapping-in-a-string needs the YAML reader

    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem", None) or type(e).__name__
        raise ValueError(f"codec argument {value!r} is not a valid YAML mapping ({where}); expected {_FORMS}") from None
    if not isinstance(parsed, Mapping):
        raise ValueError(f"codec argument {value!r} is YAML {type(parsed).__name__}, not a mapping; expected {_FORMS}")
    return dict(parsed)

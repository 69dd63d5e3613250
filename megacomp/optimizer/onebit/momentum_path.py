"""The momentum path of the 1-bit optimizers: its default codec, the checks on a codec or a ready channel, the
``dp_momentum`` channel built from settings, and the names of the two scalings (``momentum_scaling``).

The exchange itself runs in megacomp.optimizer.onebit.optimizer (the momentum channel, ``chunk``) or
megacomp.optimizer.onebit.deepspeed_exchange (``deepspeed``). Failure behaviour: ValueError naming the bad codec or
channel and the codecs that work (value codecs: sign, int2, int4, int8, fp8_*, bf16); nothing is built then.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from ...comm import AnyChannel, Channel, CommOptions, make_channel
from ...compression import Codec, make_codec

DEFAULT_MOMENTUM_CODEC = make_codec("sign", block_size=0)
"""1-bit Adam's wire format: signs with one mean-magnitude scale per encoded chunk (DeepSpeed uses the RMS)."""


WARMUP_GRAD_CODECS = ("bf16", "fp16")
"""Gradient codecs the full-precision phase may use: they round every entry to a nearby nonzero value (bf16 keeps
fp32's exponent range), so the variance estimated there keeps every entry's scale."""


def check_momentum_codec(codec: Any, error_feedback: bool, what: str):
    """The momentum codec as a Codec. Raises ValueError for a structured codec, or error feedback with a lossless
    codec (compression off needs ``error_feedback=False``)."""
    c = make_codec(codec)
    if c.structured:
        raise ValueError(f"{what}: momentum_codec {c} selects or transforms entries; the 1-bit family needs a value "
                         f"codec (sign, int2, int4, int8, fp8_*, bf16)")
    if c.is_identity and error_feedback:
        raise ValueError(f"{what}: momentum_codec {c.name!r} is lossless, but its error feedback needs a lossy codec "
                         f"(sign, int2, int4...); for compression off pass momentum_error_feedback=False")
    return c


def resolve_momentum_setting(codec: Any = None, error_feedback: Optional[bool] = None) -> tuple[Codec, bool]:
    """The momentum path's codec and error-feedback switch from settings where None means *not set* (the
    ``dp_momentum`` / ``dp_momentum_error_feedback`` fields of megacomp.config.CommCompressionConfig): codec
    unset -> :data:`DEFAULT_MOMENTUM_CODEC`; error feedback unset -> on for a lossy codec, off for ``none``; an
    explicit True / False wins. (The optimizers' own ``momentum_codec=None`` means ``none``, as it always did.)
    Raises ValueError as :func:`check_momentum_codec`."""
    c = DEFAULT_MOMENTUM_CODEC if codec is None else make_codec(codec)
    ef = (not c.is_identity) if error_feedback is None else bool(error_feedback)
    return check_momentum_codec(c, ef, "dp_momentum"), ef


def build_momentum_channel(codec: Any, error_feedback: bool, group, min_compress_numel: int, what: str) -> Channel:
    """The ``dp_momentum`` channel of a 1-bit optimizer (megacomp.comm.make_channel; classic error feedback when
    ``error_feedback``); raises as :func:`check_momentum_codec`."""
    c = check_momentum_codec(codec, error_feedback, what)
    return make_channel("dp_momentum", c, group=group, error_feedback="ef" if error_feedback else None,
                        min_compress_numel=min_compress_numel, error_feedback_arg="momentum_error_feedback",
                        options=CommOptions.from_env(two_rank_server=True))


def check_momentum_channel(channel: AnyChannel, what: str) -> AnyChannel:
    """A momentum channel handed in: it must carry a value codec (the exchange all-reduces whole momentum buckets
    element by element). Raises ValueError for PowerSGD / Accordion channels and as :func:`check_momentum_codec`."""
    if channel.reduces_whole_buckets:
        raise ValueError(f"{what}: momentum_channel {channel!r} compresses by structure (PowerSGD / Accordion); the "
                         f"1-bit family needs a value codec (sign, int2, int4, int8, fp8_*, bf16)")
    check_momentum_codec(channel.codec, channel.error_feedback is not None, what)
    if isinstance(getattr(channel, "options", None), CommOptions):  # two quantizations at DP 2 too (DeepSpeed)
        channel.options = replace(channel.options, two_rank_server=True)
    return channel


MOMENTUM_SCALINGS = ("chunk", "deepspeed")
"""``momentum_scaling``: ``chunk`` (the momentum channel: its codec's scale per bucket x segment x destination
chunk) or ``deepspeed`` (megacomp.optimizer.onebit.deepspeed_exchange: DeepSpeed's compressed all-reduce exactly)."""

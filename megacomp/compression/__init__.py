"""Codecs (scaling, rounding, packing) and error-feedback math. Knows nothing of torch.distributed."""
from .codecs import Codec, CodecLike, Packet, make_codec
from .error_feedback import (ErrorFeedback, ErrorFeedbackConfig, as_error_feedback, check_error_feedback_codec,
                             make_error_feedback_config)
from .accordion import Accordion, is_accordion, make_accordion
from .low_rank import PowerSGD, is_low_rank, make_compressor, make_low_rank
from .formats import FORMATS, Format, register_format
from .metrics import relative_error, underflow_fraction

CODEC_NAMES = tuple(FORMATS)

__all__ = [
    "Accordion", "CODEC_NAMES", "Codec", "CodecLike", "ErrorFeedback", "ErrorFeedbackConfig", "FORMATS", "Format", "Packet", "PowerSGD",
    "as_error_feedback", "is_accordion", "make_accordion", "check_error_feedback_codec", "is_low_rank", "make_compressor", "make_low_rank", "make_codec", "make_error_feedback_config", "register_format",
    "relative_error", "underflow_fraction",
]

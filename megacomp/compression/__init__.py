"""Codecs (scaling, rounding, packing) and error-feedback math. Knows nothing of torch.distributed."""
from .codecs import Codec, CodecLike, Packet, make_codec
from .error_feedback import (ErrorFeedback, ErrorFeedbackConfig, as_error_feedback, check_error_feedback_codec,
                             make_error_feedback_config)
from .accordion import Accordion, is_accordion, make_accordion
from .low_rank import PowerSGD, is_low_rank, make_low_rank
from .learned import LGCPCA, is_learned, make_learned
from .lgc import LGC
from .compressor import Compressor, check_own_error_feedback, keeps_own_error_feedback, make_compressor
from .codec_arg import parse_codec_arg
from .formats import FORMATS, Format, register_format
from .error_metrics import relative_error, underflow_fraction

CODEC_NAMES = tuple(FORMATS)

__all__ = [
    "Accordion", "CODEC_NAMES", "LGC", "LGCPCA", "is_learned", "make_learned", "Codec", "CodecLike", "Compressor", "ErrorFeedback", "ErrorFeedbackConfig", "FORMATS", "Format", "Packet", "PowerSGD",
    "as_error_feedback", "check_own_error_feedback", "is_accordion", "keeps_own_error_feedback", "make_accordion", "check_error_feedback_codec", "is_low_rank", "make_compressor", "make_low_rank", "make_codec", "make_error_feedback_config", "parse_codec_arg", "register_format",
    "relative_error", "underflow_fraction",
]

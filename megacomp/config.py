"""Configuration dataclasses: model parallelism and communication compression per traffic path.

Both load from plain dicts / YAML (unknown keys raise, naming the allowed ones) and write back with
``to_dict()`` so a checkpoint can record exactly what ran.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Optional

import torch

from .compression import Codec, CodecLike, make_codec
from .compression.error_feedback import ErrorFeedbackConfig, make_error_feedback_config

log = logging.getLogger("megacomp")

TRAFFIC_PATHS = ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter",
                 "pp_activation", "pp_gradient", "dp_gradient", "dp_parameter")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _check_keys(cls, data: Mapping[str, Any]) -> None:
    allowed = {f.name for f in fields(cls) if f.init}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s) {sorted(unknown)}; allowed keys: {sorted(allowed)}")


@dataclass
class CommCompressionConfig:
    """A codec per traffic path (None = uncompressed), error feedback, and the small-tensor policy."""

    tp_forward: Optional[CodecLike] = None
    """Forward all-reduce of tensor-parallel partial outputs (RowParallelLinear, VocabParallelEmbedding) and
    the all-gather of ColumnParallelLinear(gather_output=True)."""
    tp_backward: Optional[CodecLike] = None
    """Every tensor-parallel collective of the backward pass: the all-reduce of ColumnParallelLinear's input
    gradient, and under sequence parallelism the gradient reduce-scatter / all-gather."""
    sp_all_gather: Optional[CodecLike] = None
    """Forward all-gather of sequence-parallel activations (ColumnParallelLinear input)."""
    sp_reduce_scatter: Optional[CodecLike] = None
    """Forward reduce-scatter of sequence-parallel partial outputs (RowParallelLinear output)."""
    pp_activation: Optional[CodecLike] = None
    """Activations sent forward between pipeline stages."""
    pp_gradient: Optional[CodecLike] = None
    """Activation gradients sent backward between pipeline stages."""
    dp_gradient: Optional[CodecLike] = None
    """Data-parallel gradient reduce-scatter / all-reduce."""
    dp_parameter: Optional[CodecLike] = None
    """Data-parallel parameter all-gather after the sharded optimizer step."""
    tp_backward_error_feedback: Optional[Any] = None
    """Error feedback ('ef', 'loco' or a mapping) on the tp_backward collectives, one state per layer.
    Sound only when a layer sees the same activation shape every step (it carries one step's
    quantization residual into the next step's gradient, as Optimus-CC does for pipeline gradients).
    Forward activations never use error feedback: the residual would corrupt the next batch's values."""
    pp_gradient_error_feedback: Optional[Any] = None
    """Error feedback on pipeline gradient sends, keyed by stage boundary and micro-batch slot."""
    dp_gradient_error_feedback: Optional[Any] = None
    """Error feedback on data-parallel gradients ('loco' recommended with int4)."""
    dp_gradient_warmup_steps: int = 0
    """Optimizer steps whose data-parallel gradients travel uncompressed before dp_gradient starts
    (1-bit Adam's full-precision warm-up; pair it with adam_freeze_variance_step)."""
    min_compress_numel: int = 65536
    """Tensors with fewer elements travel uncompressed (logged once per path): below this size the
    codec's cost and the per-message latency outweigh the bytes saved."""

    def __post_init__(self) -> None:
        for name in TRAFFIC_PATHS:
            value = getattr(self, name)
            if value is not None:
                codec = make_codec(value)
                setattr(self, name, None if codec.is_identity else codec)
        for name in ("tp_backward_error_feedback", "pp_gradient_error_feedback", "dp_gradient_error_feedback"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, make_error_feedback_config(value))
        if not isinstance(self.dp_gradient_warmup_steps, int) or self.dp_gradient_warmup_steps < 0:
            raise ValueError(f"dp_gradient_warmup_steps must be an int >= 0, got {self.dp_gradient_warmup_steps!r}")
        if self.min_compress_numel < 0:
            raise ValueError(f"min_compress_numel must be >= 0, got {self.min_compress_numel}")
        for ef_name, path in [("tp_backward_error_feedback", "tp_backward"), ("pp_gradient_error_feedback", "pp_gradient"),
                              ("dp_gradient_error_feedback", "dp_gradient")]:
            if getattr(self, ef_name) is not None and getattr(self, path) is None:
                raise ValueError(f"{ef_name} is set but {path} has no codec: error feedback needs a lossy codec "
                                 f"on that path (e.g. {path}: int4)")
        self._logged: set[str] = set()

    def codec_for(self, path: str, numel: int) -> Codec:
        """The codec ``path`` uses for a tensor of ``numel`` elements: ``none`` when the path is uncompressed
        or the tensor is below ``min_compress_numel`` (said once per path in the log)."""
        if path not in TRAFFIC_PATHS:
            raise ValueError(f"unknown traffic path {path!r}; paths: {TRAFFIC_PATHS}")
        codec = getattr(self, path)
        if codec is None:
            return make_codec("none")
        if numel < self.min_compress_numel:
            if path not in self._logged:
                self._logged.add(path)
                log.info("megacomp: %s tensors of %d elements (< min_compress_numel=%d) are sent uncompressed",
                         path, numel, self.min_compress_numel)
            return make_codec("none")
        return codec

    def for_rank(self, rank: int) -> "CommCompressionConfig":
        """This config with every seeded codec's seed offset by ``rank`` (seed + rank * 1000003): a YAML seed
        is the same on every rank, and equal seeds give every rank the same stochastic-rounding draws, so
        the ranks' rounding errors would add up coherently instead of averaging out. Rank 0 keeps the seed;
        unseeded codecs are unchanged. Checkpoints record the config before this step."""
        out = replace(self)
        for name in TRAFFIC_PATHS:
            codec = getattr(self, name)
            if codec is not None and codec.seed is not None:
                setattr(out, name, make_codec(codec, seed=codec.seed + rank * 1000003))
        return out

    @property
    def enabled(self) -> bool:
        return any(getattr(self, p) is not None for p in TRAFFIC_PATHS)

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "CommCompressionConfig":
        data = dict(data or {})
        _check_keys(cls, data)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Codec):
                value = value.to_dict()
            elif isinstance(value, ErrorFeedbackConfig):
                value = {k: getattr(value, k) for k in ("beta", "reset_interval", "storage", "storage_block_size")}
            out[f.name] = value
        return out


@dataclass
class ModelParallelConfig:
    """Parallel layout and numerics shared by the parallel layers (mirrors Megatron-core's config)."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each layer's weights."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages."""
    sequence_parallel: bool = False
    """Split activations outside the tensor-parallel regions along the sequence (first) dimension;
    replaces the TP all-reduces with all-gather + reduce-scatter."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of the layers' parameters."""
    compression: CommCompressionConfig = field(default_factory=CommCompressionConfig)
    """Codec per traffic path."""
    process_groups: Optional[Any] = None
    """A megacomp.parallel_state.ProcessGroups to use; None = the parallel_state façade's default."""
    perform_initialization: bool = True
    """Initialise weights with init_method (False leaves them uninitialised, e.g. before loading)."""

    def __post_init__(self) -> None:
        if isinstance(self.params_dtype, str):
            if self.params_dtype not in _DTYPES:
                raise ValueError(f"params_dtype {self.params_dtype!r} is not one of {sorted(_DTYPES)}")
            self.params_dtype = _DTYPES[self.params_dtype]
        if isinstance(self.compression, Mapping):
            self.compression = CommCompressionConfig.from_dict(self.compression)
        if self.tensor_model_parallel_size < 1 or self.pipeline_model_parallel_size < 1:
            raise ValueError("tensor_model_parallel_size and pipeline_model_parallel_size must be >= 1")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelParallelConfig":
        data = dict(data)
        _check_keys(cls, data)
        return cls(**data)

    def tp_group(self, tp_group=None):
        """The TP group a layer uses: the explicit one, else this config's groups, else the façade's.
        Raises if its size differs from ``tensor_model_parallel_size``."""
        if tp_group is None:
            if self.process_groups is not None:
                tp_group = self.process_groups.tp
            else:
                from . import parallel_state

                tp_group = parallel_state.get_tensor_model_parallel_group()
        import torch.distributed as dist

        size = dist.get_world_size(tp_group)
        if size != self.tensor_model_parallel_size:
            raise ValueError(f"the tensor-parallel group has {size} ranks but config.tensor_model_parallel_size is "
                             f"{self.tensor_model_parallel_size}; make them agree")
        return tp_group


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML file into a dict (empty file -> {})."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data

"""Error feedback: classic EF and LoCo's moving-average compensation, as checkpointable state.

Per compressed tensor (identified by a string key), with gradient ``g`` and codec ``Q``:

    h  = g + e                             # compensate               (compensate)
    q  = Q(h)                              # what goes on the wire    (caller)
    e' = beta * e + (1 - beta) * (h - deq(q))                         (update)
    e' = 0 every ``reset_interval`` updates of that key               (LoCo's periodic reset)

``beta = 0`` is classic error feedback (e' = h - deq(q)), and then the transmitted values telescope:
``sum_t deq(q_t) + e_T = sum_t g_t``. With ``beta > 0`` the error is a moving average (LoCo), which
is more stable with low-bit codecs. ``storage='int8'`` keeps ``e`` int8-quantized with per-block
scales (LoCo's compact 8-bit error); this adds the int8 rounding error to ``e`` at each store.

Counting: each update advances its key's count (the periodic reset's clock). Inside
:meth:`ErrorFeedback.deferred_count` updates do not; :meth:`ErrorFeedback.count_deferred` then advances each key
updated there once, so several messages of one optimizer step (ZeRO-2 reduce-scatters a bucket once per
micro-batch) count as one step and the reset keeps its period in steps.

Failure behaviour: a non-finite ``h - deq(q)`` (overflow in the gradient) drops that key's error
(``e = 0``) instead of poisoning later steps, and counts it in ``dropped``. On CUDA the decision stays on the
device (the "all finite" flag is never read back during a step: no host synchronisation); its count reaches
``dropped`` when that is read. A shape change for an
existing key raises ValueError. ``rescale(factor)`` adjusts all errors when a dynamic loss scale
changes.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import torch

from .codecs import Codec, make_codec

STORAGES = ("fp32", "bf16", "int8")


@dataclass(frozen=True)
class ErrorFeedbackConfig:
    """Settings of one error-feedback state."""

    beta: float = 0.0
    """Moving-average coefficient: 0 = classic EF; LoCo uses 0.8 (0.8-0.95 work)."""
    reset_interval: int = 0
    """Zero the error every this many updates of a key (LoCo: 512); 0 = never."""
    storage: str = "fp32"
    """How ``e`` is kept: fp32, bf16 or int8 (per-block absmax, block ``storage_block_size``)."""
    storage_block_size: int = 256
    """Block size of the int8 storage scales."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"error feedback beta must be in [0, 1), got {self.beta}")
        if not isinstance(self.reset_interval, int) or self.reset_interval < 0:
            raise ValueError(f"reset_interval must be an int >= 0 (0 = never), got {self.reset_interval!r}")
        if self.storage not in STORAGES:
            raise ValueError(f"error feedback storage must be one of {STORAGES}, got {self.storage!r}")
        if self.storage_block_size <= 0:
            raise ValueError(f"storage_block_size must be > 0, got {self.storage_block_size}")


PRESETS = {
    "ef": ErrorFeedbackConfig(beta=0.0, reset_interval=0),
    "loco": ErrorFeedbackConfig(beta=0.8, reset_interval=512),
}

ErrorFeedbackLike = Union[None, str, dict, ErrorFeedbackConfig, "ErrorFeedback"]


def make_error_feedback_config(spec: Union[str, dict, ErrorFeedbackConfig]) -> ErrorFeedbackConfig:
    """``"ef"``, ``"loco"``, a mapping of config fields (may include ``preset``), or a config."""
    if isinstance(spec, ErrorFeedbackConfig):
        return spec
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown error feedback {spec!r}; use one of {sorted(PRESETS)} or an ErrorFeedbackConfig")
        return PRESETS[spec]
    if isinstance(spec, dict):
        spec = dict(spec)
        base = asdict(PRESETS[spec.pop("preset")]) if "preset" in spec else {}
        base.update(spec)
        return ErrorFeedbackConfig(**base)
    raise TypeError(f"error_feedback must be 'ef', 'loco', a dict or an ErrorFeedbackConfig, got {type(spec).__name__}")


class ErrorFeedback:
    """Error-feedback state for any number of compressed tensors, keyed by name.

    Usage per step and key: ``h = ef.compensate(key, g)``; send ``Q(h)``; ``ef.update(key, h, deq(Q(h)))``.
    """

    def __init__(self, config: Union[str, dict, ErrorFeedbackConfig] = "ef") -> None:
        self.config = make_error_feedback_config(config)
        self._errors: dict[str, Any] = {}  # key -> tensor (fp32/bf16) or (packet data, shape) for int8
        self.steps: dict[str, int] = {}
        self._dropped: dict[str, int] = {}
        self._dropped_on_device: dict[str, torch.Tensor] = {}  # key -> int64 count from device flags, not yet read
        self._deferring = 0  # depth of deferred_count() blocks
        self._deferred: dict[str, None] = {}  # keys updated inside them, in order, not yet counted
        self._store_codec: Optional[Codec] = (
            make_codec("int8", block_size=self.config.storage_block_size) if self.config.storage == "int8" else None)

    # -- access ----------------------------------------------------------------------------------
    @property
    def dropped(self) -> dict[str, int]:
        """Per key, how many updates were dropped for a non-finite residual (or a failed call). Reading it brings
        the counts kept on a GPU home (a host synchronisation: read it when logging or saving, not mid-step)."""
        if self._dropped_on_device:
            for key, count in self._dropped_on_device.items():
                n = int(count)  # host sync: reading the drop counts (logging / checkpointing, never mid-step)
                if n:
                    self._dropped[key] = self._dropped.get(key, 0) + n
            self._dropped_on_device.clear()
        return self._dropped

    @dropped.setter
    def dropped(self, value: dict[str, int]) -> None:
        """Replace the drop counts (a checkpoint's), forgetting those still on the device."""
        self._dropped = dict(value)
        self._dropped_on_device = {}

    def keys(self):
        """The keys (tensors) that hold an error."""
        return self._errors.keys()

    def error(self, key: str, like: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """The current error of ``key`` (decoded to fp32/fp64 like ``like``), or None if there is none. With
        fp32 storage this is the stored tensor itself, which the collectives' next step overwrites in place
        (megacomp.compression.ef_encoder): clone it to keep a snapshot; ``state_dict`` does."""
        stored = self._errors.get(key)
        if stored is None:
            return None
        if self._store_codec is not None:
            data, shape = stored
            e = self._store_codec.decode_flat(data, data_numel(shape)).view(shape)
        else:
            e = stored if stored.dtype in (torch.float32, torch.float64) else stored.float()
        return e.to(device=like.device, dtype=like.dtype) if like is not None else e  # (a template loaded on CPU)

    def _store(self, key: str, e: torch.Tensor) -> None:
        if self._store_codec is not None:
            self._errors[key] = (self._store_codec.encode_flat(e), tuple(e.shape))
        elif self.config.storage == "bf16":
            self._errors[key] = e.to(torch.bfloat16)
        else:
            self._errors[key] = e.to(torch.float32) if e.dtype != torch.float64 else e.clone()

    # -- the algorithm ---------------------------------------------------------------------------
    def compensate(self, key: str, g: torch.Tensor) -> torch.Tensor:
        """Return ``h = g + e`` (a new tensor in g's dtype, or fp32 for half inputs)."""
        e = self.error(key)
        work_dtype = g.dtype if g.dtype == torch.float64 else torch.float32
        h = g.to(work_dtype).clone() if e is None else g.to(work_dtype) + self.check_shape(key, e, g).to(g.device, work_dtype)
        return h

    def check_shape(self, key: str, e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``e`` when it has ``g``'s shape; raises ValueError naming ``key`` otherwise (one key per tensor)."""
        if e.shape != g.shape:
            raise ValueError(f"error feedback key {key!r} holds an error of shape {tuple(e.shape)} but got a tensor "
                             f"of shape {tuple(g.shape)}; use a distinct key (tag) per compressed tensor")
        return e

    def update(self, key: str, h: torch.Tensor, h_hat: torch.Tensor) -> None:
        """``e = beta * e + (1 - beta) * (h - h_hat)``, then the periodic reset."""
        beta = self.config.beta
        residual = h - h_hat
        finite = all_finite(residual)
        if finite is False:
            self.commit(key, torch.zeros_like(residual), finite=False)
            return
        e = self.error(key, like=residual)
        new = blend_error(None if e is None else self.check_shape(key, e, residual), residual, beta)
        self.commit(key, drop_nonfinite(new, finite), finite=finite)

    def update_encoded(self, key: str, h: torch.Tensor, codec, bufs, sizes) -> None:
        """:meth:`update` from the encoded chunks of ``h`` (``bufs[i]`` holds ``sizes[i]`` consecutive elements):
        one fused pass per chunk where a kernel covers the codec (same bits as the reference), else
        decode and :meth:`update`."""
        from .quantize import ef_update_scaled

        fmt = codec.format
        e = self.error(key)
        if uses_fused_update(self.config, codec, h.dtype) and (e is None or e.shape == h.shape):
            new, finite, off = torch.empty_like(h), True, 0
            for buf, s in zip(bufs, sizes):
                ok = ef_update_scaled(buf, h[off:off + s], None if e is None else e[off:off + s], new[off:off + s],
                                      fmt, codec.block_size, codec.dual_scale, self.config.beta)
                if ok is None:
                    break
                finite &= ok
                off += s
            else:
                self.commit(key, drop_nonfinite(new, finite), finite=finite)
                return
        parts = [codec.decode_flat(b, s, h.dtype) for b, s in zip(bufs, sizes)]
        h_hat = torch.cat(parts) if parts else h.new_empty(0)
        self.update(key, h, h_hat)

    def commit(self, key: str, new: torch.Tensor, finite: Union[bool, torch.Tensor] = True) -> None:
        """Store the new error (counting a non-finite drop), advance the step, apply the periodic reset (inside
        :meth:`deferred_count`: store only, and remember the key for :meth:`count_deferred`). ``finite``: a bool,
        or a 0-dim bool tensor on the device (the caller already zeroed ``new`` with :func:`drop_nonfinite`); the
        latter is counted on the device, so that committing never waits for the GPU."""
        if torch.is_tensor(finite):
            count = self._dropped_on_device.get(key)
            if count is None:
                count = self._dropped_on_device[key] = torch.zeros((), dtype=torch.int64, device=finite.device)
            count.add_(finite.logical_not().reshape(()))
        elif not finite:
            self._dropped[key] = self._dropped.get(key, 0) + 1
        if self._deferring:
            self._deferred[key] = None
            self._store(key, new)
            return
        step = self.steps.get(key, 0) + 1
        self.steps[key] = step
        if self.config.reset_interval and step % self.config.reset_interval == 0:
            new = torch.zeros_like(new)
        self._store(key, new)

    @contextlib.contextmanager
    def deferred_count(self):
        """Updates inside store their error but neither advance their key's count nor apply the periodic reset;
        :meth:`count_deferred` does both, once per key, after the last of them (nested blocks are one block)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1

    def count_deferred(self) -> None:
        """Advance the count of every key updated inside :meth:`deferred_count` since the last call by one, and
        zero its error where that count reaches a multiple of ``reset_interval``: the same count and reset that one
        update per key would have given."""
        for key in self._deferred:
            step = self.steps.get(key, 0) + 1
            self.steps[key] = step
            if self.config.reset_interval and step % self.config.reset_interval == 0 and key in self._errors:
                self._store(key, torch.zeros_like(self.error(key)))
        self._deferred.clear()

    def init_key(self, key: str, shape, dtype: torch.dtype = torch.float32) -> None:
        """Create a zero error for ``key`` if it has none (same behaviour as no error; gives checkpoint
        templates, e.g. for torch.distributed.checkpoint.load, an entry to fill)."""
        if key not in self._errors:
            self._store(key, torch.zeros(shape, dtype=dtype))
            self.steps.setdefault(key, 0)

    def rescale(self, factor: float) -> None:
        """Multiply every stored error by ``factor`` (call when a dynamic loss scale changes)."""
        for key in list(self._errors):
            self._store(key, self.error(key) * factor)

    def reset(self, key: Optional[str] = None) -> None:
        """Zero the error of ``key`` (or of all keys), e.g. after an overflow step is skipped."""
        for k in ([key] if key is not None else list(self._errors)):
            self._errors.pop(k, None)

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Config, errors (cloned), per-key step counts and non-finite drops: plain tensors and data."""
        errors = {}
        for k, v in self._errors.items():
            errors[k] = {"data": v[0].clone(), "shape": list(v[1])} if self._store_codec is not None else v.clone()
        return {"config": asdict(self.config), "errors": errors, "steps": dict(self.steps), "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Raises ValueError when it was saved with another ErrorFeedbackConfig."""
        cfg = ErrorFeedbackConfig(**state["config"])
        if cfg != self.config:
            raise ValueError(f"error feedback state was saved with {cfg}, this state uses {self.config}; "
                             f"build the ErrorFeedback with the saved config to load it")
        self._errors = {}
        for k, v in state["errors"].items():
            self._errors[k] = (v["data"].clone(), tuple(v["shape"])) if self._store_codec is not None else v.clone()
        self.steps = dict(state["steps"])
        self.dropped = dict(state.get("dropped", {}))


def all_finite(t: torch.Tensor) -> Union[bool, torch.Tensor]:
    """Whether every element of ``t`` is finite: a bool for a CPU tensor, else a 0-dim bool tensor on ``t``'s device
    (not read back: on a GPU that would stop the host until the stream drains)."""
    flag = torch.isfinite(t).all()
    return bool(flag) if t.device.type == "cpu" else flag  # host sync: none (CPU tensors only: no device to wait for)


def drop_nonfinite(new: torch.Tensor, finite: Union[bool, torch.Tensor]) -> torch.Tensor:
    """``new`` when ``finite``, else zeros (error feedback drops a non-finite error). ``finite`` a bool: decided
    here (a fresh zero tensor). A 0-dim bool tensor: decided on the device, ``new`` zeroed in place when it is False:
    the Triton kernel for contiguous fp32 CUDA tensors costs a launch, not a pass, when the flag is True (the usual
    case); otherwise ``masked_fill_`` (one pass)."""
    if not torch.is_tensor(finite):
        return new if finite else torch.zeros_like(new)
    if new.is_cuda and new.dtype == torch.float32 and new.is_contiguous():
        from ..kernels import triton_failed, triton_kernels

        k = triton_kernels()
        if k is not None:
            try:
                k.zero_unless(new, finite)
                return new
            except Exception as ex:  # a compile or launch failure: the eager path below, once logged
                triton_failed(ex)
    return new.masked_fill_(finite.logical_not().reshape(()), 0.0)


def blend_error(e: Optional[torch.Tensor], residual: torch.Tensor, beta: float) -> torch.Tensor:
    """The new error from the residual ``h - deq(q)``: the reference expressions of :meth:`ErrorFeedback.update`
    (element-wise, so applying it chunk by chunk gives the same bits)."""
    if e is None or beta == 0.0:
        return residual if beta == 0.0 else (1.0 - beta) * residual
    return beta * e + (1.0 - beta) * residual


def data_numel(shape) -> int:
    """Elements of a tensor of ``shape`` (1 for ``()``)."""
    n = 1
    for s in shape:
        n *= s
    return n


def as_error_feedback(spec: ErrorFeedbackLike) -> Optional[ErrorFeedback]:
    """None stays None; an ErrorFeedback is used as is; anything else builds a new state.

    Raises:
        ValueError / TypeError: as :func:`make_error_feedback_config` for a bad spec."""
    if spec is None or isinstance(spec, ErrorFeedback):
        return spec
    return ErrorFeedback(spec)


def check_error_feedback_codec(codec: Codec, error_feedback: Any, where: str) -> None:
    """The one place that enforces "error feedback needs a lossy codec" (config, channels, optimizer, hook).

    Raises:
        ValueError: ``error_feedback`` is set but ``codec`` is the identity (nothing would ever be fed back),
            naming ``where`` and the two ways out."""
    if error_feedback is not None and codec.is_identity:
        raise ValueError(f"{where}: error feedback needs a lossy codec (the codec is {codec.name!r}); set a codec "
                         f"such as int4 on that path, or drop the error feedback")


def uses_fused_update(config: ErrorFeedbackConfig, codec: Codec, dtype: torch.dtype) -> bool:
    """Kernel eligibility of the error-feedback update, decided once for the collectives' chunk encoders
    and :meth:`ErrorFeedback.update_encoded`: fp32 error storage, an int or fp8 codec without Hadamard
    rotation or structure (top-k, DCT), fp32 values. Then the update runs per chunk from the encoded bytes (C++/Triton kernels or
    their reference), in the same bits as :meth:`ErrorFeedback.update`; otherwise the decode-and-update
    reference runs."""
    return (config.storage == "fp32" and codec.format.kind in ("int", "float8") and not codec.hadamard
            and not codec.structured and dtype == torch.float32)

"""Compress megatron-core's tensor-parallel and data-parallel traffic without forking it.

    from megacomp.integrations.megatron import MegatronCompression
    comp = MegatronCompression({"tp_forward": "int8", "tp_backward": "int8", "sp_all_gather": "int8",
                                "dp_gradient": "int4", "dp_gradient_error_feedback": "loco", "dp_parameter": "int8"})
    comp.register(ddp_model)             # optional: error-feedback keys from parameter names
    with comp:                           # or comp.install() ... comp.uninstall()
        loss = ddp_model(tokens).sum(); loss.backward(); ddp_model.finish_grad_sync(); optimizer.step()

Supported: megatron-core 0.16.x (Python 3.11) and 0.19.x (Python 3.12), the releases CI tests (0.16.1 and
0.19.2); other releases are refused with that list (SUPPORTED_MEGATRON).

What it replaces (every binding of each name in the loaded ``megatron.*`` modules, so a module that did
``from .mappings import gather_from_sequence_parallel_region`` sees the replacement too; modules imported
while installed bind the replacement; ``uninstall`` puts the originals back everywhere):

| megatron-core function                          | forward path       | backward path                |
|-------------------------------------------------|--------------------|------------------------------|
| ``copy_to_tensor_model_parallel_region``        | -                  | tp_backward (all-reduce)     |
| ``reduce_from_tensor_model_parallel_region``    | tp_forward         | -                            |
| ``scatter_to_tensor_model_parallel_region``     | -                  | tp_backward (all-gather)     |
| ``gather_from_tensor_model_parallel_region``    | tp_forward         | -                            |
| ``scatter_to_sequence_parallel_region``         | -                  | tp_backward (all-gather)     |
| ``gather_from_sequence_parallel_region``        | sp_all_gather      | tp_backward (reduce-scatter) |
| ``reduce_scatter_to_sequence_parallel_region``  | sp_reduce_scatter  | tp_backward (all-gather)     |
| ``linear_with_grad_accumulation_and_async_allreduce``, ``linear_with_frozen_weight`` | sp_all_gather | tp_backward (dgrad all-reduce / reduce-scatter, error feedback per weight) |

The mapping functions run megacomp's (megacomp.tensor_parallel.mappings); the linear functions are in
megacomp.integrations.megatron_linear. megatron-core's own DistributedDataParallel and DistributedOptimizer
(gradient reduce-scatter / all-reduce per bucket on ``dp_gradient`` with error feedback per bucket, parameter
all-gather on ``dp_parameter``) are in megacomp.integrations.megatron_ddp; megatron_ddp_cpu runs them on a
CPU-only torch. Each collective is counted under its path in ``comm.stats()``.
With every path uncompressed the results equal unpatched megatron-core bit for bit (the same
torch.distributed calls on the same tensors; tested at TP 2 and 4); with a lossy codec each collective
stays within its codec's bound (megacomp.comm.collectives).

Error feedback (``tp_backward_error_feedback``) applies to the input-gradient collective of each linear
layer, keyed per weight: by parameter name after :meth:`register`, else ``megatron_linear/<n>`` in the order
weights first run forward (the same on every rank and every run of one model). The mapping functions'
backward collectives carry no per-call identity, so they travel with the codec and no error feedback.

Not covered (say so rather than guess): Transformer Engine layers (TE runs its own collectives), the MoE all-to-all and the vocab-parallel cross entropy's
small all-reduces (uncompressed). Uneven sequence splits (``output_split_sizes`` / ``input_split_sizes``),
``gradient_accumulation_fusion``, Megatron-FSDP parameters and 0.19's GTP-sharded weights (``gtp_remat_size``
> 1) run megatron-core's own code when their path is uncompressed and raise ValueError when it is lossy; so do
the data-parallel cases megatron_ddp lists.

Failure behaviour: an unsupported megatron-core version or a changed function signature raise
RuntimeError naming the supported version; installing while another MegatronCompression is installed
raises RuntimeError; lossy codecs on paths this integration does not carry (pp_*) and dp_gradient compressors
that are not element-wise codecs (PowerSGD, Accordion) or with a warm-up raise ValueError.
"""
from __future__ import annotations

import inspect
import sys
import weakref
from typing import Any, Mapping, Optional, Union

import torch.distributed as dist

from ..compression import Codec
from ..config import TRAFFIC_PATHS, Channels, CommCompressionConfig
from ..tensor_parallel import mappings as mc
from . import megatron_ddp
from .megatron_linear import CompressedFrozenLinear, CompressedLinear

SUPPORTED_MEGATRON = ((0, 16), (0, 19))
"""The megatron-core releases (major, minor) this integration is written and tested for: CI runs 0.16.1 on
Python 3.11 and 0.19.2 on Python 3.12 (scripts/ci_py312.sh)."""

_TP_PATHS = ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter")
_DP_PATHS = ("dp_gradient", "dp_parameter")
_PATHS = _TP_PATHS + _DP_PATHS
_MAPPINGS = (  # (name, the parameter names megatron-core 0.16 gives it), checked at install
    ("copy_to_tensor_model_parallel_region", ("input_", "group")),
    ("reduce_from_tensor_model_parallel_region", ("input_", "group")),
    ("scatter_to_tensor_model_parallel_region", ("input_", "group")),
    ("gather_from_tensor_model_parallel_region", ("input_", "group")),
    ("scatter_to_sequence_parallel_region", ("input_", "group")),
    ("gather_from_sequence_parallel_region", ("input_", "tensor_parallel_output_grad", "group",
                                              "output_split_sizes", "use_global_buffer")),
    ("reduce_scatter_to_sequence_parallel_region", ("input_", "group", "input_split_sizes", "use_global_buffer")),
)
_LINEARS = (  # (name, its parameter names in each supported release: 0.16, 0.19)
    ("linear_with_grad_accumulation_and_async_allreduce", (
        ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
         "grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce", "tp_group"),
        ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
         "grad_output_buffer", "wgrad_deferral_limit", "tp_group", "gtp_remat_size"))),
    ("linear_with_frozen_weight", (
        ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
         "tp_group", "grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce"),
        ("input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
         "tp_group", "grad_output_buffer", "wgrad_deferral_limit", "gtp_remat_size"))),
)
_MARK = "_megacomp_installed"  # set on megatron.core.tensor_parallel.mappings while installed


def check_megatron_version() -> str:
    """The installed megatron-core version; RuntimeError when it is missing or not a SUPPORTED_MEGATRON release."""
    try:
        import megatron.core as mcore
    except ImportError as e:
        raise RuntimeError("megacomp.integrations.megatron needs megatron-core: pip install megatron-core==0.16.1 "
                           "--no-deps (its only runtime requirements are torch, numpy and packaging)") from e
    version = str(getattr(mcore, "__version__", "unknown"))
    try:
        ok = tuple(int(p) for p in version.split(".")[:2]) in SUPPORTED_MEGATRON
    except ValueError:
        ok = False
    if not ok:
        want = ", ".join(".".join(map(str, v)) + ".x" for v in SUPPORTED_MEGATRON)
        raise RuntimeError(f"megatron-core {version} is not supported by megacomp.integrations.megatron (supported: "
                           f"{want}; CI tests 0.16.1 on Python 3.11 and 0.19.2 on Python 3.12); install one of "
                           f"those, or check that its tensor_parallel mappings, linear functions and DDP bucket "
                           f"group still match the signatures listed in megacomp.integrations.megatron / megatron_ddp")
    return version


def _check_signature(fn, expected, where: str) -> None:
    """RuntimeError unless ``fn``'s parameter names are ``expected`` (a tuple of names, or of such tuples)."""
    names = tuple(inspect.signature(fn).parameters)
    allowed = expected if isinstance(expected[0], tuple) else (expected,)
    if names not in allowed:
        raise RuntimeError(f"megatron-core's {where} has parameters {names}, megacomp expects "
                           f"{' or '.join(map(str, allowed))}: this megatron-core is not the one the integration "
                           f"was written for")


def _by_keyword(original, method):
    """Call ``method`` with the caller's arguments bound by ``original``'s signature, passed by name (the
    supported releases order the linear functions' parameters differently)."""
    signature = inspect.signature(original)

    def call(*args, **kwargs):
        return method(**signature.bind(*args, **kwargs).arguments)

    call.__self__ = method.__self__  # uninstall finds the bindings it made through this
    if hasattr(method, "warned"):  # megatron-core's function reads this flag through its module-level name
        call.warned = method.warned
    call.__name__ = method.__name__
    call.__doc__ = f"megacomp's replacement of megatron-core's {original.__name__} (megacomp.integrations.megatron)"
    return call


class MegatronCompression:
    """Compression of megatron-core's TP and DP traffic per direction (see the module docstring).

    Args:
        config: a ``CommCompressionConfig`` or its YAML mapping; the TP paths (tp_forward, tp_backward,
            sp_all_gather, sp_reduce_scatter, tp_backward_error_feedback), the DP paths of megatron-core's
            DDP and distributed optimizer (dp_gradient, dp_gradient_error_feedback, dp_parameter) and
            min_compress_numel apply.
        channels: already-built ``Channels`` to use instead (e.g. shared with megacomp's own layers).

    Raises:
        ValueError: a lossy codec on a pipeline path (not carried here); a dp_gradient that is not an
            element-wise codec (PowerSGD, Accordion) or a dp_gradient warm-up (DDP has no step counter here).
    """

    def __init__(self, config: Union[CommCompressionConfig, Mapping[str, Any], None] = None, *,
                 channels: Optional[Channels] = None) -> None:
        if channels is None:
            if not isinstance(config, CommCompressionConfig):
                config = CommCompressionConfig.from_dict(config)
            other = [p for p in TRAFFIC_PATHS if p not in _PATHS and not getattr(config, p).is_identity]
            if other:
                raise ValueError(f"megatron integration: {other} are not tensor- or data-parallel paths; "
                                 f"megatron-core's pipeline traffic is not carried here (use megacomp's pipeline "
                                 f"schedule for it), set them to none")
            if not isinstance(config.dp_gradient, Codec):
                raise ValueError("megatron integration: dp_gradient must be an element-wise codec (PowerSGD and "
                                 "Accordion work in megacomp's DDP hook and sharded optimizer, not in megatron-core's "
                                 "flat buckets)")
            if config.dp_gradient_warmup_steps:
                raise ValueError("megatron integration: dp_gradient_warmup_steps is not supported (megatron-core's "
                                 "DDP has no step counter to switch on); set it to 0")
            config = config.for_rank(dist.get_rank()) if dist.is_initialized() else config
            channels = config.build_channels()
        self.channels = channels
        # the mapping functions' backward collectives have no per-call key: codec only, no error feedback
        self._plain_backward = channels.tp_backward.without_error_feedback()
        self._keys: dict[int, tuple] = {}  # id(weight) -> (weakref to it, key); ids are checked against the ref
        self._count = 0
        self._saved: list = []  # (module, name, original) replaced by install
        self._buckets: dict[int, tuple] = {}  # id(bucket) -> (weakref to it, error-feedback key)
        self._bucket_count = 0
        self._ddp: Optional[megatron_ddp.DDPPatch] = None

    # -- error-feedback keys -----------------------------------------------------------------------
    def register(self, model) -> "MegatronCompression":
        """Key each weight's error feedback by its parameter name in ``model`` (stable across runs and
        independent of forward order); for megatron-core's DistributedDataParallel also each gradient bucket's,
        by the name of its first parameter. Call before the first forward."""
        for name, param in model.named_parameters():
            self._keys[id(param)] = (weakref.ref(param), f"megatron/{name}")
        if hasattr(model, "bucket_groups"):
            for bucket, name in megatron_ddp.bucket_names(model).items():
                self._buckets[id(bucket)] = (weakref.ref(bucket), f"megatron_ddp/{name}")
        return self

    def _bucket_key(self, bucket) -> Optional[str]:
        if self.channels.dp_gradient.error_feedback is None:
            return None
        ref, key = self._buckets.get(id(bucket), (None, None))
        if ref is None or ref() is not bucket:
            key = f"megatron_ddp/bucket{self._bucket_count}"
            self._buckets[id(bucket)] = (weakref.ref(bucket), key)
            self._bucket_count += 1
        return key

    def _ef_key(self, weight) -> Optional[str]:
        if self.channels.tp_backward.error_feedback is None:
            return None
        ref, key = self._keys.get(id(weight), (None, None))
        if ref is None or ref() is not weight:
            key = f"megatron_linear/{self._count}"
            self._keys[id(weight)] = (weakref.ref(weight), key)
            self._count += 1
        return key

    # -- install / uninstall -----------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        """Whether this object's replacements are in place."""
        return bool(self._saved)

    def install(self) -> "MegatronCompression":
        """Replace megatron-core's functions (see the module docstring). RuntimeError: unsupported version,
        changed signatures, or another MegatronCompression already installed."""
        check_megatron_version()
        from megatron.core.tensor_parallel import layers, mappings

        current = getattr(mappings, _MARK, None)
        if current is not None:
            raise RuntimeError(f"megacomp's megatron integration is already installed ({current!r}); call "
                               f"uninstall() on it first (one installation at a time)")
        originals = {}
        for name, expected in _MAPPINGS:
            _check_signature(getattr(mappings, name), expected, f"tensor_parallel.mappings.{name}")
            originals[name] = getattr(mappings, name)
        for name, expected in _LINEARS:
            _check_signature(getattr(layers, name), expected, f"tensor_parallel.layers.{name}")
            originals[name] = getattr(layers, name)
        megatron_ddp.check_signatures()
        self._originals = originals
        self._group_if_none = mappings.get_tensor_model_parallel_group_if_none
        replacement = {name: getattr(self, "_" + name) for name in originals}
        for name, _ in _LINEARS:
            replacement[name] = _by_keyword(originals[name], replacement[name])
        self._ddp = megatron_ddp.install(self)
        for module in [m for n, m in list(sys.modules.items()) if n.split(".")[0] == "megatron" and m is not None]:
            for name, original in originals.items():
                if getattr(module, name, None) is original:
                    setattr(module, name, replacement[name])
                    self._saved.append((module, name, original))
        setattr(mappings, _MARK, self)
        return self

    def uninstall(self) -> None:
        """Put every replaced binding back (also in modules imported while installed). Idempotent."""
        if not self._saved:
            return
        self._ddp.uninstall()
        self._ddp = None
        for module, name, original in self._saved:
            setattr(module, name, original)
        for module in [m for n, m in list(sys.modules.items()) if n.split(".")[0] == "megatron" and m is not None]:
            for name, original in self._originals.items():  # modules imported while installed bound ours
                if getattr(getattr(module, name, None), "__self__", None) is self:
                    setattr(module, name, original)
        self._saved = []
        from megatron.core.tensor_parallel import mappings

        if getattr(mappings, _MARK, None) is self:
            delattr(mappings, _MARK)

    def __enter__(self) -> "MegatronCompression":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        codecs = {p: str(getattr(self.channels, p).codec) for p in _PATHS}
        return f"MegatronCompression({codecs}, installed={self.installed})"

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's channel state (tp_backward and dp_gradient error feedback, stochastic streams). The
        error-feedback keys are not saved: :meth:`register` names them, or a resumed run hands them out again
        in forward (layers) and first-reduce (buckets) order."""
        return {"channels": {p: getattr(self.channels, p).state_dict() for p in _PATHS}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (ValueError when a codec differs from the one saved, or a path is missing)."""
        missing = [p for p in _PATHS if p not in state["channels"]]
        if missing:
            raise ValueError(f"MegatronCompression.load_state_dict: the state has no {missing} (saved by an older "
                             f"megacomp without the data-parallel paths); resume without it or save it again")
        for p in _PATHS:
            getattr(self.channels, p).load_state_dict(state["channels"][p])

    # -- the mapping functions (megatron-core's signatures) ----------------------------------------
    def _g(self, group):
        return self._group_if_none(group)

    def _copy_to_tensor_model_parallel_region(self, input_, group=None):
        return mc.copy_to_tensor_model_parallel_region(input_, self._g(group), backward_codec=self._plain_backward)

    def _reduce_from_tensor_model_parallel_region(self, input_, group=None):
        return mc.reduce_from_tensor_model_parallel_region(input_, self._g(group), codec=self.channels.tp_forward)

    def _scatter_to_tensor_model_parallel_region(self, input_, group=None):
        return mc.scatter_to_tensor_model_parallel_region(input_, self._g(group), backward_codec=self._plain_backward)

    def _gather_from_tensor_model_parallel_region(self, input_, group=None):
        return mc.gather_from_tensor_model_parallel_region(input_, self._g(group), codec=self.channels.tp_forward)

    def _scatter_to_sequence_parallel_region(self, input_, group=None):
        return mc.scatter_to_sequence_parallel_region(input_, self._g(group), backward_codec=self._plain_backward)

    def _refuse_lossy_uneven(self, what: str, paths) -> None:
        lossy = [c.name for c in paths if c.lossy]
        if lossy:
            raise ValueError(f"megatron integration: {what} with uneven splits (MoE token dispatch) is not "
                             f"compressed by megacomp; set {sorted(set(lossy))} to none")

    def _gather_from_sequence_parallel_region(self, input_, tensor_parallel_output_grad=True, group=None,
                                              output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is not None:
            self._refuse_lossy_uneven("gather_from_sequence_parallel_region",
                                      (self.channels.sp_all_gather, self._plain_backward))
            return self._originals["gather_from_sequence_parallel_region"](
                input_, tensor_parallel_output_grad, group, output_split_sizes, use_global_buffer)
        return mc.gather_from_sequence_parallel_region(input_, self._g(group), tensor_parallel_output_grad,
                                                       codec=self.channels.sp_all_gather,
                                                       backward_codec=self._plain_backward)

    def _reduce_scatter_to_sequence_parallel_region(self, input_, group=None, input_split_sizes=None,
                                                    use_global_buffer=False):
        if input_split_sizes is not None:
            self._refuse_lossy_uneven("reduce_scatter_to_sequence_parallel_region",
                                      (self.channels.sp_reduce_scatter, self._plain_backward))
            return self._originals["reduce_scatter_to_sequence_parallel_region"](
                input_, group, input_split_sizes, use_global_buffer)
        return mc.reduce_scatter_to_sequence_parallel_region(input_, self._g(group), codec=self.channels.sp_reduce_scatter,
                                                             backward_codec=self._plain_backward)

    # -- the linear functions ------------------------------------------------------------------------
    def _unsupported(self, fn: str, feature: str, fix: str) -> None:
        lossy = [p for p in ("sp_all_gather", "tp_backward") if getattr(self.channels, p).lossy]
        if lossy:
            raise ValueError(f"megatron integration: {feature} is not supported with compressed {lossy} "
                             f"(megatron-core's {fn} would bypass the codec); {fix}, or set {lossy} to none")

    def _linear_with_grad_accumulation_and_async_allreduce(self, input, weight, bias, gradient_accumulation_fusion,
                                                           allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
                                                           wgrad_deferral_limit=None, async_grad_allreduce=None,
                                                           tp_group=None, gtp_remat_size=1):
        name = "linear_with_grad_accumulation_and_async_allreduce"
        special = (("gradient_accumulation_fusion", "turn gradient_accumulation_fusion off in the config")
                   if gradient_accumulation_fusion else
                   ("Megatron-FSDP parameters", "use FSDP2 with megacomp.integrations.fsdp for sharded data parallelism")
                   if hasattr(weight, "__fsdp_param__") else
                   ("GTP-sharded weights (gtp_remat_size > 1)", "run without the gtp_remat process group")
                   if gtp_remat_size > 1 else None)
        if special is not None:
            self._unsupported(name, *special)
            return self._call_original(name, input=input, weight=weight, bias=bias,
                                       gradient_accumulation_fusion=gradient_accumulation_fusion,
                                       allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                                       grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                                       async_grad_allreduce=async_grad_allreduce, tp_group=tp_group,
                                       gtp_remat_size=gtp_remat_size)
        tp_group = self._g(tp_group)
        return CompressedLinear.apply(input, weight, bias, allreduce_dgrad, sequence_parallel, grad_output_buffer,
                                      wgrad_deferral_limit, tp_group, self.channels, self._ef_key(weight))

    _linear_with_grad_accumulation_and_async_allreduce.warned = True  # megatron-core's CUDA_DEVICE_MAX_CONNECTIONS hint

    def _call_original(self, name: str, **arguments):
        """megatron-core's own function with the arguments its release takes (0.16: async_grad_allreduce,
        0.19: gtp_remat_size), passed by name."""
        original = self._originals[name]
        accepted = inspect.signature(original).parameters
        return original(**{k: v for k, v in arguments.items() if k in accepted})

    def _linear_with_frozen_weight(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                   sequence_parallel, tp_group=None, grad_output_buffer=None, wgrad_deferral_limit=None,
                                   async_grad_allreduce=None, gtp_remat_size=1):
        if gtp_remat_size > 1:
            self._unsupported("linear_with_frozen_weight", "GTP-sharded weights (gtp_remat_size > 1)",
                              "run without the gtp_remat process group")
            return self._call_original("linear_with_frozen_weight", input=input, weight=weight, bias=bias,
                                       gradient_accumulation_fusion=gradient_accumulation_fusion,
                                       allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                                       tp_group=tp_group, grad_output_buffer=grad_output_buffer,
                                       wgrad_deferral_limit=wgrad_deferral_limit,
                                       async_grad_allreduce=async_grad_allreduce, gtp_remat_size=gtp_remat_size)
        if grad_output_buffer is not None or wgrad_deferral_limit is not None:
            raise ValueError("linear_with_frozen_weight: grad_output_buffer / wgrad_deferral_limit are only "
                             "supported by linear_with_grad_accumulation_and_async_allreduce (as in megatron-core)")
        tp_group = self._g(tp_group)
        if sequence_parallel:
            input = self._gather_from_sequence_parallel_region(input, True, tp_group)
        return CompressedFrozenLinear.apply(input, weight, bias, allreduce_dgrad, tp_group, self.channels,
                                            self._ef_key(weight))

"""LoQT (Loeschcke et al., "LoQT: Low-Rank Adapters for Quantized Pretraining", NeurIPS 2024, arXiv 2405.16528)
on megacomp's tensor-parallel linear layers.

A converted layer keeps its base weight only as a megacomp codec payload ``Q`` (``qweight``: packed int8/int4 codes
and fp32 block scales, the bytes ``codec.encode_flat`` writes; no fp32 copy is kept), a fixed projection ``P``
(``proj``, a buffer) and one trainable factor ``B`` (``factor``, the only new parameter). Its weight is

    column-parallel (weight [out/tp, in], sharded on dim 0):  W = deq(Q) + alpha * B P^T,  P [in, r],  B [out/tp, r]
    row-parallel    (weight [out, in/tp], sharded on dim 1):  W = deq(Q) + alpha * P B,    P [out, r], B [r, in/tp]

so the trainable factor is sharded like the weight and ``P`` spans the unsharded dim: B's gradient
(``alpha G P`` or ``alpha P^T G`` of the local weight gradient G) needs no TP communication, and every number is
independent of the TP size up to fp32 summation order. The forward is the wrapped layer's own forward with
``weight`` set to that sum for the call, so its TP mappings and channels (tp_forward/tp_backward, sequence
parallelism) are unchanged. ``B`` carries the layer's ``tensor_model_parallel``/``partition_dim`` marks.
Memory: autograd does not keep the dense weight between forward and backward (a saved-tensor hook stores a marker
and backward dequantises again); a layer's forward/backward holds two or three weight-sized temporaries at a time,
and a merge step one fp32 weight-sized gradient accumulator per layer (the reference's weight_grad buffer).

Algorithm (a training loop drives it through :class:`LoQT`; see its docstring for the call order):
  1. convert: ``Q = quantise(W)``, ``P = 0``, ``B = 0`` (uninitialised: the forward uses ``deq(Q)`` alone).
  2. at each merge step of the schedule (step 0 first), one forward/backward captures the gradient G of the
     current weight ``deq(Q) + alpha*low-rank`` (summed over micro-batches, in fp32), then per layer:
     a. G is summed over the data-parallel group (``channel``, uncompressed unless the caller gives a codec);
     b. the Gram matrix of the full G (``sum_tp G_i^T G_i`` for column, ``sum_tp G_i G_i^T`` for row) is
        all-reduced over TP in fp64 (``tp_channel``, uncompressed unless the caller gives a codec: every TP rank
        decodes the same bytes, so P stays identical across them, but carries the codec's error) and ``torch.linalg.eigh`` gives its top-r eigenvectors = the top-r right
        (column) / left (row) singular vectors of G, ordered by descending eigenvalue, each signed so that its
        entry of largest magnitude is positive (ties: the first): every rank derives the same P;
     c. merge: ``W = deq(Q) + alpha*low-rank`` (fp32); ``Q = quantise(W)``, ``B = 0`` (the first time, with B = 0
        still, Q is kept as it is); with ``compensate_iters=k``
        the reference's error compensation instead: k rounds of ``Q_i = quantise(W - alpha*lowrank(B_{i-1}))``,
        ``B_i = P^T-projection of (W - deq Q_i) / alpha`` (P has orthonormal columns, so P^+ = P^T), keeping the
        pair of least ``||W - deq Q_i - alpha*lowrank(B_i)||_F`` (a TP all-reduced fp64 scalar).
  3. in between, only B (and the layer's bias) train; the optimizer step of a merge iteration is skipped (LOMO /
     AdaLomo update inside backward: on a merge step they still update the non-LoQT parameters, B gets nothing).

Schedule (:class:`LoQTSchedule`): merge steps ``0, tau, tau + (tau + floor(psi^1)), ...``: the k-th interval after
the first is ``tau + floor(psi^k)``; a merge with ``step + tau >= total_steps`` is dropped (defaults tau=100,
psi=1.2 of the reference's scripts/350m_loqt8bit.sh).

Error bound (int codecs, round to nearest, block size b dividing the local row length): per element
``|deq(Q) - W| <= s/2`` with ``s = amax_block / qmax`` (qmax 127 for int8, 7 for int4), plus fp32 round-off of the
scaling; through the matmul ``|dy| <= sum_j |x_j| * bound_ij``. Blocks never straddle rows, so the blocks and their
scales are the same at every TP size. After a merge ``|deq(Q_new) - (deq(Q_old) + alpha*lowrank)| <= s_new/2``
(+ round-off); with compensation ``||W - deq Q - alpha*lowrank(B)||_F <= ||W - deq(quantise W)||_F``. Codec
``none`` stores W's own bytes: with B = 0 the layer is bit-identical to the original.

Reference (sebulo/LoQT at its first commit 3ab2ead: loqt/LoQT.py, torchrun_main.py, loqt/utils.py,
scripts/350m_loqt8bit.sh; the head 375b41a differs in the merge iteration only by also taking the optimizer step
with the factors' gradients zeroed and by keeping merges up to the last step: the pretraining loop's
``--loqt-merge-optimizer-step`` gives that step, docs/guide/loqt.md says why the first commit is the default), followed:
W = Q + scale * (a fixed factor from the gradient's SVD times a zero-initialised trainable one), scale = lora_alpha
used directly (not alpha/r; default 0.5); B zero at (re)initialisation unless ``compensate_quant_error_iterations``
> 0 (then the iterative compensation above, best-of by Frobenius norm); the full weight gradient reduced over DP
before the SVD (averaged there, summed here: P depends on neither that scale nor a loss scale); merge
``Q = quantise(deq Q + low-rank)``; the merge iteration makes no optimizer step; the trainable factor keeps its
parameter identity and optimizer state across merges (no reset; :func:`sync_optimizer` can reset it, as an
option); the exponential schedule above. Chosen differently: the orientation follows the TP partition dim, not the
reference's shape rule ('left' when in <= out; used here only for plain nn.Linear); the base is megacomp's
int8/int4 block codec, not NF4, and P stays in the parameter dtype (the reference can NF4-quantise P); the gradient
for P is taken at the pre-merge weight ``deq(Q)+alpha*low-rank`` in the same backward, not at the re-quantised
weight after a merge with the low-rank path off (they differ by one quantisation step, and no full-precision copy
of W is kept between merge and re-initialisation); P comes from eigh of the TP-reduced Gram matrix (the reference's
optional ``use_eigenh_for_projection`` path) rather than an SVD of the gathered gradient.

Failure behaviour: ValueError (naming the fix) for rank <= 0 or > min(out, in), an unsupported codec (only
int8/int4 with per-block scales, round to nearest, no Hadamard/dual scale, and ``none``), a block size that does
not divide the local row length, alpha <= 0, a model with no convertible layer, a missing ``dp_group`` under
TP x DP, or a checkpoint of another LoQT format; a non-finite merge gradient merges nothing (merge_and_reinit
returns False, the caller retries at a later step); TypeError for
a layer that is not ColumnParallelLinear/RowParallelLinear/nn.Linear; RuntimeError for merge_and_reinit without a
captured gradient.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..comm import AnyChannel, Channel, make_channel
from ..compression import CodecLike, make_codec
from .layers import ColumnParallelLinear, RowParallelLinear, _mark_sharded

BASE_CODECS = ("int8", "int4", "none")


def check_base_codec(codec: CodecLike, row_length: int):
    """The codec of a LoQT base weight, checked (see the module docstring); ``row_length``: the local weight's
    last dim, which the block size must divide."""
    c = make_codec(codec)
    if c.name not in BASE_CODECS or c.structured:
        raise ValueError(f"LoQT stores the base weight with int8 or int4 block scales (or 'none' for an unquantised "
                         f"base), got codec {c}; use e.g. {{name: int8, block_size: 64}}")
    if c.name == "none":
        return c
    if c.hadamard or c.dual_scale or c.rounding != "nearest":
        raise ValueError(f"LoQT base codec {c}: use plain per-block scales with round to nearest (drop hadamard, "
                         f"dual_scale and stochastic rounding)")
    if c.block_size == 0 or row_length % c.block_size:
        raise ValueError(f"LoQT base codec {c}: block_size must divide the local weight rows ({row_length} elements) "
                         f"so that blocks never straddle rows and the quantisation is the same at every TP size; "
                         f"choose a block_size dividing {row_length}")
    return c


class _CaptureWeightGrad(torch.autograd.Function):
    """Identity on the weight; backward adds the weight's gradient into ``sink`` and returns none (``anchor``, a
    private leaf that requires grad, only makes the graph reach here: no parameter's gradient hook fires)."""

    @staticmethod
    def forward(ctx, weight, anchor, sink):
        ctx.sink = sink
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink._accumulate(grad)
        return None, None, None


_ANCHOR = torch.zeros((), requires_grad=True)


class _Recompute(NamedTuple):  # what autograd keeps of the dense weight: a view's geometry, not its values
    size: torch.Size
    stride: tuple
    offset: int


class LoQTLinear(nn.Module):
    """A ColumnParallelLinear, RowParallelLinear or nn.Linear in LoQT form (see the module docstring).

    Args:
        layer: the layer to convert; it becomes ``self.base`` and loses its ``weight`` parameter (its bias and
            everything else stay).
        rank: r, 1 <= r <= min(output_size, input_size).
        codec: the base weight's codec (int8/int4 with block scales, or 'none').
        alpha: the low-rank term's scale (the reference's lora_alpha, used directly).
        compensate_iters: rounds of the reference's quantisation-error compensation at each (re)initialisation.
    """

    def __init__(self, layer: nn.Module, rank: int, *, codec: CodecLike = "int8", alpha: float = 0.5,
                 compensate_iters: int = 0) -> None:
        super().__init__()
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            self.kind = "column" if isinstance(layer, ColumnParallelLinear) else "row"
            self.tp_group, self.tp_size = layer.tp_group, layer.tp_size
            out_full, in_full = layer.output_size, layer.input_size
        elif isinstance(layer, nn.Linear):
            self.kind = "column" if layer.in_features <= layer.out_features else "row"  # the reference's 'std' rule
            self.tp_group, self.tp_size = None, 1
            out_full, in_full = layer.out_features, layer.in_features
        else:
            raise TypeError(f"LoQTLinear converts ColumnParallelLinear, RowParallelLinear or nn.Linear, got "
                            f"{type(layer).__name__}")
        w = layer.__dict__.get("_parameters", {}).get("weight")
        if not isinstance(w, nn.Parameter):
            raise ValueError(f"{type(layer).__name__} has no weight parameter to convert (already in LoQT form?)")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= min(out_full, in_full):
            raise ValueError(f"LoQT rank must be an int in [1, min(output, input) = {min(out_full, in_full)}], got "
                             f"{rank!r}; pick a smaller rank (the reference uses 128-1024 on 512-5120 wide layers)")
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"LoQT alpha must be a finite number > 0 (reference default 0.5), got {alpha!r}")
        if not isinstance(compensate_iters, int) or isinstance(compensate_iters, bool) or compensate_iters < 0:
            raise ValueError(f"compensate_iters must be an int >= 0, got {compensate_iters!r}")
        self.rank, self.alpha, self.compensate_iters = rank, float(alpha), compensate_iters
        self.shape, self.dtype = tuple(w.shape), w.dtype
        self.codec = check_base_codec(codec, self.shape[1])
        col = self.kind == "column"
        self.register_buffer("qweight", self._encode(w.detach()))
        self.register_buffer("proj", torch.zeros(in_full if col else out_full, rank, dtype=w.dtype, device=w.device))
        self.factor = nn.Parameter(torch.zeros((self.shape[0], rank) if col else (rank, self.shape[1]),
                                               dtype=w.dtype, device=w.device))
        if getattr(w, "tensor_model_parallel", False):
            _mark_sharded(self.factor, 0 if col else 1)
        self.register_buffer("loqt_step", torch.tensor(-1, dtype=torch.int64))  # step of the last (re)init; -1 none
        self.register_buffer("loqt_merges", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("loqt_format", self._format())
        del layer.weight
        layer.weight = None  # set to the LoQT weight for the duration of each forward
        self.base = layer
        self.config = getattr(layer, "config", None)  # what optimizers read (LOMO's sequence-parallel check)
        self._grad: Optional[torch.Tensor] = None  # the captured full gradient (fp32) during a merge step

    # -- weight ------------------------------------------------------------------------------------
    def _format(self) -> torch.Tensor:
        c = self.codec
        bits = 0 if c.name == "none" else c.format.bits
        return torch.tensor([bits, c.block_size or 0, self.rank, int(self.kind == "column")], dtype=torch.int64)

    def _encode(self, w: torch.Tensor) -> torch.Tensor:
        return self.codec.encode_flat(w.to(self.dtype).contiguous()).clone()

    def _decode(self, buf: torch.Tensor) -> torch.Tensor:
        n = self.shape[0] * self.shape[1]
        return self.codec.decode_flat(buf, n, self.dtype).view(self.shape)

    @property
    def bias(self) -> Optional[nn.Parameter]:
        """The wrapped layer's bias (an ordinary trainable parameter)."""
        return self.base.bias

    @property
    def initialized(self) -> bool:
        """Whether P and B have been set from a gradient (before that the weight is deq(Q) alone)."""
        return int(self.loqt_step) >= 0

    def dequantized(self) -> torch.Tensor:
        """deq(Q), the base weight shard (the parameter dtype; for codec none a view of ``qweight``)."""
        return self._decode(self.qweight)

    def low_rank(self, factor: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``B P^T`` (column) or ``P B`` (row), without alpha, of ``factor`` (default: the trainable B)."""
        b = self.factor if factor is None else factor
        return b @ self.proj.t() if self.kind == "column" else self.proj @ b

    def _recompute(self) -> torch.Tensor:
        """``deq(Q) + alpha * low-rank`` without a graph (the bits the forward used, while B is unchanged)."""
        with torch.no_grad():
            q = self.dequantized()
            return q + self.alpha * self.low_rank() if self.initialized else q

    def effective_weight(self) -> torch.Tensor:
        """``deq(Q) + alpha * low-rank`` (detached, a new tensor): the weight shard this layer applies."""
        w = self._recompute()
        return w if self.initialized else w.clone()

    def forward(self, *args, **kwargs):
        """The wrapped layer's forward with its weight = ``deq(Q) + alpha * low-rank`` (graph to B only; during a
        merge step's capture, graph to the captured gradient instead). Returns what the wrapped layer returns.

        The dense weight is not kept for backward: where the wrapped layer's autograd saves it (for the input
        gradient), a saved-tensor hook stores a marker and backward dequantises again (:meth:`_recompute`), as
        the reference's NF4 matmul does; between forward and backward only Q, P and B hold weight memory."""
        if self._grad is not None:
            w = _CaptureWeightGrad.apply(self._recompute(), _ANCHOR, self)
        else:
            q = self.dequantized()
            w = q + self.alpha * self.low_rank() if self.initialized else q
        storage = w.untyped_storage().data_ptr()

        def pack(t):
            if t.untyped_storage().data_ptr() == storage:
                return _Recompute(t.size(), t.stride(), t.storage_offset())
            return t

        def unpack(saved):
            if isinstance(saved, _Recompute):
                return self._recompute().as_strided(saved.size, saved.stride, saved.offset)
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            self.base.weight = w
            try:
                return self.base(*args, **kwargs)
            finally:
                self.base.weight = None

    # -- merge ---------------------------------------------------------------------------------------
    def start_capture(self) -> None:
        """Capture the weight's gradient in the following backward(s) (summed, fp32) instead of B's."""
        if self._grad is None:
            self._grad = torch.zeros(self.shape, dtype=torch.float32, device=self.qweight.device)

    def _accumulate(self, grad: torch.Tensor) -> None:
        if self._grad is not None:  # None: a capture graph's backward ran after merge_and_reinit; nothing to keep
            self._grad.add_(grad)

    @torch.no_grad()
    def projection(self, grad: torch.Tensor, channel: Channel) -> torch.Tensor:
        """Top-r singular vectors of the full gradient (right ones for column, left for row) from the TP-summed
        fp64 Gram matrix (step 2b of the module docstring); the same bits on every rank of the TP group."""
        g = grad.double()
        gram = g.t() @ g if self.kind == "column" else g @ g.t()
        if self.tp_size > 1:
            channel.all_reduce(gram, group=self.tp_group, tag="loqt_merge_tp")
        if not bool(torch.isfinite(gram).all()):
            raise FloatingPointError("LoQT merge: the captured weight gradient has inf/NaN (an fp16 overflow?); rerun the "
                             "merge step's backward with a smaller loss scale")
        vecs = torch.linalg.eigh(gram).eigenvectors[:, -self.rank:].flip(1)
        pivot = vecs.abs().argmax(0)
        signs = torch.sign(vecs[pivot, torch.arange(self.rank)])
        return (vecs * torch.where(signs == 0, 1.0, signs)).to(self.dtype)

    @torch.no_grad()
    def quantise(self, w: torch.Tensor, proj: torch.Tensor, channel: Channel) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, B) for the merged weight ``w`` and projection ``proj`` (step 2c of the module docstring); the
        compensation's error norms are TP all-reduced on ``channel``, which must be uncompressed (every rank must
        pick the same round)."""
        col = self.kind == "column"
        zero = torch.zeros_like(self.factor)
        if self.compensate_iters == 0:
            return self._encode(w), zero
        best, best_err, target = None, math.inf, w
        for _ in range(self.compensate_iters):
            payload = self._encode(target)
            residual = w - self._decode(payload).float()
            b = ((residual @ proj.float()) if col else (proj.float().t() @ residual)) / self.alpha
            fit = self.alpha * (b @ proj.float().t() if col else proj.float() @ b)
            err = (residual - fit).double().square().sum().reshape(1)
            if self.tp_size > 1:
                channel.all_reduce(err, group=self.tp_group, tag="loqt_merge_tp")
            if float(err) < best_err:
                best, best_err = (payload, b.to(self.dtype)), float(err)
            target = w - fit
        return best

    @torch.no_grad()
    def take_gradient(self, channel: Channel, dp: bool) -> torch.Tensor:
        """Step 2a of the module docstring: the captured gradient, summed over DP on ``channel``; the capture ends."""
        grad, self._grad = self._grad, None
        if grad is None:
            raise RuntimeError("LoQT merge_and_reinit: no captured gradient; call LoQT.start_full_gradient() before "
                               "the merge step's forward and backward")
        if dp:
            channel.all_reduce(grad)
        return grad

    @torch.no_grad()
    def reinit(self, step: int, grad: torch.Tensor, tp_channel: Channel) -> None:
        """Steps 2b-2c of the module docstring from the DP-summed gradient: set P, Q and B (the Gram all-reduce on
        ``tp_channel``, the error norms on its uncompressed sibling)."""
        proj = self.projection(grad, tp_channel)
        w = self.effective_weight().float()
        if self.initialized or self.compensate_iters:
            payload, b = self.quantise(w, proj, tp_channel.uncompressed())
            self.qweight.copy_(payload)
        else:  # first initialisation without compensation: Q is already quantise(W), B stays 0
            b = torch.zeros_like(self.factor)
        self.proj.copy_(proj)
        self.factor.copy_(b)
        self.loqt_step.fill_(step)
        self.loqt_merges.add_(1)

    # -- accounting, checkpoints -----------------------------------------------------------------------
    def stats(self) -> dict:
        """This rank's numbers for a report: trainable elements (B and the layer's other parameters), bytes of the
        quantised base (codes + scales), of P, of B and of the dense weight it replaces."""
        size = torch.empty((), dtype=self.dtype).element_size()
        other = sum(p.numel() for p in self.base.parameters() if p.requires_grad)
        return {"kind": self.kind, "shape": self.shape, "rank": self.rank, "codec": str(self.codec),
                "trainable_params": self.factor.numel() + other, "factor_params": self.factor.numel(),
                "quantized_bytes": self.qweight.numel(), "projection_bytes": self.proj.numel() * size,
                "factor_bytes": self.factor.numel() * size, "dense_bytes": self.shape[0] * self.shape[1] * size}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        saved = state_dict.get(prefix + "loqt_format")
        if saved is not None and not torch.equal(saved.cpu(), self._format()):
            bits, block, rank, col = saved.tolist()
            raise ValueError(f"LoQT checkpoint of {prefix or 'layer'!r} was saved with base bits={bits}, "
                             f"block_size={block}, rank={rank}, {'column' if col else 'row'} form; this layer has "
                             f"{self.codec}, rank={self.rank}, {self.kind} form; convert with the same settings")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        """Form, local weight shape, rank, base codec and alpha (shown by ``print(model)``)."""
        return f"{self.kind}, shape={self.shape}, rank={self.rank}, codec={self.codec}, alpha={self.alpha}"


def convert_to_loqt(model: nn.Module, rank: int, *, codec: CodecLike = "int8", alpha: float = 0.5,
                    compensate_iters: int = 0,
                    include: Optional[Callable[[str, nn.Module], bool]] = None) -> list[LoQTLinear]:
    """Replace every ColumnParallelLinear / RowParallelLinear / nn.Linear under ``model`` (for which
    ``include(name, module)`` is true, default all) by a :class:`LoQTLinear`, in place; returns them in module
    order. Raises ValueError when nothing was converted (or for bad settings, see LoQTLinear)."""
    targets = (ColumnParallelLinear, RowParallelLinear, nn.Linear)
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, targets) and not isinstance(m, LoQTLinear) and "weight" in m._parameters
             and (include is None or include(name, m))]
    if any(name == "" for name, _ in found):
        raise ValueError("convert_to_loqt converts the linear layers inside a model; wrap a single layer with "
                         "LoQTLinear(layer, rank) instead")
    if not found:
        raise ValueError("convert_to_loqt found no ColumnParallelLinear, RowParallelLinear or nn.Linear to convert "
                         "(check the include predicate)")
    out = []
    for name, m in found:
        parent_name, _, child = name.rpartition(".")
        new = LoQTLinear(m, rank, codec=codec, alpha=alpha, compensate_iters=compensate_iters)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        out.append(new)
    return out


class LoQTSchedule:
    """Merge steps (the reference's get_proj_update_steps): ``0`` and ``tau``, then each interval ``tau +
    floor(psi^k)`` for k = 1, 2, ... ('exponential'; 'static': every ``tau``); with ``total_steps``, merges with
    ``step + tau >= total_steps`` are dropped (the reference's guard against a merge just before the end)."""

    def __init__(self, gap: int = 100, growth: float = 1.2, total_steps: Optional[int] = None,
                 progression: str = "exponential") -> None:
        if not isinstance(gap, int) or isinstance(gap, bool) or gap < 1:
            raise ValueError(f"LoQT merge gap (tau) must be an int >= 1 (reference 100), got {gap!r}")
        if not (isinstance(growth, (int, float)) and math.isfinite(growth) and growth >= 1):
            raise ValueError(f"LoQT interval growth (psi) must be a finite number >= 1 (reference 1.2), got {growth!r}")
        if progression not in ("exponential", "static"):
            raise ValueError(f"LoQT schedule progression must be 'exponential' or 'static', got {progression!r}")
        self.gap, self.growth, self.total_steps, self.progression = gap, float(growth), total_steps, progression
        self._steps = [0, gap]

    def _extend(self, upto: int) -> None:
        while self._steps[-1] <= upto:
            k = len(self._steps) - 1
            extra = min(int(self.growth ** k), 1 << 40) if self.progression == "exponential" else 0
            self._steps.append(self._steps[-1] + self.gap + extra)

    def merge_steps(self, upto: int) -> list[int]:
        """The merge steps <= ``upto``."""
        self._extend(upto)
        return [s for s in self._steps if s <= upto and (self.total_steps is None or s == 0
                                                          or s + self.gap < self.total_steps)]

    def is_merge_step(self, step: int) -> bool:
        """Whether ``step`` (the training loop's iteration counter, from 0) merges and re-initialises."""
        return step in self.merge_steps(step)


class LoQT:
    """Drives the LoQT layers of a model. Per iteration ``step`` (counted from 0, one optimizer step each)::

        if loqt.wants_full_gradient(step):       # step 0 and the schedule's merge steps
            loqt.start_full_gradient()           # the next backward(s) capture the weights' gradients
            for micro_batch in batch:            # the same forward/backward as any step
                loss(micro_batch).backward()
            loqt.merge_and_reinit(step)          # DP sum, P, merge into Q, B re-initialised
            sync_optimizer(optimizer, loqt.layers)   # DistributedOptimizer masters; optional state reset
            optimizer.zero_grad()                # no optimizer step this iteration (as the reference)
        else:
            ... ordinary step: only B and the non-LoQT parameters have gradients ...

    ``dp_group``: the data-parallel group the captured gradients are summed over (None: no data parallelism,
    allowed only when every rank is in the layers' TP group or torch.distributed is not initialised).
    ``channel``: a megacomp Channel for that sum (e.g. compressed, built by megacomp.comm.make_channel from the
    ``loqt_merge`` path of a CommCompressionConfig; its error feedback is not used); default an uncompressed one,
    counted as ``loqt_merge`` in comm.stats(). ``tp_channel``: the channel of the TP Gram all-reduce (the
    ``loqt_merge_tp`` path; a value codec, its error feedback not used); default the uncompressed sibling of
    ``channel``. Both count their bytes under their traffic kind: ``loqt_merge`` (the channel's name when given)
    and ``loqt_merge_tp``. The overflow flag and the error norms always travel uncompressed.

    Raises:
        ValueError: no LoQTLinear layers; dp_group together with a channel of another group; no dp_group under
            TP x DP; a PowerSGD / Accordion channel (the merge sums need a value codec).
    """

    def __init__(self, model: Union[nn.Module, Iterable[LoQTLinear]], schedule: Optional[LoQTSchedule] = None, *,
                 dp_group=None, channel: Optional[AnyChannel] = None, tp_channel: Optional[AnyChannel] = None) -> None:
        mods = model.modules() if isinstance(model, nn.Module) else model
        self.layers = [m for m in mods if isinstance(m, LoQTLinear)]
        if not self.layers:
            raise ValueError("LoQT found no LoQTLinear layers; convert the model first: convert_to_loqt(model, rank)")
        self.schedule = schedule if schedule is not None else LoQTSchedule()
        if channel is not None and dp_group is not None and channel.group is not dp_group:
            raise ValueError("LoQT: pass the data-parallel group either as dp_group or as the channel's group, not two")
        group = channel.group if channel is not None else dp_group
        if group is None and dist.is_initialized() and dist.get_world_size() != max(m.tp_size for m in self.layers):
            raise ValueError("LoQT: the world holds more than one TP group; pass dp_group (e.g. groups.dp) so the "
                             "merge gradients are summed over data-parallel copies only")
        self.dp = group is not None and dist.get_world_size(group) > 1
        if channel is None:
            channel = make_channel("loqt_merge", group=dp_group)
        self.channel = _value_channel(channel, "channel")
        # the Gram matrices: exact unless a codec is given (the flag and the error norms always travel exactly)
        self.tp_channel = self.channel.uncompressed() if tp_channel is None else _value_channel(tp_channel, "tp_channel")

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The trainable factors B (the layers' biases stay ordinary parameters of the model)."""
        return [m.factor for m in self.layers]

    def wants_full_gradient(self, step: int) -> bool:
        """Whether iteration ``step`` is a merge step that has not been done yet (see the class docstring)."""
        return self.schedule.is_merge_step(step) and any(int(m.loqt_step) != step for m in self.layers)

    def start_full_gradient(self) -> None:
        """The following backward(s) capture each layer's weight gradient (B gets none)."""
        for m in self.layers:
            m.start_capture()

    def merge_and_reinit(self, step: int) -> bool:
        """Merge each layer's B into Q and re-initialise P and B from the captured gradients (every DP and TP rank
        alike). When any captured gradient is inf/NaN (an fp16 overflow), nothing is merged, the captures are
        dropped and False is returned (every rank agrees: the flag is reduced over TP after the DP sums): call
        :meth:`start_full_gradient` and this again at a later step. Raises RuntimeError without a captured gradient."""
        grads = [m.take_gradient(self.channel, self.dp) for m in self.layers]
        bad = torch.stack([~torch.isfinite(g).all() for g in grads]).any().to(torch.float32).reshape(1)
        tp = next((m for m in self.layers if m.tp_size > 1), None)
        if tp is not None:
            self.tp_channel.uncompressed().all_reduce(bad, op=dist.ReduceOp.MAX, group=tp.tp_group, tag="loqt_merge_tp")
        if bad.item():
            return False
        for m, g in zip(self.layers, grads):
            m.reinit(step, g, self.tp_channel)
        return True

    def stats(self) -> list[dict]:
        """Per layer (module order): :meth:`LoQTLinear.stats`."""
        return [m.stats() for m in self.layers]


def _value_channel(channel: AnyChannel, what: str) -> Channel:
    """``channel`` without error feedback (a merge's residual would enter the next merge's gradient, taken at
    another weight many steps later); ValueError for a PowerSGD / Accordion channel."""
    if channel.reduces_whole_buckets:
        raise ValueError(f"LoQT: {what} {channel!r} compresses by structure (PowerSGD / Accordion); the merge sums "
                         f"need a value codec (e.g. bf16, int8) or none")
    return channel.without_error_feedback() if channel.error_feedback is not None else channel


def sync_optimizer(optimizer, layers: Iterable[LoQTLinear], *, reset_state: bool = False) -> None:
    """After :meth:`LoQT.merge_and_reinit`: make ``optimizer`` see the new B of each layer.

    A torch optimizer steps the model's parameters themselves: nothing to reload. megacomp's optimizers are told
    through their ``reload_params(params, reset_state=...)``: the DistributedOptimizer copies B's slice of its fp32
    master shards from the model (only B's, so other parameters' masters are not replaced by a lossy all-gathered
    copy); LOMO / AdaLomo hold no copy. ``reset_state=True`` (not what the reference does) also zeroes B's optimizer
    state: for torch optimizers its per-parameter state is dropped (fresh moments and step count); for the
    DistributedOptimizer B's slice of every state tensor shaped like the master is zeroed (its step count is shared
    with the bucket and stays); for AdaLomo its statistics are zeroed; LOMO has no state."""
    factors = [m.factor for m in layers]
    if isinstance(optimizer, torch.optim.Optimizer):  # torch's (and DeMo): the model's parameters are its own
        if reset_state:
            for p in factors:
                optimizer.state.pop(p, None)
        return
    optimizer.reload_params(factors, reset_state=reset_state)  # megacomp's sharded optimizer, LOMO / AdaLomo

"""Learned gradient compression as published (LGC; Abrahamyan, Chen, Bekoulis and Deligiannis, "Learned Gradient
Compression for Distributed Deep Learning", IEEE TNNLS 2021, arXiv 2103.08870): the settings, the sizes and bytes
of each phase, and the top-k front end. The autoencoder lives in megacomp.compression.lgc_autoencoder, the
exchange in megacomp.comm.lgc_channel. (The chunked PCA / MLP code that megacomp called ``lgc`` before is
``lgc_pca``, megacomp.compression.learned.)

A bucket of ``n`` elements (flattened, fp32) is first sparsified as in Deep Gradient Compression: each rank adds
its residual (``h = g + e``, the unsent entries accumulated locally), keeps the ``k = ceil(density * n)``
entries of largest magnitude and carries the rest to the next step. Three phases, by call count per bucket key:

  1. warm-up (the first ``warmup_steps`` calls): plain top-k; every rank all-gathers every rank's ``k`` values
     and ``k`` int32 indices and sums the sparse vectors (the DGC exchange);
  2. autoencoder training (the next ``train_steps`` calls): the leader rank (group rank ``leader``) broadcasts its
     top-k indices; every rank takes ITS values at those indices, ``v_i = h_i[idx]``, and all-gathers them; the
     delivered sum is exact (the sum of the sparse vectors at the common indices). Every rank then trains the same
     autoencoder on the same gathered values (megacomp.compression.lgc_autoencoder.train: a reconstruction term
     plus a similarity term between the nodes' codes); at the last call the leader broadcasts its weights and
     every rank adopts them, so they are equal bit for bit;
  3. compressed (every later call), one of two instances:
       ``ps``   (parameter server): the leader broadcasts its indices and the code ``E(v_0 / s_0)`` of its values
                (``s = RMS of v``); every rank all-gathers its scale ``s_i`` and its innovation: the
                ``k_inno = ceil(innovation_density * n)`` largest of its own ``v_i`` with their positions, and its
                output scale ``a_i``. Node i's values are decoded by node i's decoder from the common code and node
                i's innovation: ``v̂_i = a_i * D_i(E(v_0 / s_0), inno_i / s_i)``; the delivered sum is
                ``sum_i v̂_i`` at the indices, in rank order;
       ``ring`` (ring all-reduce): the leader broadcasts its indices; every rank encodes its normalised values and
                the ranks all-reduce ``[s_i * E(v_i / s_i), s_i]``; with ``S = sum_i s_i``, the weighted mean
                code ``z = sum_i s_i z_i / S`` and ``d = D(z)``, every rank's output scale ``a_i`` is all-reduced
                too, and the delivered sum is ``(sum_i a_i) * d`` at the indices.

     The output scale ``a_i`` is the least-squares one, ``<v_i, d_i> / ||d_i||^2`` for node i's decoding ``d_i``
     (``fit_scale``, megacomp's addition: no node's values are delivered worse than not at all, so the residuals
     cannot grow), or ``s_i`` (``fit_scale: false``; ``ring`` then skips the second all-reduce).

Error feedback: each rank keeps ``e = h - own``, where ``own`` is the part of the delivered sum attributed to it,
computed with the same operations its receivers use: warm-up and training its sparse vector, ``ps`` its decoding
``v̂_i``, ``ring`` its share ``a_i * D(z)``. So ``sum_t delivered_t + sum_i e_i,T = sum_t sum_i g_i,t`` up to the
fp32 roundings of those sums and products, whatever the autoencoder learned.

Bytes per rank and call (fp32 values, int32 indices; megacomp.comm.stats' models: an all-gather sends a rank's
message to the ``N - 1`` others, a broadcast sends the leader's to the ``N - 1`` others, an all-reduce as
megacomp.comm.common.all_reduce_bytes): :meth:`LGC.wire_bytes`.

Error bound: none per element (top-k drops entries, a learned decoder promises nothing); what is dropped is carried
by the residuals, exactly as above.

Failure behaviour: bad settings (densities outside (0, 1], an innovation density not below the density, unknown
fields, the fields of ``lgc_pca``) raise ValueError with one line naming the fix when the settings are built. A
bucket whose top-k message is not smaller than itself travels as a plain all-reduce (bit for bit
``torch.distributed.all_reduce``). Non-finite inputs: a NaN/inf entry has the largest magnitude, is selected and
delivered (the optimizer's overflow check skips the step); its residual is dropped by the error feedback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from .codecs import build_from_spec
from .low_rank import StructuredCompressor

VARIANTS = ("ps", "ring")
PHASES = ("warmup", "train", "adopt", "compressed")
PCA_FIELDS = ("latent", "chunk", "decoder", "hidden", "train_samples", "retrain_threshold")
"""Fields of megacomp's chunked PCA / MLP variant (now ``lgc_pca``): a config naming ``lgc`` with them is refused
with the new name."""


@dataclass(frozen=True)
class LGC(StructuredCompressor):
    """Settings of LGC as published (YAML: ``{name: lgc, variant: ps, density: 0.001, warmup_steps: 20,
    train_steps: 20}``)."""

    name: str = "lgc"
    """Always ``lgc`` (names the compressor in YAML and checkpoints)."""
    variant: str = "ps"
    """``ps``: the parameter-server instance (the leader sends the common code, every rank its innovation);
    ``ring``: the ring all-reduce instance (the ranks all-reduce their codes)."""
    density: float = 0.001
    """Fraction of a bucket's entries the top-k front end keeps (the paper's 0.1%); ``k = ceil(density * n)``."""
    innovation_density: float = 0.00001
    """``ps``: fraction of a bucket's entries each rank sends as its innovation (values and positions); must be
    below ``density``. Unused by ``ring``."""
    warmup_steps: int = 20
    """Calls per bucket of plain top-k with accumulation (the DGC exchange) before the autoencoder trains."""
    train_steps: int = 20
    """Calls per bucket that exchange the top-k values at the leader's indices uncompressed and train the
    autoencoder on them; then the weights are frozen and the compressed phase starts."""
    train_iters: int = 5
    """Adam steps per training call, each on the values gathered by that call."""
    lr: float = 1e-3
    """Adam's learning rate for the autoencoder."""
    reconstruction_weight: float = 0.5
    """Weight of the reconstruction term of the autoencoder's loss."""
    similarity_weight: float = 0.5
    """Weight of the similarity term (mean squared difference between every pair of nodes' codes)."""
    channels: int = 16
    """Channels of the autoencoder's hidden 1-D convolutions (a lightweight network, as the paper asks)."""
    code_channels: int = 1
    """Channels of the code; the code has ``code_channels * ceil(k / 2**downsample)`` numbers."""
    downsample: int = 2
    """Stride-2 convolutions in the encoder (and stride-2 transposed ones per decoder)."""
    fit_scale: bool = True
    """Multiply each node's decoding by the least-squares scale ``a_i = <v_i, d_i> / ||d_i||^2`` of its own values
    ``v_i`` onto its decoding ``d_i`` (megacomp's addition: then ``||v_i - a_i d_i|| <= ||v_i||``, so error feedback
    never grows a residual, whatever the decoder learned; one more number per rank). False: the RMS scale ``s_i``
    that normalised the input, as the paper's normalisation would."""
    leader: int = 0
    """Group rank that chooses the common top-k indices (and sends the common code for ``ps``)."""
    seed: int = 0
    """Seed of the autoencoder's initial weights (the same on every rank)."""

    def __post_init__(self) -> None:
        if self.name != "lgc":
            raise ValueError(f"LGC settings have name 'lgc', got {self.name!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"lgc: variant must be one of {VARIANTS}, got {self.variant!r}")
        for field in ("warmup_steps", "train_steps", "train_iters", "channels", "code_channels", "downsample"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"lgc: {field} must be an int >= 1, got {v!r}")
        if not isinstance(self.fit_scale, bool):
            raise ValueError(f"lgc: fit_scale must be true or false, got {self.fit_scale!r}")
        if not isinstance(self.leader, int) or isinstance(self.leader, bool) or self.leader < 0:
            raise ValueError(f"lgc: leader must be a group rank (an int >= 0), got {self.leader!r}")
        for field in ("density", "innovation_density"):
            v = getattr(self, field)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
                raise ValueError(f"lgc: {field} must be a fraction in (0, 1], got {v!r} (the paper uses density "
                                 f"0.001)")
        if self.variant == "ps" and not self.innovation_density < self.density:
            raise ValueError(f"lgc: innovation_density ({self.innovation_density}) must be below density "
                             f"({self.density}): the innovation is a much sparser message than the top-k; e.g. "
                             f"innovation_density: {self.density / 100:g}")
        for field in ("lr", "reconstruction_weight"):
            v = getattr(self, field)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"lgc: {field} must be a number > 0, got {v!r}")
        if not isinstance(self.similarity_weight, (int, float)) or not self.similarity_weight >= 0:
            raise ValueError(f"lgc: similarity_weight must be a number >= 0, got {self.similarity_weight!r}")

    # -- the Codec-like surface channels and configs read ---------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data for YAML and checkpoints (``make_lgc`` rebuilds an equal value)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        return f"lgc-{self.variant}-top{self.density:g}+ae"

    # -- sizes -----------------------------------------------------------------------------------------
    def topk(self, numel: int) -> int:
        """``k``: entries the top-k front end keeps of a ``numel``-element bucket (at least 1)."""
        return max(1, min(numel, math.ceil(self.density * numel)))

    def innovation(self, numel: int) -> int:
        """``k_inno``: entries of each rank's innovation (``ps``), at least 1 and at most ``k``."""
        return max(1, min(self.topk(numel), math.ceil(self.innovation_density * numel)))

    def code_length(self, k: int) -> int:
        """Length of the code of ``k`` values per code channel: ``k`` halved (rounded up) ``downsample`` times."""
        for _ in range(self.downsample):
            k = -(-k // 2)
        return k

    def code_numel(self, numel: int) -> int:
        """Numbers in the code of a ``numel``-element bucket's top-k values."""
        return self.code_channels * self.code_length(self.topk(numel))

    def compresses(self, numel: int) -> bool:
        """Whether a top-k message (``k`` values and ``k`` indices) is smaller than the bucket; a bucket that is
        not travels as a plain all-reduce."""
        return 2 * self.topk(numel) < numel

    def decoders(self, world: int) -> int:
        """Decoders of the autoencoder: one per rank for ``ps`` (node i's from the common code and its
        innovation), one for ``ring`` (the mean code)."""
        return world if self.variant == "ps" else 1

    def wire_bytes(self, numel: int, world: int, rank: int, phase: str, weights_numel: int = 0) -> int:
        """Bytes group rank ``rank`` sends in one call of ``phase`` for a compressed bucket of ``numel`` elements:

        ``warmup``: all-gather of ``k`` fp32 values and ``k`` int32 indices: ``(N - 1) * 8k``;
        ``train``: the leader's broadcast of ``k`` indices (``(N - 1) * 4k``, leader only) and the all-gather of
        ``k`` values (``(N - 1) * 4k``);
        ``adopt`` (added to the last training call): the leader's broadcast of ``weights_numel`` fp32 weights;
        ``compressed``, ``ps``: the leader's broadcast of its code and ``k`` indices, and the all-gather of every
        rank's two scales, ``k_inno`` values and ``k_inno`` int32 positions; ``ring``: the leader's broadcast of
        ``k`` indices, the all-reduce of ``code + 1`` fp32 numbers and (``fit_scale``) of one more."""
        if phase not in PHASES:
            raise ValueError(f"lgc: phase must be one of {PHASES}, got {phase!r}")
        if world <= 1:
            return 0
        k, lead = self.topk(numel), rank == self.leader
        if phase == "warmup":
            return (world - 1) * 8 * k
        if phase == "train":
            return (world - 1) * 4 * k * (2 if lead else 1)
        if phase == "adopt":
            return (world - 1) * 4 * weights_numel if lead else 0
        if self.variant == "ps":
            broadcast = (world - 1) * 4 * (self.code_numel(numel) + k) if lead else 0
            return broadcast + (world - 1) * 4 * (2 + 2 * self.innovation(numel))
        fitted = 4 * _all_reduce_numel(1, world, rank) if self.fit_scale else 0
        return ((world - 1) * 4 * k if lead else 0) + 4 * _all_reduce_numel(self.code_numel(numel) + 1, world, rank) \
            + fitted


def _all_reduce_numel(numel: int, world: int, rank: int) -> int:
    """Elements rank ``rank`` sends in an all-reduce of ``numel`` (megacomp.comm.stats' model, as
    megacomp.comm.common.all_reduce_bytes: every shard but its own, then its own shard to the ``N - 1`` others)."""
    own = numel // world + (1 if rank < numel % world else 0)
    return numel - own + (world - 1) * own


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` entries of ``x`` (1-D) of largest magnitude, ascending (int64). A NaN counts as the
    largest (torch.topk's order), so it is sent, not silently kept back."""
    return torch.topk(x.abs(), k, sorted=False).indices.sort().values


def fitted_scale(v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Per row: the least-squares scale ``<v, d> / ||d||^2`` of ``v`` onto ``d`` (0 where ``d = 0``), so that
    ``||v - a d||^2 = ||v||^2 - <v, d>^2 / ||d||^2 <= ||v||^2``."""
    dd = d.pow(2).sum(dim=-1)
    return (v * d).sum(dim=-1) / torch.where(dd > 0, dd, torch.ones_like(dd))


def rms(v: torch.Tensor) -> torch.Tensor:
    """Per row of ``v`` (``rows x k``): ``||row|| / sqrt(k)``, the scale that normalises the autoencoder's input."""
    return v.norm(dim=-1) / math.sqrt(v.shape[-1])


def normalised(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``v / s`` per row; a row of scale 0 stays 0 (nothing to code)."""
    return v / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)


def is_lgc(spec: Any) -> bool:
    """Whether ``spec`` names LGC as published (an LGC, ``'lgc'`` or a mapping with that name)."""
    if isinstance(spec, LGC):
        return True
    if isinstance(spec, str):
        return spec == "lgc"
    return isinstance(spec, Mapping) and spec.get("name") == "lgc"


def make_lgc(spec: Any, **options: Any) -> LGC:
    """Build :class:`LGC` from ``'lgc'``, a mapping (YAML) or an LGC; extra keyword options override fields.

    Raises ValueError naming unknown fields, and for a mapping with the fields of megacomp's earlier ``lgc`` (the
    chunked PCA / MLP code, now ``lgc_pca``) one line naming the new name."""
    if isinstance(spec, Mapping):
        old = sorted(set(spec) & set(PCA_FIELDS))
        if old:
            raise ValueError(f"lgc: {old} are options of the chunked PCA / MLP autoencoder, which is now named "
                             f"lgc_pca; 'lgc' is the published method (top-k + autoencoder): use name: lgc_pca "
                             f"to keep the old one, or drop {old} for the published one")
    return build_from_spec(LGC, spec, options, "lgc")

"""A chunked PCA / MLP autoencoder code of gradient buckets (``lgc_pca``): megacomp's earlier reading of learned
gradient compression, kept under its own name. It is NOT the published LGC (Abrahamyan et al., IEEE TNNLS 2021:
a top-k front end, an autoencoder over the top-k values with a similarity term between the nodes' codes, a
parameter-server and a ring-allreduce instance), which is ``lgc`` (megacomp.compression.lgc). The settings as
data, and the local autoencoder math (encode, decode, train); the exchange lives in megacomp.comm.learned_channel.

A gradient bucket (flattened, fp32) is cut into chunks of ``chunk`` elements (the last one zero-padded). Each chunk
``x`` is one autoencoder sample: its scale ``s = ||x||_2 / sqrt(chunk)`` (0 for a zero chunk) normalises it,
``u = x / s``, the encoder maps ``u`` to ``latent`` numbers ``z = E(u)``, the decoder maps them back:
``x̂ = s * D(z)``. One autoencoder per bucket key, shared by every rank:

  1. training phase (the first ``train_steps`` calls of a key): the bucket is all-reduced uncompressed, and every
     rank all-gathers ``train_samples`` normalised chunks from each rank, so every rank trains on the same samples
     of every rank's gradients: a linear autoencoder is refitted to all samples seen so far (the principal
     subspace of their second-moment matrix, the least-squares optimum of a linear autoencoder), an MLP takes
     ``train_iters`` Adam steps on the mean squared reconstruction error of the call's samples. At the end of the
     phase rank 0's weights are all-gathered and adopted, so they are equal bit for bit on every rank;
  2. frozen phase: each rank sends codes of ``h = g + e`` (error feedback, kept by the channel) and keeps
     ``e = h - x̂_own``, where ``x̂_own`` is the sender's own decoding of exactly what it sent. So the error
     delivered is measured, not promised: ``sum_t delivered_t + sum_i e_i,T = sum_t sum_i g_i,t`` up to fp32
     rounding (the sums and products below), whatever the decoder does.

Two variants of the exchange:

  ``ring``  (decoder ``linear``: ``D(z) = W z``, no bias). The message is ``m = s * z``; the ranks all-reduce the
            messages and decode the sum once: ``D(sum_i m_i) = W sum_i s_i z_i = sum_i s_i D(z_i)``, the sum of what
            each rank's own decoding gave, exactly in real arithmetic (linearity; a bias or any nonlinearity breaks
            it, so the settings refuse a ring with another decoder). Wire: ``latent`` fp32 numbers per chunk.
  ``ps``    (decoder ``linear`` or ``mlp``: one hidden ReLU layer each side). Every rank's ``(z, s)`` is
            all-gathered and decoded separately, as a parameter server would, and the decodings are summed in rank
            order. Wire: ``latent + 1`` fp32 numbers per chunk (the all-gather model of megacomp.comm.stats).

Each call also carries two fp32 numbers per rank, ``||h - x̂_own||^2`` and ``||h||^2``, so every rank knows the
sender-measured relative error of the step; above ``retrain_threshold`` the key returns to the training phase for
``train_steps`` calls (the channel logs it), continuing from the current weights.

Error bound: none per element (a learned decoder promises nothing); the error that reaches the optimizer each step
is ``sum_i (h_i - x̂_i)``, exactly what the residuals carry into the next step.

Failure behaviour: settings that cannot compress (``latent >= chunk``, or ``latent + 1 >= chunk`` for ``ps``, which
also sends the scale), a ring with a nonlinear decoder, unknown fields or bad sizes raise ValueError naming the
fix when the settings are built. Non-finite inputs give a non-finite scale, so every rank delivers inf/NaN (the
optimizer's overflow check skips the step) and the error feedback drops that residual.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from .codecs import build_from_spec
from .lgc import LGC, is_lgc, make_lgc
from .low_rank import StructuredCompressor

VARIANTS = ("ring", "ps")
DECODERS = ("linear", "mlp")


@dataclass(frozen=True)
class LGCPCA(StructuredCompressor):
    """Settings of the chunked PCA / MLP autoencoder code (YAML: ``{name: lgc_pca, latent: 32, chunk: 512,
    train_steps: 20}``)."""

    name: str = "lgc_pca"
    """Always ``lgc_pca`` (names the compressor in YAML and checkpoints)."""
    latent: int = 32
    """Numbers per chunk in the code (must be below ``chunk``: the code is what is sent)."""
    chunk: int = 512
    """Elements per autoencoder input; a bucket is cut into chunks of this length (the last one zero-padded)."""
    variant: str = "ring"
    """``ring``: all-reduce the codes and decode their sum once (needs ``decoder: linear``); ``ps``: all-gather every
    rank's code and decode each (any decoder), as a parameter server would."""
    decoder: str = "linear"
    """``linear``: encoder and decoder are single bias-free matrices; ``mlp``: one hidden ReLU layer each side."""
    hidden: int = 128
    """Width of the hidden layers of the ``mlp`` autoencoder (unused by ``linear``)."""
    train_steps: int = 20
    """Calls per key that run uncompressed while the autoencoder trains (and again after each retraining trigger)."""
    train_samples: int = 64
    """Chunks each rank contributes to the training data per training call (all-gathered, uncompressed)."""
    train_iters: int = 20
    """Adam steps per training call of the ``mlp`` autoencoder, each on all the samples gathered by that call."""
    lr: float = 3e-3
    """Adam's learning rate for the ``mlp`` autoencoder (the linear one is fitted in closed form)."""
    retrain_threshold: float = 0.0
    """Retrain a key when a frozen call's sender-measured relative error ``sqrt(sum_i ||h_i - x̂_i||^2 /
    sum_i ||h_i||^2)`` (over the ranks) exceeds this; 0 = never."""
    seed: int = 0
    """Seed of the autoencoder's initial weights and of the sample draws (the same on every rank)."""

    def __post_init__(self) -> None:
        where = "lgc_pca"
        if self.name != "lgc_pca":
            raise ValueError(f"LGCPCA settings have name 'lgc_pca', got {self.name!r}")
        for field in ("latent", "chunk", "hidden", "train_steps", "train_samples", "train_iters"):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: {field} must be an int >= 1, got {v!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"{where}: variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.decoder not in DECODERS:
            raise ValueError(f"{where}: decoder must be one of {DECODERS}, got {self.decoder!r}")
        sent = self.latent + (1 if self.variant == "ps" else 0)
        if sent >= self.chunk:
            raise ValueError(f"{where}: latent={self.latent} cannot compress chunks of {self.chunk} elements "
                             f"(a code of {sent} numbers per chunk{' with its scale' if self.variant == 'ps' else ''}); use "
                             f"latent < {self.chunk - (1 if self.variant == 'ps' else 0)}, e.g. latent: "
                             f"{max(1, self.chunk // 16)}, or a larger chunk")
        if self.variant == "ring" and self.decoder != "linear":
            raise ValueError(f"{where}: the ring variant sums codes, which decodes to the sum of the gradients only "
                             f"for a linear decoder; use decoder: linear, or variant: ps for decoder: {self.decoder}")
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"{where}: lr must be a number > 0, got {self.lr!r}")
        if not isinstance(self.retrain_threshold, (int, float)) or self.retrain_threshold < 0:
            raise ValueError(f"{where}: retrain_threshold must be a number >= 0 (0 = never retrain), "
                             f"got {self.retrain_threshold!r}")

    # -- the Codec-like surface channels and configs read ---------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data for YAML and checkpoints (``make_learned`` rebuilds an equal value)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        return f"lgc_pca-{self.variant}-{self.decoder}{self.latent}/{self.chunk}+ef"

    # -- sizes -----------------------------------------------------------------------------------------
    def chunks(self, numel: int) -> int:
        """Chunks of a bucket of ``numel`` elements (the last one zero-padded)."""
        return -(-numel // self.chunk)

    def message_numel(self, numel: int) -> int:
        """fp32 numbers one rank contributes per frozen call for a bucket of ``numel`` elements: the codes (and the
        scales for ``ps``) plus the two error sums."""
        return self.chunks(numel) * (self.latent + (1 if self.variant == "ps" else 0)) + 2

    def compresses(self, numel: int) -> bool:
        """Whether the code of a ``numel``-element bucket is smaller than the bucket (a bucket shorter than a chunk
        may not be: its padding is coded too); a bucket that is not travels uncompressed."""
        return self.message_numel(numel) < numel


def init_autoencoder(lgc: LGCPCA, key: str, device=None) -> dict[str, torch.Tensor]:
    """The seeded start weights of key ``key``'s autoencoder (drawn on the CPU: the same on every rank and device).

    Linear: ``enc`` (latent x chunk) with orthonormal rows, ``dec`` its transpose. MLP: two layers each side,
    uniform in ``+-1/sqrt(fan_in)`` (torch's Linear default), zero biases."""
    g = torch.Generator().manual_seed((lgc.seed * 1_000_003 + zlib.crc32(key.encode())) % (1 << 63))
    c, d, h = lgc.latent, lgc.chunk, lgc.hidden
    if lgc.decoder == "linear":
        q = torch.linalg.qr(torch.randn(d, c, generator=g)).Q  # d x c, orthonormal columns
        out = {"enc": q.t().contiguous(), "dec": q.contiguous()}
    else:
        def layer(o, i):
            return (torch.rand(o, i, generator=g) * 2 - 1) / math.sqrt(i)
        out = {"enc1": layer(h, d), "enc1_b": torch.zeros(h), "enc2": layer(c, h), "enc2_b": torch.zeros(c),
               "dec1": layer(h, c), "dec1_b": torch.zeros(h), "dec2": layer(d, h), "dec2_b": torch.zeros(d)}
    return {k: v.to(device) if device is not None else v for k, v in out.items()}


def chunked(lgc: LGCPCA, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (fp32, 1-D) zero-padded to whole chunks, as a ``chunks x chunk`` matrix."""
    n = lgc.chunks(flat.numel())
    pad = n * lgc.chunk - flat.numel()
    return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(n, lgc.chunk)


def normalise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (chunk) of ``x``: ``(x / s, s)`` with ``s = ||row||_2 / sqrt(len)``; a zero row keeps ``s = 0`` and
    normalises to zeros. A non-finite row gives a non-finite ``s``, so its decoding is non-finite too."""
    s = x.norm(dim=1) / math.sqrt(x.shape[1])
    return x / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(1), s


def encode(lgc: LGCPCA, w: Mapping[str, torch.Tensor], u: torch.Tensor) -> torch.Tensor:
    """Codes ``E(u)`` of the normalised chunks ``u`` (rows), ``chunks x latent``."""
    if lgc.decoder == "linear":
        return u @ w["enc"].t()
    return torch.relu(u @ w["enc1"].t() + w["enc1_b"]) @ w["enc2"].t() + w["enc2_b"]


def decode(lgc: LGCPCA, w: Mapping[str, torch.Tensor], z: torch.Tensor) -> torch.Tensor:
    """Decodings ``D(z)`` of codes ``z`` (rows), ``chunks x chunk``. Linear: ``z @ W^T``, so ``D(a + b) = D(a) + D(b)``
    in real arithmetic (the ring variant's premise); MLP: not additive."""
    if lgc.decoder == "linear":
        return z @ w["dec"].t()
    return torch.relu(z @ w["dec1"].t() + w["dec1_b"]) @ w["dec2"].t() + w["dec2_b"]


def train_state(lgc: LGCPCA, w: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The training state of an autoencoder with weights ``w``. Linear: the running second-moment matrix of the
    samples seen (``cov``, fp64, chunk x chunk) and their count ``t``; MLP: Adam's zero first and second moments
    (``m.<name>``, ``v.<name>``) and its step count ``t``."""
    if lgc.decoder == "linear":
        return {"cov": torch.zeros(lgc.chunk, lgc.chunk, dtype=torch.float64, device=w["dec"].device),
                "t": torch.zeros((), dtype=torch.int64)}
    out = {f"m.{k}": torch.zeros_like(v) for k, v in w.items()}
    out.update({f"v.{k}": torch.zeros_like(v) for k, v in w.items()})
    out["t"] = torch.zeros((), dtype=torch.int64)
    return out


def train(lgc: LGCPCA, w: dict[str, torch.Tensor], state: dict[str, torch.Tensor], samples: torch.Tensor) -> float:
    """One training call on the normalised ``samples`` (rows), updating ``w`` and ``state`` in place; returns the mean
    squared reconstruction error of the samples after it. Deterministic: the same samples, weights and state give the
    same bits on the same device.

    Linear: the samples join the running second-moment matrix and the weights become its top ``latent`` eigenvectors
    (``enc = V^T``, ``dec = V``): the autoencoder of least mean squared error over every sample seen so far (the
    optimum of a linear autoencoder is the principal subspace; Baldi and Hornik, 1989). MLP: ``train_iters`` Adam
    steps (betas 0.9 / 0.999, eps 1e-8, learning rate ``lr``) on the mean squared error of these samples."""
    if lgc.decoder == "linear":
        state["cov"] += samples.double().t() @ samples.double()
        state["t"] += samples.shape[0]
        vecs = torch.linalg.eigh(state["cov"]).eigenvectors[:, -lgc.latent:].flip(1)  # largest eigenvalues first
        w["dec"] = vecs.to(torch.float32).contiguous()
        w["enc"] = w["dec"].t().contiguous()
    else:
        for _ in range(lgc.train_iters):
            params = {k: v.detach().requires_grad_(True) for k, v in w.items()}
            with torch.enable_grad():
                loss = (decode(lgc, params, encode(lgc, params, samples)) - samples).pow(2).mean()
                grads = torch.autograd.grad(loss, list(params.values()))
            state["t"] += 1
            t = int(state["t"])
            with torch.no_grad():
                for (k, p), gr in zip(params.items(), grads):
                    m, v = state[f"m.{k}"], state[f"v.{k}"]
                    m.mul_(0.9).add_(gr, alpha=0.1)
                    v.mul_(0.999).addcmul_(gr, gr, value=0.001)
                    denom = (v / (1 - 0.999 ** t)).sqrt_().add_(1e-8)
                    w[k] = p.detach().addcdiv(m, denom, value=-lgc.lr / (1 - 0.9 ** t))
    return float((decode(lgc, w, encode(lgc, w, samples)) - samples).pow(2).mean())


def restart_training(lgc: LGCPCA, state: dict[str, torch.Tensor]) -> None:
    """Before a retraining phase: a linear autoencoder forgets the samples seen so far (its new subspace is fitted to
    the gradients of now); an MLP keeps its weights and Adam state and continues from them."""
    if lgc.decoder == "linear":
        state["cov"].zero_()
        state["t"].zero_()


def is_learned(spec: Any) -> bool:
    """Whether ``spec`` names a learned compressor: LGC as published (``lgc``, megacomp.compression.lgc) or the
    chunked PCA / MLP code (``lgc_pca``): an instance, its name, or a mapping with that name."""
    if isinstance(spec, (LGCPCA, LGC)):
        return True
    if isinstance(spec, str):
        return spec in ("lgc", "lgc_pca")
    return isinstance(spec, Mapping) and spec.get("name") in ("lgc", "lgc_pca")


def make_learned(spec: Any, **options: Any) -> "LGCPCA | LGC":
    """Build the learned compressor ``spec`` names: :class:`~megacomp.compression.lgc.LGC` for ``lgc``,
    :class:`LGCPCA` for ``lgc_pca`` (from the name, a mapping (YAML) or an instance); extra keyword options override
    fields. Raises ValueError naming unknown fields and the allowed ones, or a setting that cannot compress."""
    if is_lgc(spec):
        return make_lgc(spec, **options)
    return make_lgc_pca(spec, **options)


def make_lgc_pca(spec: Any, **options: Any) -> LGCPCA:
    """Build :class:`LGCPCA` from ``'lgc_pca'``, a mapping (YAML) or an LGCPCA; raises ValueError naming unknown
    fields and the allowed ones, or a setting that cannot compress."""
    return build_from_spec(LGCPCA, spec, options, "lgc_pca")

"""SparseLoCo's and DCT-momentum DiLoCo's outer step: an error-feedback accumulator in place of outer momentum.

SparseLoCo (Sarfi et al., 2025, arXiv 2508.15706), per outer step, on
replica r with outer weights theta, local weights theta_r after H inner steps and accumulator e_r:

    Delta_r    = theta - theta_r                      the pseudo-gradient
    e_r       <- beta * e_r + Delta_r                 decayed accumulator (it plays the outer momentum)
    Dhat_r     = C(e_r)                               the outer codec: top-k per chunk, values in 2 bits
    e_r       <- e_r - Dhat_r                         what was sent leaves the accumulator
    theta     <- theta - alpha * mean_r Dhat_r        plain averaged step, no momentum state

The exchange is an all-gather of every replica's encoding (``Channel.all_gather_into_tensor``), decoded
slot by slot and summed in fp32 in replica order, so the mean is exact for the decoded values and the
same on every rank, and there is a single compression per step (a reduce-scatter/all-gather all-reduce
would re-compress the reduced shard). ``Dhat_r`` is this replica's own slot, decoded from the very bytes
the others received, so ``e_r - Dhat_r`` is exactly the residual of what was sent. Cost per replica and
outer step: it sends its encoding to the R - 1 others (``(R - 1) * wire_bytes``, counted under the
channel's tag) and decodes R encodings (O(R * n) work, an R * n fp32 buffer for this rank's parameters).

Against the authors' code (tplr-ai/SparseLoCo, src/tplr/sparseloco.py): the rule and alpha = 1, beta = 0.95 are
theirs; their top-k runs over each tensor's 64 x 64 tiles (here: runs of ``chunk`` entries of the flat buffer,
the same entries where a tile is such a run), their 2-bit quantizer decodes to the mean of each of 4 bins of a
tensor's kept values (here: int2, symmetric, a scale per 128), and their aggregate divides each entry by the
replicas that sent it (here and in the paper: by R). tests/test_outer_sparseloco.py restates their step.

DCT-momentum DiLoCo (arXiv 2510.03371) is the same rule with a DCT codec (``transform='dct'`` plus top-k
per chunk: the accumulated Nesterov-style momentum is split in the frequency domain, the strongest
components are synchronised, the rest stay local). Only the paper's abstract is in our references, so this
is a reconstruction in DeMo's decoupled-momentum form, not the authors' exact update; the README says so.

Error bound: the applied step is alpha times the exact mean of the decoded Dhat_r (fp32 round-off of an
R-term sum); whatever the codec drops stays in e_r and is sent later, so sum over steps of Dhat_r plus the
final e_r telescopes to the decayed sum of the Delta_r. With an identity codec, beta = 0 and alpha = 1 the
step is theta - mean(Delta_r) = mean(theta_r) up to fp32 round-off.

Across nodes and sites: the replicas' messages are all-gathered flat over the outer groups (one rank per replica and
position); ranks of a replica that hold the same parameters each send theirs across the slow link (not hop by hop).
"""
from __future__ import annotations

import torch

from ..comm import Channel
from ..compression import make_codec

DEFAULT_LR, DEFAULT_DECAY = 1.0, 0.95
"""alpha and beta of the paper's runs (the reference code's outer_learning_rate 1 and error_decay 0.95): the outer_lr
and outer_momentum of megacomp.outer.DiLoCoConfig(algorithm='sparseloco') left unset, and of the CLI."""

DEFAULT_CODEC = make_codec("int2", k=64, chunk=4096)
"""SparseLoCo's outer codec when none is set: top-64 of every 4096 entries (1.6% density, inside the paper's 1-3%),
values in 2 bits (the ``outer`` path of a CommCompressionConfig left unset means this for SparseLoCo)."""


def start_exchange(channel: Channel, accum: torch.Tensor, delta: torch.Tensor, beta: float, replicas: int,
                   async_op: bool):
    """``e <- beta * e + Delta`` in place, then the all-gather of ``C(e)`` (encoded now, so ``e`` may change
    afterwards). Returns (work or None, the [replicas * n] fp32 buffer that holds every decoded slot after
    ``work.wait()``)."""
    accum.mul_(beta).add_(delta)
    gathered = torch.empty(replicas * accum.numel(), dtype=torch.float32, device=accum.device)
    work = channel.all_gather_into_tensor(gathered, accum, async_op=async_op)
    return work, gathered


def outer_update(outer: torch.Tensor, accum: torch.Tensor, gathered: torch.Tensor, replica: int, replicas: int,
                 lr: float) -> None:
    """``e <- e - Dhat_self`` and ``theta <- theta - lr * mean(Dhat)`` (fp32 sum in replica order)."""
    slots = gathered.view(replicas, -1)
    accum.sub_(slots[replica])
    mean = slots[0].clone()
    for j in range(1, replicas):
        mean.add_(slots[j])
    mean.div_(replicas)
    outer.add_(mean, alpha=-lr)

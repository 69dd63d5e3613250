"""MT-DAO's synchronisation: parameters and every optimizer moment averaged across the replicas every H steps.

Algorithm (Iacob et al., "MT-DAO", ICLR 2026), per replica, with the
inner optimizer megacomp.optimizer.MultiTimescaleAdamW (fast and slow first moments, second moment):

    H inner steps on the replica's own data
    theta <- mean over the replicas of theta        the DiLoCo engine with outer lr 1, no momentum: theta_t =
                                                    theta_{t-1} - mean(theta_{t-1} - theta_i), the mean of the
                                                    local weights up to fp32 rounding (through the outer codec)
    x     <- mean over the replicas of x            for every optimizer state tensor x (exp_avg, exp_avg_sq,
                                                    slow_avg_j): :func:`average_optimizer_state`, uncompressed

The fast term: the paper's update mixes the slow momenta with the raw gradient, (1 - sum_j w_j) * g (its
quasi-hyperbolic form, no state beyond the slow momenta); MultiTimescaleAdamW's betas[0] = 0 (``--adam-beta1 0``) is
exactly that (its exp_avg is then g, bias correction 1), and :func:`average_optimizer_state` does not send exp_avg
then: the next step overwrites it with the new gradient before anything reads it. The default betas[0] = 0.9
keeps Adam's fast momentum in its place (AdamW's update when the slow weights are 0), which the paper's family
also covers (several momenta, one of them fast) but at one more parameter-sized exchange per synchronisation.

The paper allows a separate period per state (K_x, K_j, K_v); here all share H, which is the setting of its
experiments (K = K_x = K_1 = K_v). The state tensors cross uncompressed: a quantised second moment would
change every coordinate's step size, and no codec here is designed (or tested) for that. They are counted
under the ``outer`` traffic kind, so a run's bytes say what the extra moments cost: (2 + N) x the parameter
bytes per synchronisation for N slow momenta ((1 + N) x with betas[0] = 0), on top of the parameters' exchange.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Channel


@torch.no_grad()
def average_optimizer_state(optimizer: torch.optim.Optimizer, channel: Channel) -> int:
    """Replace every floating-point state tensor of ``optimizer`` (``step`` counters excepted) by its mean
    over ``channel.group``; returns how many tensors were averaged (the same on every rank). ``exp_avg`` of a
    group with ``betas[0] == 0`` is skipped: it is the last gradient, overwritten by the next step unread.

    Every member must hold the same parameters in the same order with the same state keys (equal positions
    of equal replicas do); tensors are visited in parameter order, keys sorted, so the collectives pair up.

    Raises:
        ValueError: a parameter with a gradient step but no state on this rank (nothing to average yet).
    """
    replicas = dist.get_world_size(channel.group)
    count = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                raise ValueError("MT-DAO: a parameter has no optimizer state to average; synchronise only after "
                                 "the first inner step")
            for name in sorted(state):
                x = state[name]
                if name == "step" or not torch.is_tensor(x) or not x.is_floating_point():
                    continue
                if name == "exp_avg" and group.get("betas", (None,))[0] == 0:
                    continue
                x.div_(replicas)  # mean = sum / R: gloo has no AVG
                channel.all_reduce(x, dist.ReduceOp.SUM, key=f"mt_dao/{name}")
                count += 1
    return count

"""DistributedOptimizer.overlap_param_gather (megacomp.optimizer.param_gather) on real gloo groups.

- Bit for bit the synchronous all-gather's results and bytes (int4 + LoCo gradients, int8 parameters, several
  buckets, DP 2; uncompressed too), with the all-gathers in flight between step() and the next forward and finished
  by the owning modules' forward pre-hooks.
- state_dict() and wait_params() finish what is in flight; a forward that reads another module's parameter before
  that module ran is caught in backward (RuntimeError naming the fix); bad set-ups raise ValueError.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from megacomp import comm
from megacomp.optimizer import DistributedOptimizer
from test_optimizer_distributed import batch, loss_fn, make_model

KW = dict(grad_codec="int4", error_feedback="loco", param_codec="int8", bucket_size=40, min_compress_numel=0, lr=1e-2)


def _train_body(rank, world, overlap, kw):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, **kw)
    assert len(opt.buckets) > 1
    if overlap:
        opt.overlap_param_gather(model)
    comm.reset_stats()
    losses, in_flight = [], []
    for step in range(5):
        loss = loss_fn(model, *batch(rank, step))
        losses.append(loss.item())
        loss.backward()
        opt.step()
        in_flight.append(len(opt._pending))
    opt.wait_params()
    stats = {k: v.wire_bytes for k, v in comm.stats().items()}
    return losses, [p.detach().clone() for p in model.parameters()], stats, in_flight


@pytest.mark.parametrize("kw", [KW, dict(bucket_size=40, lr=1e-2)], ids=["int4-loco-int8", "uncompressed"])
def test_overlapped_gather_is_bit_identical_to_the_synchronous_one(kw):
    sync = run_ranks(_train_body, 2, False, kw)
    over = run_ranks(_train_body, 2, True, kw)
    for (l0, p0, s0, f0), (l1, p1, s1, f1) in zip(sync, over):
        assert l0 == l1
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))
        assert s0 == s1
        assert set(f0) == {0} and all(n > 1 for n in f1)  # every bucket in flight after each overlapped step


def _hooks_body(rank, world):
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, **KW)
    opt.overlap_param_gather(model)
    loss_fn(model, *batch(rank, 0)).backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    first_layer = model[0]
    first_layer(batch(rank, 1)[0])  # the first layer's forward finishes the buckets up to its own
    partly = len(opt._pending)
    state = opt.state_dict()  # finishes the rest
    after = [p.detach().clone() for p in model.parameters()]
    return partly, len(opt._pending), any(not torch.equal(a, b) for a, b in zip(before, after)), sorted(state)


def test_pre_hooks_and_state_dict_finish_the_gathers():
    for partly, left, changed, keys in run_ranks(_hooks_body, 2):
        assert 0 < partly and left == 0 and changed
        assert keys == ["dp_rank_0"] or keys == ["dp_rank_1"]


class ForeignUse(nn.Module):
    """Reads its child's weight without calling the child: the child's pre-hook never runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(7, 3)

    def forward(self, x):
        return F.linear(x, self.lin.weight, self.lin.bias)


def _stale_body(rank, world):
    model = ForeignUse()
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, bucket_size=8, lr=1e-2)
    opt.overlap_param_gather(model)
    x, y = batch(rank, 0)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    try:
        ((model(x) - y) ** 2).mean().backward()
    except RuntimeError as e:
        message = str(e)
    opt.zero_grad()
    opt.wait_params()
    errors = []
    for bad in (dict(shard=False), ):
        m = make_model()
        try:
            DistributedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2, **bad).overlap_param_gather(m)
        except ValueError as e:
            errors.append(str(e))
    m = make_model()
    try:
        DistributedOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-2).overlap_param_gather(nn.Linear(2, 2))
    except ValueError as e:
        errors.append(str(e))
    return message, errors


def test_stale_reads_and_bad_setups_raise_naming_the_fix():
    for message, errors in run_ranks(_stale_body, 2):
        assert "previous step's values" in message and "wait_params()" in message
        assert "shard=True" in errors[0]
        assert "not in the model" in errors[1]

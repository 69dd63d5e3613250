"""A transformer block built from the TP layers matches a single-device block written with nn.Linear and
F.scaled_dot_product_attention (TP 2 and 4, with and without sequence parallelism, inside a TP x DP grid),
forward and backward (megacomp.models.transformer)."""
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from megacomp import parallel_state
from megacomp.config import ModelParallelConfig
from megacomp.models import TransformerBlock, TransformerConfig
from megacomp.tensor_parallel import allreduce_sequence_parallel_gradients

S, B, H, HEADS = 8, 2, 32, 4


class ReferenceBlock(nn.Module):
    """Plain single-device pre-LN block with the same parameter layout (per-head fused QKV rows)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        s, b = x.shape[:2]
        qkv = self.qkv(self.ln1(x)).view(s, b, HEADS, 3, H // HEADS)
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3).reshape(s, b, H)
        x = x + self.proj(ctx)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _block_body(rank, world, tp, sp):
    groups = parallel_state.initialize_model_parallel(tp)
    r, d = groups.tp_rank, groups.dp_rank
    cfg = TransformerConfig(hidden_size=H, num_attention_heads=HEADS, num_layers=2)
    torch.manual_seed(0)
    block = TransformerBlock(cfg, ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp))
    ref = ReferenceBlock()
    with torch.no_grad():  # gather the TP shards into the reference (random biases / LN params too)
        gen = torch.Generator().manual_seed(1)
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        def shard(full, dim):
            return full.chunk(tp, dim=dim)[r]
        for mine, full, dim in [(block.attention.qkv, ref.qkv, 0), (block.mlp.fc1, ref.fc1, 0)]:
            mine.weight.copy_(shard(full.weight, 0))
            mine.bias.copy_(shard(full.bias, 0))
        for mine, full in [(block.attention.proj, ref.proj), (block.mlp.fc2, ref.fc2)]:
            mine.weight.copy_(shard(full.weight, 1))
            mine.bias.copy_(full.bias)
        for mine, full in [(block.ln1, ref.ln1), (block.ln2, ref.ln2)]:
            mine.weight.copy_(full.weight)
            mine.bias.copy_(full.bias)
    X = torch.randn(S, B, H, generator=torch.Generator().manual_seed(10 + d))
    G = torch.randn(S, B, H, generator=torch.Generator().manual_seed(20 + d))
    seq = slice(r * S // tp, (r + 1) * S // tp) if sp else slice(None)
    x = X[seq].clone().requires_grad_()
    out = block(x)
    (out * G[seq]).sum().backward()
    allreduce_sequence_parallel_gradients(block.parameters(), groups.tp)
    xr = X.clone().requires_grad_()
    ref_out = ref(xr)
    (ref_out * G).sum().backward()
    torch.testing.assert_close(out, ref_out[seq])
    torch.testing.assert_close(x.grad, xr.grad[seq])
    pairs = [(block.attention.qkv.weight.grad, ref.qkv.weight.grad.chunk(tp, 0)[r]),
             (block.attention.proj.weight.grad, ref.proj.weight.grad.chunk(tp, 1)[r]),
             (block.attention.proj.bias.grad, ref.proj.bias.grad),
             (block.mlp.fc1.bias.grad, ref.fc1.bias.grad.chunk(tp, 0)[r]),
             (block.mlp.fc2.weight.grad, ref.fc2.weight.grad.chunk(tp, 1)[r]),
             (block.ln1.weight.grad, ref.ln1.weight.grad), (block.ln2.bias.grad, ref.ln2.bias.grad)]
    for got, want in pairs:
        torch.testing.assert_close(got, want)
    parallel_state.destroy_model_parallel()
    return True


@pytest.mark.parametrize("world,tp,sp", [(2, 2, False), (2, 2, True), (4, 4, True), (4, 2, True)],
                         ids=["tp2", "tp2-sp", "tp4-sp", "tp2xdp2-sp"])
def test_block_matches_single_device(world, tp, sp):
    assert all(run_ranks(_block_body, world, tp, sp))


# -- the optional apex path (apex cannot be installed here: the guard is tested with stand-in modules) ----------
def test_apex_guard_falls_back_when_apex_is_missing_or_unrelated(monkeypatch):
    import types

    from megacomp.models import transformer as tr

    monkeypatch.setitem(sys.modules, "apex", None)  # not installed: import raises ImportError
    assert tr.apex_layer_norm_class() is None
    unrelated = types.ModuleType("apex")  # PyPI's unrelated "apex": a module without apex.normalization
    monkeypatch.setitem(sys.modules, "apex", unrelated)
    monkeypatch.delitem(sys.modules, "apex.normalization", raising=False)
    assert tr.apex_layer_norm_class() is None
    ln = tr.layer_norm(8, 1e-5, False, torch.bfloat16)
    assert type(ln) is torch.nn.LayerNorm and ln.weight.dtype == torch.bfloat16


def test_apex_layer_norm_gets_the_model_dtype(monkeypatch):
    """apex's FusedLayerNorm takes no dtype and makes fp32 parameters: layer_norm casts them to the model's."""
    import types

    from megacomp.models import transformer as tr

    class FusedLayerNorm(torch.nn.LayerNorm):  # apex's constructor signature: no dtype argument
        def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True):
            super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine)

    apex, norm = types.ModuleType("apex"), types.ModuleType("apex.normalization")
    norm.FusedLayerNorm = FusedLayerNorm
    apex.normalization = norm
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", norm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ln = tr.layer_norm(8, 1e-5, True, torch.bfloat16)
    assert type(ln) is FusedLayerNorm and {p.dtype for p in ln.parameters()} == {torch.bfloat16}
    assert all(p.sequence_parallel for p in ln.parameters())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # apex without CUDA: torch's LayerNorm
    assert type(tr.layer_norm(8, 1e-5, False, torch.float32)) is torch.nn.LayerNorm

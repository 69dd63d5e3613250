"""The Llama options of megacomp.models (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied output layer).

- Pieces against plain single-device references written here in straight torch: RoPE as a complex rotation of
  the pairs (x_i, x_{i + d/2}); RMSNorm in fp64; a whole Llama block (separate q, k, v, gate, up projections,
  key/value heads repeated with repeat_interleave, attention as masked softmax) against the TP block at TP 2 and 4,
  with and without sequence parallelism, forward and backward, each option alone and all together.
- The Llama-style GPTModel at TP 2 (with and without SP), PP 2 and PP 2 interleaved equals the unsplit TP 1 model
  (loss and every gradient) within fp32 round-off, compression off.
- With int8 on tp_forward (on sp_reduce_scatter under SP) every forward all-reduce (reduce-scatter) of the model is
  within the codec's bound (tests/codec_bounds.py) of the exact sum of the partials that layer computed.
- Bad shapes are refused with one ValueError line.

Tolerances: the TP and single-device computations differ only in how fp32 matmul sums are split and re-associated,
so comparisons use torch.testing.assert_close's fp32 defaults, as the GPT tests do (rtol 1.3e-6, atol 1e-5), with
the absolute part scaled by the reference tensor's largest magnitude when that exceeds 1 (:func:`close`):
re-association round-off is a few ulps of the summed terms, so a gradient of magnitude 40 may differ by
40 x 1e-5 (about 80 fp32 ulps of its largest element), not 1e-5.
"""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from codec_bounds import all_reduce_bound, reduce_scatter_bound
from distributed import run_ranks
from megacomp import parallel_state
from megacomp.compression import make_codec
from megacomp.config import CommCompressionConfig, ModelParallelConfig
from megacomp.models import RMSNorm, TransformerBlock, TransformerConfig, llama_config
from megacomp.models.chunks import GPTChunks
from megacomp.models.gpt import GPTModel, split_layers, sync_tied_embedding_grads
from megacomp.models.transformer import ParallelAttention, apply_rotary, rotary_cos_sin
from megacomp.tensor_parallel import ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_gradients

S, B, H = 8, 2, 32


def close(got, want, what=""):
    """assert_close at the fp32 defaults, atol scaled by max(1, max |want|) (see the module docstring)."""
    scale = max(1.0, want.detach().abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


# -- references ---------------------------------------------------------------------------------------------------
def ref_rope(x, base):
    """RoPE as a complex rotation: z_i = x_i + j x_{i+d/2} times exp(j p base^(-2i/d)), in fp64; x [..., s, d]."""
    s, d = x.shape[-2:]
    xd = x.double()
    z = torch.complex(xd[..., :d // 2], xd[..., d // 2:])
    theta = torch.tensor([base ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
    pos = torch.arange(s, dtype=torch.float64)[:, None]
    z = z * torch.polar(torch.ones_like(pos * theta), pos * theta)
    return torch.cat([z.real, z.imag], -1)


def ref_rms_norm(x, weight, eps):
    xd = x.double()
    return xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * weight.double()


class ReferenceBlock(nn.Module):
    """Plain pre-norm block with separate projections: Wq [n d, h], Wk, Wv [g d, h], gate / up [f, h]."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        n, g, f, bias = cfg.num_attention_heads, cfg.num_query_groups, cfg.ffn_hidden_size, cfg.add_bias_linear
        d = H // n
        rms = cfg.normalization == "RMSNorm"
        self.ln1, self.ln2 = ((RefRMSNorm(cfg.layernorm_epsilon), RefRMSNorm(cfg.layernorm_epsilon)) if rms
                              else (nn.LayerNorm(H), nn.LayerNorm(H)))
        self.wq = nn.Linear(H, n * d, bias=bias)
        self.wk, self.wv = nn.Linear(H, g * d, bias=bias), nn.Linear(H, g * d, bias=bias)
        self.proj = nn.Linear(H, H, bias=bias)
        if cfg.swiglu:
            self.gate, self.up = nn.Linear(H, f, bias=bias), nn.Linear(H, f, bias=bias)
        else:
            self.fc1 = nn.Linear(H, f, bias=bias)
        self.fc2 = nn.Linear(f, H, bias=bias)

    def forward(self, x):
        cfg, s, b = self.cfg, x.shape[0], x.shape[1]
        n, g = cfg.num_attention_heads, cfg.num_query_groups
        d = H // n
        y = self.ln1(x)
        q = self.wq(y).view(s, b, n, d).permute(1, 2, 0, 3)  # [b, n, s, d]
        k = self.wk(y).view(s, b, g, d).permute(1, 2, 0, 3)
        v = self.wv(y).view(s, b, g, d).permute(1, 2, 0, 3)
        if cfg.position_embedding_type == "rope":
            q, k = ref_rope(q, cfg.rotary_base).float(), ref_rope(k, cfg.rotary_base).float()
        k, v = k.repeat_interleave(n // g, dim=1), v.repeat_interleave(n // g, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        ctx = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, H)
        x = x + self.proj(ctx)
        y = self.ln2(x)
        act = F.silu(self.gate(y)) * self.up(y) if cfg.swiglu else F.gelu(self.fc1(y))
        return x + self.fc2(act)


class RefRMSNorm(nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(H))

    def forward(self, x):
        return ref_rms_norm(x, self.weight, self.eps).float()


def _get(module, attr: str):
    """``module.weight``, ``.bias`` or ``.weight.grad`` by a dotted name."""
    for a in attr.split("."):
        module = getattr(module, a)
    return module


def fused_qkv(ref: ReferenceBlock, attr: str):
    """The reference's q, k, v rows (or biases) in megacomp's per-group layout [q of group j's heads; k_j; v_j]."""
    g = ref.cfg.num_query_groups
    q, k, v = (_get(getattr(ref, w), attr) for w in ("wq", "wk", "wv"))
    qs, ks, vs = q.chunk(g, 0), k.chunk(g, 0), v.chunk(g, 0)
    return torch.cat([torch.cat([qs[j], ks[j], vs[j]], 0) for j in range(g)], 0)


def fused_fc1(ref: ReferenceBlock, attr: str):
    """gate and up rows interleaved per unit: [gate_0; up_0; gate_1; up_1; ...]."""
    gate, up = _get(ref.gate, attr), _get(ref.up, attr)
    return torch.stack([gate, up], 1).reshape(-1, *gate.shape[1:])


BLOCK_CASES = {  # name -> TransformerConfig fields
    "rope": dict(num_attention_heads=4, position_embedding_type="rope", rotary_base=500000.0),
    "rmsnorm": dict(num_attention_heads=4, normalization="RMSNorm", layernorm_epsilon=1e-6),
    "swiglu": dict(num_attention_heads=4, swiglu=True, ffn_hidden_size=48),
    "gqa": dict(num_attention_heads=4, num_query_groups=2),
    "llama": dict(num_attention_heads=8, num_query_groups=4, position_embedding_type="rope", normalization="RMSNorm",
                  swiglu=True, ffn_hidden_size=48, add_bias_linear=False),
}


def _block_body(rank, world, tp, sp, case):
    groups = parallel_state.initialize_model_parallel(tp)
    r = groups.tp_rank
    cfg = TransformerConfig(hidden_size=H, num_layers=2, **BLOCK_CASES[case])
    torch.manual_seed(0)
    block = TransformerBlock(cfg, ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp))
    ref = ReferenceBlock(cfg)
    shard = lambda full, dim: full.chunk(tp, dim=dim)[r]  # noqa: E731
    col_full = {block.attention.qkv: lambda a: fused_qkv(ref, a),
                block.mlp.fc1: (lambda a: fused_fc1(ref, a)) if cfg.swiglu else (lambda a: _get(ref.fc1, a))}
    row_full = {block.attention.proj: ref.proj, block.mlp.fc2: ref.fc2}
    with torch.no_grad():  # random reference weights (norm weights and biases too), sharded into the TP block
        gen = torch.Generator().manual_seed(1)
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 and p.shape == (H,) else 0.0))
        for mine, full in col_full.items():
            mine.weight.copy_(shard(full("weight"), 0))
            if mine.bias is not None:
                mine.bias.copy_(shard(full("bias"), 0))
        for mine, full in row_full.items():
            mine.weight.copy_(shard(full.weight, 1))
            if mine.bias is not None:
                mine.bias.copy_(full.bias)
        for mine, full in [(block.ln1, ref.ln1), (block.ln2, ref.ln2)]:
            for name, p in mine.named_parameters():
                p.copy_(getattr(full, name))
    assert (block.attention.qkv.bias is None) == (not cfg.add_bias_linear)
    X = torch.randn(S, B, H, generator=torch.Generator().manual_seed(10))
    G = torch.randn(S, B, H, generator=torch.Generator().manual_seed(20))
    seq = slice(r * S // tp, (r + 1) * S // tp) if sp else slice(None)
    x = X[seq].clone().requires_grad_()
    out = block(x)
    (out * G[seq]).sum().backward()
    allreduce_sequence_parallel_gradients(block.parameters(), groups.tp)
    xr = X.clone().requires_grad_()
    ref_out = ref(xr)
    (ref_out * G).sum().backward()
    close(out, ref_out[seq], "output")
    close(x.grad, xr.grad[seq], "input gradient")
    pairs = [(block.attention.qkv.weight.grad, shard(fused_qkv(ref, "weight.grad"), 0)),
             (block.mlp.fc1.weight.grad,
              shard(fused_fc1(ref, "weight.grad") if cfg.swiglu else ref.fc1.weight.grad, 0)),
             (block.attention.proj.weight.grad, shard(ref.proj.weight.grad, 1)),
             (block.mlp.fc2.weight.grad, shard(ref.fc2.weight.grad, 1)),
             (block.ln1.weight.grad, ref.ln1.weight.grad), (block.ln2.weight.grad, ref.ln2.weight.grad)]
    for i, (got, want) in enumerate(pairs):
        close(got, want, f"gradient {i}")
    parallel_state.destroy_model_parallel()
    return True


@pytest.mark.parametrize("case", list(BLOCK_CASES))
@pytest.mark.parametrize("world,tp,sp", [(2, 2, False), (2, 2, True)], ids=["tp2", "tp2-sp"])
def test_block_options_match_plain_reference(world, tp, sp, case):
    assert all(run_ranks(_block_body, world, tp, sp, case))


def test_llama_block_tp4_matches_plain_reference():
    """TP 4 with 4 key/value groups of 2 query heads: one group per rank."""
    assert all(run_ranks(_block_body, 4, 4, True, "llama"))


def test_rope_is_a_rotation_of_half_split_pairs():
    d, base = 16, 10000.0
    x = torch.randn(2, 3, S, d, generator=torch.Generator().manual_seed(0))
    cos, sin = rotary_cos_sin(S, d, base)
    got = apply_rotary(x, cos, sin)
    close(got, ref_rope(x, base).float(), "rope")
    torch.testing.assert_close(got[..., 0, :], x[..., 0, :])  # position 0 is not rotated
    # q . k after RoPE depends only on the distance between the positions: shift both by 3
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    qs, ks = apply_rotary(q.expand(S, d), cos, sin), apply_rotary(k.expand(S, d), cos, sin)
    torch.testing.assert_close(qs[4] @ ks[1], qs[7] @ ks[4])


def test_rms_norm_matches_the_formula():
    norm = RMSNorm(H, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(H, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4)) * 3
    close(norm(x), ref_rms_norm(x, norm.weight, 1e-6).float(), "rmsnorm")
    assert not hasattr(norm, "bias") or norm.bias is None
    half = RMSNorm(H, dtype=torch.bfloat16)
    assert half(x.bfloat16()).dtype == torch.bfloat16


# -- the whole model -----------------------------------------------------------------------------------------------
V = 64
MODEL = dict(hidden_size=H, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48, num_layers=2, vocab_size=V,
             max_seq_length=S, seed=7, rotary_base=500000.0)


def _batch(dp_rank=0, k=0):
    g = torch.Generator().manual_seed(100 * dp_rank + k)
    toks = torch.randint(0, V, (B, S + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def _reference(groups, cfg):
    solo = [dist.new_group([q]) for q in range(dist.get_world_size())][dist.get_rank()]
    ref = GPTModel(cfg, ModelParallelConfig(), tp_group=solo)
    return ref


def _compare_grads(model, ref, tp, tp_rank):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        ref_name = name
        if name.startswith("layers."):
            j = int(name.split(".")[1])
            ref_name = f"layers.{model.layer_range[j]}." + name.split(".", 2)[2]
        want = ref_params[ref_name].grad
        if getattr(p, "tensor_model_parallel", False):
            want = want.chunk(tp, dim=p.partition_dim)[tp_rank]
        close(p.grad, want, name)


def _model_tp_body(rank, world, tp, sp):
    groups = parallel_state.initialize_model_parallel(tp)
    cfg = llama_config(**MODEL)
    model = GPTModel(cfg, ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp,
                                              process_groups=groups))
    names = {n for n, _ in model.named_parameters()}
    assert "output_layer.weight" in names and "position_embeddings" not in names and not any("bias" in n for n in names)
    ids, labels = _batch(groups.dp_rank)
    loss = model(ids, labels)
    loss.backward()
    allreduce_sequence_parallel_gradients(model.parameters(), groups.tp)
    ref = _reference(groups, cfg)
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    close(loss, ref_loss, "loss")
    _compare_grads(model, ref, tp, groups.tp_rank)
    # the untied output layer really is separate from the word embedding
    assert model.output_layer.weight.data_ptr() != model.word_embeddings.weight.data_ptr()
    assert not torch.equal(ref.output_layer.weight, ref.word_embeddings.weight)
    parallel_state.destroy_model_parallel()
    return loss.item()


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_llama_model_tp2_equals_tp1(sp):
    losses = run_ranks(_model_tp_body, 2, 2, sp)
    assert losses[0] == losses[1]


def _model_pp_body(rank, world):
    from megacomp.pipeline_parallel import (PipelineCommunicator, forward_backward_pipelining_with_interleaving,
                                            forward_backward_pipelining_without_interleaving)

    groups = parallel_state.initialize_model_parallel(1, 2)
    cfg = llama_config(**{**MODEL, "num_layers": 4})
    stage, M = groups.pp_rank, 2
    mpc = ModelParallelConfig(pipeline_model_parallel_size=2, process_groups=groups)
    ref = _reference(groups, cfg)
    for k in range(M):
        (ref(*_batch(0, k)) / M).backward()
    # 1F1B over two stages of two layers
    model = GPTModel(cfg, mpc, pre_process=stage == 0, post_process=stage == 1,
                     layer_range=split_layers(cfg.num_layers, 2, stage))
    assert not hasattr(model, "output_weight")

    def stage_forward(x, k, m=model):
        ids, labels = _batch(0, k)
        inp = ids if m.pre_process else x
        return m(inp, labels) if m.post_process else m(inp)
    losses = forward_backward_pipelining_without_interleaving(
        stage_forward=stage_forward, num_microbatches=M, communicator=PipelineCommunicator(groups.pp_ranks),
        activation_shape=(S, B, H))
    sync_tied_embedding_grads(model, groups.embedding)  # untied: nothing to sum
    _compare_grads(model, ref, 1, 0)
    # interleaved: two chunks of one layer per stage (virtual stages 0..3: stage 0 holds layers 0 and 2)
    chunks = GPTChunks(cfg, mpc, pp_size=2, pp_rank=stage, num_chunks=2)
    inter = forward_backward_pipelining_with_interleaving(
        stage_forward=lambda x, k, v: stage_forward(x, k, chunks.chunks[v]), num_microbatches=M,
        communicator=PipelineCommunicator(groups.pp_ranks), activation_shape=(S, B, H), num_model_chunks=2,
        models=list(chunks.chunks))
    for chunk in chunks.chunks:
        _compare_grads(chunk, ref, 1, 0)
    parallel_state.destroy_model_parallel()
    return losses, inter, [loss.item() for loss in (ref(*_batch(0, k)) for k in range(M))]


def test_llama_model_pp2_and_interleaved_equal_unsplit():
    """1F1B over PP 2 and the interleaved schedule (PP 2 x 2 virtual stages) with the untied output layer on the last
    (virtual) stage: the unsplit model's losses and gradients."""
    results = run_ranks(_model_pp_body, 2)
    assert [bool(r[0]) for r in results] == [False, True] and [bool(r[1]) for r in results] == [False, True]
    for losses, inter, ref_losses in results:
        if losses:
            close(torch.tensor(losses), torch.tensor(ref_losses), "losses")
            close(torch.tensor(inter), torch.tensor(ref_losses), "interleaved losses")


# -- compression on the TP paths -------------------------------------------------------------------------------------
INT8 = dict(name="int8", block_size=32)


def _codec_body(rank, world, sp):
    groups = parallel_state.initialize_model_parallel(2)
    r = groups.tp_rank
    codec = make_codec(INT8)
    # without SP the forward all-reduces use tp_forward; with SP the reduce-scatters use sp_reduce_scatter
    comp = CommCompressionConfig(**{"sp_reduce_scatter" if sp else "tp_forward": INT8}, min_compress_numel=0)
    cfg = llama_config(**MODEL)
    checks = []

    def check(name, partial, out):  # partial: this rank's full [s, b, h] partial sum; out: what the layer returned
        parts = [torch.empty_like(partial) for _ in range(2)]
        dist.all_gather(parts, partial.contiguous(), group=groups.tp)
        if sp:  # reduce-scatter along the sequence: this rank's slice of the sum
            parts = [p[r * S // 2:(r + 1) * S // 2] for p in parts]
            bound = reduce_scatter_bound(codec, parts).view(parts[0].shape)
        else:
            bound = all_reduce_bound(codec, parts)
        exact = sum(p.double() for p in parts)
        err = (out.double() - exact).abs()
        checks.append((name, (err - bound).max().item(), err.max().item()))

    def row_hook(mod, inputs, output):  # the partial this rank computed, recomputed the layer's way
        check(type(mod).__name__, F.linear(inputs[0], mod.weight), output[0])

    def emb_hook(mod, inputs, output):
        ids = inputs[0]
        outside = (ids < mod.vocab_start) | (ids >= mod.vocab_end)
        partial = F.embedding((ids - mod.vocab_start).masked_fill(outside, 0), mod.weight)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, h]; under SP scattered as [s, b, h]
        check("VocabParallelEmbedding", partial.transpose(0, 1) if sp else partial, output)

    mpc = dict(tensor_model_parallel_size=2, sequence_parallel=sp, process_groups=groups)
    model = GPTModel(cfg, ModelParallelConfig(compression=comp, **mpc))
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            m.register_forward_hook(row_hook)
    model.word_embeddings.register_forward_hook(emb_hook)
    ids, labels = _batch()
    with torch.no_grad():
        lossy = model(ids, labels).item()
        exact = GPTModel(cfg, ModelParallelConfig(**mpc))(ids, labels).item()
    parallel_state.destroy_model_parallel()
    return checks, lossy, exact


@pytest.mark.parametrize("sp", [False, True], ids=["tp_forward", "sp_reduce_scatter"])
def test_int8_on_tp_paths_within_the_codec_bound(sp):
    """Each forward all-reduce (reduce-scatter under SP) of the embedding and of every block's proj and fc2 is within
    the int8 bound of the exact sum of the partials that layer computed."""
    for checks, lossy, exact in run_ranks(_codec_body, 2, sp):
        assert len(checks) == 1 + 2 * MODEL["num_layers"]
        for name, excess, err in checks:
            assert excess <= 0, f"{name}: error exceeds the int8 bound by {excess:.3g}"
        assert any(err > 0 for _, _, err in checks)  # the codec was really applied
        assert math.isfinite(lossy) and lossy != exact


# -- bad input -------------------------------------------------------------------------------------------------------
def _one_line(excinfo):
    return "\n" not in str(excinfo.value)


def test_query_groups_must_divide_heads():
    with pytest.raises(ValueError, match=r"num_query_groups \(3\) must divide num_attention_heads \(4\)") as e:
        llama_config(hidden_size=H, num_attention_heads=4, num_query_groups=3)
    assert _one_line(e)
    with pytest.raises(ValueError, match=r"normalization 'rmsnorm' is not one of") as e:
        TransformerConfig(hidden_size=H, num_attention_heads=4, normalization="rmsnorm")
    assert _one_line(e)
    with pytest.raises(ValueError, match=r"position_embedding_type 'rotary' is not one of") as e:
        TransformerConfig(hidden_size=H, num_attention_heads=4, position_embedding_type="rotary")
    with pytest.raises(ValueError, match="rope needs an even head width"):
        TransformerConfig(hidden_size=12, num_attention_heads=4, position_embedding_type="rope")


def _bad_tp_body(rank, world):
    parallel_state.initialize_model_parallel(2)
    mpc = ModelParallelConfig(tensor_model_parallel_size=2)
    out = []
    not_divisible = r"is not divisible by the tensor-parallel size \(2\)"
    with pytest.raises(ValueError, match=r"num_query_groups \(1\) " + not_divisible) as e:
        GPTModel(llama_config(hidden_size=H, num_attention_heads=4, num_query_groups=1, vocab_size=V), mpc)
    out.append(_one_line(e))
    with pytest.raises(ValueError, match=r"num_query_groups \(3\) " + not_divisible) as e:
        ParallelAttention(TransformerConfig(hidden_size=48, num_attention_heads=6, num_query_groups=3), mpc)
    out.append(_one_line(e))
    with pytest.raises(ValueError, match=r"num_attention_heads \(3\) " + not_divisible) as e:
        GPTModel(llama_config(hidden_size=24, num_attention_heads=3, num_query_groups=3, vocab_size=V), mpc)
    out.append(_one_line(e))
    with pytest.raises(ValueError, match=r"RowParallelLinear input_size \(33\)") as e:  # swiglu ffn not divisible
        GPTModel(llama_config(hidden_size=H, num_attention_heads=4, ffn_hidden_size=33, vocab_size=V), mpc)
    parallel_state.destroy_model_parallel()
    return out


def test_tp_not_dividing_query_groups_or_heads_is_refused():
    for lines in run_ranks(_bad_tp_body, 2):
        assert all(lines)

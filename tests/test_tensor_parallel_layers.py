"""Tensor-parallel layers against single-device PyTorch, on TP 2 and 4 and inside a TP x DP grid, with and
without sequence parallelism (megacomp.tensor_parallel.layers / cross_entropy).

- Compression off: outputs and gradients (input, weight, bias) match nn.Linear / nn.Embedding /
  F.cross_entropy to fp32 tolerance, and are bit-identical to the same layers running on plain
  torch.distributed calls (megacomp.comm swapped out for a shim).
- Compression on (int8, fp8_e4m3, int8 + Hadamard on every TP path): each compressed collective's
  error is bounded by the codec's per-element bound, propagated through the matmuls in fp64.
"""
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from codec_bounds import all_reduce_bound, elementwise_bound, reduce_scatter_bound
from distributed import run_ranks
from megacomp import parallel_state
from megacomp.comm import Channel
from megacomp.compression import make_codec
from megacomp.config import CommCompressionConfig, ModelParallelConfig
from megacomp.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      allreduce_sequence_parallel_gradients, cross_entropy, init_method_normal,
                                      vocab_parallel_cross_entropy)

S, B, H, O, V = 8, 3, 16, 24, 32  # seq, batch, hidden, ffn, vocab (divisible by TP 4)
LAYOUTS = [(2, 2, False), (2, 2, True), (4, 4, False), (4, 4, True), (4, 2, False), (4, 2, True)]


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def full_weight(shape, seed):
    """The full weight a layer draws when torch is seeded with ``seed`` (parallelism-invariant init)."""
    torch.manual_seed(seed)
    w = torch.empty(shape)
    init_method_normal(0.02)(w)
    return w


def plain_comm_shim():
    """megacomp.comm's three collectives as direct torch.distributed calls (codec must be off)."""
    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, codec=None, error_feedback=None, tag=None, **_):
        assert codec is None and error_feedback is None
        dist.all_reduce(t, op=op, group=group)

    def all_gather_into_tensor(out, inp, group=None, codec=None, tag=None, **_):
        assert codec is None
        dist.all_gather_into_tensor(out, inp, group=group)

    def reduce_scatter_tensor(out, inp, group=None, codec=None, error_feedback=None, tag=None, **_):
        assert codec is None
        dist.reduce_scatter_tensor(out, inp, group=group)
    return types.SimpleNamespace(all_reduce=all_reduce, all_gather_into_tensor=all_gather_into_tensor,
                                 reduce_scatter_tensor=reduce_scatter_tensor)


def _as_channel_method(fn):
    """A shim collective as a Channel method: the channel must be uncompressed; its group is the default."""
    def method(self, *args, group=None, **kw):
        assert not self.lossy, "the shim only stands in for uncompressed channels"
        kw.pop("key", None)
        return fn(*args, group=group if group is not None else self.group, **kw)
    return method


def run_layers(tp, sp, codec):
    """Run every layer once on this rank; return a dict name -> (got, reference, bound or None)."""
    g = parallel_state.get_process_groups()
    r, d = g.tp_rank, g.dp_rank
    comp = CommCompressionConfig(**{p: codec for p in ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter")},
                                 min_compress_numel=0)
    cfg = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, compression=comp)
    c = make_codec(codec)
    seq = slice(r * S // tp, (r + 1) * S // tp)
    res = {}

    def bound_or_zero(t):
        return t if codec else torch.zeros(())

    # ---- ColumnParallelLinear: H -> O
    rows = slice(r * O // tp, (r + 1) * O // tp)
    W, bias = full_weight((O, H), 1), randn(O, seed=2)
    X, G = randn(S, B, H, seed=10 + d), randn(S, B, O, seed=20 + d)
    torch.manual_seed(1)
    col = ColumnParallelLinear(H, O, config=cfg)
    with torch.no_grad():
        col.bias.copy_(bias[rows])
    x = (X[seq] if sp else X).clone().requires_grad_()
    out, out_bias = col(x)
    assert out_bias is None
    (out * G[..., rows]).sum().backward()
    ref = nn.Linear(H, O)
    with torch.no_grad():
        ref.weight.copy_(W)
        ref.bias.copy_(bias)
    xr = X.clone().requires_grad_()
    (ref(xr) * G).sum().backward()
    dx_partials = [G[..., slice(q * O // tp, (q + 1) * O // tp)] @ W[slice(q * O // tp, (q + 1) * O // tp)]
                   for q in range(tp)]
    if sp:
        bx = torch.cat([elementwise_bound(c, X[q * S // tp:(q + 1) * S // tp]).view(S // tp, B, H)
                        for q in range(tp)]) if codec else torch.zeros(S, B, H, dtype=torch.float64)
        res["col.out"] = (out, ref(X)[..., rows], bx @ W[rows].abs().double().t())
        res["col.dW"] = (col.weight.grad, ref.weight.grad[rows],
                         torch.einsum("sbo,sbh->oh", G[..., rows].abs().double(), bx))
        res["col.dx"] = (x.grad, xr.grad[seq], bound_or_zero(reduce_scatter_bound(c, [p[seq] for p in dx_partials])))
    else:
        res["col.out"] = (out, ref(X)[..., rows], None)
        res["col.dW"] = (col.weight.grad, ref.weight.grad[rows], None)
        res["col.dx"] = (x.grad, xr.grad, bound_or_zero(all_reduce_bound(c, dx_partials)))
    res["col.db"] = (col.bias.grad, ref.bias.grad[rows], None)

    # ---- RowParallelLinear: O -> H, input split over O
    cols = slice(r * O // tp, (r + 1) * O // tp)
    W2, bias2 = full_weight((H, O), 3), randn(H, seed=4)
    X2, G2 = randn(S, B, O, seed=30 + d), randn(S, B, H, seed=40 + d)
    torch.manual_seed(3)
    row = RowParallelLinear(O, H, config=cfg)
    with torch.no_grad():
        row.bias.copy_(bias2)
    x2 = X2[..., cols].clone().requires_grad_()
    out2, _ = row(x2)
    g2 = G2[seq] if sp else G2
    (out2 * g2).sum().backward()
    allreduce_sequence_parallel_gradients(row.parameters(), g.tp)
    ref2 = nn.Linear(O, H)
    with torch.no_grad():
        ref2.weight.copy_(W2)
        ref2.bias.copy_(bias2)
    x2r = X2.clone().requires_grad_()
    (ref2(x2r) * G2).sum().backward()
    y_partials = [X2[..., slice(q * O // tp, (q + 1) * O // tp)] @ W2[:, slice(q * O // tp, (q + 1) * O // tp)].t()
                  for q in range(tp)]
    if sp:
        res["row.out"] = (out2, ref2(X2)[seq], bound_or_zero(reduce_scatter_bound(c, [p[seq] for p in y_partials])))
        bg = torch.cat([elementwise_bound(c, G2[q * S // tp:(q + 1) * S // tp]).view(S // tp, B, H)
                        for q in range(tp)]) if codec else torch.zeros(S, B, H, dtype=torch.float64)
        res["row.dx"] = (x2.grad, x2r.grad[..., cols], bg @ W2[:, cols].abs().double())
        res["row.dW"] = (row.weight.grad, ref2.weight.grad[:, cols],
                         torch.einsum("sbh,sbo->ho", bg, X2[..., cols].abs().double()))
    else:
        res["row.out"] = (out2, ref2(X2), bound_or_zero(all_reduce_bound(c, y_partials)))
        res["row.dx"] = (x2.grad, x2r.grad[..., cols], None)
        res["row.dW"] = (row.weight.grad, ref2.weight.grad[:, cols], None)
    res["row.db"] = (row.bias.grad, ref2.bias.grad, None)

    # ---- non-parallel input / gathered output variants (no SP)
    if not sp:
        torch.manual_seed(1)
        colg = ColumnParallelLinear(H, O, config=cfg, gather_output=True, skip_bias_add=True)
        outg, b_out = colg(X)
        assert b_out is colg.bias
        bound = torch.cat([elementwise_bound(c, (X @ W[slice(q * O // tp, (q + 1) * O // tp)].t())).view(S, B, -1)
                           for q in range(tp)], dim=-1) if codec else None
        res["colgather.out"] = (outg, X @ W.t(), bound)
        torch.manual_seed(3)
        rowp = RowParallelLinear(O, H, config=cfg, input_is_parallel=False, bias=False)
        x3 = X2.clone().requires_grad_()
        out3, _ = rowp(x3)
        (out3 * G2).sum().backward()
        res["rowfull.out"] = (out3, X2 @ W2.t(), bound_or_zero(all_reduce_bound(c, y_partials)))
        res["rowfull.dx"] = (x3.grad, x2r.grad, None if not codec else torch.cat(
            [elementwise_bound(c, G2 @ W2[:, slice(q * O // tp, (q + 1) * O // tp)]).view(S, B, -1)
             for q in range(tp)], dim=-1))

    # ---- VocabParallelEmbedding
    E = full_weight((V, H), 5)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(50 + d))
    torch.manual_seed(5)
    emb = VocabParallelEmbedding(V, H, config=cfg, reduce_scatter_embeddings=sp)
    eout = emb(ids)
    ref_e = F.embedding(ids, E)
    partials = [F.embedding(ids, E) * ((ids >= q * V // tp) & (ids < (q + 1) * V // tp)).unsqueeze(-1)
                for q in range(tp)]
    if sp:
        ref_e = ref_e.transpose(0, 1)[seq]
        eb = reduce_scatter_bound(c, [p.transpose(0, 1)[seq] for p in partials])
    else:
        eb = all_reduce_bound(c, partials)
    res["emb.out"] = (eout, ref_e, bound_or_zero(eb))
    ge = randn(*eout.shape, seed=60 + d)
    (eout * ge).sum().backward()
    full_e = E.clone().requires_grad_()
    ref_full = F.embedding(ids, full_e)
    (ref_full.transpose(0, 1)[seq] * ge if sp else ref_full * ge).sum().backward()
    if sp:  # each rank saw its sequence slice: sum the embedding grads over TP to compare with the full batch
        egrad = emb.weight.grad.clone()
        full_grad = torch.zeros(V, H)
        full_grad[r * V // tp:(r + 1) * V // tp] = egrad
        dist.all_reduce(full_grad, group=g.tp)
        all_ge = torch.zeros(S, B, H)
        all_ge[seq] = ge
        dist.all_reduce(all_ge, group=g.tp)
        full_e2 = E.clone().requires_grad_()
        (F.embedding(ids, full_e2).transpose(0, 1) * all_ge).sum().backward()
        # the backward all-gather of the gradient is compressed (tp_backward): every slice is ge, decoded
        bound_w = None
        if codec:
            bound_g = elementwise_bound(c, ge).view(S // tp, B, H).repeat(tp, 1, 1)
            bound_w = torch.zeros(V, H, dtype=torch.float64).index_add_(0, ids.t().reshape(-1), bound_g.reshape(-1, H))
            bound_w = bound_w[r * V // tp:(r + 1) * V // tp]
        res["emb.dW"] = (full_grad[r * V // tp:(r + 1) * V // tp], full_e2.grad[r * V // tp:(r + 1) * V // tp], bound_w)
    else:
        res["emb.dW"] = (emb.weight.grad, full_e.grad[r * V // tp:(r + 1) * V // tp], None)

    # ---- vocab-parallel cross entropy (uncompressed by design)
    for eps in (0.0, 0.1):
        logits = randn(S, B, V, seed=70 + d).requires_grad_()
        target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(80 + d))
        local = logits.detach()[..., r * V // tp:(r + 1) * V // tp].clone().requires_grad_()
        w = randn(S, B, seed=90 + d)
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing=eps)
        (loss * w).sum().backward()
        ref_loss = F.cross_entropy(logits.view(-1, V), target.view(-1), reduction="none",
                                   label_smoothing=eps).view(S, B)
        (ref_loss * w).sum().backward()
        res[f"xent{eps}.loss"] = (loss, ref_loss, None)
        res[f"xent{eps}.grad"] = (local.grad, logits.grad[..., r * V // tp:(r + 1) * V // tp], None)
    return {k: (v[0].detach(), v[1].detach(), v[2]) for k, v in res.items()}


def _body(rank, world, tp, sp, codec, shim):
    parallel_state.initialize_model_parallel(tp)
    got = run_layers(tp, sp, codec)
    if shim:  # the same layers on plain torch.distributed must give the same bits
        real = {n: getattr(Channel, n) for n in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")}
        real_xent = cross_entropy.comm
        shim_ns = plain_comm_shim()
        for n in real:  # every channel (the layers' identity channels) calls torch.distributed directly
            setattr(Channel, n, _as_channel_method(getattr(shim_ns, n)))
        cross_entropy.comm = shim_ns
        try:
            plain = run_layers(tp, sp, codec)
        finally:
            for n, f in real.items():
                setattr(Channel, n, f)
            cross_entropy.comm = real_xent
        for k in got:
            assert torch.equal(got[k][0], plain[k][0]), f"{k}: compression off differs from plain torch.distributed"
    for name, (value, ref, bound) in got.items():
        if bound is None or codec is None:
            torch.testing.assert_close(value, ref, msg=lambda m: f"{name}: {m}")
        else:
            err = (value.double() - ref.double()).abs()
            slack = 1e-5 + 1e-5 * ref.double().abs()  # fp32 matmul re-association
            excess = (err - bound.double().reshape(err.shape) - slack).max().item()
            assert excess <= 0, f"{name}: error exceeds the codec bound by {excess:.3g} (max err {err.max():.3g})"
    parallel_state.destroy_model_parallel()
    return sorted(got)


@pytest.mark.parametrize("world,tp,sp", LAYOUTS, ids=[f"w{w}-tp{t}{'-sp' if s else ''}" for w, t, s in LAYOUTS])
def test_layers_match_single_device_and_plain_torch_distributed(world, tp, sp):
    names = run_ranks(_body, world, tp, sp, None, True)[0]
    assert "col.dx" in names and "row.db" in names and "emb.dW" in names and "xent0.1.grad" in names


CODECS = [dict(name="int8", block_size=32), dict(name="fp8_e4m3", block_size=64),
          dict(name="int8", block_size=0, hadamard=16)]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("world,tp,sp", [(2, 2, False), (2, 2, True), (4, 2, True), (4, 4, False)],
                         ids=["tp2", "tp2-sp", "tp2xdp2-sp", "tp4"])
def test_compressed_layers_within_codec_bounds(world, tp, sp, codec):
    run_ranks(_body, world, tp, sp, codec, False)


def _tp_error_feedback_body(rank, world):
    parallel_state.initialize_model_parallel(2)
    out = {}
    for ef in (None, "ef"):
        comp = CommCompressionConfig(tp_backward={"name": "int2", "block_size": 32}, tp_backward_error_feedback=ef,
                                     min_compress_numel=0)
        cfg = ModelParallelConfig(tensor_model_parallel_size=2, compression=comp)
        torch.manual_seed(1)
        col = ColumnParallelLinear(H, O, config=cfg)
        X, G = randn(S, B, H, seed=10), randn(S, B, O, seed=20)
        rows = slice(parallel_state.get_tensor_model_parallel_rank() * O // 2, (parallel_state.get_tensor_model_parallel_rank() + 1) * O // 2)
        total = torch.zeros(S, B, H, dtype=torch.float64)
        steps = 30
        for _ in range(steps):
            x = X.clone().requires_grad_()
            out_, _ = col(x)
            (out_ * G[..., rows]).sum().backward()
            total += x.grad.double()
        exact = (G @ full_weight((O, H), 1)).double()
        out[str(ef)] = ((total / steps - exact).norm() / exact.norm()).item()
        if ef:
            # two ranks exchange whole encodings: no server-side error (more ranks also keep 'tp_backward/server')
            assert sorted(cfg.channels.tp_backward.error_feedback.keys()) == [f"{col.ef_key}/worker"]
    parallel_state.destroy_model_parallel()
    return out


def test_tp_backward_error_feedback_averages_out_the_int2_error():
    """With error feedback on the backward all-reduce the time-averaged input gradient converges to the
    exact one; without it the int2 bias stays."""
    for res in run_ranks(_tp_error_feedback_body, 2):
        assert res["ef"] < 0.25 * res["None"], res


def _small_tensor_ef_body(rank, world):
    parallel_state.initialize_model_parallel(2)
    comp = CommCompressionConfig(tp_backward="int8", tp_backward_error_feedback="ef")  # default threshold 65536
    cfg = ModelParallelConfig(tensor_model_parallel_size=2, compression=comp)
    col = ColumnParallelLinear(H, O, config=cfg)
    x = randn(S, B, H, seed=1).requires_grad_()
    col(x)[0].sum().backward()  # below the threshold: uncompressed, and no error feedback either
    lazy = ColumnParallelLinear(H, O, config=ModelParallelConfig(tensor_model_parallel_size=2,
                                                                 perform_initialization=False))
    attrs = (lazy.weight.tensor_model_parallel, lazy.weight.partition_dim, lazy.bias.partition_dim)
    parallel_state.destroy_model_parallel()
    return x.grad is not None, attrs


def test_small_tensors_skip_error_feedback_and_uninitialised_shards_keep_their_attributes():
    for ok, attrs in run_ranks(_small_tensor_ef_body, 2):
        assert ok and attrs == (True, 0, 0)

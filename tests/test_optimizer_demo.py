"""megacomp.optimizer.DeMo against an independent fp64 restatement of the reference algorithm (bloc97/DeMo),
its k = whole-tile limit (sign-SGD on the all-rank mean of the momenta,
zero residual), wire bytes, skipped steps, checkpoint round trip and bad settings."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megacomp import comm
from megacomp.optimizer import DeMo
from distributed import run_ranks

SHAPES = [(12, 10), (7,), (130, 6), (3, 4, 5)]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _grads(rank, step, dtype):
    g = torch.Generator().manual_seed(1000 * rank + step + 1)
    return [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]


# -- the restatement: written from the reference's description, sharing no code with megacomp ------------
def _largest_divisor(n, limit):
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _dct_matrix(n):
    m = torch.empty(n, n, dtype=torch.float64)
    for k in range(n):
        for i in range(n):
            m[k, i] = math.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt((1 if k == 0 else 2) / n)
    return m


def _tiles(x, chunk):
    """List of (tile slices, tile) for a tensor seen as a matrix [shape[0], rest] (a vector: 1-D tiles)."""
    m = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(1, -1)
    h = _largest_divisor(m.shape[0], chunk) if x.dim() > 1 else 1
    w = _largest_divisor(m.shape[1], chunk)
    return m, h, w


def _forward(x, chunk):
    """Coefficients per tile, as a list of (row, col, coefficient matrix)."""
    m, h, w = _tiles(x, chunk)
    dh, dw = _dct_matrix(h), _dct_matrix(w)
    return [(r, c, dh @ m[r:r + h, c:c + w] @ dw.T) for r in range(0, m.shape[0], h) for c in range(0, m.shape[1], w)]


def _inverse(tiles, like, chunk):
    m, h, w = _tiles(torch.zeros_like(like), chunk)
    dh, dw = _dct_matrix(h), _dct_matrix(w)
    for r, c, t in tiles:
        m[r:r + h, c:c + w] = dh.T @ t @ dw
    return m.reshape(like.shape)


def _topk_mask(t, k):
    flat = t.reshape(-1)
    k = min(k, flat.numel())
    order = sorted(range(flat.numel()), key=lambda i: -abs(float(flat[i])))
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    mask[order[:k]] = True
    return mask.view(t.shape)


def _reference_run(world, steps, lr, decay, topk, chunk, wd):
    """Every rank's parameters and momenta after ``steps`` DeMo steps, in fp64, all ranks simulated."""
    params = [p.detach().clone() for p in _params(torch.float64)]
    deltas = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    for step in range(steps):
        grads = [_grads(r, step, torch.float64) for r in range(world)]
        sent = []  # per rank, per parameter: list of (row, col, mask, values)
        for r in range(world):
            mine = []
            for i, p in enumerate(params):
                d = deltas[r][i] * decay + lr * grads[r][i]
                coeff = _forward(d, chunk)
                kept = [(row, col, _topk_mask(t, topk), t) for row, col, t in coeff]
                deltas[r][i] = _inverse([(row, col, torch.where(m, 0.0, t)) for row, col, m, t in kept], d, chunk)
                mine.append(kept)
            sent.append(mine)
        new = []
        for i, p in enumerate(params):
            p = p * (1 - lr * wd)
            tiles = []
            for j, (row, col, _, _) in enumerate(sent[0][i]):
                total = sum(torch.where(sent[r][i][j][2], sent[r][i][j][3], 0.0) for r in range(world))
                count = sum(sent[r][i][j][2].double() for r in range(world))
                tiles.append((row, col, total / count.clamp(min=1)))
            new.append(p - lr * torch.sign(_inverse(tiles, p, chunk)))
        params = new
    return params, deltas


# -- a second restatement, following bloc97/DeMo demo.py (commit cab4606) operation by operation in plain torch:
# tiles "(y h) (x w) -> y h x w" transformed by einsum with its basis matrices (forward D^T per axis, inverse D),
# torch.topk of |c| per tile, the sender's own scatter_reduce(mean) decoded and subtracted from delta, the ranks'
# indices and values concatenated in rank order and scatter_reduce(mean, include_self=False), sign, SGD step.
# The reference handles 1-D and 2-D tensors; the 3-D one is given megacomp's [shape[0], rest] view.
def _ref_encode(x, chunk):
    if x.dim() == 1:
        w = _largest_divisor(x.shape[0], chunk)
        return torch.einsum("xj,jb->xb", x.reshape(-1, w), _dct_matrix(w).T)
    m = x.reshape(x.shape[0], -1)
    h, w = _largest_divisor(m.shape[0], chunk), _largest_divisor(m.shape[1], chunk)
    tiles = m.reshape(m.shape[0] // h, h, m.shape[1] // w, w)
    return torch.einsum("yjkl,jb,ld->ykbd", tiles, _dct_matrix(h).T, _dct_matrix(w).T)


def _ref_decode(c, shape):
    if c.dim() == 2:
        return torch.einsum("xj,jb->xb", c, _dct_matrix(c.shape[1])).reshape(shape)
    y, xx, h, w = c.shape
    return torch.einsum("yxkl,kb,ld->ybxd", c, _dct_matrix(h), _dct_matrix(w)).reshape(shape)


def _ref_scatter_mean(c, idx, val):
    flat = torch.zeros_like(c).reshape(*c.shape[:-2], -1) if c.dim() == 4 else torch.zeros_like(c)
    flat.scatter_reduce_(-1, idx, val, reduce="mean", include_self=False)
    return flat.reshape(c.shape)


def _reference_code_run(world, steps, lr, decay, topk, chunk, wd):
    params = [p.detach().clone() for p in _params(torch.float64)]
    deltas = [[torch.zeros_like(p) for p in params] for _ in range(world)]
    for step in range(steps):
        grads = [_grads(r, step, torch.float64) for r in range(world)]
        params = [p * (1.0 - lr * wd) for p in params]
        new = []
        for i, p in enumerate(params):
            idxs, vals = [], []
            for r in range(world):
                d = deltas[r][i] * decay + lr * grads[r][i]
                c = _ref_encode(d, chunk)
                flat = c.reshape(*c.shape[:-2], -1) if c.dim() == 4 else c
                idx = torch.topk(flat.abs(), k=min(topk, flat.shape[-1]), dim=-1, largest=True, sorted=False).indices
                val = torch.gather(flat, -1, idx)
                deltas[r][i] = d - _ref_decode(_ref_scatter_mean(c, idx, val), d.shape)
                idxs.append(idx)
                vals.append(val)
            c = _ref_encode(torch.zeros_like(p), chunk)
            mean = _ref_scatter_mean(c, torch.cat(idxs, -1), torch.cat(vals, -1))
            new.append(p - lr * _ref_decode(mean, p.shape).sign())
        params = new
    return params, deltas


def _demo_run(rank, world, steps, dtype, kwargs, channel_tag=None):
    params = _params(dtype)
    channel = comm.Channel(channel_tag, None) if channel_tag else None
    opt = DeMo(params, channel=channel, **kwargs)
    for step in range(steps):
        for p, g in zip(params, _grads(rank, step, dtype)):
            p.grad = g
        assert opt.step()
    return [p.detach().clone() for p in params], [opt.state[p]["delta"].clone() for p in params]


def _restatement_body(rank, world, kwargs, steps):
    got = _demo_run(rank, world, steps, torch.float64, kwargs)
    args = [world, steps] + [kwargs[k] for k in ("lr", "compression_decay", "compression_topk", "compression_chunk",
                                                 "weight_decay")]
    ref_params, ref_deltas = _reference_run(*args)
    code_params, code_deltas = _reference_code_run(*args)
    return got, [(ref_params, ref_deltas[rank]), (code_params, code_deltas[rank])]


@pytest.mark.parametrize("world", [2, 3])
def test_update_equals_an_fp64_restatement_of_the_reference(world):
    kwargs = dict(lr=0.05, compression_decay=0.9, compression_topk=3, compression_chunk=8, weight_decay=0.1)
    results = run_ranks(_restatement_body, world, kwargs, 3)
    for rank, ((params, deltas), references) in enumerate(results):
        for ref_params, ref_delta in references:  # the description's restatement, then the code's
            for p, q in zip(params, ref_params):
                assert torch.allclose(p, q, rtol=0, atol=1e-12), (rank, (p - q).abs().max())
            for d, e in zip(deltas, ref_delta):
                assert torch.allclose(d, e, rtol=0, atol=1e-12), (rank, (d - e).abs().max())
    for p, q in zip(results[0][0][0], results[-1][0][0]):
        assert torch.equal(p, q)  # the replicas stay bit-identical


def _full_tile_body(rank, world):
    lr, decay = 0.01, 0.5
    params = _params(torch.float32)
    start = [p.detach().clone() for p in params]
    opt = DeMo(params, lr=lr, compression_decay=decay, compression_topk=4096, compression_chunk=64)
    for p, g in zip(params, _grads(rank, 0, torch.float32)):
        p.grad = g
    assert opt.step()
    return start, [p.detach().clone() for p in params], [opt.state[p]["delta"].clone() for p in params]


def test_every_coefficient_sent_is_sign_sgd_on_the_mean_momentum_with_zero_residual():
    world, lr = 3, 0.01
    results = run_ranks(_full_tile_body, world)
    start = results[0][0]
    mean = [sum(lr * _grads(r, 0, torch.float32)[i].double() for r in range(world)) / world for i in range(len(SHAPES))]
    for _, params, deltas in results:
        for d in deltas:
            assert not d.any()  # everything was sent: exactly nothing is left
        for p0, p, m in zip(start, params, mean):
            step = (p0.double() - p.double()) / lr
            # fp32 round-off of the two orthonormal transforms (the tensor norm bounds each tile's): 4 products of length <= h + w
            # (h, w <= 64), each within n * 2^-24 of the tile's norm; signs of entries below it may flip
            bound = 4 * 128 * 2.0 ** -24 * float(m.norm())
            sure = m.abs() > bound
            assert sure.float().mean() > 0.99
            assert torch.equal(step.sign()[sure], m.sign()[sure])
            # p = p0 - lr * s rounded to fp32: |s - step| <= ulp(|p0| + lr) / lr
            atol = 2.0 ** -23 * (float(p0.abs().max()) + lr) / lr
            assert torch.allclose(step.abs()[sure], torch.ones(()).double(), rtol=0, atol=atol)


def _bytes_body(rank, world):
    comm.reset_stats()
    kwargs = dict(lr=0.01, compression_topk=8, compression_chunk=16, value_codec="bf16")
    params = _params(torch.float32)
    opt = DeMo(params, channel=comm.Channel("demo_test", None), **kwargs)
    for p, g in zip(params, _grads(rank, 0, torch.float32)):
        p.grad = g
    opt.step()
    s = comm.stats()["demo_test"]
    return s.wire_bytes, s.uncompressed_bytes, opt.wire_bytes_per_step(), sum(p.numel() for p in params)


def test_wire_bytes_are_the_encodings_sent_to_each_peer():
    world = 3
    for wire, raw, per_step, numel in run_ranks(_bytes_body, world):
        assert wire == (world - 1) * per_step
        assert raw == (world - 1) * numel * 4
    # (12,10): tiles 12x10 -> k 8, 1-byte indices + bf16 values; (7,): one tile of 7 -> 7 kept
    from megacomp.compression import make_codec
    c = make_codec("bf16", k=8, chunk=120, select="topk")
    assert c.wire_bytes(120) == 8 * (1 + 2)


def _skip_body(rank, world):
    params = _params(torch.float32)
    start = [p.detach().clone() for p in params]
    opt = DeMo(params, lr=0.01)
    for p, g in zip(params, _grads(rank, 0, torch.float32)):
        p.grad = g
    if rank == 1:
        params[0].grad[0, 0] = float("nan")
    stepped = opt.step()
    same = all(torch.equal(p, q) for p, q in zip(params, start))
    untouched = all(not opt.state[p]["delta"].any() for p in params)
    return stepped, same, untouched, opt.skipped_steps


def test_a_nonfinite_gradient_on_one_rank_skips_the_step_everywhere():
    for stepped, same, untouched, skipped in run_ranks(_skip_body, 2):
        assert (stepped, same, untouched, skipped) == (False, True, True, 1)


def _resume_body(rank, world):
    kwargs = dict(lr=0.02, compression_decay=0.9, compression_topk=5, compression_chunk=8, value_codec="int8")

    def steps(opt, params, which):
        for step in which:
            for p, g in zip(params, _grads(rank, step, torch.float32)):
                p.grad = g
            opt.step()

    params = _params(torch.float32)
    opt = DeMo(params, **kwargs)
    steps(opt, params, range(4))
    straight = [p.detach().clone() for p in params]

    params = _params(torch.float32)
    opt = DeMo(params, **kwargs)
    steps(opt, params, range(2))
    saved, saved_params = opt.state_dict(), [p.detach().clone() for p in params]
    params = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt = DeMo(params, **kwargs)
    opt.load_state_dict(saved)
    steps(opt, params, range(2, 4))
    errors = []
    for other in (dict(kwargs, compression_topk=6), dict(kwargs, value_codec="bf16")):
        try:
            DeMo(_params(torch.float32), **other).load_state_dict(saved)
        except ValueError as e:
            errors.append(str(e))
    return straight, [p.detach().clone() for p in params], errors


def test_checkpoint_round_trip_continues_bit_for_bit_and_other_settings_are_refused():
    for straight, resumed, errors in run_ranks(_resume_body, 2):
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b)
        assert len(errors) == 2 and "layout differs" in errors[0] and "value_codec differs" in errors[1]


def _bad_body(rank, world):
    out = []
    for kw in (dict(compression_topk=0), dict(compression_chunk=0), dict(compression_decay=1.0),
               dict(value_codec={"name": "int8", "k": 4, "chunk": 16}), dict(lr=0.0)):
        try:
            DeMo(_params(torch.float32), **kw)
            out.append("")
        except ValueError as e:
            out.append(str(e))
    return out


def test_bad_settings_raise():
    msgs = run_ranks(_bad_body, 1)[0]
    assert "compression_topk must be an int >= 1" in msgs[0]
    assert "compression_chunk must be an int >= 1" in msgs[1]
    assert "compression_decay must be in [0, 1)" in msgs[2]
    assert "pass a plain value format" in msgs[3]
    assert "lr must be > 0" in msgs[4]


# -- in pretraining (--optimizer demo) ---------------------------------------------------------------------
from test_training_pretrain import _train_body, base, losses  # noqa: E402,F401  (the fixture and the run helper)


def test_pretraining_with_demo_under_tp_and_pp_sends_only_its_components_and_resumes(base, tmp_path):
    from dataclasses import replace

    cfg = replace(base, train_iters=6, optimizer="demo", demo_topk=8, demo_chunk=16, tensor_model_parallel_size=2,
                  save=str(tmp_path / "ckpt"))
    full = run_ranks(_train_body, 4, replace(cfg, save=None))
    assert all(losses(h) == losses(full[0]) for h in full)
    assert losses(full[0])[-1] < losses(full[0])[0]
    traffic = full[0][-1][3]
    wire, raw = traffic["dp_gradient"]
    assert 0 < wire < 0.2 * raw and "dp_parameter" not in traffic  # components only, no parameter all-gather
    first = losses(run_ranks(_train_body, 4, replace(cfg, exit_interval=3))[0])
    rest = losses(run_ranks(_train_body, 4, replace(cfg, load=str(tmp_path / "ckpt")))[0])
    assert first + rest == losses(full[0])  # the momenta (each rank's own) are checkpointed
    piped = run_ranks(_train_body, 4, replace(cfg, save=None, tensor_model_parallel_size=1,  # and the reference's
                                              pipeline_model_parallel_size=2, train_iters=3,  # decay of every tensor
                                              demo_weight_decay_vectors=True))
    assert losses(piped[0])[-1] < losses(piped[0])[0]


def test_pretraining_refuses_demo_with_settings_it_cannot_honour(base):
    from dataclasses import replace

    from megacomp.training.arguments import check

    with pytest.raises(AssertionError, match="must be a plain value format without error feedback"):
        run_ranks(_train_body, 2, replace(base, optimizer="demo", compression="loco4"))
    with pytest.raises(ValueError, match="does not combine with --outer-algorithm"):
        check(replace(base, optimizer="demo", outer_algorithm="diloco", num_replicas=2))
    with pytest.raises(ValueError, match="optimizer must be one of adamw, demo"):
        check(replace(base, optimizer="sgd"))

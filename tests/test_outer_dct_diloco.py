"""DCT-DiLoCo (megacomp.outer.dct_diloco) on the outer-loop engine, real gloo ranks.

- Each outer step equals a plain-torch fp64 restatement of the published rule, written the way the authors' release
  computes it (tiles cut with reshape, a DCT matrix per side, torch.topk per tile, scatter_reduce(mean,
  include_self=False) over the replicas' coefficients, Nesterov step with the local pseudo-gradient), from every
  replica's state gathered here: the weights and the momentum, within fp32 round-off.
- Bytes: every exchange sends the codec's wire_bytes per tensor to each other replica, counted under ``outer``.
- Every coefficient sent: the momentum is the same bits on every replica and its residual is exactly zero; the
  step keeps the replica's own pseudo-gradient, so this is not plain DiLoCo (the published rule).
- An exchange in flight (fragments, delay) resumes bit-identically; bad settings raise naming the fix; the
  trainer runs it and resumes mid-cycle.
"""
import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import comm
from megacomp.outer import DiLoCo, DiLoCoConfig
from megacomp.outer import dct_diloco
from test_outer_diloco import flat

EPS32 = 2.0 ** -24
# a matrix in 4 x 4 tiles, a vector, a 3-D tensor (tiled as [6, 8]: 3 x 4 tiles) and a matrix whose sides have
# no divisor between 2 and 4 (1 x 1 tiles: the DCT is the identity there)
SHAPES = [(16, 12), (24,), (6, 2, 4), (5, 7)]


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def inner_step(params, rank, step):
    """H inner steps stand-in: a deterministic, rank-dependent move."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g), alpha=0.05 * (rank + 1))


def _dct_matrix(n):
    """Orthonormal DCT-II, from its definition, in fp64."""
    k, i = torch.arange(n, dtype=torch.float64)[:, None], torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d


def _side(n, chunk):
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


def _encode(x, chunk):
    """The release's TransformDCT.encode: [Y, X, h, w] tiles (1-D: [X, w]), each D_h T D_w^T."""
    if x.dim() > 2:
        x = x.reshape(x.shape[0], -1)
    if x.dim() == 1:
        w = _side(x.shape[0], chunk)
        return x.reshape(-1, w) @ _dct_matrix(w).T
    h, w = _side(x.shape[0], chunk), _side(x.shape[1], chunk)
    t = x.reshape(x.shape[0] // h, h, x.shape[1] // w, w)
    return torch.einsum("yhxw,ah,bw->yxab", t, _dct_matrix(h), _dct_matrix(w))


def _decode(c, shape):
    if c.dim() == 2:
        return (c @ _dct_matrix(c.shape[1])).reshape(shape)
    y, x, h, w = c.shape
    t = torch.einsum("yxab,ah,bw->yhxw", c, _dct_matrix(h), _dct_matrix(w))
    return t.reshape(shape)


def restated_step(befores, momenta, locals_, me, topk, chunk, beta, lr):
    """The published outer step of replica ``me`` in fp64 from every replica's (theta, m, theta_local)."""
    new_theta, new_m = [], []
    off = 0
    for shape in SHAPES:
        n = math.prod(shape)
        part = lambda v, j: v[j][off:off + n].reshape(shape)  # noqa: E731
        coeffs, idx, vals, resid = [], [], [], []
        for j in range(len(befores)):
            m = beta * part(momenta, j) + (part(befores, j) - part(locals_, j))
            c = _encode(m, chunk)
            flatc = c.reshape(*c.shape[:-2], -1) if c.dim() == 4 else c
            k = min(topk, flatc.shape[-1])
            i = torch.topk(flatc.abs(), k, dim=-1).indices
            v = torch.gather(flatc, -1, i)
            kept = torch.zeros_like(flatc).scatter(-1, i, v)
            resid.append(_decode((flatc - kept).reshape(c.shape), shape))
            idx.append(i)
            vals.append(v)
            coeffs.append(c)
        shared = torch.zeros_like(flatc).scatter_reduce(-1, torch.cat(idx, -1), torch.cat(vals, -1), reduce="mean",
                                                        include_self=False)
        m = resid[me] + _decode(shared.reshape(coeffs[me].shape), shape)
        delta = part(befores, me) - part(locals_, me)
        new_theta.append((part(befores, me) - lr * (delta + beta * m)).reshape(-1))
        new_m.append(m.reshape(-1))
        off += n
    return torch.cat(new_theta), torch.cat(new_m)


def _rule_body(rank, world, topk, chunk, beta, lr, h, outer_steps):
    params = make_params()
    cfg = DiLoCoConfig(outer_steps=h, outer_lr=lr, outer_momentum=beta, algorithm="dct_diloco", dct_topk=topk,
                       dct_chunk=chunk)
    outer = DiLoCo(params, None, cfg)
    checks = []
    for t in range(outer_steps * h):
        before = outer.outer[0].detach().double().clone()
        m_before = outer.momenta[0].double().clone()
        inner_step(params, rank, t)
        local = flat(params).double()
        gathered = []
        for x in (before, m_before, local):
            xs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(xs, x)
            gathered.append(xs)
        if not outer.step():
            continue
        want, want_m = restated_step(*gathered, rank, topk, chunk, beta, lr)
        got, got_m = flat(params).double(), outer.momenta[0].double()
        scale = max(x.abs().max().item() for xs in gathered for x in xs) + want_m.abs().max().item()
        tol = 64 * EPS32 * scale * (1 + lr)  # fp32 transforms: a few ulps of each tile's norm
        ms = [torch.empty_like(outer.momenta[0]) for _ in range(world)]
        dist.all_gather(ms, outer.momenta[0])
        checks.append(((got - want).abs().max().item(), (got_m - want_m).abs().max().item(), tol,
                       torch.equal(got.float(), outer.outer[0].detach()), all(torch.equal(ms[0], m) for m in ms)))
    return checks


@pytest.mark.parametrize("world,topk", [(2, 3), (3, 5)])
def test_outer_step_equals_the_published_rule_restated_in_plain_torch(world, topk):
    for checks in run_ranks(_rule_body, world, topk, 4, 0.9, 0.7, 2, 3):
        assert len(checks) == 3
        for err, err_m, tol, same, _ in checks:
            assert err <= tol and err_m <= tol, (err, err_m, tol)
            assert same  # the model's parameters are theta_r


def test_every_coefficient_sent_synchronises_the_momentum_exactly():
    # top-16 of 4 x 4 tiles: everything is sent, the residual is exactly zero and every replica holds the same
    # momentum bits; the step still adds each replica's own Delta_r, so the replicas' weights differ
    for checks in run_ranks(_rule_body, 2, 16, 4, 0.9, 0.7, 1, 2):
        for err, err_m, tol, same, identical in checks:
            assert err <= tol and err_m <= tol and same and identical


def _bytes_body(rank, world):
    params = make_params()
    outer = DiLoCo(params, None, DiLoCoConfig(outer_steps=2, algorithm="dct_diloco", dct_topk=3, dct_chunk=4,
                                              codec="bf16"))
    comm.reset_stats()
    for t in range(6):
        inner_step(params, rank, t)
        outer.step()
    st = comm.stats()["outer"]
    codecs = dct_diloco.codecs_for([torch.Size(s) for s in SHAPES], 3, 4, outer.config.codec)
    per_tensor = [c.wire_bytes(math.prod(s)) for s, c in zip(SHAPES, codecs)]
    return st.calls, st.wire_bytes, st.uncompressed_bytes, sum(per_tensor), flat(params).numel()


def test_bytes_on_the_wire_are_the_codecs_wire_bytes():
    for calls, wire, raw, msg, n in run_ranks(_bytes_body, 3):
        assert calls == 3  # one all-gather every 2 of 6 steps
        assert wire == 3 * 2 * msg  # each exchange: this replica's encoding to each of the 2 others
        assert raw == 3 * 2 * 4 * n  # against the fp32 pseudo-gradient
        # 3 of 16 coefficients of the 4 x 4 tiles (3 of 4 for the vector, 3 of 12 and 1 of 1 elsewhere), bf16
        # values and 1-byte indices
        assert msg == (12 * 3 + 6 * 3 + 4 * 3 + 35 * 1) * 3


def _resume_body(rank, world):
    from test_outer_diloco import run_and_resume

    cfg = DiLoCoConfig(outer_steps=4, algorithm="dct_diloco", dct_topk=3, dct_chunk=4, fragments=2, delay=1)
    same, in_flight, _ = run_and_resume(rank, cfg, 6, 11)
    return same, in_flight


def test_an_exchange_in_flight_resumes_bit_identically():
    for same, in_flight in run_ranks(_resume_body, 2):
        assert same and in_flight  # stopped with a fragment's exchange in flight


def test_bad_settings_name_the_fix():
    with pytest.raises(ValueError, match="momentum is its error feedback"):
        DiLoCoConfig(algorithm="dct_diloco", codec="int4", error_feedback="ef")
    with pytest.raises(ValueError, match="give the kept values' format only"):
        DiLoCoConfig(algorithm="dct_diloco", codec={"name": "bf16", "k": 4, "chunk": 16})
    with pytest.raises(ValueError, match="dct_topk must be an int >= 1"):
        DiLoCoConfig(algorithm="dct_diloco", dct_topk=0)
    with pytest.raises(ValueError, match=r"outer_momentum must be in \[0, 1\)"):
        DiLoCoConfig(algorithm="dct_diloco", outer_momentum=1.0)
    cfg = DiLoCoConfig(algorithm="dct_diloco")  # the release's settings when none are given
    assert (cfg.outer_lr, cfg.outer_momentum, cfg.dct_topk, cfg.dct_chunk) == (0.7, 0.95, 32, 64)
    # the other algorithms' checkpoints keep their saved form (no DCT-DiLoCo keys)
    assert "dct_topk" not in DiLoCoConfig().to_dict() and "dct_topk" in DiLoCoConfig(algorithm="dct_diloco").to_dict()


def test_pretraining_with_dct_diloco_logs_outer_traffic_and_resumes(tiny_config, tmp_path):
    from dataclasses import replace

    from megacomp.training.features.outer_loop import outer_config
    from test_outer_diloco import _pretrain_body

    cfg = replace(tiny_config, train_iters=4, outer_algorithm="dct_diloco", num_replicas=2, outer_steps=2)
    oc = outer_config(cfg)  # the release's settings: top-32 of 64 x 64 tiles, fp32 values, lr 0.7, beta 0.95
    assert (oc.algorithm, oc.outer_lr, oc.outer_momentum, oc.dct_topk, oc.dct_chunk, oc.codec.is_identity) == \
        ("dct_diloco", 0.7, 0.95, 32, 64, True)
    full = run_ranks(_pretrain_body, 2, cfg)[0]
    outer = [t.get("outer", [0, 0]) for _, t in full]
    assert [w > 0 for w, _ in outer] == [False, True] * 2  # one all-gather every 2 steps
    assert all(0 < w < u for w, u in outer if u)
    ck = str(tmp_path / "ck")
    first = run_ranks(_pretrain_body, 2, replace(cfg, save=ck, exit_interval=3))[0]  # mid-cycle
    rest = run_ranks(_pretrain_body, 2, replace(cfg, load=ck))[0]
    assert [loss for loss, _ in first + rest] == [loss for loss, _ in full]


def test_algorithm_names_and_trainer_checks():
    from megacomp.compression import make_codec
    from megacomp.training import PretrainConfig
    from megacomp.training.features.outer_loop import OuterLoop, outer_config

    # megacomp's earlier variant keeps working under its own name: SparseLoCo with a 1-D DCT top-k codec
    old = outer_config(PretrainConfig(outer_algorithm="sparseloco_dct", num_replicas=2))
    assert (old.algorithm, make_codec(old.codec).transform, old.outer_lr, old.outer_momentum) == \
        ("sparseloco", "dct", 1.0, 0.95)
    with pytest.raises(ValueError, match="needs a codec with transform: dct"):
        outer_config(PretrainConfig(outer_algorithm="sparseloco_dct", num_replicas=2, outer_codec="int2"))
    new = outer_config(PretrainConfig(outer_algorithm="dct_diloco", num_replicas=2, outer_dct_topk=8,
                                      outer_codec="bf16"))
    assert (new.algorithm, new.dct_topk, new.dct_chunk, new.codec.name) == ("dct_diloco", 8, 64, "bf16")
    with pytest.raises(ValueError, match="DCT-DiLoCo as published synchronises every parameter"):
        OuterLoop.check(PretrainConfig(outer_algorithm="dct_diloco", num_replicas=2, outer_fragments=2), 2)
    with pytest.raises(ValueError, match="momentum is its error feedback"):
        OuterLoop.check(PretrainConfig(outer_algorithm="dct_diloco", num_replicas=2, outer_codec="int8",
                                       outer_error_feedback="ef"), 2)

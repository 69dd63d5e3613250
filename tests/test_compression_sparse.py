"""Codecs by structure (megacomp.compression.sparse, dct): top-k, random-k, chunked DCT.

Each property is checked against a restatement written here from the definition (the k largest
magnitudes of a chunk, the orthonormal DCT-II of scipy's convention, the value codec's own bound), with
tolerances derived from fp32 round-off; then through the collectives on real gloo groups: with
k = chunk they equal the uncompressed reduction up to fp32 round-off, and error feedback telescopes.
"""
import math

import pytest
import torch

from codec_bounds import FP32_ULP, elementwise_bound
from distributed import run_ranks
from megacomp import comm
from megacomp.compression import dct, make_codec, sparse


def _x(numel, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(dtype)


def _dct_reference(n):
    """DCT-II, orthonormal (scipy's norm='ortho'), in fp64, written from the definition."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] *= math.sqrt(0.5)
    return d


def _dct_tol(chunk, norms):
    """Forward + inverse: each output is a dot product of ``chunk`` terms with a unit-norm row, so each
    transform adds at most (chunk + 2) * u * ||chunk||_2 (products, sums, the rounded matrix)."""
    return 2 * (chunk + 2) * FP32_ULP * norms


# -- the transform ----------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_dct_matches_definition_and_round_trips(chunk):
    x = _x(1000, 1)
    c = dct.dct_chunks(x, chunk)
    padded = torch.cat([x.double(), torch.zeros((-1000) % chunk, dtype=torch.float64)]).view(-1, chunk)
    ref = padded @ _dct_reference(chunk).T
    norms = padded.norm(dim=1, keepdim=True)
    assert ((c.double() - ref).abs() <= (chunk + 2) * FP32_ULP * norms).all()
    back = dct.idct_chunks(c, 1000).double()
    tol = _dct_tol(chunk, norms).expand(-1, chunk).reshape(-1)[:1000]
    assert ((back - x.double()).abs() <= tol).all()


def test_dct_tiles_are_demo_2d_transform():
    w = _x(96 * 130, 2).view(96, 130)
    assert dct.tile_shape(w.shape, 64) == (48, 26) and dct.block_size_for(97, 64) == 1
    coeffs = dct.dct_tiles(w, 64)
    dh, dw = _dct_reference(48), _dct_reference(26)
    tile = w[48:, 26:52].double()  # tile (y=1, x=1) is row 1 * 5 + 1
    ref = (dh @ tile @ dw.T).reshape(-1)
    assert ((coeffs[6].double() - ref).abs() <= (48 + 26 + 4) * FP32_ULP * tile.norm()).all()
    back = dct.idct_tiles(coeffs, w.shape, 64)
    assert (back.double() - w.double()).abs().max() <= 2 * (48 + 26 + 4) * FP32_ULP * w.double().norm()


# -- the codec on one tensor ------------------------------------------------------------------------
def test_topk_keeps_the_k_largest_of_each_chunk():
    x = _x(1000, 3)  # 3 full chunks of 300 and one of 100 (which keeps min(k, 100))
    codec = make_codec("none", k=40, chunk=300)
    y = codec.decode_flat(codec.encode_flat(x), 1000)
    for start in range(0, 1000, 300):
        xs, ys = x[start:start + 300], y[start:start + 300]
        keep = xs.abs().argsort(descending=True)[:40]
        ref = torch.zeros_like(xs)
        ref[keep] = xs[keep]
        assert torch.equal(ys, ref)
    assert codec.wire_bytes(1000) == 160 * (2 + 4)


@pytest.mark.parametrize("spec", [dict(name="none", k=256, chunk=256), dict(name="none", k=4096),
                                  dict(name="none", k=100, chunk=100, select="randk")],
                         ids=["topk-256", "topk-default", "randk"])
def test_k_equal_to_chunk_is_exact(spec):
    x = _x(10_000, 4)
    codec = make_codec(spec)
    assert torch.equal(codec.decode_flat(codec.encode_flat(x), x.numel()), x)


@pytest.mark.parametrize("k", [0, 64])
def test_dct_codec_with_all_coefficients_round_trips(k):
    x = _x(1000, 5)
    codec = make_codec("none", k=k, chunk=64, transform="dct")
    y = codec.decode_flat(codec.encode_flat(x), 1000)
    padded = torch.cat([x.double(), torch.zeros(24, dtype=torch.float64)]).view(-1, 64)
    tol = _dct_tol(64, padded.norm(dim=1, keepdim=True)).expand(-1, 64).reshape(-1)[:1000]
    assert ((y.double() - x.double()).abs() <= tol).all()


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "sign", "fp8_e4m3", "bf16"])
def test_kept_values_within_the_value_codec_bound(name):
    """Top-k then the value codec: kept entries are within the value codec's own bound (computed over the
    vector of kept values, as it is encoded), dropped entries decode to exactly zero."""
    x = _x(3000, 6)
    codec = make_codec(name, k=50, chunk=500)
    y = codec.decode_flat(codec.encode_flat(x), 3000)
    keep = torch.cat([x[s:s + 500].abs().topk(50).indices.sort().values + s for s in range(0, 3000, 500)])
    mask = torch.zeros(3000, dtype=torch.bool)
    mask[keep] = True
    assert (y[~mask] == 0).all()
    bound = elementwise_bound(sparse.value_codec(codec), x[keep])
    assert ((y[keep].double() - x[keep].double()).abs() <= bound).all()
    vals = sparse.value_codec(codec).wire_bytes(300)
    assert codec.wire_bytes(3000) == 300 * 2 + vals


def test_topk_error_is_at_most_the_dropped_energy():
    x = _x(4096, 7)
    for k in (1, 16, 256, 4095):
        codec = make_codec("none", k=k, chunk=4096)
        err = (codec.decode_flat(codec.encode_flat(x), 4096) - x).double().norm() ** 2
        assert err <= (1 - k / 4096) * x.double().norm() ** 2


def test_randk_positions_follow_the_key_and_are_uniform():
    x = torch.ones(64 * 50)
    codec = make_codec("none", k=8, chunk=64, select="randk")
    assert codec.wire_bytes(x.numel()) == 8 + 50 * 8 * 4  # the key, then the values: no indices
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(codec.encode_flat(x, g1), codec.encode_flat(x, g2))  # same stream, same bytes
    counts = torch.zeros(64 * 50)
    draws = 400
    for _ in range(draws):
        y = codec.decode_flat(codec.encode_flat(x, g1), x.numel())
        assert (y.view(50, 64) != 0).sum(1).eq(8).all()  # exactly k per chunk
        counts += y
    # each position is kept with p = 1/8: mean count draws*p, sd sqrt(draws*p*(1-p)); 6 sd over 3200 positions
    p = 8 / 64
    assert (counts - draws * p).abs().max() <= 6 * math.sqrt(draws * p * (1 - p))


def test_seeded_stochastic_values_and_bf16_input():
    x = _x(2000, 8, torch.bfloat16)
    codec = make_codec("int4", k=20, chunk=200, rounding="stochastic", seed=3)
    assert torch.equal(codec.encode_flat(x), codec.encode_flat(x))  # a pure function of (x, seed)
    y = codec.decode_flat(codec.encode_flat(x), 2000, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and (y != 0).sum() <= 200


def test_nonfinite_is_never_hidden():
    x = _x(256, 9)
    x[17] = float("nan")
    for codec in (make_codec("int8", k=4, chunk=64), make_codec("none", k=4, chunk=64, transform="dct")):
        assert torch.isnan(codec.decode_flat(codec.encode_flat(x), 256)).any()


@pytest.mark.parametrize("spec, match", [
    (dict(name="int4", k=65), "exceeds the chunk"), (dict(name="int4", k=4, chunk=70000), "chunk must be"),
    (dict(name="int4", k=4, chunk=0), "chunk must be"), (dict(name="int4", chunk=64), "only applies"),
    (dict(name="int4", k=-1), "k \\(entries kept per chunk\\)"), (dict(name="int4", select="randk"), "needs k > 0"),
    (dict(name="int4", k=4, hadamard=16), "hadamard"), (dict(name="int4", k=4, transform="fft"), "transform"),
])
def test_bad_structure_is_refused(spec, match):
    spec = dict(spec)
    if spec.get("k") == 65:
        spec["chunk"] = 64
    with pytest.raises(ValueError, match=match):
        make_codec(spec)


def test_dtype_and_buffer_errors():
    codec = make_codec("int4", k=4, chunk=64)
    with pytest.raises(TypeError, match="floating"):
        codec.encode_flat(torch.arange(10))
    with pytest.raises(ValueError, match="expected a uint8 buffer"):
        codec.decode_flat(torch.zeros(3, dtype=torch.uint8), 64)


def test_spec_round_trip_and_old_specs_unchanged():
    codec = make_codec({"name": "int2", "k": 32, "chunk": 1024})
    assert make_codec(codec.to_dict()) == codec and str(codec) == "int2/b128+topk32/1024"
    assert set(make_codec("int4").to_dict()) == {"name", "block_size", "rounding", "dual_scale", "hadamard", "seed"}
    assert make_codec("none", transform="dct").chunk == 64 and not make_codec("none", k=1).is_identity


# -- through the collectives ------------------------------------------------------------------------
def _full_k_body(rank, world):
    x = _x(5000, 10 + rank) * (rank + 1)
    plain = x.clone()
    torch.distributed.all_reduce(plain)
    out = {}
    for name, spec in {"topk": dict(name="none", k=512, chunk=512),
                       "dct": dict(name="none", k=64, chunk=64, transform="dct")}.items():
        y = x.clone()
        comm.Channel(name, spec).all_reduce(y)
        out[name] = y
    return plain, out, x


@pytest.mark.parametrize("world", [2, 3])
def test_full_k_all_reduce_equals_the_plain_one(world):
    """k = chunk: the compressed all-reduce equals torch's up to fp32 summation round-off (world terms),
    plus the two DCT round trips of each term (and of the reduced shard, for more than two ranks)."""
    res = run_ranks(_full_k_body, world)
    plain = res[0][0].double()
    terms = torch.stack([r[2].double() for r in res])
    sum_tol = 2 * world * FP32_ULP * terms.abs().sum(0)
    for r in res:
        assert torch.equal(r[1]["topk"], res[0][1]["topk"]) and torch.equal(r[1]["dct"], res[0][1]["dct"])
    assert ((res[0][1]["topk"].double() - plain).abs() <= sum_tol).all()
    # a 64-window (a DCT chunk starts at any shard boundary) has norm <= 8 max|x|; the reduced shard's <= the sum's
    dct_tol = sum_tol + (world + 1) * _dct_tol(64, 8 * terms.abs().amax(1).sum().item())
    assert ((res[0][1]["dct"].double() - plain).abs() <= dct_tol).all()


def _ef_body(rank, world, spec, steps):
    ch = comm.Channel("sparse-ef", spec, error_feedback="ef")
    x = _x(3000, 20 + rank)
    total = torch.zeros(3000, dtype=torch.float64)
    for _ in range(steps):
        y = x.clone()
        ch.all_reduce(y)
        total += y.double()
    ef = ch.error_feedback
    return total, ef.error("sparse-ef/worker"), ef.error("sparse-ef/server")


@pytest.mark.parametrize("spec", [dict(name="int2", k=16, chunk=256), dict(name="none", k=4, chunk=64, transform="dct"),
                                  dict(name="none", k=8, chunk=128, select="randk")],
                         ids=["topk-int2", "dct-topk", "randk"])
def test_error_feedback_telescopes_through_sparse_all_reduce(spec):
    """Classic EF: sum_t out_t + sum_r e_worker_r + e_server = T * exact, up to fp32 round-off of every
    step's arithmetic (derived: a few ulps of the largest magnitude per step and rank)."""
    world, steps = 3, 12
    res = run_ranks(_ef_body, world, spec, steps)
    exact = torch.stack([_x(3000, 20 + r).double() for r in range(world)]).sum(0)
    worker = torch.stack([r[1].double() for r in res]).sum(0)
    server = torch.cat([r[2].double() for r in res])
    # per step and rank: h = g + e, e' = h - decode(h) (the same decode the output uses, so the DCT's own
    # round-off cancels), the fp32 decode-sum over ranks and the server's re-encode: (4 + 2 world) roundings
    scale = world * max(_x(3000, 20 + r).abs().max().item() for r in range(world)) + worker.abs().max().item() \
        + server.abs().max().item()
    tol = steps * (4 + 2 * world) * world * FP32_ULP * scale
    assert (res[0][0] + worker + server - steps * exact).abs().max().item() <= tol
    assert all(torch.equal(r[0], res[0][0]) for r in res)

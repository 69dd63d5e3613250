"""TACO's codec (megacomp.compression.taco, ``make_codec("taco")``).

- The transform restated here in plain torch (reshape chosen by measured error, per-row Hadamard when it lowers
  the row's largest magnitude, dual-scale e4m3 quantisation) decodes to the codec's values, with the same
  reshape and row flags on the wire.
- The error bound is the codec's promise, derived here from e4m3's half-ulp (2^-4) and half-subnormal terms and
  the orthonormal row transforms: ||x^ - x|| <= (2^-4 + 2^-9 sqrt(B) / 448) ||x||.
- Encoded bytes equal ``wire_bytes`` (and the layout's byte count restated here), alone and on a real two-rank
  TP all-reduce, where they equal megacomp.plan.wire's count; with compression off the TP layer's output is
  bit-for-bit that of plain torch.distributed.
"""
import math

import pytest
import torch
import torch.distributed as dist

from codec_bounds import hadamard
from distributed import run_ranks
from megacomp import parallel_state
from megacomp.comm import StatsTable
from megacomp.compression import make_codec, taco
from megacomp.config import CommCompressionConfig, ModelParallelConfig
from megacomp.plan import wire
from megacomp.tensor_parallel import RowParallelLinear

FMAX, MIN_SUB = 448.0, 2.0 ** -9  # e4m3


def _dual_fp8(y: torch.Tensor, block: int) -> torch.Tensor:
    """Dual-scale e4m3 round trip of a flat fp32 ``y``: coarse c = amax / 448, per block k = floor(log2(amax /
    amax_b)) in [0, 126], codes e4m3(y 2^k / c), decoded codes * c * 2^-k."""
    nb = -(-y.numel() // block)
    yb = torch.cat([y, y.new_zeros(nb * block - y.numel())]).view(nb, block)
    amax_b = yb.abs().amax(1, keepdim=True)
    amax = amax_b.max()
    c = amax / FMAX
    ratio = amax / amax_b
    k = torch.where(torch.isfinite(ratio), torch.floor(torch.log2(ratio)).clamp(0, 126), torch.full_like(ratio, 126.0))
    codes = ((yb * torch.exp2(k)) / c).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn).to(torch.float32)
    return ((codes * c) * torch.exp2(-k)).reshape(-1)[:y.numel()]


def taco_reference(x: torch.Tensor, g_max: int = 256, block: int = 128):
    """(decoded x, chosen row length, row flags): the TACO transform as the codec's docstring states it."""
    n = x.numel()
    p = -(-n // g_max) * g_max
    flat = torch.cat([x.reshape(-1).float(), x.new_zeros(p - n, dtype=torch.float32)])
    best = None
    for g in (g_max // 8, g_max // 4, g_max // 2, g_max):
        h = hadamard(g).float()
        rows = flat.view(-1, g)
        flags = (rows @ h).abs().amax(1) < rows.abs().amax(1)
        y = torch.where(flags[:, None], rows @ h, rows).reshape(-1)
        yq = _dual_fp8(y, block)
        err = (yq - y).square().sum().item()
        if best is None or err < best[0]:
            back = yq.view(-1, g)
            best = (err, g, flags, torch.where(flags[:, None], back @ h, back).reshape(-1)[:n])
    return best[3], best[1], best[2]


def tp_like(seed: int, rows: int = 64, hidden: int = 384, scale: float = 1e-3, outliers: int = 3) -> torch.Tensor:
    """A dense near-zero activation block with a few outlier channels (the pattern TACO targets)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g) * scale
    x[:, torch.randperm(hidden, generator=g)[:outliers]] *= 50
    return x


def _wire_parts(codec, buf, n):
    """(row-length index, flags as bools) read from the wire layout of the module docstring."""
    p = -(-n // codec.hadamard) * codec.hadamard
    q = 4 + -(-p // codec.block_size) + p
    bits = ((buf[q + 1:].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1)
    return int(buf[q]), bits.bool()


@pytest.mark.parametrize("seed,outliers", [(0, 3), (1, 0), (2, 12)])
def test_codec_matches_the_transform_restated_in_plain_torch(seed, outliers):
    codec = make_codec("taco")
    x = tp_like(seed, outliers=outliers)
    ref, g, flags = taco_reference(x)
    buf = codec.encode_flat(x)
    index, wire_flags = _wire_parts(codec, buf, x.numel())
    assert (codec.hadamard // 8) << index == g
    assert torch.equal(wire_flags[:flags.numel()], flags) and not wire_flags[flags.numel():].any()
    got = codec.decode(codec.encode(x)).reshape(-1)
    assert torch.allclose(got, ref, rtol=0, atol=1e-6 * x.abs().max().item())
    sent, received = taco.wire_values(codec, x)  # the transformed message: orthonormal rows keep the error's norm
    assert math.isclose((received - sent).norm().item(), (got - x.reshape(-1)).norm().item(), rel_tol=1e-4)
    if outliers:  # a row holding an outlier channel has a smaller largest magnitude once rotated
        assert flags.any()


def _promise(codec) -> float:
    return 2.0 ** -4 + MIN_SUB * math.sqrt(codec.block_size) / FMAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_error_within_the_codecs_promise(dtype):
    g = torch.Generator().manual_seed(5)
    cases = [tp_like(3), tp_like(4, outliers=0, scale=1e-5), torch.randn(1000, generator=g),
             torch.randn(7, 33, generator=g) * 1e3, torch.zeros(300), torch.randn(1, generator=g)]
    spike = torch.randn(4096, generator=g) * 1e-4
    spike[17] = 5.0
    cases.append(spike)
    for block in (128, 32):
        codec = make_codec({"name": "taco", "block_size": block})
        for x in cases:
            x = x.to(dtype)
            y = codec.roundtrip(x)
            assert y.dtype == dtype and y.shape == x.shape
            err = (y.double() - x.double()).norm().item()
            # fp32 round-off of the transforms (a few ulps of the norm) and of the output cast
            out_ulp = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float64: 2.0 ** -24}[dtype]
            slack = (16 * 2.0 ** -24 + out_ulp) * x.double().norm().item()
            assert err <= _promise(codec) * x.double().norm().item() + slack, (block, dtype, x.shape)


def test_non_finite_inputs_never_decode_finite_and_bad_options_name_the_fix():
    codec = make_codec("taco")
    for bad in (float("nan"), float("inf")):
        x = torch.randn(600)
        x[300] = bad
        y = codec.roundtrip(x)
        assert not torch.isfinite(y[300])
    for spec, words in (({"name": "taco", "rounding": "stochastic"}, "nearest"), ({"name": "taco", "k": 4}, "drop"),
                        ({"name": "taco", "block_size": 0}, "block_size"), ({"name": "taco", "hadamard": 48}, "power of two")):
        with pytest.raises(ValueError, match=words):
            make_codec(spec)
    buf = codec.encode_flat(torch.randn(300))
    with pytest.raises(ValueError, match="expected a uint8 buffer"):
        codec.decode_flat(buf[:-1], 300)
    corrupt = buf.clone()
    corrupt[4 + 512 // 128 + 512] = 9
    with pytest.raises(ValueError, match="corrupt"):
        codec.decode_flat(corrupt, 300)


def test_encoded_bytes_equal_wire_bytes():
    codec = make_codec("taco")
    assert str(codec) == "taco/b128/g32-256" and make_codec(codec.to_dict()) == codec
    for n in (0, 1, 255, 256, 257, 5000):
        p = -(-n // 256) * 256
        layout = 0 if n == 0 else 4 + -(-p // 128) + p + 1 + -(-(p // 32) // 8)
        assert codec.wire_bytes(n) == layout == codec.encode_flat(torch.randn(n)).numel()


S, B, H, O = 8, 3, 256, 16  # seq, batch, hidden (the all-reduced size), ffn split over TP


def _tp_body(rank, world):
    parallel_state.initialize_model_parallel(world)
    out = {}
    for spec in (None, "taco"):
        stats = StatsTable()
        comp = CommCompressionConfig(tp_forward=spec, min_compress_numel=0)
        cfg = ModelParallelConfig(tensor_model_parallel_size=world, compression=comp)
        cfg.channels.tp_forward.stats = stats
        torch.manual_seed(3)
        row = RowParallelLinear(O, H, config=cfg, bias=False)
        x = tp_like(10 + rank, rows=S * B, hidden=O // world).view(S, B, O // world)
        with torch.no_grad():
            got, _ = row(x)
            partial = x @ row.weight.t()
            plain = partial.clone()
            dist.all_reduce(plain)
            partials = [torch.empty_like(partial) for _ in range(world)]
            dist.all_gather(partials, partial)
        snap = stats.snapshot()
        out[str(spec)] = (got, plain, partials, snap["tp_forward"].wire_bytes if snap else 0)
    parallel_state.destroy_model_parallel()
    return out


def test_tp_all_reduce_with_taco_bytes_bound_and_compression_off_bit_for_bit():
    world = 2
    for res in run_ranks(_tp_body, world):
        got, plain, _, _ = res["None"]
        assert torch.equal(got, plain)  # compression off: exactly plain torch.distributed
        got, plain, partials, nbytes = res["taco"]
        codec = make_codec("taco")
        assert nbytes == wire.all_reduce_bytes(codec, S * B * H, world) > 0
        # two ranks: both decode-sum the two encodings, so the error is at most each partial's promise
        bound = _promise(codec) * sum(p.double().norm().item() for p in partials)
        assert (got.double() - plain.double()).norm().item() <= bound * (1 + 1e-5)
        assert not torch.equal(got, plain)


def test_every_tp_path_with_sequence_parallelism_stays_within_the_bound():
    """taco on tp_forward, tp_backward and the sequence-parallel all-gather / reduce-scatter of megacomp's TP
    layers: each layer's outputs and gradients within the codec's per-element bound (tests/codec_bounds.py)
    propagated through the matmuls, as for the other codecs in test_tensor_parallel_layers.py."""
    from test_tensor_parallel_layers import _body
    names = run_ranks(_body, 2, 2, True, {"name": "taco"}, False)[0]
    assert "col.dx" in names and "row.out" in names

"""megacomp.compression.unbiased: rand-k with the d/k scaling and stochastic quantisation at 2/4/8 bits.

- Bytes: every encoding is exactly ``wire_bytes`` long (the inner codec's layout: key + fp32 values for rand-k,
  fp32 scales + packed codes for usq).
- rand-k: with equal magnitudes the squared error is exactly omega ||x||^2 (deterministic), every decoded entry
  is 0 or chunk/k times the input, and the mean over N draws is within 5 standard deviations of x per entry.
- usq: |C(x) - x| < s per element (one grid step), the mean over N draws is within 5 standard deviations
  (sqrt(s^2 / 4 / N)) of x, and the mean squared error is below omega ||x||^2 (with the sampling margin).
- Bad input: k larger than the chunk or the bucket, unknown or biased codecs, raise one line naming the fix.
"""
import math

import pytest
import torch

from megacomp.compression.unbiased import UNBIASED_CODEC_NAMES, make_unbiased_codec, omega_of

N_DRAWS = 400


def test_names_and_identity():
    assert UNBIASED_CODEC_NAMES == ("randk", "usq2", "usq4", "usq8")
    ident = make_unbiased_codec(None)
    assert ident.is_identity and omega_of(ident, 100) == 0.0
    assert make_unbiased_codec("none").is_identity


@pytest.mark.parametrize("spec,numel", [({"name": "randk", "k": 3, "chunk": 16}, 50), ({"name": "randk", "k": 64}, 5000),
                                        ("usq2", 300), ("usq4", 300), ({"name": "usq8", "block_size": 32}, 301)])
def test_encoding_is_exactly_wire_bytes(spec, numel):
    c = make_unbiased_codec(spec)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    buf = c.encode_flat(x, torch.Generator().manual_seed(1))
    assert buf.dtype == torch.uint8 and buf.numel() == c.wire_bytes(numel)
    if c.name == "randk":  # 8-byte key, then the kept values in fp32
        full, rest = divmod(numel, c.chunk)
        assert buf.numel() == 8 + 4 * (full * c.k + min(rest, c.k))
    else:  # one fp32 scale per block, then numel codes of `bits` bits
        bits = int(c.name[3:])
        assert buf.numel() == 4 * math.ceil(numel / c.block_size) + math.ceil(numel * bits / 8)


def test_randk_error_is_exactly_omega_for_equal_magnitudes_and_values_are_scaled_inputs():
    c = make_unbiased_codec({"name": "randk", "k": 4, "chunk": 32})
    x = torch.where(torch.rand(96, generator=torch.Generator().manual_seed(2)) < 0.5, -1.5, 1.5)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        y = c.roundtrip(x, g)
        assert ((y == 0) | (y == x * 8)).all()  # chunk / k = 8
        assert int((y != 0).sum()) == 12  # k per chunk
        err = float((y - x).pow(2).sum())
        assert err == pytest.approx(c.omega(96) * float(x.pow(2).sum()), rel=1e-6)  # omega = 32/4 - 1 = 7


@pytest.mark.parametrize("spec", [{"name": "randk", "k": 5, "chunk": 20}, "usq2", "usq4", "usq8"])
def test_mean_of_draws_is_the_input_and_error_within_omega(spec):
    c = make_unbiased_codec(spec if not isinstance(spec, str) else {"name": spec, "block_size": 16})
    x = torch.randn(80, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(5)
    draws = torch.stack([c.roundtrip(x, g) for _ in range(N_DRAWS)])
    mean = draws.mean(0)
    if c.name == "randk":
        var = x.pow(2) * (c.chunk / c.k - 1)  # per-entry variance of rand-k
    else:
        amax = x.view(-1, 16).abs().amax(1, keepdim=True).expand(-1, 16).reshape(-1)
        step = amax / c.inner.format.qmax
        assert ((draws - x).abs() < step * (1 + 1e-6)).all()  # one grid step at most
        var = step.pow(2) / 4  # p (1 - p) step^2 <= step^2 / 4
    assert ((mean - x).abs() <= 5 * (var / N_DRAWS).sqrt() + 1e-6).all()
    mse = float((draws - x).pow(2).sum(1).mean())
    # the mean of N squared errors, each <= (max entry error)^2 * numel: 5 sigma of that mean as the margin
    bound = c.omega(80) * float(x.pow(2).sum())
    assert mse <= bound * (1 + 5 / math.sqrt(N_DRAWS)) + 1e-9


def test_bad_settings_raise_one_line_naming_the_fix():
    with pytest.raises(ValueError, match="k=5000 is larger than the chunk of 4096; use k <= chunk"):
        make_unbiased_codec({"name": "randk", "k": 5000})
    c = make_unbiased_codec({"name": "randk", "k": 64})
    with pytest.raises(ValueError, match="k=64 is larger than the bucket of 40 elements; use k < 40"):
        c.check_numel(40)
    with pytest.raises(ValueError, match="unknown unbiased codec 'int4'"):
        make_unbiased_codec("int4")
    with pytest.raises(ValueError, match="not unbiased"):
        from megacomp.compression import make_codec
        make_unbiased_codec(make_codec("int4"))
    with pytest.raises(ValueError, match="k .* must be an int >= 1"):
        make_unbiased_codec("randk")

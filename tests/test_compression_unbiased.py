"""megacomp.compression.unbiased: rand-k with the d/k scaling and stochastic quantisation at 2/4/8 bits.

- Bytes: every encoding is exactly ``wire_bytes`` long (the inner codec's layout: key + fp32 values for rand-k,
  fp32 scales + packed codes for usq).
- rand-k: with equal magnitudes the squared error is exactly omega ||x||^2 (deterministic), every decoded entry
  is 0 or chunk/k times the input, and the mean over N draws is within 5 standard deviations of x per entry.
- usq: |C(x) - x| < s per element (one grid step), the mean over N draws is within 5 standard deviations
  (sqrt(s^2 / 4 / N)) of x, and the mean squared error is below omega ||x||^2 (with the sampling margin).
- natural (Horvath et al. 2019) and rand-k + natural: the encoding is 9 bits an entry (plus rand-k's 8-byte key);
  decoded entries are signed powers of two next to the input; the mean over N draws is x within a Hoeffding
  bound; at the worst case (every |x| = 4/3 times a power of two, rand-k's chunk / k a power of two) the mean
  squared error equals omega ||x||^2 (1/8 for natural, 9/8 chunk/k - 1 composed) within a Hoeffding bound, and
  for random x it stays below omega ||x||^2 plus that bound; fp32 and fp64 inputs draw the same roundings.
- Bad input: k larger than the chunk or the bucket, unknown or biased codecs, raise one line naming the fix.
"""
import math

import pytest
import torch

from megacomp.compression.unbiased import UNBIASED_CODEC_NAMES, make_unbiased_codec, omega_of

N_DRAWS = 400


def test_names_and_identity():
    assert UNBIASED_CODEC_NAMES == ("randk", "usq2", "usq4", "usq8", "natural", "randk_natural")
    ident = make_unbiased_codec(None)
    assert ident.is_identity and omega_of(ident, 100) == 0.0
    assert make_unbiased_codec("none").is_identity


@pytest.mark.parametrize("spec,numel", [({"name": "randk", "k": 3, "chunk": 16}, 50), ({"name": "randk", "k": 64}, 5000),
                                        ("natural", 37), ({"name": "randk_natural", "k": 3, "chunk": 16}, 50),
                                        ("usq2", 300), ("usq4", 300), ({"name": "usq8", "block_size": 32}, 301)])
def test_encoding_is_exactly_wire_bytes(spec, numel):
    c = make_unbiased_codec(spec)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    buf = c.encode_flat(x, torch.Generator().manual_seed(1))
    assert buf.dtype == torch.uint8 and buf.numel() == c.wire_bytes(numel)
    if c.name == "randk":  # 8-byte key, then the kept values in fp32
        full, rest = divmod(numel, c.chunk)
        assert buf.numel() == 8 + 4 * (full * c.k + min(rest, c.k))
    elif c.name == "natural":  # 8 exponent bits and a sign bit an entry
        assert buf.numel() == math.ceil(numel * 9 / 8)
    elif c.name == "randk_natural":  # the key, then 9 bits a kept entry
        full, rest = divmod(numel, c.chunk)
        kept = full * c.k + min(rest, c.k)
        assert buf.numel() == 8 + kept + math.ceil(kept / 8)
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


def _hoeffding(total_range_sq: float, delta: float = 1e-6) -> float:
    """t with P(|mean - E| >= t) <= delta for a mean of independent terms, sum of (range / count)^2 given:
    Hoeffding's inequality, 2 exp(-2 t^2 / total_range_sq) = delta."""
    return math.sqrt(total_range_sq * math.log(2 / delta) / 2)


def worst_case(numel, seed, spread=3):
    """Every |x| = 4/3 times a power of two (m = 1/3, where natural compression's variance ratio is 1/8), the
    powers from 2^-spread to 2^spread."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-spread, spread + 1, (numel,), generator=g).double()
    sign = torch.where(torch.rand(numel, generator=g) < 0.5, -1.0, 1.0).double()
    return sign * (4.0 / 3.0) * torch.pow(2.0, e)


def test_natural_is_unbiased_and_attains_omega_one_eighth_at_the_worst_case():
    c = make_unbiased_codec("natural")
    assert c.omega(10) == 0.125
    d, n = 64, 2000
    x = worst_case(d, 0)
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([c.roundtrip(x, g) for _ in range(n)])
    a = torch.pow(2.0, torch.floor(torch.log2(x.abs())))  # the power of two below |x|
    assert ((draws.abs() == a) | (draws.abs() == 2 * a)).all() and (torch.sign(draws) == torch.sign(x)).all()
    # unbiased: each entry's n draws lie in an interval of width a; a union bound over the d entries
    assert ((draws.mean(0) - x).abs() <= _hoeffding(float(a.max()) ** 2 / n, 1e-6 / d)).all()
    # variance: the squared error of entry j lies in [0, x_j^2 / 4] (error (2/3) a at most, |x| = (4/3) a), so the
    # normalised sum over the n d independent entries has Hoeffding's sum of squared ranges sum_j x_j^4 / (16 n ||x||^4)
    ratio = float((draws - x).pow(2).sum(1).mean()) / float(x.pow(2).sum())
    tol = _hoeffding(float(x.pow(4).sum()) / (16 * n * float(x.pow(2).sum()) ** 2))
    assert abs(ratio - 0.125) <= tol, (ratio, tol)
    assert tol < 0.005  # the test resolves omega to 4% at least


def test_natural_below_omega_for_random_inputs_and_fp32_fp64_draw_alike():
    c = make_unbiased_codec("natural")
    d, n = 64, 1000
    x = torch.randn(d, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    draws = torch.stack([c.roundtrip(x, g) for _ in range(n)])
    # entry j's squared error is at most x_j^2 (rounding up from just above a power of two)
    ratio = float((draws - x).pow(2).sum(1).mean()) / float(x.pow(2).sum())
    assert ratio <= 0.125 + _hoeffding(float(x.pow(4).sum()) / (n * float(x.pow(2).sum()) ** 2))
    a = c.roundtrip(x.float(), torch.Generator().manual_seed(7))
    b = c.roundtrip(x, torch.Generator().manual_seed(7))
    assert b.dtype == torch.float64 and torch.equal(a.double(), b)
    tiny = torch.tensor([0.0, 2.0 ** -130, -(2.0 ** -140)])
    out = c.roundtrip(tiny, g)
    assert out[0] == 0 and set(out.abs().tolist()) <= {0.0, 2.0 ** -126}


@pytest.mark.parametrize("k", [1, 4])
def test_randk_natural_is_unbiased_and_attains_the_composed_omega(k):
    chunk, chunks, n = 32, 64, 300
    c = make_unbiased_codec({"name": "randk_natural", "k": k, "chunk": chunk})
    omega = 9 / 8 * chunk / k - 1
    assert c.omega(chunk * chunks) == pytest.approx(omega)
    x = worst_case(chunk * chunks, 4, spread=0)  # equal magnitudes: rand-k's error is then omega ||x||^2 exactly
    g = torch.Generator().manual_seed(5)
    draws = torch.stack([c.roundtrip(x, g) for _ in range(n)])
    assert (((draws != 0).view(n, chunks, chunk).sum(2)) == k).all()
    # per chunk (independent positions, independent roundings) the normalised squared error lies in [0, r_c] with
    # r_c the largest it can be: every kept entry rounded up to (chunk/k) 2a = (chunk/k)(3/2)|x|, all others dropped
    xc = x.view(chunks, chunk)
    worst = (xc.pow(2).sum(1) + k * ((chunk / k * 1.5 - 1) * xc.abs().max(1).values).pow(2)) / float(x.pow(2).sum())
    ratio = float((draws - x).pow(2).sum(1).mean()) / float(x.pow(2).sum())
    tol = _hoeffding(float(worst.pow(2).sum()) / n)
    assert abs(ratio - omega) <= tol, (ratio, omega, tol)
    assert tol < 0.1 * omega
    # unbiased: entry j's draws lie in [0, (chunk/k)(3/2)|x_j|] (times its sign): that width, a union bound over j
    width = (chunk / k) * 1.5 * x.abs()
    assert ((draws.mean(0) - x).abs() <= width * math.sqrt(math.log(2 * x.numel() / 1e-6) / (2 * n))).all()


def test_natural_refuses_entries_beyond_fp32_exponents():
    c = make_unbiased_codec("natural")
    with pytest.raises(ValueError, match="natural compression: an entry is >= 2\\^127 .*; scale the message"):
        c.encode_flat(torch.tensor([1.0, 2.0 ** 127], dtype=torch.float64))
    with pytest.raises(ValueError, match="not finite"):
        c.encode_flat(torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="unbiased codec randk_natural: k=40 is larger than the chunk of 30"):
        make_unbiased_codec({"name": "randk_natural", "k": 40, "chunk": 30})

"""Stochastic rounding's counter-based draws (megacomp.compression.counter_rng): the specification's
values, uniformity and independence with tolerances derived from the sample sizes, reproducibility, and the
refusal of tensors too large for the 32-bit counter."""
import math

import pytest
import torch

from megacomp.compression import counter_rng, make_codec, quantize


def _mix32(x: int) -> int:
    """The docstring's mixer on Python ints (an independent restatement of the specification)."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) % 2**32
    x = (((x >> 16) ^ x) * 0x45D9F3B) % 2**32
    return (x >> 16) ^ x


def _u(key: int, i: int) -> float:
    s0, s1 = _mix32(key % 2**32), _mix32((key >> 32) ^ 0x9E3779B9)
    return (_mix32(((i * 0x4F1BBCDD + s0) % 2**32) ^ s1) >> 8) / 2**24


@pytest.mark.parametrize("key", [0, 1, 2**32 - 1, 2**32, 123456789 * 2**31 + 987654321, 2**62 - 1])
def test_values_follow_the_specification(key):
    idx = [0, 1, 2, 255, 256, 65535, 65536, 4_000_000, 2**22 + 3]
    u = counter_rng.uniforms(torch.tensor([key]), max(idx) + 1)
    assert [u[i].item() for i in idx] == [_u(key, i) for i in idx]  # exact: 24-bit values are exact in fp32


def _chi2_bound(bins: int) -> float:
    """Mean + 6 standard deviations of a chi-square statistic with bins - 1 degrees of freedom."""
    dof = bins - 1
    return dof + 6 * math.sqrt(2 * dof)


def _chi2(counts: torch.Tensor) -> float:
    expected = counts.sum().item() / counts.numel()
    return ((counts.double() - expected) ** 2 / expected).sum().item()


def test_uniform_in_high_and_low_bits():
    n = 1 << 20
    u = counter_rng.uniforms(counter_rng.draw_key(torch.Generator().manual_seed(0), "cpu"), n)
    assert u.min().item() >= 0.0 and u.max().item() < 1.0
    # mean within 6 standard errors of 1/2 (variance of U[0,1) is 1/12)
    assert abs(u.double().mean().item() - 0.5) <= 6 * math.sqrt(1 / 12 / n)
    grid = (u.double() * 2**24).long()
    assert torch.equal(grid.double(), u.double() * 2**24)  # on the 24-bit grid, like torch.rand
    assert _chi2(torch.bincount(grid >> 16, minlength=256)) <= _chi2_bound(256)  # top 8 bits
    assert _chi2(torch.bincount(grid & 255, minlength=256)) <= _chi2_bound(256)  # lowest 8 bits


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return (a * b).mean().item() / math.sqrt((a * a).mean().item() * (b * b).mean().item())


def test_neighbours_and_keys_are_uncorrelated():
    """|correlation| of independent samples is below 6 / sqrt(n) with overwhelming probability; the pairs
    checked: neighbouring elements, successive keys of one generator, and keys one bit apart (low and high
    halves, the adversarial case of a counter-based design)."""
    n = 1 << 20
    bound = 6 / math.sqrt(n)
    g = torch.Generator().manual_seed(1)
    k1, k2 = counter_rng.draw_key(g, "cpu"), counter_rng.draw_key(g, "cpu")
    u1 = counter_rng.uniforms(k1, n)
    assert abs(_corr(u1[:-1], u1[1:])) <= bound
    assert abs(_corr(u1[::2], u1[1::2])) <= bound
    for other in (k2, k1 ^ 1, k1 ^ (1 << 40)):
        u2 = counter_rng.uniforms(other, n)
        assert not torch.equal(u1, u2)
        assert abs(_corr(u1, u2)) <= bound
        assert abs(_corr(u1[1:], u2[:-1])) <= bound


def test_keys_come_from_the_generator():
    a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(counter_rng.draw_key(a, "cpu"), counter_rng.draw_key(b, "cpu"))
    k = counter_rng.draw_key(a, "cpu")
    assert k.dtype == torch.int64 and k.shape == (1,) and 0 <= k.item() < 2**62
    assert not torch.equal(k, counter_rng.draw_key(a, "cpu"))  # each call moves the generator on


def test_chunked_reference_equals_one_pass(monkeypatch):
    key = torch.tensor([2**40 + 5])
    whole = counter_rng.uniforms(key, 10_000)
    monkeypatch.setattr(counter_rng, "_CHUNK", 999)
    assert torch.equal(counter_rng.uniforms(key, 10_000), whole)


def test_too_many_elements_are_refused():
    with pytest.raises(ValueError, match="32-bit counter.*buckets"):
        counter_rng.check_numel(2**32)
    counter_rng.check_numel(2**32 - 1)


def test_stochastic_codec_refuses_huge_tensors_without_allocating(monkeypatch):
    """The refusal comes before any draw or kernel call, on both paths (the limit is lowered to 8 here so
    that no 2^32-element tensor has to be allocated)."""
    x = torch.zeros(8)
    monkeypatch.setattr(counter_rng, "MAX_NUMEL", 8)
    fmt = make_codec("int4").format
    for ref in (True, False):
        with pytest.raises(ValueError, match="32-bit counter"):
            if ref:
                quantize.encode_scaled_reference(x, fmt, 128, False, True, None)
            else:
                quantize.encode_scaled(x, fmt, 128, False, True, None)

"""Error feedback with device-side "all finite" flags (what the Triton kernels return instead of a bool, so a step
never reads a flag back): the drop of a non-finite error decided on the device, counted when ``dropped`` is read,
and the same state as with host bools. On CPU the flags are CPU tensors; the Triton zeroing kernel runs under
triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from megacomp.compression import ErrorFeedback
from megacomp.compression.error_feedback import drop_nonfinite

try:
    from megacomp.kernels.triton import codec_triton as ct
    HAVE_TRITON = ct.HAVE_TRITON
except Exception:  # pragma: no cover - triton is a test requirement (scripts/install.sh test)
    HAVE_TRITON = False


def test_device_flag_drops_and_counts_like_a_bool():
    host, dev = ErrorFeedback("loco"), ErrorFeedback("loco")
    for step, finite in enumerate((True, False, True, False, False)):
        new = torch.full((5,), float(step + 1))
        host.commit("k", drop_nonfinite(new.clone(), finite), finite=finite)
        flag = torch.tensor(finite)
        dev.commit("k", drop_nonfinite(new.clone(), flag), finite=flag)
        assert torch.equal(host.error("k"), dev.error("k")), step
    dev.commit("other", torch.ones(2), finite=torch.tensor(True))
    assert dev.steps == {**host.steps, "other": 1}
    assert dev.dropped == host.dropped == {"k": 3}  # a key without drops gets no entry, as with bools
    assert dev.state_dict()["dropped"] == {"k": 3}
    dev.dropped = {}
    assert dev.dropped == {}


def test_update_keeps_the_flag_on_the_tensor_device_only_off_cpu():
    ef = ErrorFeedback("ef")
    h = torch.tensor([1.0, float("inf"), 2.0])
    ef.update("k", h, torch.zeros(3))
    assert ef.error("k") is None or torch.equal(ef.error("k"), torch.zeros(3))
    assert ef.dropped == {"k": 1}


@pytest.mark.skipif(not HAVE_TRITON, reason="needs the triton package (its interpreter runs on CPU)")
def test_interpreted_zero_unless_writes_only_when_flagged():
    t = ct.interpreted()
    e = torch.arange(10_000, dtype=torch.float32)
    t.zero_unless(e, torch.tensor(True))
    assert torch.equal(e, torch.arange(10_000, dtype=torch.float32))
    t.zero_unless(e, torch.tensor(False))
    assert torch.equal(e, torch.zeros(10_000))
    with pytest.raises(ct.Unsupported):
        t.zero_unless(torch.zeros(4, dtype=torch.float64), torch.tensor(True))

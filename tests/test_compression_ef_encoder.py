"""megacomp.compression.ef_encoder: chunk-by-chunk error feedback (one fused pass per chunk where the C++
kernel covers it) gives the bytes and the error state of ``compensate`` + ``encode`` + ``update_encoded``
bit for bit, over several steps, chunk orders, codecs, error storages, LoCo resets and a non-finite step."""
import pytest
import torch

from megacomp.compression import ErrorFeedback, make_codec, quantize
from megacomp.compression.ef_encoder import ChunkEncoder, CompensatedEncoder, chunk_encoder

CODECS = [dict(name="int4"), dict(name="int8", block_size=32), dict(name="int2", block_size=64),
          dict(name="fp8_e4m3"), dict(name="fp8_e5m2", block_size=16), dict(name="int4", block_size=32, dual_scale=True),
          dict(name="int4", block_size=0), dict(name="int8", block_size=7), dict(name="int4", rounding="stochastic"),
          dict(name="int2", block_size=64, rounding="stochastic"), dict(name="sign"), dict(name="int4", hadamard=64),
          dict(name="bf16")]
EFS = [dict(beta=0.0), dict(beta=0.8, reset_interval=3), dict(beta=0.8, storage="bf16"), dict(beta=0.0, storage="int8")]


def _chunks(n: int, order: str):
    cuts = [0, 1000, 1000 + 256, 5000, n] if n > 5000 else [0, n]
    ranges = [(a, b - a) for a, b in zip(cuts, cuts[1:])]
    return ranges[::-1] if order == "reversed" else ranges


def _reference_step(ef, key, g, codec, ranges, generator=None):
    """The whole-tensor steps, as the collectives ran them before chunk encoders."""
    h = ef.compensate(key, g)
    bufs = {o: codec.encode_flat(h[o:o + s], generator, strict=False) for o, s in ranges}
    ordered = sorted(ranges)
    ef.update_encoded(key, h, codec, [bufs[o] for o, _ in ordered], [s for _, s in ordered])
    return bufs


def _spec_codec(spec):
    spec = dict(spec)
    if spec.get("rounding") == "stochastic":
        spec["seed"] = 5
    return make_codec(spec)


@pytest.mark.parametrize("spec", CODECS, ids=lambda s: "/".join(str(v) for v in s.values()))
@pytest.mark.parametrize("efc", EFS, ids=lambda s: "/".join(f"{k}={v}" for k, v in s.items()))
def test_chunk_encoder_matches_whole_tensor_steps(spec, efc):
    ef_ref, ef_new = ErrorFeedback(efc), ErrorFeedback(efc)
    codec_ref, codec_new = _spec_codec(spec), _spec_codec(spec)
    n = 9_001
    gen = torch.Generator().manual_seed(0)
    stream_ref, stream_new = codec_ref.stream(), codec_new.stream()  # two equal streams (None if unseeded)
    for step in range(5):
        g = torch.randn(n, generator=gen) * (10.0 ** (step - 2))
        if step == 2:
            g[4242] = float("inf")  # a non-finite residual drops the error (and is counted)
        ranges = _chunks(n, "reversed" if step % 2 else "forward")
        ref = _reference_step(ef_ref, "k", g, codec_ref, ranges, stream_ref)
        enc = chunk_encoder(ef_new, "k", g, codec_new, stream_new)
        got = {o: enc.encode(o, s) for o, s in ranges}
        enc.commit()
        for o, _ in ranges:
            assert torch.equal(got[o], ref[o]), f"step {step}: bytes of chunk {o} differ"
        e_ref, e_new = ef_ref.error("k"), ef_new.error("k")
        assert (e_ref is None) == (e_new is None)
        if e_ref is not None:
            assert torch.equal(e_ref.view(torch.int32), e_new.view(torch.int32)), f"step {step}: errors differ"
        assert ef_ref.steps == ef_new.steps and ef_ref.dropped == ef_new.dropped
    assert ef_new.dropped == {"k": 1}


def test_fused_pass_is_used_where_it_applies(monkeypatch):
    """int4 block 128 on fp32 with fp32 storage: every chunk of more than one block takes the one-pass
    kernel (no separate encode); a chunk of one block takes the three steps."""
    calls = []
    real = quantize.ef_encode_scaled
    monkeypatch.setattr(quantize, "ef_encode_scaled", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    ef, codec = ErrorFeedback("loco"), make_codec("int4")
    enc = chunk_encoder(ef, "k", torch.randn(1000), codec)
    assert isinstance(enc, CompensatedEncoder) and enc.chunked
    enc.encode(0, 900)
    enc.encode(900, 100)
    enc.commit()
    from megacomp import kernels
    if kernels.cpu_kernels() is not None:
        assert calls == [True, None]


def test_reference_kernels_give_the_same_state(monkeypatch):
    g = torch.randn(5000, generator=torch.Generator().manual_seed(3))
    states = []
    for mode in ("auto", "reference"):
        monkeypatch.setenv("MEGACOMP_KERNELS", mode)
        ef, codec = ErrorFeedback("loco"), make_codec("int4")
        for _ in range(2):
            enc = chunk_encoder(ef, "k", g, codec)
            bufs = [enc.encode(o, s) for o, s in ((0, 2500), (2500, 2500))]
            enc.commit()
        states.append((bufs, ef.error("k")))
    assert all(torch.equal(a, b) for a, b in zip(states[0][0], states[1][0]))
    assert torch.equal(states[0][1], states[1][1])


def test_without_error_feedback_is_plain_encode():
    codec = make_codec("int4")
    g = torch.randn(3000)
    enc = chunk_encoder(None, "k", g, codec)
    assert type(enc) is ChunkEncoder
    assert torch.equal(enc.encode(100, 2000), codec.encode_flat(g[100:2100]))
    enc.commit()


@pytest.mark.parametrize("ranges", [[(0, 500)], [(0, 600), (500, 500)], [(0, 1000), (0, 1000)]])
def test_commit_refuses_incomplete_or_overlapping_chunks(ranges):
    ef = ErrorFeedback("ef")
    enc = chunk_encoder(ef, "k", torch.randn(1000), make_codec("int4"))
    for o, s in ranges:
        enc.encode(o, s)
    with pytest.raises(RuntimeError, match="exactly once"):
        enc.commit()
    assert ef.error("k") is None  # nothing stored


def test_commit_refusal_after_an_in_place_update_drops_the_error():
    ef = ErrorFeedback("loco")
    for ranges, ok in (([(0, 1000)], True), ([(0, 600)], False)):
        enc = chunk_encoder(ef, "k", torch.randn(1000), make_codec("int4"))
        for o, s in ranges:
            enc.encode(o, s)
        if ok:
            enc.commit()
            assert ef.error("k") is not None
        else:
            with pytest.raises(RuntimeError, match="dropped"):
                enc.commit()
    assert ef.error("k") is None


def test_shape_change_raises_like_compensate():
    ef = ErrorFeedback("ef")
    enc = chunk_encoder(ef, "k", torch.randn(1000), make_codec("int4"))
    enc.encode(0, 1000)
    enc.commit()
    with pytest.raises(ValueError, match="distinct key"):
        chunk_encoder(ef, "k", torch.randn(999), make_codec("int4"))


@pytest.mark.parametrize("efc", [dict(beta=0.8), dict(beta=0.8, storage="bf16")], ids=["fp32", "bf16"])
def test_input_filled_between_chunks(efc):
    """The encoder reads g only in encode(): a buffer filled segment by segment (the all-reduce's server
    shard) gives the state of encoding the finished tensor."""
    g = torch.randn(4000, generator=torch.Generator().manual_seed(9))
    ef_ref, ef_new = ErrorFeedback(efc), ErrorFeedback(efc)
    for _ in range(2):
        ref = _reference_step(ef_ref, "s", g, make_codec("int4"), [(0, 1500), (1500, 2500)])
        buf = torch.full_like(g, float("nan"))
        enc = chunk_encoder(ef_new, "s", buf, make_codec("int4"))
        got = []
        for o, s in ((0, 1500), (1500, 2500)):
            buf[o:o + s] = g[o:o + s]
            got.append(enc.encode(o, s))
        enc.commit()
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1500])
        assert torch.equal(ef_ref.error("s"), ef_new.error("s"))


@pytest.mark.parametrize("spec", [dict(name="int4", block_size=16, rounding="stochastic", seed=5),
                                  dict(name="sign"), dict(name="int8", block_size=16)], ids=["int4-sr", "sign", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_empty_chunks_draw_nothing_and_collide_with_nothing(spec, dtype):
    """Collectives encode empty chunks when a tensor is smaller than the world (several at one offset): no
    stochastic key is drawn for them (as encode_flat of an empty tensor) and they do not displace the
    chunk that starts at the same offset."""
    ranges = [(0, 0), (0, 40), (40, 0), (40, 0), (40, 24), (64, 0)]
    ef_ref, ef_new = ErrorFeedback("loco"), ErrorFeedback("loco")
    c_ref, c_new = make_codec(spec), make_codec(spec)
    s_ref, s_new = c_ref.stream(), c_new.stream()  # two equal streams (None if unseeded)
    for step in range(3):
        g = torch.randn(64, generator=torch.Generator().manual_seed(step)).to(dtype)
        h = ef_ref.compensate("k", g)
        ref = [c_ref.encode_flat(h[o:o + s], s_ref, strict=False) for o, s in ranges]
        ef_ref.update_encoded("k", h, c_ref, ref, [s for _, s in ranges])
        with chunk_encoder(ef_new, "k", g, c_new, s_new) as enc:
            got = [enc.encode(o, s) for o, s in ranges]
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), step
        assert torch.equal(ef_ref.error("k"), ef_new.error("k")), step


def test_abort_drops_a_half_updated_error_and_nothing_else():
    ef, codec = ErrorFeedback("loco"), make_codec("int4")
    g = torch.randn(1000)
    with chunk_encoder(ef, "k", g, codec) as enc:  # first step: the error is created
        enc.encode(0, 1000)
    enc = chunk_encoder(ef, "k", g, codec)
    enc.encode(0, 1000)
    enc.commit()
    assert ef.error("k") is not None and ef.dropped == {}
    enc.abort()  # after a commit: nothing to undo
    assert ef.error("k") is not None and ef.dropped == {}
    with pytest.raises(RuntimeError, match="already committed"):
        enc.commit()
    with pytest.raises(ConnectionError):
        with chunk_encoder(ef, "k", g, codec) as enc:
            enc.encode(0, 500)  # the stored error is now half overwritten
            raise ConnectionError("a send failed")
    assert ef.error("k") is None and ef.dropped == {"k": 1}
    ef2 = ErrorFeedback("loco")  # no error yet: nothing was overwritten, nothing to drop
    with pytest.raises(ConnectionError):
        with chunk_encoder(ef2, "k", g, codec) as enc:
            enc.encode(0, 500)
            raise ConnectionError("a send failed")
    assert ef2.error("k") is None and ef2.dropped == {}

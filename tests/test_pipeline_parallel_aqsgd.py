"""AQ-SGD activation-delta compression (megacomp.pipeline_parallel.aqsgd) on real pipeline ranks.

- One process: the receiver's activation equals the sender's cache, and differs from the true activation
  by at most the codec's bound on the *delta* (block-scaled int: max|delta in block| / (2 qmax) per element);
  first visits travel uncompressed; bad ids and shapes raise.
- PP 2, PP 4 and PP 2 x VP 2, int4 deltas over several epochs with SGD steps in between: after every
  step the sender's and the receiver's cache of every boundary are bit-identical.
- Codec off (pp_activation none, AQ-SGD on): losses and gradients bit-identical to the plain pipeline.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import parallel_state
from megacomp.comm import reset_stats, stats as wire_stats
from megacomp.compression import make_codec
from megacomp.compression.channel_max import ChannelMaxQuantizer
from megacomp.config import CommCompressionConfig, ModelParallelConfig
from megacomp.models.chunks import GPTChunks
from megacomp.models.gpt import GPTConfig, GPTModel, split_layers
from megacomp.pipeline_parallel import (PipelineCommunicator, forward_backward_pipelining_with_interleaving,
                                        forward_backward_pipelining_without_interleaving)
from megacomp.pipeline_parallel.aqsgd import ActivationDeltaCache
from megacomp.training.features.aqsgd_caches import build_activation_delta, cache_sides

CFG = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_layers=4, max_seq_length=16, seed=5)
S, B, NSAMPLES = 16, 2, 8
TOKENS = torch.randint(0, 64, (NSAMPLES, S + 1), generator=torch.Generator().manual_seed(0))


def block_bound(delta: torch.Tensor, codec) -> torch.Tensor:
    """Per-element bound of a round-to-nearest block-scaled int codec on ``delta`` (flattened as encoded)."""
    flat = delta.reshape(-1)
    n, bs = flat.numel(), codec.block_size
    pad = torch.zeros(-n % bs)
    amax = torch.cat([flat.abs(), pad]).view(-1, bs).amax(dim=1)
    return (amax / (2 * codec.format.qmax)).repeat_interleave(bs)[:n] * (1 + 1e-5) + 1e-7


def test_delta_round_trip_is_bounded_and_both_caches_agree():
    codec = make_codec("int4")
    slot_of = torch.arange(4)
    send = ActivationDeltaCache([(1, "send")], slot_of, (S, 8), torch.float32)
    recv = ActivationDeltaCache([(1, "recv")], slot_of, (S, 8), torch.float32)
    ids = [[0, 2], [1, 3]]
    send.set_sample_ids(ids)
    recv.set_sample_ids(ids)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(S, 2, 8, generator=g)
    for visit in range(4):
        assert send.in_warmup(1, "send", 0) == (visit == 0)
        msg = send.encode(1, 0, a, codec)
        assert msg.dtype == (torch.float32 if visit == 0 else torch.uint8)
        out = torch.empty(S, 2, 8)
        buf = recv.message_buffer(1, 0, out.shape, codec, "cpu")
        assert buf.shape == msg.shape and buf.dtype == msg.dtype
        before = recv.values["b1/recv"][[0, 2]].clone()
        recv.decode(1, 0, msg, out, codec)
        assert torch.equal(send.values["b1/send"], recv.values["b1/recv"])
        assert torch.equal(out, recv.values["b1/recv"][[0, 2]].transpose(0, 1))
        if visit == 0:
            assert torch.equal(out, a)
        else:
            delta = a.transpose(0, 1) - before
            err = (out.transpose(0, 1) - a.transpose(0, 1)).reshape(-1).abs()
            assert (err <= block_bound(delta, codec)).all()
        a = a + 0.01 * torch.randn(S, 2, 8, generator=g)  # the activation drifts a little between visits
    # the delta path's error is far below direct quantisation's on slowly changing activations
    direct = codec.decode_flat(codec.encode_flat(a), a.numel()).view_as(a)
    msg = send.encode(1, 0, a, codec)
    recv.decode(1, 0, msg, out, codec)
    assert (out - a).abs().max() < 0.2 * (direct - a).abs().max()


def test_bad_ids_shapes_and_missing_ids_raise():
    c = ActivationDeltaCache([(1, "send")], torch.tensor([0, -1, 1]), (S, 8), torch.float32)
    with pytest.raises(ValueError, match="call set_sample_ids"):
        c.encode(1, 0, torch.zeros(S, 2, 8), make_codec("int4"))
    c.set_sample_ids([[0, 1], [0, 7]])
    with pytest.raises(ValueError, match="not in this rank's cache"):
        c.encode(1, 0, torch.zeros(S, 2, 8), make_codec("int4"))
    with pytest.raises(ValueError, match="outside the dataset"):
        c.encode(1, 1, torch.zeros(S, 2, 8), make_codec("int4"))
    c.set_sample_ids([[0, 2]])
    with pytest.raises(ValueError, match="does not match the cache"):
        c.encode(1, 0, torch.zeros(S, 3, 8), make_codec("int4"))
    with pytest.raises(ValueError, match="no recv cache for boundary 1"):
        c.decode(1, 0, torch.zeros(1, dtype=torch.uint8), torch.zeros(S, 2, 8), make_codec("int4"))
    with pytest.raises(ValueError, match="need 0.00 GiB|need .* GiB"):
        build_activation_delta(num_samples=10_000, shard=torch.arange(10_000), pp_size=2, pp_rank=0, num_chunks=1,
                               sample_shape=(128, 256), dtype=torch.float32, warmup_visits=1, available_bytes=1 << 20)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size >= 2"):
        build_activation_delta(num_samples=4, shard=torch.arange(4), pp_size=1, pp_rank=0, num_chunks=1,
                               sample_shape=(4, 4), dtype=torch.float32, warmup_visits=1)
    assert cache_sides(2, 0, 2) == [(1, "send"), (2, "recv"), (3, "send")]
    assert cache_sides(4, 3, 1) == [(3, "recv")]


def _epochs_body(rank, world, pp, chunks, codec, epochs, batched=False, extra=None):
    """SGD over ``epochs`` passes of NSAMPLES samples; returns per step (losses, caches, wire stats) and final
    grads. ``extra``: more compression settings (AQ-SGD on)."""
    groups = parallel_state.initialize_model_parallel(1, pp)
    comp = CommCompressionConfig(pp_activation=codec, min_compress_numel=0,
                                 pp_activation_delta=codec is not None or extra is not None, **(extra or {}))
    mpc = ModelParallelConfig(pipeline_model_parallel_size=pp, compression=comp)
    cfg = GPTConfig(**CFG)
    r = groups.pp_rank
    if chunks > 1:
        model = GPTChunks(cfg, mpc, pp_size=pp, pp_rank=r, num_chunks=chunks)
        parts = list(model.chunks)
    else:
        model = GPTModel(cfg, mpc, pre_process=r == 0, post_process=r == pp - 1, layer_range=split_layers(4, pp, r))
        parts = [model]
    cache = None
    if comp.pp_activation_delta:
        cache = build_activation_delta(num_samples=NSAMPLES, shard=torch.arange(NSAMPLES), pp_size=pp, pp_rank=r,
                                       num_chunks=chunks, sample_shape=(S, CFG["hidden_size"]), dtype=torch.float32,
                                       warmup_visits=1, bits=comp.pp_activation_delta_bits,
                                       warmup_full_gradients=comp.pp_activation_delta_warmup_full_gradients)
    comm_ = PipelineCommunicator(groups.pp_ranks, comp, activation_delta=cache, batched_p2p=batched)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    M = pp  # micro-batches per step
    steps = epochs * NSAMPLES // (M * B)
    records = []
    for step in range(steps):
        e, j = divmod(step, NSAMPLES // (M * B))
        perm = torch.randperm(NSAMPLES, generator=torch.Generator().manual_seed(e))
        ids = [perm[(j * M + k) * B:(j * M + k + 1) * B].tolist() for k in range(M)]
        comm_.set_sample_ids(ids)
        reset_stats()

        def run(part, x, k):
            toks = TOKENS[ids[k]]
            inp = toks[:, :-1] if part.pre_process else x
            return part(inp, toks[:, 1:]) if part.post_process else part(inp)
        opt.zero_grad()
        if chunks > 1:
            losses = forward_backward_pipelining_with_interleaving(
                stage_forward=lambda x, k, v: run(parts[v], x, k), num_microbatches=M, communicator=comm_,
                activation_shape=(S, B, CFG["hidden_size"]), num_model_chunks=chunks, models=parts)
        else:
            losses = forward_backward_pipelining_without_interleaving(
                stage_forward=lambda x, k: run(model, x, k), num_microbatches=M, communicator=comm_,
                activation_shape=(S, B, CFG["hidden_size"]))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        caches = {k: v.clone() for k, v in cache.values.items()} if cache is not None else {}
        records.append((losses, caches, wire_stats()))
    parallel_state.destroy_model_parallel()
    return records, grads


@pytest.mark.parametrize("world,chunks,batched", [(2, 1, False), (4, 1, False), (2, 2, False), (2, 2, True)],
                         ids=["pp2", "pp4", "pp2xvp2", "pp2xvp2-batched"])
def test_sender_and_receiver_caches_are_bit_identical_after_every_step(world, chunks, batched):
    results = run_ranks(_epochs_body, world, world, chunks, "int4", 3, batched)
    steps = len(results[0][0])
    checked = 0
    for step in range(steps):
        caches = {}
        for records, _ in results:
            caches.update(records[step][1])
        for key, values in caches.items():
            b, side = key.split("/")
            if side == "send":
                assert torch.equal(values, caches[f"{b}/recv"]), f"step {step}: boundary {b} caches differ"
                checked += 1
    boundaries = world * chunks - 1
    assert checked == steps * boundaries
    last = [rec for rec, _ in results if rec[0][0]][0]
    assert all(torch.isfinite(torch.tensor(losses)).all() for losses, *_ in last)


@pytest.mark.parametrize("world,chunks", [(2, 1), (2, 2)], ids=["pp2", "pp2xvp2"])
def test_codec_off_is_bit_identical_to_the_plain_pipeline(world, chunks):
    aq = run_ranks(_epochs_body, world, world, chunks, "none", 2)
    plain = run_ranks(_epochs_body, world, world, chunks, None, 2)
    for (rec_a, grads_a), (rec_p, grads_p) in zip(aq, plain):
        assert [x[0] for x in rec_a] == [x[0] for x in rec_p]
        assert all(torch.equal(grads_a[n], grads_p[n]) for n in grads_p)


def test_a_non_finite_activation_resets_that_sample_on_both_sides():
    """An inf in one sample after the warm-up: both caches clear that row (and any row sharing its scale block)
    and reset its visits, equally; the next visit goes uncompressed and the caches are finite again."""
    codec = make_codec("int4")
    h = 6  # S * h = 96 < block 128: a scale block spans two samples
    send = ActivationDeltaCache([(1, "send")], torch.arange(2), (S, h), torch.float32)
    recv = ActivationDeltaCache([(1, "recv")], torch.arange(2), (S, h), torch.float32)
    for c in (send, recv):
        c.set_sample_ids([[0, 1]])
    out = torch.empty(S, 2, h)
    for visit in range(3):
        a = torch.randn(S, 2, h, generator=torch.Generator().manual_seed(visit))
        if visit == 1:
            a[3, 0, 2] = float("inf")
        msg = send.encode(1, 0, a, codec)
        recv.decode(1, 0, msg, out, codec)
        assert torch.equal(send.values["b1/send"], recv.values["b1/recv"])
        assert torch.equal(send.visits["b1/send"], recv.visits["b1/recv"])
        if visit == 1:  # the inf's block covers both samples: both rows cleared, both back to warm-up
            assert send.visits["b1/send"].tolist() == [0, 0] and not send.values["b1/send"].any()
            assert not torch.isfinite(out).all()
        if visit == 2:
            assert msg.dtype == torch.float32 and torch.equal(out, a)  # uncompressed again, exact


def test_cache_state_refuses_other_samples():
    c = ActivationDeltaCache([(1, "send")], torch.arange(4), (S, 8), torch.float32)
    state = c.state_dict()
    other = ActivationDeltaCache([(1, "send")], torch.tensor([1, 0, 2, 3]), (S, 8), torch.float32)
    with pytest.raises(ValueError, match="maps other samples to its rows"):
        other.load_state_dict(state)
    c.load_state_dict(state)


# -- the reference's quantiser and warm-up (DS3Lab/AC-SGD, commit 95a0f2e) ---------------------------------------
# Restated from compress/fixpoint.py (_compress_nbits / _decompress_nbits with scale_method 'max', scale_dims (0, 1);
# compress/utils.py's pack_low_bit_tensor / unpack_low_bit_tensor, in numpy instead of cupy) and
# compress/delta_modules.py (DeltaCompressor: fp16 caches, warm-up epochs send x itself), on [micro-batch, s, h].
def ref_compress(x: torch.Tensor, bits: int):
    fbits = bits - 1
    scale = x.abs().amax((0, 1), keepdims=True).half()
    y = x / (scale + 1e-6)
    y = y.ldexp(torch.tensor(fbits))
    y = y.round().clip(-(1 << fbits), (1 << fbits) - 1)
    y = (y - (-(1 << fbits))).type(torch.uint8)
    packed = np.packbits(np.unpackbits(y.numpy()).reshape(*y.shape, 8)[..., -bits:])
    return torch.from_numpy(packed), scale


def ref_decompress(packed: torch.Tensor, scale: torch.Tensor, bits: int, shape) -> torch.Tensor:
    n = int(np.prod(shape))
    codes = np.packbits(np.pad(np.unpackbits(packed.numpy())[:n * bits].reshape(-1, bits), ((0, 0), (8 - bits, 0))))
    fbits = bits - 1
    y = torch.from_numpy(codes).view(shape).float() + (-(1 << fbits))
    return y / ((1 << fbits) - 1 + 1) * scale


def ref_message(packed, scale) -> torch.Tensor:
    """megacomp's one message for the reference's two sends (codes, then the fp16 scales)."""
    return torch.cat([packed, scale.reshape(-1).view(torch.uint8)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_channel_quantizer_is_the_reference_bit_for_bit_and_within_its_bound(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 5, 12, generator=g) * torch.logspace(-3, 2, 12)).to(dtype)  # channels of unlike size
    x[0, 1, 4] = 0.0
    x[:, :, 7] = 0.0  # an all-zero channel (scale 0)
    for bits in range(1, 9):
        q = ChannelMaxQuantizer(bits, 12)
        msg = q.encode_flat(x)
        packed, scale = ref_compress(x, bits)
        assert torch.equal(msg, ref_message(packed, scale)), bits
        assert msg.numel() == q.wire_bytes(x.numel()) == (x.numel() * bits + 7) // 8 + 2 * 12
        dec = q.decode_flat(msg, x.numel()).view(x.shape)
        assert torch.equal(dec, ref_decompress(packed, scale, bits, x.shape)), bits
        # the module docstring's bound: half a step unclipped, a whole step (+ the fp16 max's rounding) at the top
        f = bits - 1
        s = x.float().abs().amax((0, 1)).half()
        d = (s + 1e-6).float()
        t = x.float() / d * 2 ** f
        step = d / 2 ** f
        u = torch.finfo(dtype).eps / 2  # x / d is rounded in x's dtype (half-precision for fp16 input)
        bound = (torch.where(t > 2 ** f - 0.5, step * (1 + 2.0 ** (f - 10)), step / 2) + (d - s.float()).abs()
                 + u * x.float().abs())
        assert ((dec - x.float()).abs() <= bound * (1 + 1e-6) + 1e-9).all(), bits
    with pytest.raises(ValueError, match="1 to 8 bits"):
        ChannelMaxQuantizer(9, 12)
    with pytest.raises(ValueError, match="expected"):
        ChannelMaxQuantizer(4, 12).decode_flat(torch.zeros(3, dtype=torch.uint8), x.numel())


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_delta_rule_and_warmup_are_the_reference_bit_for_bit(bits):
    """fp16 activations (the paper's setting) over 3 epochs, the first a warm-up: megacomp's caches with the
    reference's options against a restatement of DeltaCompressor (sender and receiver caches in fp16)."""
    h, n = 8, 4
    ids = [[[0, 2], [1, 3]], [[3, 0], [2, 1]], [[1, 2], [0, 3]]]  # a permutation per epoch
    send = ActivationDeltaCache([(1, "send")], torch.arange(n), (S, h), torch.float16, bits=bits,
                                warmup_full_gradients=True)
    recv = ActivationDeltaCache([(1, "recv")], torch.arange(n), (S, h), torch.float16, bits=bits,
                                warmup_full_gradients=True)
    q = send.quantizer
    ref_com = torch.zeros(n, S, h, dtype=torch.float16)  # the reference's np_com (sender) and np_dec caches
    ref_dec = torch.zeros(n, S, h, dtype=torch.float16)
    g = torch.Generator().manual_seed(4)
    base = torch.randn(n, S, h, generator=g)
    for epoch, batches in enumerate(ids):
        warm = epoch < 1  # --warmup-epochs 1: compress.flag.FLAG_DISABLE_COMPRESSION
        for c in (send, recv):
            c.set_sample_ids(batches)
        # gradients: both ends of the boundary agree, uncompressed exactly in the warm-up epoch
        assert recv.gradients_uncompressed("send") == send.gradients_uncompressed("recv") == warm
        for mb, rows in enumerate(batches):
            x = (base[rows] + 0.05 * epoch * torch.randn(2, S, h, generator=g)).half()  # [mb, s, h]
            if warm:
                want_msg, act = x, x
                ref_com[rows] = x.half()
                ref_dec[rows] = x.half()
            else:
                packed, scale = ref_compress(x - ref_com[rows], bits)
                ref_com[rows] = (ref_com[rows] + ref_decompress(packed, scale, bits, x.shape)).half()
                x_recv = ref_dec[rows] + ref_decompress(packed, scale, bits, x.shape)  # float32
                ref_dec[rows] = x_recv.half()
                want_msg, act = ref_message(packed, scale), x_recv.half()  # copied into the fp16 input buffer
            msg = send.encode(1, mb, x.transpose(0, 1), q)
            out = torch.empty(S, 2, h, dtype=torch.float16)
            buf = recv.message_buffer(1, mb, out.shape, q, "cpu")
            assert buf.shape == msg.shape and buf.dtype == msg.dtype
            recv.decode(1, mb, msg, out, q)
            assert torch.equal(msg.transpose(0, 1) if warm else msg, want_msg), (epoch, mb)
            assert torch.equal(out.transpose(0, 1), act), (epoch, mb)
        assert torch.equal(send.values["b1/send"], ref_com) and torch.equal(recv.values["b1/recv"], ref_dec)


def test_reference_options_on_two_ranks_put_wire_bytes_on_the_wire():
    """PP 2, 2 epochs, 3-bit channel deltas and the reference's warm-up with int8 gradients: every step's bytes
    on both sides are the warm-up's raw tensors, then ChannelMaxQuantizer.wire_bytes / the int8 codec's; the
    caches stay bit-identical."""
    extra = {"pp_activation_delta_bits": 3, "pp_activation_delta_warmup_full_gradients": True, "pp_gradient": "int8"}
    results = run_ranks(_epochs_body, 2, 2, 1, None, 2, False, extra)
    h = CFG["hidden_size"]
    numel, M = S * B * h, 2
    delta_bytes = ChannelMaxQuantizer(3, h).wire_bytes(numel)
    assert delta_bytes == (numel * 3 + 7) // 8 + 2 * h
    grad_bytes = make_codec("int8").wire_bytes(numel)
    (rec0, _), (rec1, _) = results
    for step, ((_, c0, st0), (_, c1, st1)) in enumerate(zip(rec0, rec1)):
        warm = step < NSAMPLES // (M * B)  # the first epoch
        act = numel * 4 if warm else delta_bytes
        grad = numel * 4 if warm else grad_bytes
        assert st0["pp_activation"].wire_bytes == st1["pp_activation_recv"].wire_bytes == M * act, step
        assert st1["pp_gradient"].wire_bytes == st0["pp_gradient_recv"].wire_bytes == M * grad, step
        assert torch.equal(c0["b1/send"], c1["b1/recv"]), step
    assert all(torch.isfinite(torch.tensor(losses)).all() for losses, *_ in rec1)


def test_reference_options_are_checked():
    with pytest.raises(ValueError, match="leave pp_activation unset"):
        CommCompressionConfig(pp_activation="int4", pp_activation_delta=True, pp_activation_delta_bits=4)
    with pytest.raises(ValueError, match="set pp_activation_delta: true"):
        CommCompressionConfig(pp_activation_delta_warmup_full_gradients=True)
    with pytest.raises(ValueError, match="int in 0..8"):
        CommCompressionConfig(pp_activation_delta=True, pp_activation_delta_bits=9)
    on = CommCompressionConfig(pp_activation_delta=True, pp_activation_delta_bits=2).to_dict()
    assert on["pp_activation_delta_bits"] == 2 and "pp_activation_delta_warmup_full_gradients" not in on


@pytest.mark.parametrize("pp,chunks", [(2, 2), (4, 1), (3, 2)])
def test_reference_warmup_gradient_rule_agrees_between_neighbours(pp, chunks):
    """Rank r's gradient sends to rank r - 1 (its receiving sides) and rank r - 1's gradient receives (its sending
    sides) cover the same boundaries: they agree whichever boundary is still in warm-up (e.g. after a reset)."""
    total = pp * chunks
    for reset in [None] + list(range(1, total)):
        caches = [build_activation_delta(num_samples=4, shard=torch.arange(4), pp_size=pp, pp_rank=r, num_chunks=chunks,
                                         sample_shape=(2, 2), dtype=torch.float32, warmup_visits=1,
                                         warmup_full_gradients=True) for r in range(pp)]
        for c in caches:
            for key in c.visits:
                c.visits[key][:] = 0 if key.startswith(f"b{reset}/") else 1
            c.set_sample_ids([[0, 1], [2, 3]])
        for r in range(pp):
            assert caches[r].gradients_uncompressed("send") == caches[(r - 1) % pp].gradients_uncompressed("recv")
        assert any(c.gradients_uncompressed("send") for c in caches) == (reset is not None)

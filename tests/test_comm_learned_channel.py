"""The chunked PCA / MLP autoencoder code ``lgc_pca`` (megacomp.compression.learned, megacomp.comm.learned_channel) on
real gloo ranks. (LGC as published, ``lgc``, is tests/test_comm_lgc_channel.py.)

What is checked: the settings refuse what cannot compress (one line naming the fix); the ring variant's premise
(a linear decoder decodes a sum of codes to the sum of the decodings; an MLP decoder does not); the training calls
are torch.distributed.all_reduce of the bucket bit for bit and their bytes are counted; in the frozen phase the
residual is exactly the input minus the sender's own decoding, and delivered sums plus the final residuals equal
the inputs' sum within a bound derived from the fp32 roundings of the step (below); the frozen call's bytes; the
retraining trigger; resume; and pretraining with ``dp_gradient: {name: lgc_pca, ...}``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp.comm import LearnedChannel, StatsTable, make_channel
from megacomp.comm.common import all_reduce_bytes
from megacomp.comm.learned_channel import encode_message
from megacomp.compression import LGCPCA, make_compressor
from megacomp.compression.learned import decode, init_autoencoder
from megacomp.config import CommCompressionConfig

U = 2.0 ** -24  # fp32 unit roundoff (round to nearest)
U64 = 2.0 ** -53
SHAPES = [(40, 24), (24,), (16, 20)]  # one bucket of 1,264 elements: 3 chunks of 512 (the last padded)
SMALL = dict(latent=16, chunk=512, train_steps=3, train_samples=8, train_iters=5)


def gamma(n: int, u: float = U) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of a sum or dot product of n + 1 terms."""
    return n * u / (1 - n * u)


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    """Gradients with a shared low-dimensional part (what an autoencoder can learn) plus per-rank noise."""
    common = torch.Generator().manual_seed(7)
    basis = torch.randn(8, 512, generator=common)
    g = torch.Generator().manual_seed(1000 * step + rank)
    numel = sum(math.prod(s) for s in SHAPES)
    flat = (torch.randn(3, 8, generator=g) @ basis).reshape(-1)[:numel] + 0.1 * torch.randn(numel, generator=g)
    out, pos = [], 0
    for s in SHAPES:
        out.append(flat[pos:pos + math.prod(s)].view(s).clone())
        pos += math.prod(s)
    return out


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def test_settings_that_cannot_compress_name_the_fix():
    with pytest.raises(ValueError, match=r"lgc_pca: latent=512 cannot compress chunks of 512 elements.*use latent < 512"):
        LGCPCA(latent=512, chunk=512)
    with pytest.raises(ValueError, match=r"latent=511 cannot compress.*with its scale.*use latent < 511"):
        LGCPCA(latent=511, chunk=512, variant="ps")
    with pytest.raises(ValueError, match="ring variant sums codes.*use decoder: linear, or variant: ps"):
        LGCPCA(decoder="mlp")
    with pytest.raises(ValueError, match=r"unknown lgc_pca option\(s\) \['rank'\]"):
        make_compressor({"name": "lgc_pca", "rank": 4})
    with pytest.raises(ValueError, match="keeps its own error feedback.*leave dp_gradient_error_feedback at None"):
        CommCompressionConfig(dp_gradient={"name": "lgc_pca"}, dp_gradient_error_feedback="ef")
    spec = {"name": "lgc_pca", "latent": 8, "chunk": 256, "variant": "ps", "decoder": "mlp"}
    cfg = CommCompressionConfig(dp_gradient=spec)
    assert isinstance(cfg.dp_gradient, LGCPCA)
    assert CommCompressionConfig.from_dict(cfg.to_dict()).dp_gradient == cfg.dp_gradient  # YAML round trip
    assert isinstance(make_channel("dp_gradient", cfg.dp_gradient), LearnedChannel)
    off = make_channel("dp_gradient", CommCompressionConfig().dp_gradient)  # compression off: no autoencoder at all,
    assert type(off).__name__ == "Channel" and off.codec.is_identity  # the plain Channel (torch.distributed's calls)
    assert LGCPCA(chunk=512, latent=16).message_numel(1264) == 3 * 16 + 2  # 3 chunks, plus the two error sums


def test_a_linear_decoder_decodes_a_sum_of_codes_to_the_sum_of_decodings_an_mlp_does_not():
    # integer weights and codes in fp64: every product and sum is exact, so equality here is the algebra, not luck
    g = torch.Generator().manual_seed(0)
    lin, mlp = LGCPCA(latent=4, chunk=16), LGCPCA(latent=4, chunk=16, hidden=8, decoder="mlp", variant="ps")
    codes = [torch.randint(-4, 5, (3, 4), generator=g).double() for _ in range(3)]
    for lgc in (lin, mlp):
        w = {k: torch.randint(-3, 4, v.shape, generator=g).double() for k, v in init_autoencoder(lgc, "k").items()}
        summed = decode(lgc, w, codes[0] + codes[1] + codes[2])
        separate = decode(lgc, w, codes[0]) + decode(lgc, w, codes[1]) + decode(lgc, w, codes[2])
        if lgc.decoder == "linear":
            assert torch.equal(summed, separate)
        else:
            assert not torch.equal(summed, separate)  # ReLU and biases: the ring variant would deliver a wrong sum


def _training_calls(rank, world):
    stats = StatsTable()
    lgc = LGCPCA(**SMALL)
    ch = LearnedChannel("dp_gradient", lgc, stats=stats)
    same, wires = [], []
    for step in range(lgc.train_steps):
        g = _grads(rank, step)
        ref = _flat(g).clone()
        dist.all_reduce(ref)
        stats.reset()
        ch.all_reduce_coalesced(g, key="b0")
        same.append(torch.equal(_flat(g), ref))
        wires.append(stats.snapshot()["dp_gradient"].wire_bytes)
    weights = sum(v.numel() for v in ch.weights["b0"].values())
    return same, wires, weights, ch.training("b0")


def test_training_calls_are_the_plain_all_reduce_bit_for_bit_and_their_bytes_are_counted():
    world, lgc = 3, LGCPCA(**SMALL)
    numel = sum(math.prod(s) for s in SHAPES)
    for rank, (same, wires, weights, training) in enumerate(run_ranks(_training_calls, world)):
        assert all(same) and not training
        samples = (world - 1) * lgc.train_samples * lgc.chunk * 4  # the all-gather of every rank's samples
        plain = all_reduce_bytes(numel, 4, world, rank)
        assert wires[:-1] == [plain + samples] * (lgc.train_steps - 1)
        assert wires[-1] == plain + samples + (world - 1) * weights * 4  # the last one adopts rank 0's weights


def _frozen_calls(rank, world, spec, steps):
    stats = StatsTable()
    lgc = LGCPCA(**spec)
    ch = LearnedChannel("dp_gradient", lgc, stats=stats)
    for step in range(lgc.train_steps):
        ch.all_reduce_coalesced(_grads(rank, step), key="b0")
    w = ch.weights["b0"]
    n = sum(math.prod(s) for s in SHAPES)
    delivered, sent = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    bound = torch.zeros(n, dtype=torch.float64)
    exact, wires = [], []
    for step in range(lgc.train_steps, lgc.train_steps + steps):
        g = _grads(rank, step)
        sent += _flat(g).double()
        e = ch.error_feedback.error("b0")
        h = _flat(g) + e  # what the channel compensates, the same operation
        message, own = encode_message(lgc, w, h)
        stats.reset()
        ch.all_reduce_coalesced(g, key="b0")
        wires.append(stats.snapshot()["dp_gradient"].wire_bytes)
        e_new = ch.error_feedback.error("b0")
        exact.append(torch.equal(e_new, h - own))  # the sender-side error: input minus its own decoding, exactly
        delivered += _flat(g).double()
        # this rank's roundings: h = fl(g + e) and e' = fl(h - own), each within gamma_1 of its result
        bound += gamma(1) * (h.double().abs() + e_new.double().abs())
        # the delivered sum against the sum of every rank's own decoding (identical on every rank; counted once)
        if lgc.variant == "ring":  # fl(W fl(sum_i m_i)) vs sum_i fl(W m_i)
            a = message.double().abs()
            dist.all_reduce(a)
            wabs = w["dec"].double().abs()
            per_chunk = (gamma(lgc.latent) * (1 + gamma(world)) + gamma(world - 1) + gamma(lgc.latent)) * (a @ wabs.t())
            term = per_chunk.reshape(-1)[:n]
        else:  # the rank-order sum of the own decodings
            a = own.double().abs()
            dist.all_reduce(a)
            term = gamma(world - 1) * a
        bound += term / world
    residual = ch.error_feedback.error("b0").double()
    for t in (sent, residual, bound):
        dist.all_reduce(t)
    gap = (delivered + residual - sent).abs()
    # the test's own fp64 sums (over steps and ranks) round too
    slack = gamma(world * (steps + 2), U64) * (delivered.abs() + residual.abs() + sent.abs())
    rel = ch.last_error["b0"]
    return exact, wires, bool((gap <= bound + slack).all()), float((gap / (bound + slack)).max()), rel, \
        float(residual.norm())


@pytest.mark.parametrize("variant,decoder", [("ring", "linear"), ("ps", "mlp")])
def test_frozen_calls_send_codes_feed_back_the_exact_sender_error_and_telescope(variant, decoder):
    world, steps = 3, 6
    spec = dict(SMALL, variant=variant, decoder=decoder, hidden=32)
    lgc = LGCPCA(**spec)
    n = sum(math.prod(s) for s in SHAPES)
    for rank, (exact, wires, within, worst, rel, res_norm) in enumerate(run_ranks(_frozen_calls, world, spec, steps)):
        assert all(exact)
        assert within, f"the gap reached {worst:.2f} of its bound"
        assert res_norm > 0 and 0 < rel < 1  # something was dropped and fed back; the code is not useless
        m = lgc.message_numel(n)  # 3 chunks x latent (+1 for the scales of ps) + the two error sums
        expected = all_reduce_bytes(m, 4, world, rank) if variant == "ring" else (world - 1) * m * 4
        assert wires == [expected] * steps
        assert expected < all_reduce_bytes(n, 4, world, rank) / 5


def _retrain(rank, world):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("megacomp")
    handler = Keep(level=logging.WARNING)
    log.addHandler(handler)
    try:
        lgc = LGCPCA(**dict(SMALL, train_steps=2, retrain_threshold=1e-6))  # any real error is above it
        ch = LearnedChannel("dp_gradient", lgc)
        for step in range(3):  # two training calls, one frozen call that triggers retraining
            ch.all_reduce_coalesced(_grads(rank, step), key="b0")
        e = ch.error_feedback.error("b0").clone()
        g = _grads(rank, 3)
        ref = _flat(g) + e  # a retraining call delivers the gradient plus the residual, uncompressed
        dist.all_reduce(ref)
        ch.all_reduce_coalesced(g, key="b0")
        return (ch.retrains, ch.training("b0"), torch.equal(_flat(g), ref),
                float(ch.error_feedback.error("b0").abs().max()), records)
    finally:
        log.removeHandler(handler)


def test_an_error_above_the_threshold_retrains_and_is_logged():
    for retrains, training, same, residual, records in run_ranks(_retrain, 2):
        assert retrains == {"b0": 1} and training and same and residual == 0.0
        assert len(records) == 1 and "exceeds retrain_threshold 1e-06 at call 3; retraining for 2 calls" in records[0]


def _resume(rank, world):
    lgc = LGCPCA(**dict(SMALL, variant="ps", decoder="mlp", hidden=16))
    a = LearnedChannel("dp_gradient", lgc)
    for step in range(lgc.train_steps + 1):
        a.all_reduce_coalesced(_grads(rank, step), key="b0")
    saved = a.state_dict()
    b = LearnedChannel("dp_gradient", lgc)
    b.init_keys("b0", SHAPES)  # a template has the same keys and shapes
    template = b.state_dict()
    b.load_state_dict(saved)
    outs = []
    for ch in (a, b):
        g = _grads(rank, 9)
        ch.all_reduce_coalesced(g, key="b0")
        outs.append(_flat(g))
    same_layout = all(template["weights"]["b0"][k].shape == v.shape for k, v in saved["weights"]["b0"].items())
    return torch.equal(*outs), same_layout


def test_state_resumes_bit_for_bit():
    for same, same_layout in run_ranks(_resume, 2):
        assert same and same_layout


@pytest.mark.slow
def test_pretraining_with_lgc_on_the_dp_gradient_path(tiny_config):
    from test_training_pretrain import _train_body

    lgc = {"name": "lgc_pca", "latent": 16, "chunk": 256, "train_steps": 2, "train_samples": 8, "train_iters": 3}
    cfg = replace(tiny_config, train_iters=5, compression={"dp_gradient": lgc, "min_compress_numel": 4096})
    history = run_ranks(_train_body, 2, cfg)[0]
    assert all(math.isfinite(h[0]) for h in history)
    wire, dense = history[-1][3]["dp_gradient"]
    assert wire < dense / 2  # frozen by now: the matrices' buckets travel as codes


def _hook(rank, world):
    from test_optimizer_ddp_hook import train

    from megacomp import comm
    from megacomp.optimizer import CompressedHookState

    _, base = train(rank, None, 60)
    comm.reset_stats()
    state = CompressedHookState(codec={"name": "lgc_pca", "latent": 16, "chunk": 512, "train_steps": 5},
                                min_compress_numel=1000)
    _, losses = train(rank, state, 60)
    stats = comm.stats()["dp_gradient"]
    return base, losses, stats.wire_bytes / stats.uncompressed_bytes, sorted(state.channel.weights)


@pytest.mark.slow
def test_the_ddp_hook_trains_with_lgc():
    for base, losses, ratio, keys in run_ranks(_hook, 2):
        tail = lambda ls: sum(ls[-10:]) / 10  # noqa: E731
        assert tail(losses) < 0.5 * tail(losses[:10])  # it learns
        assert keys and ratio < 0.5  # the buckets over min_compress_numel travel as codes after 5 training calls

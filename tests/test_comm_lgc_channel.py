"""LGC as published (megacomp.compression.lgc, .lgc_autoencoder, megacomp.comm.lgc_channel) on real gloo ranks.

What is checked: bad settings, and configs that name ``lgc`` with the old chunked code's fields, are refused with
one line naming the fix; the autoencoder's training lowers its reconstruction and similarity terms,
deterministically; on 3 ranks, both instances (``ps``, ``ring``) through their three phases: every call's bytes
equal ``LGC.wire_bytes`` and the byte formulas written out here, every rank gets the same sum, each residual is
exactly the input minus what was delivered on that rank's behalf, and over the run the delivered sums plus the
final residuals equal the inputs' sum within the fp32 roundings of the steps; compression off, and a bucket
the top-k cannot shrink, are ``torch.distributed.all_reduce`` bit for bit; resume is bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp.comm import Channel, LGCChannel, StatsTable, make_channel
from megacomp.comm.common import all_reduce_bytes
from megacomp.compression import LGC, LGCPCA, make_compressor
from megacomp.compression.lgc import top_indices
from megacomp.compression.lgc_autoencoder import init_autoencoder, train, train_state
from megacomp.config import CommCompressionConfig

U = 2.0 ** -24  # fp32 unit roundoff
U64 = 2.0 ** -53
N = 2000  # bucket elements: k = 40 at density 0.02, an innovation of 4
SMALL = dict(density=0.02, innovation_density=0.002, warmup_steps=2, train_steps=2, train_iters=3)


def gamma(n: int, u: float = U) -> float:
    """Higham's gamma_n = n u / (1 - n u)."""
    return n * u / (1 - n * u)


def _grad(rank: int, step: int) -> torch.Tensor:
    """A gradient shared in part by every rank (what the nodes' codes can have in common) plus per-rank noise."""
    common = torch.randn(N, generator=torch.Generator().manual_seed(7))
    return common + 0.5 * torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank))


def test_settings_refuse_with_one_line_and_configs_of_the_old_lgc_are_told_its_new_name():
    with pytest.raises(ValueError, match=r"lgc: density must be a fraction in \(0, 1\], got 0"):
        LGC(density=0)
    with pytest.raises(ValueError, match=r"innovation_density \(0.001\) must be below density \(0.001\).*e.g. "
                                         r"innovation_density: 1e-05"):
        LGC(innovation_density=0.001)
    with pytest.raises(ValueError, match=r"lgc: \['chunk', 'latent'\] are options of the chunked PCA / MLP "
                                         r"autoencoder, which is now named lgc_pca.*use name: lgc_pca"):
        make_compressor({"name": "lgc", "latent": 32, "chunk": 512})
    assert isinstance(make_compressor({"name": "lgc_pca", "latent": 32, "chunk": 512}), LGCPCA)
    cfg = CommCompressionConfig(dp_gradient={"name": "lgc", "variant": "ring", "density": 0.01})
    assert isinstance(cfg.dp_gradient, LGC)
    assert CommCompressionConfig.from_dict(cfg.to_dict()).dp_gradient == cfg.dp_gradient  # YAML round trip
    assert isinstance(make_channel("dp_gradient", cfg.dp_gradient), LGCChannel)
    with pytest.raises(ValueError, match="keeps its own error feedback"):
        CommCompressionConfig(dp_gradient={"name": "lgc"}, dp_gradient_error_feedback="ef")
    # the byte model, written out: k = 40, code = ceil(40 / 4) = 10, innovation 4, 3 ranks, leader 0
    ps, ring = LGC(**SMALL), LGC(**dict(SMALL, variant="ring"))
    assert (ps.topk(N), ps.code_numel(N), ps.innovation(N)) == (40, 10, 4)
    assert ps.wire_bytes(N, 3, 1, "warmup") == 2 * 8 * 40
    assert [ps.wire_bytes(N, 3, r, "train") for r in (0, 1)] == [2 * 4 * 40 * 2, 2 * 4 * 40]
    assert [ps.wire_bytes(N, 3, r, "compressed") for r in (0, 1)] == [2 * 4 * (10 + 40) + 2 * 4 * 10, 2 * 4 * 10]
    assert [ring.wire_bytes(N, 3, r, "compressed") for r in (0, 2)] == \
        [2 * 4 * 40 + all_reduce_bytes(11, 4, 3, 0) + all_reduce_bytes(1, 4, 3, 0),
         all_reduce_bytes(11, 4, 3, 2) + all_reduce_bytes(1, 4, 3, 2)]
    unfitted = LGC(**dict(SMALL, variant="ring", fit_scale=False))  # no second all-reduce
    assert unfitted.wire_bytes(N, 3, 2, "compressed") == all_reduce_bytes(11, 4, 3, 2)
    assert not ps.compresses(2) and ps.compresses(3)  # k = 1: one value and one index against 2 or 3 elements


@pytest.mark.slow  # over 0.2 s
def test_the_autoencoder_learns_the_common_part_and_pulls_the_codes_together_deterministically():
    # three nodes' top-k values: a common part plus node noise, a different draw per call
    base = torch.randn(40, generator=torch.Generator().manual_seed(0))
    for variant in ("ps", "ring"):
        lgc = LGC(**dict(SMALL, variant=variant, train_iters=4, lr=3e-3))
        runs = []
        for _ in range(2):
            w = init_autoencoder(lgc, "b0", 3)
            state = train_state(w)
            g = torch.Generator().manual_seed(1)
            losses = [train(lgc, w, state, (base + 0.3 * torch.randn(3, 40, generator=g)) * 1e-3, c, 4)
                      for c in range(12)]
            runs.append((losses, w))
        (losses, w), (again, w2) = runs
        assert losses == again and all(torch.equal(w[n], w2[n]) for n in w)  # the same bits every time
        assert losses[-1][0] < 0.7 * losses[0][0]  # reconstruction (unit-RMS inputs: 1.0 is knowing nothing)
        assert losses[-1][1] < 0.1  # the nodes' codes are close: mean squared difference against unit inputs


def _phases(rank, world, variant, fit_scale, compressed_calls):
    stats = StatsTable()
    lgc = LGC(**dict(SMALL, variant=variant, fit_scale=fit_scale))
    ch = LGCChannel("dp_gradient", lgc, stats=stats)
    sent = torch.zeros(N, dtype=torch.float64)
    delivered = torch.zeros(N, dtype=torch.float64)
    bound = torch.zeros(N, dtype=torch.float64)
    rows, warm_sparse = [], []
    last_train = lgc.warmup_steps + lgc.train_steps - 1
    for step in range(lgc.warmup_steps + lgc.train_steps + compressed_calls):
        g = _grad(rank, step)
        sent += g.double()
        e = ch.error_feedback.error("b0")
        h = g.clone() if e is None else g + e  # what the channel compensates, the same operation
        phase = ch.phase("b0")
        stats.reset()
        out = g.clone()
        ch.all_reduce_coalesced([out], key="b0")
        wire = stats.snapshot()["dp_gradient"].wire_bytes
        expected = lgc.wire_bytes(N, world, rank, phase)
        if step == last_train:
            expected += lgc.wire_bytes(N, world, rank, "adopt", ch.weights_numel(world))
        e_new = ch.error_feedback.error("b0").clone()
        own = h - e_new  # exact where e_new = fl(h - own) is: checked below against the warm-up's known own
        if phase == "warmup":
            idx = top_indices(h, lgc.topk(N))
            sparse = torch.zeros(N).index_copy_(0, idx, h[idx])
            warm_sparse.append(torch.equal(e_new, h - sparse))
        everyone = torch.empty(world * N)
        dist.all_gather_into_tensor(everyone, out)
        same = all(torch.equal(everyone.view(world, N)[r], out) for r in range(world))
        # fit_scale: no rank's values are delivered worse than not at all, so a residual never outgrows its input
        shrinks = not fit_scale or phase != "compressed" or float(e_new.norm()) <= float(h.norm()) * (1 + gamma(N))
        rows.append((phase, wire, expected, same, shrinks))
        delivered += out.double()
        # this rank's roundings: h = fl(g + e), e' = fl(h - own), and its part in the delivered sum (a rank-order
        # sum of the ranks' parts; ring: fl(s_i * d) against fl(fl(sum s_i) * d))
        bound += gamma(world + 2) * (h.double().abs() + e_new.double().abs() + own.double().abs())
    residual = ch.error_feedback.error("b0").double()
    for t in (sent, residual, bound):
        dist.all_reduce(t)
    delivered_sum = delivered  # the same on every rank (checked per call), counted once
    gap = (delivered_sum + residual - sent).abs()
    slack = gamma(world * (len(rows) + 2), U64) * (delivered_sum.abs() + residual.abs() + sent.abs())
    return rows, warm_sparse, bool((gap <= bound + slack).all()), float((gap / (bound + slack)).max()), \
        float(residual.norm()), float(sent.norm())


@pytest.mark.slow  # over 0.2 s
@pytest.mark.parametrize("variant,fit_scale", [("ps", True), ("ring", True), ("ring", False)])
def test_both_instances_on_three_ranks_count_the_codecs_bytes_and_feed_back_exactly(variant, fit_scale):
    world, compressed = 3, 3
    for rank, (rows, warm_sparse, within, worst, res, sent) in \
            enumerate(run_ranks(_phases, world, variant, fit_scale, compressed)):
        phases = [r[0] for r in rows]
        assert phases == ["warmup"] * 2 + ["train"] * 2 + ["compressed"] * compressed
        assert all(wire == expected for _, wire, expected, *_ in rows), rows
        assert all(same for *_, same, _ in rows)  # every rank holds the same sum
        assert all(shrinks for *_, shrinks in rows)
        assert warm_sparse == [True, True]  # warm-up: the residual is the input minus its own top-k, exactly
        assert within, f"the gap reached {worst:.2f} of its bound"
        assert 0 < res < sent  # something was kept back and carried, not lost
        dense = all_reduce_bytes(N, 4, world, rank)
        assert rows[-1][1] < dense / 20  # a compressed call is a small fraction of the dense all-reduce


def _plain(rank, world):
    g = torch.randn(7, 3, generator=torch.Generator().manual_seed(rank))
    ref = g.clone()
    dist.all_reduce(ref)
    off = make_channel("dp_gradient", CommCompressionConfig().dp_gradient)  # compression off
    a = g.clone()
    off.all_reduce(a)
    stats = StatsTable()
    lgc = LGCChannel("dp_gradient", dict(SMALL, name="lgc", density=0.5, innovation_density=0.1), stats=stats)
    b = g.clone()
    lgc.all_reduce_coalesced([b], key="small")  # k = 11 of 21: the top-k message is not smaller
    return type(off) is Channel, torch.equal(a, ref), torch.equal(b, ref), \
        stats.snapshot()["dp_gradient"].wire_bytes == all_reduce_bytes(21, 4, world, rank), lgc.calls


def test_compression_off_and_a_bucket_top_k_cannot_shrink_are_the_plain_all_reduce_bit_for_bit():
    for plain, off_same, small_same, counted, calls in run_ranks(_plain, 2):
        assert plain and off_same and small_same and counted and calls == {}


def _resume(rank, world):
    lgc = LGC(**SMALL)
    a = LGCChannel("dp_gradient", lgc)
    for step in range(lgc.warmup_steps + lgc.train_steps + 1):
        a.all_reduce_coalesced([_grad(rank, step)], key="b0")
    saved = a.state_dict()
    b = LGCChannel("dp_gradient", lgc)
    b.init_keys("b0", [(N,)])  # a template has the same keys and shapes
    template = b.state_dict()
    b.load_state_dict(saved)
    outs = []
    for ch in (a, b):
        g = _grad(rank, 9)
        ch.all_reduce_coalesced([g], key="b0")
        outs.append(g)
    same_layout = all(template["weights"]["b0"][n].shape == t.shape for n, t in saved["weights"]["b0"].items())
    return torch.equal(*outs), same_layout, a.phase("b0")


@pytest.mark.slow  # over 0.2 s
def test_state_resumes_bit_for_bit():
    for same, same_layout, phase in run_ranks(_resume, 2):
        assert same and same_layout and phase == "compressed"


@pytest.mark.slow
def test_pretraining_with_lgc_on_the_dp_gradient_path(tiny_config):
    from dataclasses import replace

    from test_training_pretrain import _train_body

    lgc = {"name": "lgc", "density": 0.01, "innovation_density": 0.001, "warmup_steps": 1, "train_steps": 2,
           "train_iters": 2}
    cfg = replace(tiny_config, train_iters=5, compression={"dp_gradient": lgc, "min_compress_numel": 4096})
    history = run_ranks(_train_body, 2, cfg)[0]
    assert all(math.isfinite(h[0]) for h in history)
    wire, dense = history[-1][3]["dp_gradient"]
    assert wire < dense / 2  # the matrices' buckets travel as top-k values or codes and innovations

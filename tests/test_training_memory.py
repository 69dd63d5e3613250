"""megacomp.training.memory.MemoryTracker against allocations whose sizes are known by hand, and
benchmarks.memory_bench's method builders on a tiny GPT at DP 2 (the LOMO / AdaLomo gradient bound checked
from the measurement) and, for ZeRO-1 vs ZeRO-2, at DP 4."""
import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from distributed import run_ranks
from megacomp.training.memory import MemoryTracker, reset_rss_peak, rss

F32 = 4


def test_known_allocations_views_frees_and_peaks():
    t = MemoryTracker()
    with t:
        a = torch.empty(1000)  # factory op: counted as 'temp' (the default)
        with t.category("act"):
            b = torch.zeros(250, 4)
            v = b[:, 1:].t()  # a view: no new storage
        assert t.current["temp"] == 1000 * F32 and t.current["act"] == 1000 * F32
        c = a * 2  # a new storage
        assert t.current["temp"] == 2000 * F32
        del a, c
        assert t.current["temp"] == 0 and t.peak == 3000 * F32 and t.at_peak["temp"] == 2000 * F32
        t.tag(b, "grad", "b")  # retag moves the bytes, a view keeps counting the storage once
        assert t.current["act"] == 0 and t.current["grad"] == 1000 * F32 and t.cat_peak["grad"] == 1000 * F32
        assert t.grad_live_at_peak == [("b", 1000 * F32)]
        del b, v
        assert t.current["grad"] == 0
        t.reset_peak()
        assert t.peak == 0
        p = torch.ones(10, dtype=torch.float64)
        t.tag(p, "param")
        t.tag(p, "grad")  # params and optimizer state keep their category
        assert t.category_of(p) == "param" and t.current["param"] == 80
        x = torch.empty(0)
        torch.add(torch.ones(8), 1, out=x)  # resized by an out= op
        assert t.current["temp"] == 8 * F32  # x only: the torch.ones(8) argument is gone
    pre = torch.ones(100)  # created outside: ignored, also its views
    with MemoryTracker() as t2:
        pre.view(10, 10)
        assert sum(t2.current.values()) == 0
    with pytest.raises(ValueError):
        t.tag(pre, "weights")
    with pytest.raises(TypeError):
        t.tag([1.0], "param")


def test_mlp_forward_activations_and_gradients_by_hand():
    B, D, H, O = 8, 16, 32, 4
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, O))
    x = torch.randn(B, D)
    t = MemoryTracker()
    with t:
        t.watch_params(mlp)
        assert t.current["param"] == F32 * (D * H + H + H * O + O)
        with t.category("act"):
            y = mlp(x)
        # alive: ReLU's output (saved by ReLU and by the second Linear) and y; the first Linear's output went
        # when ReLU had read it; the peak was first output + ReLU output, or ReLU output + y
        assert t.current["act"] == F32 * B * (H + O)
        assert t.cat_peak["act"] == F32 * B * max(2 * H, H + O)
        loss = y.square().sum()
        t.watch_graph(loss, mlp)
        loss.backward()
        assert t.current["grad"] == t.current["param"]  # every .grad is alive, each counted once
        assert t.current["act"] == F32 * B * O  # saved tensors freed by backward; y remains
        del y, loss
        assert t.current["act"] == 0


def test_tied_parameter_partials_are_gradients_and_summed_in_place():
    """A parameter used twice gets two partial gradients; under a dispatch mode autograd sums them out of place,
    without one in place: the tracker counts the sum in place (peak = two gradients, not three)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64, 32))
    m = nn.Module()
    m.w = w
    x1, x2 = torch.randn(5, 64), torch.randn(7, 64)
    t = MemoryTracker()
    with t:
        t.watch_params(m)
        with t.category("act"):
            loss = (x1 @ w).sum() + (x2 @ w).square().sum()
        t.watch_graph(loss, m)
        t.reset_peak()
        loss.backward()
    assert t.cat_peak["grad"] == 2 * w.numel() * F32
    assert sorted(n for n, _ in t.grad_live_at_peak) == ["w (partial)", "w (partial)"]
    assert t.current["grad"] == w.numel() * F32 and t.category_of(w.grad) == "grad"


def test_label_groups_sum_storages_by_label_across_categories():
    t = MemoryTracker()
    with t:
        t.track_labels("opt", "optimizer:")
        a = torch.zeros(100)  # temp
        t.tag(a, "grad", "optimizer: bucket 0")
        with t.category("comm"):
            b = torch.empty(50)
        t.label(b, "optimizer: shard 0")  # labelled, still comm
        assert t.category_of(b) == "comm" and t.label_peak["opt"] == 150 * F32
        c = torch.empty(30)
        t.tag(c, "grad", "w")  # another gradient: not in the group
        del a
        d = torch.zeros(20)
        t.label(d, "optimizer: bucket 1")
        assert t.label_peak["opt"] == 150 * F32 and t.current["grad"] == 30 * F32
        assert sorted(t.label_live_at_peak["opt"]) == [("optimizer: bucket 0", 400), ("optimizer: shard 0", 200)]
        t.reset_peak()
        assert t.label_peak["opt"] == 70 * F32
        assert t.summary()["label_peak"] == {"opt": 70 * F32}
        del b, c, d


def test_rss_helpers():
    r = rss()
    assert r["ru_maxrss"] > 0
    if Path("/proc/self/status").exists():
        assert r["VmHWM"] >= r["VmRSS"] > 0
        reset_rss_peak()


# -- the benchmark's builders at DP 2 ---------------------------------------------------------------
def _bench():
    from benchmarks import memory_bench

    return memory_bench


HIDDEN = 32


def _args(**kw):
    base = dict(config=None, num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=1024, seq_length=32,
                micro_batch_size=1, params_dtype="float32", device="cpu", warmup=1, lr=1e-3, weight_decay=0.1,
                clip_grad=1.0, loqt_rank=4, loqt_block=32, bucket_size=1 << 22)
    return argparse.Namespace(**{**base, **kw})


def _body(rank, world, method, args):
    return _bench().run_rank(args, method)


@pytest.fixture(scope="module")
def results():
    args = _args()
    return {m: run_ranks(_body, 2, m, args, timeout=120) for m in _bench().METHODS}


def test_builders_are_data():
    assert {"adamw", "zero1", "zero2", "lomo", "adalomo", "loqt"} <= set(_bench().METHODS)


def test_loqt_keeps_int8_base_weights_and_small_optimizer_state(results):
    for r, ref in zip(results["loqt"], results["adamw"]):
        assert r["at_peak"]["param"] < ref["at_peak"]["param"]  # int8 codes + scales instead of fp32 weights
        assert r["cat_peak"]["optim"] < ref["cat_peak"]["optim"]


def test_adamw_and_zero_hold_every_gradient_and_their_state(results):
    for r in results["adamw"]:
        params = r["at_peak"]["param"]
        assert r["cat_peak"]["grad"] >= params  # DDP's gradient buckets hold every gradient
        assert 2 * params <= r["cat_peak"]["optim"] <= 2 * params + 64 * F32  # exp_avg, exp_avg_sq (+ step scalars)
    for r in results["zero1"]:
        params = r["at_peak"]["param"]
        assert r["cat_peak"]["grad"] >= params  # the fp32 flat buckets
        # fp32 master shard + AdamW's two moments on it: 3 x half the (padded) parameters at DP 2
        assert 1.5 * params <= r["cat_peak"]["optim"] <= 1.5 * params + 64 * F32
        assert r["cat_peak"]["comm"] > 0


@pytest.mark.parametrize("method", ["lomo", "adalomo"])
def test_lomo_gradient_bound_measured(results, method):
    """LOMO's gradient bound from the measurement: the checks are the comparisons of measured numbers. Pretraining's
    arrangement (megacomp.training.features.lomo_fused.tie_for_fused_update) keeps one [V, h] gradient buffer for the tied word
    embedding: the lookup's backward adds into the output layer's partial. The DP reduction runs on Lomo's
    persistent buffer (a copy; the gradient is freed in its hook), so no gradient waits for gloo's worker thread to
    let go of it (CI once caught one that did). So the peak is that buffer plus the one layer gradient being
    produced: the largest gradient + one layer's, deterministically. The vocabulary (1024) makes the embedding 8x a
    layer weight, so that stays well below the bound (largest gradient + one message)."""
    layer = 4 * HIDDEN * HIDDEN * F32  # the largest gradient besides the embedding (fc1 / fc2 weight, ffn 4h)
    for r, ref in zip(results[method], results["adamw"]):
        bound = r["largest_grad_bytes"] + r["bucket_bytes"]
        assert r["grad_bound_applies"] and r["bucket_bytes"] == r["largest_grad_bytes"]  # one parameter per message
        assert r["grad_bound_ok"] == (r["cat_peak"]["grad"] <= bound)
        assert r["whole_grad_bound_ok"] == (r["whole_grad_peak"] <= bound)
        live = r["grad_live_at_peak"]
        assert sum(b for _, b in live) == r["cat_peak"]["grad"]
        emb = [b for n, b in live if n.startswith("word_embeddings.weight")]
        assert emb == [r["largest_grad_bytes"]], live  # one buffer for the tied weight, not two partials
        assert r["cat_peak"]["grad"] - emb[0] <= layer, live
        assert r["cat_peak"]["grad"] <= r["largest_grad_bytes"] + layer < bound  # the margin
        assert r["grad_bound_ok"] and r["whole_grad_bound_ok"], (r["cat_peak"]["grad"], r["whole_grad_peak"], bound)
        whole = [n for n, _ in live if not n.endswith("(partial)")]
        assert len(whole) <= 1, live  # at most the gradient being copied into the reduction buffer
        assert r["cat_peak"]["grad"] < ref["cat_peak"]["grad"] and r["peak"] < ref["peak"]
    if method == "adalomo":  # factored second moments: rows + columns, far below AdamW's two full moments
        assert 0 < results[method][0]["cat_peak"]["optim"] < results["adamw"][0]["cat_peak"]["optim"] / 10


def test_zero2_holds_a_gradient_shard_and_the_buckets_in_progress():
    """DP 4, a tiny GPT (vocabulary 128) in 4K-element buckets, measured by the tracker: ZeRO-1's optimizer holds
    every full-size buffer for the step (and the reduced shards beside them); ZeRO-2's peak is the shards (1/4 of
    ZeRO-1's buffers) plus the buckets backward is filling (one per param group here: the matrices' and the biases /
    norms', which fill side by side) plus at most the one on the wire; the reduced shards are the same bytes."""
    args = _args(bucket_size=1 << 12, vocab_size=128)
    res = {m: run_ranks(_body, 4, m, args, timeout=180) for m in ("zero1", "zero2")}
    for r1, r2 in zip(res["zero1"], res["zero2"]):
        full, bucket = r1["label_peak"]["full buckets"], r2["bucket_bytes"]
        in_progress = bucket + sum(r2["largest_bucket_per_group"])  # one on the wire, one filling per group
        assert full > 2 * in_progress  # enough buckets for the saving to show
        assert r1["label_peak"]["shards"] == r2["label_peak"]["shards"] == full // 4
        assert r1["label_peak"]["optimizer gradients"] == full + full // 4  # ZeRO-1: all at once, after the last launch
        assert r2["label_peak"]["full buckets"] <= in_progress, r2["label_live_at_peak"]
        assert r2["label_peak"]["optimizer gradients"] <= full // 4 + in_progress
        assert r2["cat_peak"]["grad"] < r1["cat_peak"]["grad"]

"""megacomp.plan.estimate: compute per micro-batch, the 1F1B bubble, what each schedule overlaps and the memory per
device, hand-computed on clusters whose links are simple numbers."""
from __future__ import annotations

import dataclasses

import pytest

from megacomp.plan import Cluster, Layout, Link, Method, ModelSpec, device, estimate, memory_per_device
from megacomp.plan.calibration import pipeline

DEV = dataclasses.replace(device("h100"), peak_flops=1e12, mfu=0.5, memory_bandwidth_Bps=1e30)
MODEL = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128,
                  micro_batch_size=2, global_batch_size=8)
SLOW = Link(1e6, 1e-3, 1.0)  # 1 MB/s, 1 ms, no efficiency loss


def two_nodes(gpus=2):
    return Cluster(DEV, gpus, gpus, 1, inter_node=SLOW)


def t_mb(tp=1, pp=1):
    return MODEL.flops_per_token * 2 * 32 / (tp * pp) / 5e11


def test_pipeline_bubble_and_sends():
    e = estimate(MODEL, Layout(1, 2, 1), two_nodes(), Method("plain", "zero1"))
    # one send per micro-batch each way: s b h bf16 = 32 x 2 x 64 x 2 bytes leave each node, 1 ms + bytes / 1 MB/s
    t_send = 1e-3 + 32 * 2 * 64 * 2 / 1e6
    stage = t_mb(pp=2) + t_send
    M = 8 // 2
    assert e.bubble_s == pytest.approx(stage)  # (PP - 1) / VP stages
    assert e.step_s == pytest.approx(M * stage + stage)
    assert e.compute_s == pytest.approx(M * t_mb(pp=2))
    assert e.utilisation == pytest.approx(M * t_mb(pp=2) / e.step_s)


def test_ddp_buckets_hide_behind_the_last_backward_only():
    c = two_nodes()
    e = estimate(MODEL, Layout(1, 1, 2), c, Method("ddp", "ddp_buckets"))
    n = MODEL.params
    t_ar = 2 * 1e-3 + 4 * n / 1e6  # ring all-reduce of fp32 gradients, p = 2: 2(p-1) hops, 4n bytes leave a node
    (dp,) = e.transfers
    assert dp.seconds == pytest.approx(t_ar)
    assert dp.exposed_s == pytest.approx(max(0.0, t_ar - 2 / 3 * t_mb()))
    M = 8 // (2 * 2)
    assert e.step_s == pytest.approx(M * t_mb() + dp.exposed_s)


def test_zero1_overlapped_gather_and_codec_pipeline():
    c = two_nodes()
    int4 = {"name": "int4", "block_size": 128}
    plain = estimate(MODEL, Layout(1, 1, 2), c, Method("z", "zero1", dp_gradient=int4))
    over = estimate(MODEL, Layout(1, 1, 2), c, Method("z", "zero1", dp_gradient=int4, overlap_param_gather=True))
    ag = {t.path: t for t in plain.transfers}["dp_parameter"]
    assert ag.exposed_s == pytest.approx(ag.seconds)
    assert {t.path: t for t in over.transfers}["dp_parameter"].exposed_s == pytest.approx(max(0.0, ag.seconds - t_mb() / 3))
    rs = {t.path: t for t in plain.transfers}["dp_gradient"]
    # the 1-D parameters (biases, norms) sit in uncompressed buckets: reduced apart, uncompressed
    vec = -(-MODEL.vector_params // 2)
    shard = -(-MODEL.params // 2) - vec
    wire_bytes = 4 / 8 * shard + 4 * -(-shard // 128)  # int4/b128 of the other rank's chunk: codes and fp32 scales
    t_codec = 2 * 2 * shard * 4 / DEV.codec_Bps  # (E, D) = (1, 1) per byte of the 2-chunk input
    t_vec = 1e-3 + 4 * vec / 1e6  # a ring reduce-scatter of 2 ranks: one hop, the other rank's fp32 chunk
    assert rs.seconds == pytest.approx(1e-3 + pipeline(wire_bytes / 1e6, t_codec, 1) + t_vec)
    # started from the gradient hooks in the last micro-batch's backward: only what 2/3 of it does not hide shows
    assert rs.exposed_s == pytest.approx(max(0.0, rs.seconds - 2 / 3 * t_mb())) and rs.exposed_s < rs.seconds


def test_local_steps_amortise_the_outer_exchange():
    c = Cluster(DEV, 4, 4, 2, inter_node=Link(1e9, 1e-5, 1.0), inter_site=SLOW)
    int8 = {"name": "int8", "block_size": 128}
    blocking = estimate(MODEL, Layout(1, 1, 4), c, Method("d", "local_steps", outer=int8, outer_steps=10), replicas=2)
    outer = {t.path: t for t in blocking.transfers}["outer"]
    assert outer.exposed_s == pytest.approx(outer.seconds)  # DiLoCo: blocking, 1/H of the exchange per step
    streaming = estimate(MODEL, Layout(1, 1, 4), c, Method("s", "local_steps", outer=int8, outer_steps=10,
                                                            fragments=2, delay=3), replicas=2)
    frag = {t.path: t for t in streaming.transfers}["outer"]
    inner_step = streaming.step_s - frag.exposed_s
    per_sync = frag.seconds / (2 / 10)
    assert frag.exposed_s == pytest.approx(max(0.0, per_sync - 3 * inner_step) * 2 / 10)


def test_memory_per_device():
    lay, n = Layout(1, 1, 4), MODEL.params
    acts = 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64) * 2
    assert memory_per_device(MODEL, lay, Method("z", "zero1")) == pytest.approx(2 * n + 4 * n + 12 * n / 4 + acts)
    assert memory_per_device(MODEL, lay, Method("d", "ddp_buckets")) == pytest.approx(18 * n + acts)
    ef = Method("z", "zero1", compression={"dp_gradient_error_feedback": "loco"})
    assert memory_per_device(MODEL, lay, ef) == pytest.approx(2 * n + 4 * n + 12 * n / 4 + 4 * n + acts)


def test_zero2_reduces_every_micro_batch_behind_its_backward():
    c, lay = two_nodes(), Layout(1, 1, 2)
    one = {t.path: t for t in estimate(MODEL, lay, c, Method("z1", "zero1")).transfers}["dp_gradient"]
    two = {t.path: t for t in estimate(MODEL, lay, c, Method("z2", "zero2")).transfers}["dp_gradient"]
    M = 8 // (2 * 2)
    assert two.seconds == pytest.approx(M * one.seconds)
    assert two.exposed_s == pytest.approx(M * max(0.0, one.seconds - 2 / 3 * t_mb()))
    assert two.tier_bytes["inter_node"] == pytest.approx(M * one.tier_bytes["inter_node"])

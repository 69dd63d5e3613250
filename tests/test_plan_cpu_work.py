"""megacomp.plan.cpu_work and the DP-step model's use of it: every count hand-computed from the code it restates."""
from __future__ import annotations

import math

import pytest

from benchmarks import perf_model as pm
from benchmarks import step_validation as sv
from megacomp.plan import cpu_work as cw, shaped_steps as ss
from megacomp.plan.workload import ModelSpec

GPT = ModelSpec(4, 256, 4, 64, 1024, micro_batch_size=8, global_batch_size=16)  # benchmarks.netns_dp_worker's GPT


def test_matmul_and_qr_counts():
    w = cw.matmul(768, 256, 4)  # a QKV gradient (768 x 256) times a rank-4 Q
    assert w.matmul_flops == 2 * 768 * 256 * 4 == 1_572_864
    assert w.matmul_bytes == 4 * (768 * 256 + 256 * 4 + 768 * 4) == 802_816
    q = cw.qr(1024, 4)
    assert q.matmul_flops == pytest.approx(2 * 1024 * 16 - 2 * 64 / 3)
    assert q.matmul_bytes == 2 * 4 * 1024 * 4


def test_powersgd_work_of_one_matrix_per_engine():
    n, m, r = 1024, 256, 4  # fc1's gradient: compressed (1024 x 256 >= 2 x 1280 x 4)
    mc = cw.powersgd_work([(n, m)], r, "megacomp")
    one = 2 * n * m * r  # 2,097,152 FLOPs per product
    assert mc.matmul_flops == pytest.approx(4 * one + 2 * n * r * r - 2 * r ** 3 / 3)  # P, Q, own approx., result; QR
    assert mc.matmul_bytes == 4 * 4 * (n * m + m * r + n * r) + 2 * 4 * n * r  # each product reads or writes n x m
    assert mc.elementwise_bytes == 11 * 4 * n * m == 11_534_336
    th = cw.powersgd_work([(n, m)], r, "torch")
    assert th.matmul_flops == pytest.approx(3 * one + 2 * n * r * r - 2 * r ** 3 / 3)  # P, Q, P Q^T
    assert th.elementwise_bytes == 12 * 4 * n * m
    # a bias is divided, never compressed
    assert cw.powersgd_work([(256,)], r) == cw.Work(0.0, 0.0, 2 * 4 * 256)
    with pytest.raises(ValueError, match="engine"):
        cw.powersgd_work([(n, m)], r, "deepspeed")


def test_compression_rules_differ_at_the_boundary():
    # n m = 2 (n + m) r exactly: megacomp's rule (>=) compresses, torch's (>) does not
    assert cw.torch_rank_for((4, 4), 1) == 0
    assert cw.powersgd_work([(4, 4)], 1, "megacomp").matmul_flops > 0
    assert cw.powersgd_work([(4, 4)], 1, "torch").matmul_flops == 0
    assert cw.torch_rank_for((64, 256), 4) == 4 and cw.torch_rank_for((1024, 8, 8), 8) == 8  # read as 1024 x 64


def test_onebit_work_and_lamb_extra():
    n = 3_438_080
    assert cw.onebit_work(n).elementwise_bytes == 7 * 4 * n  # b1 M + (1 - b1) g (5 passes), / world (2)
    lamb = cw.onebit_work(n, lamb=True).elementwise_bytes
    assert cw.LAMB_RULE_PASSES == 7 + 6 + 2 + 6 + 5 + 6 + 3 + 27 + 5 + 3
    # LAMB's extra over 1-bit Adam: scale/unscale (4) and its longer step (70 - 17); no extra exchange unsharded
    assert lamb - cw.onebit_work(n).elementwise_bytes == (4 + 70 - 17) * 4 * n == 783_882_240
    lamb_ph = ss.method_phases("megacomp_onebit_lamb", n, 2, 2 * 2 ** 20)
    adam_ph = ss.method_phases("megacomp_onebit_adam", n, 2, 2 * 2 ** 20)
    assert lamb_ph == adam_ph  # the same sign all-reduce of the momentum


def test_work_seconds_is_a_roofline_plus_passes():
    w = cw.Work(matmul_flops=8e9, matmul_bytes=2e9, elementwise_bytes=4e9)
    assert w.seconds(80e9, 10e9) == pytest.approx(max(0.1, 0.2) + 0.4)
    assert w.seconds(20e9, 10e9) == pytest.approx(max(0.4, 0.2) + 0.4)


def test_benchmark_gpt_shapes_and_method_work():
    shapes = GPT.parameter_shapes()
    assert len(shapes) == 52 and sum(math.prod(s) for s in shapes) == GPT.params == 3_438_080
    numel = GPT.params
    assert ss.method_work("megacomp_powersgd4", shapes) == cw.powersgd_work(shapes, 4, "megacomp")
    assert ss.method_work("ddp_powersgd1", shapes) == cw.powersgd_work(shapes, 1, "torch")
    assert ss.method_work("megacomp_accordion", shapes) == cw.powersgd_work(shapes, 1) + cw.Work(0, 0, 36 * numel)
    assert ss.method_work("megacomp_onebit_lamb", shapes) == cw.onebit_work(numel, lamb=True)
    assert ss.method_work("megacomp_onebit_adam_in_step", shapes) == cw.onebit_work(numel)
    assert ss.method_work("ddp_fp32", shapes) == cw.Work()
    # the record check: a GPT the worker did not build is refused in one line
    assert sv.benchmark_gpt({"method": "x", "layers": 4, "hidden": 256, "world": 2, "params": 3_438_080}) == GPT
    with pytest.raises(ValueError, match="benchmark_gpt"):
        sv.benchmark_gpt({"method": "x", "layers": 4, "hidden": 256, "world": 2, "params": 1})


def test_work_adds_to_the_step_and_zero1_reduces_in_backward():
    (ph,) = ss.method_phases("ddp_fp32", 1000, 2, 4000.0)
    assert ss.predict_step(pm.Model(0.0, 1.0), [ph], 1e6, 2, 0.3, 1.0, 0.0, work_s=0.05) == pytest.approx(
        ss.predict_step(pm.Model(0.0, 1.0), [ph], 1e6, 2, 0.3, 1.0, 0.0) + 0.05)
    rs, ag = ss.method_phases("megacomp_zero1_int4_loco_int8", 3_438_080, 2, 2 * 2 ** 20)
    assert (rs.window, ag.window) == ("in_backward", "after_backward")  # reduce-scatter from the gradient hooks


def test_onebit_steps_are_measured_after_the_warm_up():
    # 20 iterations: the worker's freeze_step is 20 // 5 = 4, so iterations 4.. are the steady state
    every = [9.0] * 4 + [1.0] * 9 + [2.0] * 7
    rec = {"method": "megacomp_onebit_adam", "all_times_s": every, "times_s": every[2:]}
    assert sv.measured_step(rec) == 1.0  # median of 9 ones and 7 twos
    assert sv.measured_step({**rec, "method": "ddp_fp32"}) == 1.5  # all but the first two, as recorded

"""Pretraining with ``--overlap-optimizer acco`` (megacomp.optimizer.acco inside megacomp.training): it trains under
TP, PP (the tied embedding deferred and summed over the embedding group per half) and SP; it puts twice ZeRO-1's
gradient and parameter bytes on the wire, every byte booked in some iteration's record; a run stopped and resumed
continues the uninterrupted curve bit for bit (the estimate is checkpointed); the flags it refuses name the fix; warmed up for every iteration (--overlap-optimizer-warmup-steps), ACCO and DPU
are ZeRO-1's run bit for bit. Also --overlap-param-gather (the same run as the synchronous all-gather) and DPU."""
from dataclasses import replace

import pytest

from distributed import run_ranks
from megacomp.training import Trainer
from megacomp.training.arguments import check


@pytest.fixture(scope="module")
def base(tiny_config):
    return replace(tiny_config, train_iters=4)


def _run_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        final = [p.detach().clone() for p in trainer.model.parameters()]
    finally:
        trainer.close()
    traffic = {}
    for h in history:
        for kind, (w, _) in h["traffic"].items():
            traffic[kind] = traffic.get(kind, 0) + w
    return [h["loss"] for h in history], traffic, final, [h["skipped"] for h in history]


def test_dpu_trains_with_the_bytes_of_zero1(base):
    """DPU (--overlap-optimizer dpu) on PP 2 x DP 2: the same first loss, training, exactly ZeRO-1's DP bytes."""
    cfg = replace(base, pipeline_model_parallel_size=2)
    plain = run_ranks(_run_body, 4, cfg)
    dpu = run_ranks(_run_body, 4, replace(cfg, overlap_optimizer="dpu"))
    for (l0, t0, _, _), (l1, t1, _, s1) in zip(plain, dpu):
        assert l1[0] == l0[0]  # the first step computes at θ_0 either way
        assert l1[-1] < l1[0] and not any(s1)
        assert t1 == t0


@pytest.mark.parametrize("tp,pp,sp", [(2, 1, False), (1, 2, False), (2, 1, True)], ids=["tp2-dp2", "pp2-dp2", "tp2-sp"])
def test_acco_trains_under_tp_pp_sp_with_twice_the_dp_bytes(base, tp, pp, sp):
    cfg = replace(base, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                  global_batch_size=8 * pp)  # two halves of whole 1F1B rounds
    plain = run_ranks(_run_body, 4, cfg)
    acco = run_ranks(_run_body, 4, replace(cfg, overlap_optimizer="acco"))
    for (l0, t0, _, _), (l1, t1, _, s1) in zip(plain, acco):
        assert l1[0] == l0[0]  # the same first forward (θ̃_0 = θ_0)
        assert l1[-1] < l1[0] and not any(s1)
        for kind in ("dp_gradient", "dp_parameter"):  # an estimate and an update per step, all booked
            assert t1[kind] == 2 * t0[kind], (kind, t0[kind], t1[kind])
        assert {k: v for k, v in t1.items() if not k.startswith("dp_")} == \
               {k: v for k, v in t0.items() if not k.startswith("dp_")}


@pytest.mark.parametrize("overlap", ["acco", "dpu"])
def test_resume_continues_the_uninterrupted_run_bit_for_bit(base, tmp_path, overlap):
    """int4 + LoCo gradients and int8 parameters, DP 2: stopped at iteration 3 (the update in flight lands and the
    parameters the next step computes at are saved: ACCO's estimate, DPU's previous parameters) and resumed, the
    losses and final weights equal the uninterrupted run's."""
    cfg = replace(base, train_iters=6, compression="loco4_qwz", overlap_optimizer=overlap, save=str(tmp_path / "ckpt"))
    full = run_ranks(_run_body, 2, replace(cfg, save=None))[0]
    first = run_ranks(_run_body, 2, replace(cfg, exit_interval=3))[0]
    rest = run_ranks(_run_body, 2, replace(cfg, load=str(tmp_path / "ckpt")))[0]
    assert len(first[0]) == 3 and first[0] + rest[0] == full[0]
    assert all(a.equal(b) for a, b in zip(rest[2], full[2]))
    # the stopped run booked its last update too; the all-gather of loading the checkpoint is not an iteration's
    # traffic (the loop's table starts when the loop does), so the two halves add up to the uninterrupted run
    assert first[1]["dp_gradient"] + rest[1]["dp_gradient"] == full[1]["dp_gradient"]
    assert first[1]["dp_parameter"] + rest[1]["dp_parameter"] == full[1]["dp_parameter"]


@pytest.mark.parametrize("change,match", [
    (dict(overlap_optimizer="zero_bubble"), "must be .none., .acco. or .dpu."),
    (dict(optimizer="onebit_adam"), "use --optimizer adamw"),
    (dict(shard_optimizer=False), "drop --no-shard-optimizer"),
    (dict(zero_stage=2), "use --zero-stage 1"),
    (dict(compression="powersgd4"), "value codec"),
    (dict(global_batch_size=12), "two equal halves"),
    (dict(compression="pp_aqsgd4"), "AQ-SGD"),
    (dict(outer_algorithm="diloco", num_replicas=2), "outer-algorithm diloco"),
    (dict(overlap_optimizer_warmup_steps=-1), "overlap_optimizer_warmup_steps must be >= 0"),
])
def test_acco_refusals_name_the_fix(base, change, match):
    with pytest.raises(ValueError, match=match):
        check(replace(replace(base, overlap_optimizer="acco"), **change), world_size=2)
    check(replace(base, overlap_optimizer="acco", compression="loco4"), world_size=2)


def test_overlap_param_gather_gives_the_same_run(base):
    """--overlap-param-gather on TP 2 x DP 2 with int4 + LoCo gradients and int8 parameters: the same losses, bytes
    and final weights as the synchronous all-gather (the forward pre-hooks wait per bucket)."""
    cfg = replace(base, tensor_model_parallel_size=2, compression="loco4_qwz")
    sync = run_ranks(_run_body, 4, cfg)
    over = run_ranks(_run_body, 4, replace(cfg, overlap_param_gather=True))
    for (l0, t0, w0, _), (l1, t1, w1, _) in zip(sync, over):
        assert l0 == l1 and t0 == t1
        assert all(a.equal(b) for a, b in zip(w0, w1))


@pytest.mark.parametrize("change,match", [
    (dict(optimizer="onebit_adam"), "use --optimizer adamw"),
    (dict(overlap_optimizer="dpu"), "overlap-optimizer dpu"),
    (dict(outer_algorithm="diloco", num_replicas=2), "outer-algorithm diloco"),
])
def test_overlap_param_gather_refusals(base, change, match):
    with pytest.raises(ValueError, match=match):
        check(replace(replace(base, overlap_param_gather=True), **change), world_size=2)


def test_a_zero1_checkpoint_resumes_under_acco(base, tmp_path):
    """A ZeRO-1 run stopped at iteration 3 resumes with --overlap-optimizer acco (the checkpoint has no estimate:
    θ̃ = θ, ACCO's own start), so its first resumed loss is the uninterrupted ZeRO-1 run's (both halves at θ_3)."""
    cfg = replace(base, train_iters=5, save=str(tmp_path / "ckpt"))
    full = run_ranks(_run_body, 2, replace(cfg, save=None))[0][0]
    first = run_ranks(_run_body, 2, replace(cfg, exit_interval=3))[0][0]
    rest = run_ranks(_run_body, 2, replace(cfg, overlap_optimizer="acco", load=str(tmp_path / "ckpt")))[0][0]
    assert first == full[:3] and rest[0] == full[3] and len(rest) == 2



def test_warmup_steps_are_zero1_steps(base):
    """--overlap-optimizer-warmup-steps N: the first N steps wait for their own update (ACCO: no estimate), so an
    ACCO or DPU run warmed up for all its iterations is ZeRO-1's run: the same losses, final parameters and wire
    bytes, bit for bit."""
    want = run_ranks(_run_body, 2, base)[0]
    for mode in ("acco", "dpu"):
        got = run_ranks(_run_body, 2, replace(base, overlap_optimizer=mode,
                                              overlap_optimizer_warmup_steps=base.train_iters))[0]
        assert got[0] == want[0], mode
        assert all(a.equal(b) for a, b in zip(got[2], want[2])), mode
        assert got[1] == want[1], mode

"""End-to-end pretraining on real ranks (megacomp.training): layout invariance, compression, resume, bad input.

The corpus is a small slice of the Python standard library (real text); the tokenizer and token file
are built once per session in a temporary cache.
"""
import json
import sysconfig
from dataclasses import replace

import pytest
import torch

from distributed import run_ranks
from megacomp.training import Trainer, parse_args
from megacomp.config import load_yaml
from megacomp.training.arguments import REPO_CONFIGS, check


@pytest.fixture(scope="module")
def base(tiny_config):
    return replace(tiny_config, num_layers=4)


def _train_body(rank, world, cfg, probe=False):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    if probe:  # loss, traffic and the compression-error probe of each iteration
        return [(h["loss"], h["traffic"], h.get("probe")) for h in history]
    return [(h["loss"], h["wire_bytes"], h["uncompressed_bytes"], h["traffic"]) for h in history]


def losses(history):
    return [h[0] for h in history]


def test_loss_does_not_depend_on_the_parallel_layout(base):
    runs = {}
    for tp, pp, sp in [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, True), (4, 1, True)]:
        cfg = replace(base, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp)
        per_rank = run_ranks(_train_body, 4, cfg)
        assert all(losses(h) == losses(per_rank[0]) for h in per_rank)  # every rank reports the same loss
        runs[(tp, pp, sp)] = losses(per_rank[0])
    ref = runs[(1, 1, False)]
    assert ref[-1] < ref[0]
    for layout, got in runs.items():
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=2e-5, atol=0,
                                   msg=lambda m: f"layout tp/pp/sp={layout}: {m}")


def test_loco4_keeps_the_loss_and_cuts_gradient_bytes(base):
    cfg = replace(base, train_iters=12)
    plain = run_ranks(_train_body, 2, cfg)[0]
    loco = run_ranks(_train_body, 2, replace(cfg, compression="loco4"))[0]
    assert abs(losses(loco)[-1] - losses(plain)[-1]) <= 0.03 * losses(plain)[-1]
    dp_plain, dp_loco = plain[-1][3]["dp_gradient"], loco[-1][3]["dp_gradient"]
    assert dp_plain[0] == dp_plain[1] and dp_loco[1] == dp_plain[1]
    assert dp_loco[0] < 0.3 * dp_loco[1]  # int4 + scales on the matrices; 1-D params stay uncompressed
    assert loco[-1][1] < plain[-1][1]


def test_kill_and_resume_continues_the_same_curve(base, tmp_path):
    # every kind compressed, with error feedback on PP gradients and DP gradients, down to tiny tensors
    everything = {**load_yaml(str(REPO_CONFIGS / "compression" / "all.yaml")), "min_compress_numel": 0}
    cfg = replace(base, train_iters=6, tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                  compression=everything, save=str(tmp_path / "ckpt"), log_dir=str(tmp_path / "logs"))
    full = losses(run_ranks(_train_body, 4, replace(cfg, save=None, log_dir=None))[0])
    first = losses(run_ranks(_train_body, 4, replace(cfg, exit_interval=3))[0])
    assert len(first) == 3 and (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "3"
    # a later save killed half-way leaves only its .tmp directory behind: the last good checkpoint is used
    (tmp_path / "ckpt" / "iter_0000005.tmp").mkdir()
    (tmp_path / "ckpt" / "iter_0000005.tmp" / "half-written").write_text("x")
    rest_history = run_ranks(_train_body, 4, replace(cfg, load=str(tmp_path / "ckpt")))[0]
    assert first + losses(rest_history) == full
    traffic = rest_history[-1][3]
    for kind in ("pp_activation", "pp_gradient", "dp_gradient", "dp_parameter"):
        assert traffic[kind][0] < traffic[kind][1], kind  # really compressed
    lines = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "tokens_per_second", "wire_bytes", "uncompressed_bytes"} <= set(r) for r in lines)
    # a checkpoint from another configuration is refused, naming the difference
    other = replace(cfg, hidden_size=64, load=str(tmp_path / "ckpt"), save=None, log_dir=None)
    with pytest.raises(AssertionError, match="hidden_size: checkpoint 32 vs this run 64"):
        run_ranks(_train_body, 4, other)


def test_bad_configuration_errors(base, tmp_path):
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("num_layers: 2\nhiden_size: 64\n")
    with pytest.raises(ValueError, match=r"unknown key 'hiden_size' \(did you mean 'hidden_size'\?\)"):
        parse_args(["--config", str(cfg_file)])
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size \(3\) x --pipeline-model-parallel-size \(1\) "
                                         r"= 3 does not divide the world size 4"):
        check(replace(base, tensor_model_parallel_size=3), world_size=4)
    with pytest.raises(ValueError, match="--global-batch-size 6 is not a multiple"):
        check(replace(base, global_batch_size=6), world_size=2)
    with pytest.raises(ValueError, match="3 micro-batches per iteration .* not a multiple of the 2 pipeline stages"):
        check(replace(base, global_batch_size=12, micro_batch_size=2, pipeline_model_parallel_size=2), world_size=4)
    with pytest.raises(ValueError, match="adam_freeze_variance_step must be >= 0"):
        check(replace(base, adam_freeze_variance_step=-1), world_size=1)
    with pytest.raises(ValueError, match="dp_gradient_warmup_steps must be an int >= 0"):
        replace(base, compression={"dp_gradient": "int4", "dp_gradient_warmup_steps": -2}).compression_config()
    with pytest.raises(ValueError, match="neither a file nor a preset"):
        replace(base, compression="lolo").compression_config()
    missing = replace(base, data_path=[str(tmp_path / "nope")], data_cache_dir=str(tmp_path / "c"))
    with pytest.raises(AssertionError, match="nope"):
        run_ranks(_train_body, 2, missing)
    (tmp_path / "empty").mkdir()
    empty = replace(base, data_path=[str(tmp_path / "empty")], data_cache_dir=str(tmp_path / "c"))
    with pytest.raises(AssertionError, match="corpus is empty"):
        run_ranks(_train_body, 2, empty)
    assert sysconfig.get_paths()["stdlib"]


def test_single_rank_resume_with_error_feedback(base, tmp_path):
    """One DP rank never compresses (nothing to send) yet its checkpoints carry the EF keys a resume expects."""
    cfg = replace(base, train_iters=3, compression="loco4", save=str(tmp_path / "c"))
    full = losses(run_ranks(_train_body, 1, replace(cfg, save=None))[0])
    first = losses(run_ranks(_train_body, 1, replace(cfg, exit_interval=1))[0])
    rest = losses(run_ranks(_train_body, 1, replace(cfg, load=str(tmp_path / "c")))[0])
    assert first + rest == full


def test_seeded_stochastic_rounding_resumes_bit_identically(base, tmp_path):
    """DP gradients with seeded stochastic rounding: the codec's stream is checkpointed, so a resume draws
    what the uninterrupted run drew (a fresh process would otherwise restart the stream at its seed)."""
    comp = {"dp_gradient": {"name": "int2", "rounding": "stochastic", "seed": 11}, "min_compress_numel": 0}
    cfg = replace(base, train_iters=4, compression=comp, save=str(tmp_path / "c"))
    full = losses(run_ranks(_train_body, 2, replace(cfg, save=None))[0])
    first = losses(run_ranks(_train_body, 2, replace(cfg, exit_interval=2))[0])
    rest = losses(run_ranks(_train_body, 2, replace(cfg, load=str(tmp_path / "c")))[0])
    assert first + rest == full


def test_frozen_variance_recipe_resumes_bit_identically(base, tmp_path):
    """1-bit Adam's recipe in pretraining: uncompressed warm-up, then int4+LoCo with Adam's variance frozen
    (FrozenVarianceAdamW). A resume across the switch gives the uninterrupted run's losses."""
    comp = {"dp_gradient": "int4", "dp_gradient_error_feedback": "loco", "dp_gradient_warmup_steps": 2,
            "min_compress_numel": 0}
    cfg = replace(base, train_iters=4, compression=comp, adam_freeze_variance_step=2, save=str(tmp_path / "c"))
    full = run_ranks(_train_body, 2, replace(cfg, save=None))[0]
    first = losses(run_ranks(_train_body, 2, replace(cfg, exit_interval=3))[0])
    rest = losses(run_ranks(_train_body, 2, replace(cfg, load=str(tmp_path / "c")))[0])
    assert first + rest == losses(full)
    traffic = full[-1][3]["dp_gradient"]
    assert traffic[0] < traffic[1]  # compressed after the warm-up


def test_checkpoints_of_another_format_version_or_segment_size_are_refused(base, tmp_path):
    """Checkpoints written before the channel refactor (format version 1: no ``format_version`` in
    megacomp.json) are refused naming both versions; so is a resume with another pipelining segment size,
    which changes the numbers of scaled codecs."""
    cfg = replace(base, train_iters=1, compression="loco4", save=str(tmp_path / "c"))
    run_ranks(_train_body, 1, cfg)
    meta = tmp_path / "c" / "iter_0000001" / "megacomp.json"
    saved = json.loads(meta.read_text())
    assert saved["format_version"] == 2 and saved["compression_resolved"]["segment_numel"] == 1 << 20
    resume = replace(cfg, train_iters=2, load=str(tmp_path / "c"), save=None)
    other_segments = replace(resume, compression={**load_yaml(str(REPO_CONFIGS / "compression" / "loco4.yaml")),
                                                  "segment_numel": 4096})
    with pytest.raises(AssertionError, match="segment_numel"):
        run_ranks(_train_body, 1, other_segments)
    for key in ("format_version", "files", "manifest_sha256"):  # what a version-1 manifest lacks
        del saved[key]
    meta.write_text(json.dumps(saved))
    with pytest.raises(AssertionError, match="has format version 1, this megacomp reads format version 2"):
        run_ranks(_train_body, 1, resume)


def test_powersgd_dp_gradients_under_tensor_parallelism_resume_bit_identically(base, tmp_path):
    """PowerSGD rank 2 on the DP gradients of a TP2 x DP2 run (each TP rank compresses its own weight
    shards): fewer DP bytes, a resume across the save gives the uninterrupted losses (residuals and
    warm-start Q restored), and full rank matches the uncompressed run to fp32 round-off."""
    comp = {"dp_gradient": {"name": "powersgd", "rank": 2}, "min_compress_numel": 0}
    cfg = replace(base, train_iters=4, tensor_model_parallel_size=2, compression=comp, save=str(tmp_path / "c"))
    full = run_ranks(_train_body, 4, replace(cfg, save=None))[0]
    first = losses(run_ranks(_train_body, 4, replace(cfg, exit_interval=2))[0])
    rest = losses(run_ranks(_train_body, 4, replace(cfg, load=str(tmp_path / "c")))[0])
    assert first + rest == losses(full)
    wire, dense = full[-1][3]["dp_gradient"]
    assert wire < 0.5 * dense
    exact = {"dp_gradient": {"name": "powersgd", "rank": 512, "min_compression_rate": 0, "error_feedback": False},
             "min_compress_numel": 0}
    plain = losses(run_ranks(_train_body, 4, replace(cfg, save=None, compression=None))[0])
    got = losses(run_ranks(_train_body, 4, replace(cfg, save=None, compression=exact))[0])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(plain), rtol=2e-5, atol=0)


def test_accordion_over_powersgd_ranks_resumes_bit_identically(base, tmp_path):
    """Accordion switching PowerSGD rank 4 / rank 1 in pretraining (DP 2): the regimes, partial norm sums
    and both ranks' Q matrices are checkpointed, so a resume mid-interval gives the uninterrupted losses."""
    comp = {"dp_gradient": {"name": "accordion", "low": {"name": "powersgd", "rank": 4},
                            "high": {"name": "powersgd", "rank": 1}, "eta": 0.5, "interval": 2},
            "min_compress_numel": 0}
    cfg = replace(base, train_iters=5, compression=comp, save=str(tmp_path / "c"))
    full = losses(run_ranks(_train_body, 2, replace(cfg, save=None))[0])
    first = losses(run_ranks(_train_body, 2, replace(cfg, exit_interval=3))[0])
    rest = losses(run_ranks(_train_body, 2, replace(cfg, load=str(tmp_path / "c")))[0])
    assert first + rest == full


def test_onebit_optimizers_with_compression_off_are_adamw_in_pretraining(base):
    """1-bit Adam with an uncompressed momentum path whose freeze step is never reached steps exactly as
    --optimizer adamw (TP2 x DP2), sharded and not (each against adamw with the same --shard-optimizer: an
    all-reduce sums in another order than a reduce-scatter)."""
    cfg = replace(base, train_iters=3, tensor_model_parallel_size=2)
    adamw = losses(run_ranks(_train_body, 4, cfg)[0])
    off = dict(optimizer="onebit_adam", freeze_step=100, momentum_codec="none", momentum_error_feedback=False)
    assert losses(run_ranks(_train_body, 4, replace(cfg, **off, shard_optimizer=True))[0]) == adamw
    whole = losses(run_ranks(_train_body, 4, replace(cfg, shard_optimizer=False))[0])  # all-reduce, not RS + AG
    assert losses(run_ranks(_train_body, 4, replace(cfg, **off, shard_optimizer=False))[0]) == whole


@pytest.mark.parametrize("layout,optimizer,extra", [
    ((2, 1), "onebit_adam", {"freeze_step": 2}),
    ((1, 2), "onebit_lamb", {"freeze_step": 2}),
    ((1, 1), "zero_one_adam", {"var_freeze_step": 2, "var_update_scaler": 1, "local_step_scaler": 1,
                               "local_step_clipper": 2, "shard_optimizer": False}),
])
def test_onebit_optimizers_resume_bit_identically_across_the_switch(base, tmp_path, layout, optimizer, extra):
    """Each 1-bit optimizer under TP or PP with DP 2 (4 ranks; DP 4 for 0/1 Adam): the momentum travels 1-bit
    after the warm-up, and a resume after the switch (worker/server errors, frozen variance, LAMB coefficients,
    the local-step schedule) gives the uninterrupted run's losses."""
    tp, pp = layout
    comp = {"min_compress_numel": 0}
    cfg = replace(base, train_iters=6, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  compression=comp, optimizer=optimizer, save=str(tmp_path / "c"), **extra)
    full = run_ranks(_train_body, 4, replace(cfg, save=None))[0]
    first = losses(run_ranks(_train_body, 4, replace(cfg, exit_interval=4))[0])
    rest = losses(run_ranks(_train_body, 4, replace(cfg, load=str(tmp_path / "c")))[0])
    assert first + rest == losses(full)
    wire, dense = full[-1][3]["dp_momentum"]
    assert 0 < wire < 0.1 * dense  # signs and one scale per chunk: about 1/32 of fp32


def test_onebit_adam_with_deepspeed_scaling_trains_and_resumes_bit_identically(base, tmp_path):
    """--momentum-scaling deepspeed (DeepSpeed's compressed all-reduce: one flat buffer per param group, RMS worker
    and server scales) at DP 2: the loss falls, the momentum travels as signs after the switch, and a resume after
    the switch (its worker and server errors) gives the uninterrupted run's losses."""
    cfg = replace(base, train_iters=5, optimizer="onebit_adam", freeze_step=2, momentum_scaling="deepspeed",
                  save=str(tmp_path / "c"))
    full = run_ranks(_train_body, 2, replace(cfg, save=None))[0]
    first = losses(run_ranks(_train_body, 2, replace(cfg, exit_interval=3))[0])
    rest = losses(run_ranks(_train_body, 2, replace(cfg, load=str(tmp_path / "c")))[0])
    assert first + rest == losses(full)
    assert losses(full)[-1] < losses(full)[0]
    wire, dense = full[-1][3]["dp_momentum"]
    assert 0 < wire < 0.1 * dense  # signs and one scale per chunk of each param group's buffer


def test_onebit_optimizer_bad_configuration_errors(base):
    with pytest.raises(ValueError, match="drop --shard-optimizer"):  # typed: refused (unset: unsharded, said)
        check(replace(base, optimizer="zero_one_adam", shard_optimizer=True))
    with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
        check(replace(base, optimizer="onebit_adam", freeze_step=0))
    with pytest.raises(ValueError, match="lossless"):
        check(replace(base, optimizer="onebit_lamb", momentum_codec="none", momentum_error_feedback=True))
    with pytest.raises(ValueError, match="--momentum-scaling must be one of chunk, deepspeed"):
        check(replace(base, optimizer="onebit_adam", momentum_scaling="rms"))
    with pytest.raises(ValueError, match="drop --shard-optimizer"):
        check(replace(base, optimizer="onebit_adam", momentum_scaling="deepspeed", shard_optimizer=True))
    with pytest.raises(ValueError, match="takes no other momentum codec"):
        check(replace(base, optimizer="onebit_lamb", momentum_scaling="deepspeed", momentum_codec="int4"))
    with pytest.raises(ValueError, match="does not combine with --outer-algorithm"):
        check(replace(base, optimizer="onebit_adam", outer_algorithm="diloco", num_replicas=2))
    with pytest.raises(AssertionError, match="dp_gradient must be none"):
        run_ranks(_train_body, 1, replace(base, optimizer="onebit_adam", compression="loco4"))


@pytest.mark.parametrize("pp,preset", [(2, "all_int8"), (1, "all"), (1, "all_int8")])
def test_error_probe_logs_every_compressed_path_and_changes_nothing(base, pp, preset):
    """TP 2 x PP 2 and TP 2 x DP 2 (sharded optimizer: asynchronous reduce-scatters) with sequence parallelism and
    every path compressed (the `all` and `all_int8` presets): probing iterations 1 and 2 measures every path that
    moved compressed traffic, and the losses and bytes equal the unprobed run's."""
    all_paths = load_yaml(str(REPO_CONFIGS / "compression" / f"{preset}.yaml"))
    all_paths["min_compress_numel"] = 256
    cfg = replace(base, tensor_model_parallel_size=2, pipeline_model_parallel_size=pp, sequence_parallel=True,
                  train_iters=3, compression=all_paths)
    plain = run_ranks(_train_body, 4, cfg, True)[0]
    probed = run_ranks(_train_body, 4, replace(cfg, compression={**all_paths, "error_probe_interval": 2}), True)[0]
    assert [(l, t) for l, t, _ in probed] == [(l, t) for l, t, _ in plain]
    assert [p is not None for _, _, p in probed] == [True, True, False]  # the first iteration, then every 2nd
    for loss, traffic, probe in probed[:2]:
        compressed = {k for k, (w, u) in traffic.items() if w < u}
        assert set(probe["paths"]) == compressed, (set(probe["paths"]), compressed)
        for path, (rel, worst, crest, kurt, calls) in probe["paths"].items():
            # fp8 e4m3 keeps 3 mantissa bits (relative error <= 2^-4 per element, before the Hadamard's
            # mixing, which preserves the norm), int8 / int4 a step of amax/127 / amax/7 per block: every path's
            # delivered error is nonzero and far below the signal, except int4 with error feedback, where the
            # residual of the previous step is part of what is delivered
            assert 0 < rel <= worst and calls >= 1 and crest >= 1.0 and kurt > 0
            assert rel < (1.0 if path == "dp_gradient" else 0.2), (path, rel)
        calls = probe["calls"]
        assert sum(1 for c in calls if c[0] == "tp_backward") == probe["paths"]["tp_backward"][4]
        assert probe["bytes"] > 0

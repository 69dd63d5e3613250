"""Validation during pretraining (megacomp.training.evaluation): --eval-interval / --eval-iters on real ranks.

Tolerances (fp32 round-off, u = 2^-24; Higham's gamma_n = n u / (1 - n u) bounds a length-n reduction computed in
another order):
  * the same micro-batches through the same kernels, averaged in float64 the same way: bit-identical (rtol 0);
  * pipeline stages pass activations uncompressed and run each micro-batch's ops unchanged: PP2 == PP1 bit for bit;
  * DP2 only regroups the float64 average of the same fp32 micro-batch losses: a few float64 ulps (rtol 1e-12);
  * one forward of all samples at once, or TP2's split reductions, changes the order of the reductions inside the
    model (the longest is the log-sum-exp over the V = 512 vocabulary) and of the mean over the N tokens: each
    token loss moves by at most 2 gamma_V relative (log-sum-exp and the picked logit), the mean by gamma_N more:
    rtol = 2 gamma_512 + gamma_N.
"""
import json
import math
from dataclasses import replace

import pytest
import torch

from distributed import run_ranks
from megacomp.data import get_batch
from megacomp.training import Trainer
from megacomp.training.evaluation import evaluation_samples, perplexity
from megacomp.training.metrics_log import Progress, duration, validation_lines

U = 2.0 ** -24


def gamma(n):
    return n * U / (1 - n * U)


def test_samples_ppl_and_the_console_block():
    """Every DP layout evaluates the same samples per round, the same ones each time; PPL is Megatron's clamped exp;
    the console block is Megatron's validation line."""
    def round_samples(r, dp, micro=2, batch=8, n=20):
        m = batch // (micro * dp)
        return sorted(i for d in range(dp) for k in range(m) for i in evaluation_samples(r, k, d, dp, micro, batch, n))
    assert round_samples(0, 1) == round_samples(0, 2) == round_samples(0, 4) == list(range(8))
    assert round_samples(2, 2) == [0, 1, 2, 3, 16, 17, 18, 19]  # 20 samples: the third round wraps around
    assert perplexity(2.0) == math.exp(2.0) and perplexity(50.0) == math.exp(20.0) and math.isnan(perplexity(math.nan))
    record = {"iteration": 10, "valid_loss": 7.065453, "valid_ppl": perplexity(7.065453), "eval_wire_bytes": 2e6,
              "eval_uncompressed_bytes": 4e6, "eval_samples": 800, "eval_time_s": 1.5}
    lines = validation_lines(record)
    assert lines[1] == " validation loss at iteration 10 | lm loss value: 7.065453E+00 | lm loss PPL: 1.170812E+03 | "
    assert lines[0] == lines[-1] == "-" * (max(len(x) for x in lines[1:-1]) + 1)
    assert "wire 2.00 MB of 4.00 MB (0.50x), not in training's traffic" in lines[2]
    assert duration(3725.4) == "1:02:05" and Progress(5, 10).fields(5)["eta_s"] is None


@pytest.fixture(scope="module")
def cfg(tiny_config):
    """Train, validation and test splits of 36, 2 and 2 of the tiny corpus's 40 files (--split, by document)."""
    return replace(tiny_config, split="90,5,5", train_iters=2, eval_interval=2, eval_iters=2)


def _run(rank, world, cfg, reference=False):
    """Train ``cfg``; returns the history's records, the summary's evaluation lines and, with
    ``reference``, the evaluated model's own forward of the validation samples on this one device."""
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        out = {"history": [{k: v for k, v in h.items() if k in ("loss", "traffic") or "valid" in k or "test" in k
                            or k.startswith("eval")} for h in history], "summary": trainer.evaluation.summary()}
        if reference:  # per micro-batch (in the evaluation's order) and all samples in one forward
            t, ds = cfg.training, trainer.valid_dataset
            batches = [evaluation_samples(r, k, 0, 1, t.micro_batch_size, t.global_batch_size, len(ds))
                       for r in range(cfg.eval_iters) for k in range(trainer.num_microbatches)]
            with torch.no_grad():
                per_mb = [trainer.model(*get_batch(ds, b)).item() for b in batches]
                out["per_mb"] = sum(per_mb) / len(per_mb)  # the float64 mean Trainer._global_loss takes
                out["at_once"] = trainer.model(*get_batch(ds, [i for b in batches for i in b])).item()
        return out
    finally:
        trainer.close()


def test_eval_loss_is_the_forward_of_the_same_samples(cfg, tmp_path):
    out = run_ranks(_run, 1, replace(cfg, log_dir=str(tmp_path)), True)[0]
    first, last = out["history"]
    assert "valid_loss" not in first and last["valid_ppl"] == perplexity(last["valid_loss"])
    assert last["valid_loss"] == out["per_mb"]
    tokens = cfg.eval_iters * cfg.global_batch_size * cfg.seq_length
    assert math.isclose(last["valid_loss"], out["at_once"], rel_tol=2 * gamma(512) + gamma(tokens), abs_tol=0)
    assert last["eval_samples"] == 2 * cfg.eval_iters * cfg.global_batch_size  # validation and test
    assert math.isfinite(last["test_loss"]) and last["test_ppl"] == perplexity(last["test_loss"])
    # metrics.jsonl: one record per iteration, the evaluated one with the validation fields; the summary names it
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2] and lines[1]["valid_loss"] == last["valid_loss"]
    assert {"valid_ppl", "eval_wire_bytes", "eval_traffic", "elapsed_s", "iterations_per_second", "eta_s"} <= set(
        lines[1]) and "valid_loss" not in lines[0]
    assert f"validation lm loss {last['valid_loss']:.4f}" in out["summary"] and "test lm loss" in out["summary"]


def test_eval_under_tp_pp_dp_matches_one_rank(cfg):
    """lr 0: every layout evaluates the same weights; the loss differs only by the order of the additions."""
    still = replace(cfg, lr=0.0, min_lr=0.0, train_iters=1, eval_interval=1)
    ref = run_ranks(_run, 1, still)[0]["history"][-1]["valid_loss"]
    act = cfg.seq_length * cfg.micro_batch_size * cfg.hidden_size * 4  # one micro-batch's activation, fp32 bytes
    for (tp, pp), rtol in {(1, 2): 0.0, (1, 1): 1e-12, (2, 1): 2 * gamma(512) + gamma(2 * 8 * 32)}.items():
        per_rank = run_ranks(_run, 2, replace(still, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp))
        last = per_rank[0]["history"][-1]
        assert len({r["history"][-1]["valid_loss"] for r in per_rank}) == 1  # every rank knows the same loss
        assert math.isclose(last["valid_loss"], ref, rel_tol=rtol, abs_tol=0), (tp, pp, last["valid_loss"], ref)
        if pp == 2:  # stage 0 sends each micro-batch's activation once per round (validation and test splits: the
            # last iteration), counted apart from training's
            sends = 2 * cfg.eval_iters * cfg.global_batch_size // cfg.micro_batch_size
            assert last["eval_traffic"]["pp_activation"] == [act * sends] * 2
            assert last["traffic"]["pp_activation"][0] == act * cfg.global_batch_size // cfg.micro_batch_size
        if tp == 2:
            assert last["eval_traffic"]["tp_forward"][0] > 0 and "tp_backward" not in last["eval_traffic"]


def test_eval_does_not_change_training(cfg):
    """Stochastic rounding on both forward paths of TP2 with sequence parallelism (all-gather: the channel's seeded
    stream; reduce-scatter: torch's generator): training with an evaluation after every iteration is the training
    without, bit for bit, loss and bytes."""
    sr = {"sp_all_gather": {"name": "int8", "block_size": 32, "rounding": "stochastic", "seed": 3},
          "sp_reduce_scatter": {"name": "int8", "block_size": 32, "rounding": "stochastic"}, "min_compress_numel": 0}
    base = replace(cfg, train_iters=3, tensor_model_parallel_size=2, sequence_parallel=True, compression=sr,
                   eval_iters=1)
    plain = run_ranks(_run, 2, replace(base, eval_interval=None))[0]["history"]
    evaluated = run_ranks(_run, 2, replace(base, eval_interval=1))[0]["history"]
    assert [(h["loss"], h["traffic"]) for h in evaluated] == [(h["loss"], h["traffic"]) for h in plain]
    assert all(math.isfinite(h["valid_loss"]) and h["eval_traffic"]["sp_all_gather"][0] for h in evaluated)
    assert all("valid_loss" not in h for h in plain)


def test_resumed_run_continues_the_validation_history(cfg, tmp_path):
    run = replace(cfg, train_iters=4, eval_interval=2, eval_iters=1, save=str(tmp_path / "ck"))
    run_ranks(_run, 1, replace(run, exit_interval=2))
    summary = run_ranks(_run, 1, replace(run, load=str(tmp_path / "ck")))[0]["summary"]
    assert "at iteration 2 -> " in summary and "at iteration 4" in summary
    assert "2 evaluations (1 before the resume)" in summary


def _plain(rank, world, cfg):
    Trainer(cfg).close()


def test_eval_interval_without_a_validation_split_is_refused_on_every_rank(cfg):
    with pytest.raises(AssertionError) as e:
        run_ranks(_plain, 2, replace(cfg, split=None))
    assert len(e.value.errors) == 2
    assert all("--eval-interval 2 evaluates on the validation split" in t and "--split" in t
               for t in e.value.errors.values())

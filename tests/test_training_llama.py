"""Pretraining the Llama-style model (megacomp.models.llama: RoPE, RMSNorm, SwiGLU, grouped-query attention, no
linear biases, an untied output layer) through megacomp.pretrain's trainer on real gloo ranks: the shipped
configs/llama_tiny.yaml fields on the tiny test config; TP 2 x DP 2 with every path int8 (all_int8) trains, counts
its TP and DP traffic, and a kill-and-resume continues the uninterrupted run's losses bit for bit (the untied output
layer and every option are in the checkpoint); pipeline stages train with the untied output layer. The model itself (TP 2 against TP 1, each option against a plain
reference, against megatron-core's GPTModel) is tested in test_models_llama*.py."""
from dataclasses import replace

import pytest

from distributed import run_ranks
from megacomp.config import load_yaml
from megacomp.training import Trainer
from megacomp.training.arguments import REPO_CONFIGS
from megacomp.training.pretrain_config import MODEL_OPTION_FIELDS


@pytest.fixture(scope="module")
def llama(tiny_config):
    shipped = load_yaml(str(REPO_CONFIGS / "llama_tiny.yaml"))
    options = {k: shipped[k] for k in MODEL_OPTION_FIELDS if k in shipped}
    assert options["num_query_groups"] == 2 and options["position_embedding_type"] == "rope"
    return replace(tiny_config, **options, train_iters=4)


def _body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
        untied = any("output_layer" in n for n, _ in trainer.model.named_parameters())
    finally:
        trainer.close()
    return [h["loss"] for h in history], history[-1]["traffic"], untied


def test_llama_trains_compressed_and_resumes_exactly(llama, tmp_path):
    every_message = {**load_yaml(str(REPO_CONFIGS / "compression" / "all_int8.yaml")), "min_compress_numel": 0}
    cfg = replace(llama, tensor_model_parallel_size=2, compression=every_message)
    losses, traffic, untied = run_ranks(_body, 4, cfg)[0]
    assert untied and all(x == x for x in losses) and losses[-1] < losses[0]
    for path in ("tp_forward", "tp_backward", "dp_gradient", "dp_parameter"):
        wire, raw = traffic[path]
        assert 0 < wire < raw, path  # compressed
    saved = replace(cfg, save=str(tmp_path / "ckpt"))
    first = run_ranks(_body, 4, replace(saved, exit_interval=2))[0][0]
    rest = run_ranks(_body, 4, replace(saved, load=str(tmp_path / "ckpt")))[0][0]
    assert first + rest == losses


def test_llama_pipeline_stages_train_with_an_untied_output_layer(llama):
    """PP 2: the untied output layer is the last stage's own weight (no tied-embedding sum across stages)."""
    losses, _, untied = run_ranks(_body, 2, replace(llama, pipeline_model_parallel_size=2, train_iters=3))[1]
    assert untied and len(losses) == 3 and losses[-1] < losses[0]

"""megacomp.plan.cluster and megacomp.plan.workload: link parsing, devices, the layout's checks and the model's
size against the real GPT."""
from __future__ import annotations

import math

import pytest

from distributed import run_ranks
from megacomp import parallel_state
from megacomp.config import ModelParallelConfig
from megacomp.models.gpt import GPTConfig, GPTModel
from megacomp.plan import Cluster, Layout, ModelSpec, device, parse_link


def test_parse_link():
    ln = parse_link("10gbit,20ms")
    assert ln.bandwidth_Bps == 10e9 / 8 and ln.latency_s == 0.02 and ln.efficiency == 0.9
    assert parse_link("400gbit,5us,0.8").rate_Bps == pytest.approx(400e9 / 8 * 0.8)
    assert parse_link("100mbit", latency_s=1e-3).latency_s == 1e-3
    for bad in ("fast", "10gbit,soon", "10furlong"):
        with pytest.raises(ValueError, match="RATE|latency"):
            parse_link(bad)


def test_devices_and_cluster_errors():
    assert device("H100").peak_flops == 989e12
    with pytest.raises(ValueError, match="unknown hardware 'x9'"):
        device("x9")
    with pytest.raises(ValueError, match="do not divide into 3 nodes"):
        Cluster(device("h100"), 8, 3)
    c = Cluster(device("h100"), 16, 4, 2)
    assert (c.gpus_per_node, c.unit(9, "inter_node"), c.unit(9, "inter_site")) == (4, 2, 1)
    assert c.widest_tier([0, 3]) == "intra_node" and c.widest_tier([0, 4]) == "inter_node"
    assert c.widest_tier([0, 8]) == "inter_site"


def test_layout_checks():
    m = ModelSpec(4, 64, 4, 32, 128, 2, 16)
    Layout(2, 2, 2).check(m, 8)
    for lay, msg in ((Layout(3, 1, 1), "TP 3 does not divide"), (Layout(1, 3, 1), "does not divide the 4 layers"),
                     (Layout(1, 1, 3), "not a multiple"), (Layout(1, 4, 4), "pipeline stages")):
        with pytest.raises(ValueError, match=msg):
            lay.check(m)
    with pytest.raises(ValueError, match="does not match 16 GPUs"):
        Layout(2, 2, 2).check(m, 16)
    with pytest.raises(ValueError, match="TP 4 does not divide the 2 key/value heads"):
        Layout(4, 1, 1).check(ModelSpec(4, 64, 4, 32, 128, 2, 16, num_query_groups=2))


LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
             add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _model_shapes(rank, world, options):
    groups = parallel_state.initialize_model_parallel(1, 1)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_length=16, vocab_size=64,
                    ffn_hidden_size=48, **options)
    return [tuple(p.shape) for p in GPTModel(cfg, ModelParallelConfig(process_groups=groups)).parameters()]


@pytest.mark.parametrize("options", [{}, LLAMA, dict(LLAMA, add_bias_linear=True, normalization="LayerNorm")],
                         ids=["gpt", "llama", "llama-with-biases"])
def test_parameter_shapes_are_the_models_megacomp_builds(options):
    spec = ModelSpec(2, 32, 4, 16, 64, ffn_hidden_size=48, **options)
    shapes = run_ranks(_model_shapes, 1, options)[0]
    assert spec.parameter_shapes() == shapes
    assert spec.params == sum(math.prod(s) for s in shapes)


def test_gpt_flops_are_megatrons_formula_and_llama_counts_its_three_mlp_matmuls():
    L, h, a, s, V = 4, 256, 8, 512, 1024
    gpt = ModelSpec(L, h, a, s, V)
    assert gpt.flops_per_token == pytest.approx(72.0 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)), rel=1e-12)
    llama = ModelSpec(L, h, a, s, V, ffn_hidden_size=4 * h, swiglu=True, num_query_groups=2)
    # SwiGLU adds a third h x 4h matmul per layer; GQA's 2 key/value heads of 8 shrink K and V to a quarter
    extra = 6 * L * (h * 4 * h - 2 * (h - 2 * h // a) * h)
    assert llama.flops_per_token == pytest.approx(gpt.flops_per_token + extra, rel=1e-12)

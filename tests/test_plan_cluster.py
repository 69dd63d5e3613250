"""megacomp.plan.cluster and megacomp.plan.workload: link parsing, devices, the layout's checks and the model's
size against the real GPT."""
from __future__ import annotations

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


def _gpt_params(rank, world):
    groups = parallel_state.initialize_model_parallel(1, 1)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, max_seq_length=16, vocab_size=64)
    return sum(p.numel() for p in GPTModel(cfg, ModelParallelConfig(process_groups=groups)).parameters())


def test_params_match_the_gpt_megacomp_builds():
    assert ModelSpec(2, 32, 4, 16, 64).params == run_ranks(_gpt_params, 1)[0]

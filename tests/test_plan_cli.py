"""python -m megacomp.plan: a ranked table, a compression YAML and a pretraining config that megacomp's own loader
accepts, and one-line errors for bad input."""
from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
import yaml

from megacomp.plan import cli
from megacomp.training.arguments import check, parse_args
from megacomp.training.pretrain_config import load_compression

REPO = cli.REPO


def _plan(tmp_path, config, *extra):
    out = tmp_path / "plan"
    results = cli.run(["--model", str(REPO / "configs" / config), "--out", str(out), *extra])
    return results, out


@pytest.mark.slow
def test_plan_writes_a_config_pretraining_accepts(tmp_path, capsys):
    results, out = _plan(tmp_path, "gpt_125m.yaml", "--gpus", "16", "--nodes", "2", "--sites", "2",
                         "--inter-site", "1gbit,30ms", "--layout", "1x1x16", "--top", "0")
    text = capsys.readouterr().out
    assert "| rank | method |" in text and "choice:" in text and "pretraining flags:" in text
    steps = [e.step_s for e in results]
    assert steps == sorted(steps) and len(results) >= 8
    cfg = parse_args(["--config", str(out / "pretrain.yaml")])
    check(cfg, 16)
    # the printed flags name the model config too: on their own they give the same run
    flags = next(line for line in text.splitlines() if line.startswith("pretraining flags: "))
    assert parse_args(shlex.split(flags[len("pretraining flags: "):])).to_dict() == cfg.to_dict()
    assert (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (1, 1)
    load_compression(str(out / "compression.yaml"))
    # every method's compression YAML and settings load, not only the winner's
    for i, e in enumerate(results):
        comp = tmp_path / f"c{i}.yaml"
        comp.write_text(yaml.safe_dump(cli.compression_mapping(e.method)))
        load_compression(str(comp))
        cfg_file = tmp_path / f"p{i}.yaml"
        cfg_file.write_text(yaml.safe_dump(cli.pretrain_config(str(REPO / "configs" / "gpt_125m.yaml"), e, str(comp))))
        check(parse_args(["--config", str(cfg_file)]), 16)


@pytest.mark.slow
@pytest.mark.parametrize("config,gpus,nodes", [("gpt_125m.yaml", 64, 8), ("gpt_1.3b.yaml", 128, 16),
                                               ("gpt_7b.yaml", 256, 32)])
def test_shipped_configs_rank_every_method(tmp_path, capsys, config, gpus, nodes):
    results, out = _plan(tmp_path, config, "--gpus", str(gpus), "--nodes", str(nodes), "--sites", "2",
                         "--inter-node", "100gbit", "--inter-site", "10gbit,20ms")
    assert len(results) >= 9
    check(parse_args(["--config", str(out / "pretrain.yaml")]), gpus)
    assert (out / "step_vs_bandwidth.png").exists() or "plot skipped" in capsys.readouterr().out


def test_bad_input_is_one_line(capsys):
    for args, msg in ((["--hardware", "x100"], "unknown hardware 'x100'"),
                      (["--layout", "3x2x4"], "does not match 32 GPUs"),
                      (["--nodes", "5"], "do not divide into 5 nodes"),
                      (["--inter-site", "fast"], "link 'fast'"),
                      (["--backend", "mpi"], "unknown backend 'mpi': use one of nccl, gloo")):
        assert cli.main(["--model", str(REPO / "configs" / "gpt_125m.yaml"), "--gpus", "32", *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0], lines


@pytest.mark.slow
def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "megacomp.plan", "--model", str(REPO / "configs" / "gpt_125m.yaml"),
                        "--gpus", "32", "--hardware", "x100"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown hardware" in r.stderr

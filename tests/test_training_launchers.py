"""Fast checks of the launch scripts, configs and the metrics plotter (no daemons, no training).

Real launches (torchrun, Slurm, mpirun) are exercised by scripts/ci_launchers.sh.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megacomp.config import TRAFFIC_PATHS, load_yaml
from megacomp.training.arguments import PretrainConfig, check, load_compression, parse_args

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
SHELL_SCRIPTS = ["pretrain_gpt.sh", "pretrain_gpt.sbatch", "pretrain_gpt_mpirun.sh", "slurm_up.sh", "slurm_down.sh",
                 "ci_launchers.sh"]
MODEL_CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
PRESETS = sorted((REPO / "configs" / "compression").glob("*.yaml"))
BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="bash is not installed")


# ---- configs --------------------------------------------------------------------------------------------
def test_expected_files_exist():
    names = {p.name for p in MODEL_CONFIGS}
    assert {"gpt_tiny.yaml", "gpt_125m.yaml", "gpt_350m.yaml", "gpt_1.3b.yaml", "gpt_7b.yaml"} <= names
    assert {"none", "loco4", "tp_fp8", "pp_int8", "dp_int8", "all"} <= {p.stem for p in PRESETS}
    for name in SHELL_SCRIPTS:
        assert (SCRIPTS / name).is_file(), name
    assert (REPO / "benchmarks" / "plot_metrics.py").is_file()


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.name)
def test_model_config_parses_and_fits_its_layout(path):
    cfg = parse_args(["--config", str(path)])  # unknown keys raise
    keys = set(PretrainConfig.flat_fields()) | set(PretrainConfig.components()) | {"compression"}
    assert set(load_yaml(str(path))) <= keys  # flat names or nested components
    cfg.compression_config()
    mp = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size
    for dp in (1, 2, 4):  # the config's own TP x PP layout with a few data-parallel sizes
        check(cfg, world_size=mp * dp)


@pytest.mark.parametrize("name,shape", [
    ("gpt_125m", (12, 768, 12)), ("gpt_350m", (24, 1024, 16)), ("gpt_1.3b", (24, 2048, 16)),
    ("gpt_7b", (32, 4096, 32))])
def test_gpt3_shapes(name, shape):
    cfg = parse_args(["--config", str(REPO / "configs" / f"{name}.yaml")])
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == shape
    assert cfg.seq_length == 2048
    assert cfg.num_layers % cfg.pipeline_model_parallel_size == 0


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_compression_preset_loads(path):
    c = load_compression(path.stem)
    assert c.enabled == (path.stem != "none")


def test_preset_contents():
    tp = load_compression("tp_fp8")
    for p in ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter"):
        codec = getattr(tp, p)
        assert (codec.name, codec.block_size, codec.hadamard) == ("fp8_e4m3", 128, 128)
    assert tp.pp_activation.is_identity and tp.dp_gradient.is_identity
    pp = load_compression("pp_int8")
    assert pp.pp_activation.name == pp.pp_gradient.name == "int8" and pp.pp_gradient_error_feedback is not None
    dp = load_compression("dp_int8")
    assert dp.dp_gradient.name == dp.dp_parameter.name == "int8"
    everything = load_compression("all")
    assert all(getattr(everything, p) is not None for p in TRAFFIC_PATHS)
    assert everything.dp_gradient.name == "int4" and everything.dp_gradient_error_feedback.beta == 0.8  # LoCo
    assert (everything.dp_parameter.name, everything.dp_parameter.block_size) == ("int8", 256)
    near = load_compression("all_int8")  # the recommended preset: 8 bits on every path
    for p in ("tp_forward", "tp_backward", "sp_all_gather", "sp_reduce_scatter"):
        codec = getattr(near, p)
        assert (codec.name, codec.block_size, codec.hadamard) == ("int8", 128, 128)
    assert all(getattr(near, p).name == "int8" for p in TRAFFIC_PATHS)
    assert near.dp_gradient_error_feedback is None and near.pp_gradient_error_feedback is not None


def test_help_lists_presets_in_whole_sentences_and_states_each_default_once():
    from megacomp.training.arguments import build_parser, first_sentence, presets_epilog
    assert first_sentence("TP in FP8 (e4m3. as tp_fp8.yaml) here. More") == "TP in FP8 (e4m3. as tp_fp8.yaml) here."
    epilog = presets_epilog().splitlines()
    assert len(epilog) == 1 + len(PRESETS)
    for line in epilog[1:]:
        assert line.endswith("."), line
    assert any("all-gathers in int8 with one scale per 256 elements." in line for line in epilog)
    help_text = " ".join(build_parser().format_help().split())
    assert "MLP width (default 4 x hidden). --seq-length" in help_text
    assert "Tokens per sample. (default 64)" in help_text
    assert not re.search(r"\(default[^()]*\)\.? \(default", help_text)


# ---- shell scripts ---------------------------------------------------------------------------------------
@needs_bash
@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_shell_script_syntax(name):
    r = subprocess.run([BASH, "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _dry_run(script, env_extra, *args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TP", "PP", "COMPRESSION", "TRAIN_ITERS", "NNODES", "NPROC", "LOG_DIR", "CONFIG", "SAVE",
                        "LOAD", "MASTER_ADDR", "MASTER_PORT", "BOOTSTRAP", "NP")}
    env.update(DRY_RUN="1", **env_extra)
    r = subprocess.run([BASH, str(SCRIPTS / script), *args], capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout.strip().splitlines()[-1])


def _pretrain_args(cmd):
    """The flags after ``-m megacomp.pretrain``, checked by the real argument parser."""
    i = cmd.index("megacomp.pretrain")
    assert cmd[i - 1] == "-m"
    args = cmd[i + 1:]
    parse_args(args)
    return args


@needs_bash
def test_torchrun_launcher_default_is_tiny_on_4_ranks():
    cmd = _dry_run("pretrain_gpt.sh", {})
    assert "--standalone" in cmd and cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert "--master-addr" not in cmd
    args = _pretrain_args(cmd)
    assert Path(args[args.index("--config") + 1]) == REPO / "configs" / "gpt_tiny.yaml"
    assert "--log-dir" in args


@needs_bash
def test_torchrun_launcher_overrides_and_passthrough(tmp_path):
    cmd = _dry_run("pretrain_gpt.sh", {"TP": "2", "PP": "2", "COMPRESSION": "all", "TRAIN_ITERS": "7",
                                       "LOG_DIR": str(tmp_path), "SAVE": str(tmp_path / "ckpt")},
                   "--log-interval", "1")
    args = _pretrain_args(cmd)
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--tensor-model-parallel-size"] == "2" and flags["--pipeline-model-parallel-size"] == "2"
    assert flags["--compression"] == "all" and flags["--train-iters"] == "7"
    assert flags["--log-dir"] == str(tmp_path) and flags["--save"] == str(tmp_path / "ckpt")
    assert args[-2:] == ["--log-interval", "1"]


@needs_bash
def test_torchrun_launcher_multi_node():
    cmd = _dry_run("pretrain_gpt.sh", {"NNODES": "2", "NODE_RANK": "1", "NPROC": "8", "MASTER_ADDR": "node0",
                                       "MASTER_PORT": "6000"})
    assert "--standalone" not in cmd
    for flag, value in [("--nnodes", "2"), ("--node-rank", "1"), ("--nproc-per-node", "8"),
                        ("--master-addr", "node0"), ("--master-port", "6000")]:
        assert cmd[cmd.index(flag) + 1] == value


def _has_open_mpi():
    mpirun = Path(sys.executable).parent / "mpirun"
    exe = str(mpirun) if mpirun.exists() else shutil.which("mpirun")
    if not exe:
        return False
    r = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return "Open MPI" in r.stdout


@needs_bash
@pytest.mark.skipif(not _has_open_mpi(), reason="Open MPI's mpirun is not installed (pip install -e '.[mpi]')")
def test_mpirun_launcher_bootstraps():
    cmd = _dry_run("pretrain_gpt_mpirun.sh", {"PYTHON": sys.executable})
    assert "--oversubscribe" in cmd and cmd[cmd.index("-n") + 1] == "4"
    exported = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert {"MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"} <= set(exported)
    _pretrain_args(cmd)
    cmd = _dry_run("pretrain_gpt_mpirun.sh", {"PYTHON": sys.executable, "BOOTSTRAP": "mpi4py", "TP": "2"})
    exported = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert "MASTER_ADDR" not in exported and "MASTER_PORT" not in exported
    assert "--tensor-model-parallel-size" in _pretrain_args(cmd)


def test_sbatch_directives():
    text = (SCRIPTS / "pretrain_gpt.sbatch").read_text()
    directives = dict(re.findall(r"^#SBATCH\s+--([\w-]+)=(\S+)", text, re.M))
    assert {"nodes", "ntasks-per-node", "cpus-per-task", "time", "output"} <= set(directives)
    assert directives["ntasks-per-node"] == "4"
    assert directives["signal"] == "USR1@120"  # Slurm's warning: the trainer saves and exits at the next iteration
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    assert not re.search(r"^\s*torchrun\b", text, re.M)
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_", "CUDA_DEVICE_MAX_CONNECTIONS"):
        assert var in text


@needs_bash
def test_sbatch_script_runs_srun_with_a_fake_slurm(tmp_path):
    """Run the batch script with stand-ins for scontrol/srun: rendezvous and arguments as documented."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {"scontrol": '#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "node7\\nnode8\\n"\n',
             "srun": '#!/bin/sh\necho "MASTER=$MASTER_ADDR:$MASTER_PORT OMP=$OMP_NUM_THREADS"\n'
                     'for a in "$@"; do printf "%s\\n" "$a"; done\n'}
    for name, body in fakes.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TP", "PP", "COMPRESSION", "TRAIN_ITERS", "CONFIG",
                                                            "LOG_DIR", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="12345", SLURM_JOB_NODELIST="node[7-8]",
               SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2", SLURM_SUBMIT_DIR=str(REPO), SLURM_CPUS_PER_TASK="3",
               TP="2", COMPRESSION="tp_fp8", LOG_DIR=str(tmp_path / "run"), PYTHON=sys.executable)
    r = subprocess.run([BASH, str(SCRIPTS / "pretrain_gpt.sbatch"), "--log-interval", "1"], capture_output=True,
                       text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("MASTER="))
    assert lines[i] == "MASTER=node7:32345 OMP=3"  # first node, 20000 + job id % 20000
    srun_args = lines[i + 1:]
    assert srun_args[0] == "--kill-on-bad-exit=1"
    assert srun_args[1:4] == [sys.executable, "-m", "megacomp.pretrain"]
    args = _pretrain_args(srun_args)
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--tensor-model-parallel-size"] == "2" and flags["--compression"] == "tp_fp8"
    assert flags["--log-dir"] == str(tmp_path / "run") and args[-2:] == ["--log-interval", "1"]


def test_ci_mpi_packages_match_setup_extra():
    tree = ast.parse((REPO / "setup.py").read_text())
    extras = next(kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    mpi = sorted(ast.literal_eval(extras)["mpi"])
    m = re.search(r"^MPI_PACKAGES=\(([^)]*)\)", (SCRIPTS / "ci_launchers.sh").read_text(), re.M)
    assert m and sorted(m.group(1).split()) == mpi


# ---- plot_metrics -------------------------------------------------------------------------------------------
def _plot_module():
    from benchmarks import plot_metrics

    return plot_metrics


def _write_run(path: Path, iterations, wire=1000, raw=4000, extra=()):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for it in list(iterations) + list(extra):
            f.write(json.dumps({"iteration": it, "loss": 7.0 - 0.1 * it, "lr": 1e-3, "tokens_per_second": 1.0,
                                "iteration_time_s": 0.1, "wire_bytes": wire, "uncompressed_bytes": raw,
                                "traffic": {"dp_gradient": [wire, raw]}, "grad_norm": 1.0,
                                "skipped": False}) + "\n")


def test_cumulative_wire_bytes_counts_log_interval_and_resumes(tmp_path):
    pm = _plot_module()
    _write_run(tmp_path / "a", [2, 4, 6], extra=[5, 6])  # every 2nd iteration; resumed at 4 -> 5, 6 again
    recs = pm.read_run(tmp_path / "a" / "metrics.jsonl")
    assert [r["iteration"] for r in recs] == [2, 4, 5, 6]
    assert pm.cumulative_wire_bytes(recs) == [2000, 4000, 5000, 6000]
    assert pm.find_metrics([str(tmp_path)]) == [tmp_path / "a" / "metrics.jsonl"]
    with pytest.raises(FileNotFoundError):
        pm.find_metrics([str(tmp_path / "missing")])


def test_plot_metrics_without_matplotlib_names_the_fix(monkeypatch):
    pm = _plot_module()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        pm._import_pyplot()


def test_plot_metrics_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install matplotlib)")
    pm = _plot_module()
    _write_run(tmp_path / "runs" / "none", range(1, 11), wire=4000, raw=4000)
    _write_run(tmp_path / "runs" / "int4", range(1, 11), wire=1000, raw=4000)
    out = tmp_path / "plots"
    assert pm.main([str(tmp_path / "runs" / "none"), str(tmp_path / "runs" / "int4" / "metrics.jsonl"),
                    "--out", str(out)]) == 0
    for name in ("loss_vs_iteration.png", "loss_vs_wire_bytes.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    text = capsys.readouterr().out
    assert "none: 10 records" in text and "int4: 10 records" in text and "0.25x" in text
    assert pm.main([str(tmp_path / "runs"), "--labels", "only-one", "--out", str(out)]) == 2  # 2 runs, 1 label

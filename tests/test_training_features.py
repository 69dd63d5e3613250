"""The training families behind one interface (megacomp.training.features): the registry, the configuration
tree they contribute to, and every family built from one compression YAML that sets every traffic path.

- Every family in the registry owns a config component (or none) whose fields all have docstrings and flat
  names, and the tree's flat names are unique (checked when the tree is assembled).
- Old flat keys and flags, nested YAML components and the flat attribute view name the same settings.
- One YAML that sets all twelve traffic paths (the eight layout paths and the families' dp_momentum, outer,
  loqt_merge, loqt_merge_tp) builds and trains every family on 4 gloo ranks; each family's own path then carries
  the configured codec: fewer bytes on the wire than uncompressed, in the traffic kind named after the path.
- Choices only one value of works are made and said, never over a flag the user typed.
"""
from dataclasses import replace

import pytest
import yaml

from distributed import run_ranks
from megacomp.config import ALL_TRAFFIC_PATHS
from megacomp.data import default_corpus_files
from megacomp.training import PretrainConfig, Trainer, parse_args
from megacomp.training.arguments import build_parser, resolve
from megacomp.training.config_tree import component_fields, field_docs
from megacomp.training.features import FEATURES

EVERY_PATH = {  # values every family accepts (the 1-bit family and LOMO need dp_gradient / dp_parameter exact)
    "tp_forward": {"name": "int8", "block_size": 64}, "tp_backward": {"name": "int8", "block_size": 64},
    "sp_all_gather": {"name": "int8", "block_size": 64}, "sp_reduce_scatter": {"name": "int8", "block_size": 64},
    "pp_activation": {"name": "int8", "block_size": 64}, "pp_gradient": {"name": "int8", "block_size": 64},
    "dp_gradient": "none", "dp_parameter": "none",
    "dp_momentum": {"name": "int4", "block_size": 0}, "dp_momentum_error_feedback": True,
    "outer": {"name": "int8", "block_size": 64}, "outer_error_feedback": "ef",
    "loqt_merge": "bf16", "loqt_merge_tp": "bf16", "min_compress_numel": 256,
    "replicas": {"name": "int8", "block_size": 64}, "replicas_error_feedback": "ef",
}
CASES = {  # family: (TP, PP, flat settings, the traffic kind that must travel compressed)
    "adamw": (2, 1, {}, "tp_forward"),
    "acco": (2, 1, {"overlap_optimizer": "acco", "global_batch_size": 16}, "tp_backward"),
    "onebit": (2, 1, {"optimizer": "onebit_adam", "freeze_step": 1}, "dp_momentum"),
    "demo": (2, 1, {"optimizer": "demo", "demo_topk": 8, "demo_chunk": 16}, "tp_forward"),
    "lomo": (2, 1, {"optimizer": "lomo", "global_batch_size": 4}, "tp_forward"),
    "loqt": (2, 1, {"loqt_rank": 4, "loqt_update_interval": 1, "loqt_codec": "{name: int8, block_size: 16}"},
             "loqt_merge"),
    "outer": (2, 1, {"outer_algorithm": "diloco", "num_replicas": 2, "outer_steps": 2}, "outer"),
    "error_probe": (2, 1, {"compression": {**EVERY_PATH, "error_probe_interval": 1}}, "tp_forward"),
    "aqsgd": (1, 2, {"dataset_samples": 16, "compression": {**EVERY_PATH, "pp_activation_delta": True}},
              "pp_activation"),
    # one replica group on torchft's quorum (rank 0 hosts the Lighthouse): its own kind, replicas, carries nothing
    # with one group (tests/test_integrations_torchft.py runs several); the layout's paths keep their codecs
    "fault_tolerance": (2, 1, {"fault_tolerance": "torchft", "ft_lighthouse": "local"}, "tp_forward"),
    # --compression auto with a ladder of one codec on tp_backward (its own field unset, as a laddered path's must be)
    "auto_compression": (2, 1, {"compression": {**{k: v for k, v in EVERY_PATH.items() if k != "tp_backward"},
                                                "auto": {"ladder": {"tp_backward": [EVERY_PATH["tp_backward"]]},
                                                         "interval": 1}}}, "tp_backward"),
}


def test_every_family_is_exercised_and_documented():
    assert {f.name for f in FEATURES} == set(CASES)
    for feature in FEATURES:
        if feature.CONFIG is None:
            continue
        docs = field_docs(feature.CONFIG)
        assert all(docs.get(f.name) for f in component_fields(feature.CONFIG)), feature.name
        assert PretrainConfig.components()[feature.config_key] is feature.CONFIG


def test_flat_and_nested_names_are_one_setting(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"onebit": {"freeze_step": 7}, "training": {"optimizer": "onebit_adam"},
                                      "outer": {"steps": 9}}))
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"freeze_step": 7, "optimizer": "onebit_adam", "outer_steps": 9}))
    a, b = parse_args(["--config", str(nested)]), parse_args(["--config", str(flat)])
    assert a == b and a.freeze_step == a.onebit.freeze_step == 7 and a.outer.steps == 9
    c = parse_args(["--config", str(flat), "--freeze-step", "11", "--no-shard-optimizer"])
    assert c.onebit.freeze_step == 11 and c.zero.shard is False and c.explicit == {"freeze_step", "shard_optimizer"}
    d = replace(c, lr=0.5)  # the flat names work with dataclasses.replace, and the original is untouched
    assert d.training.lr == 0.5 and c.training.lr != 0.5 and d.onebit.freeze_step == 11
    bad = tmp_path / "bad.yaml"
    bad.write_text("freez_step: 3\n")
    with pytest.raises(ValueError, match=r"unknown key 'freez_step' \(did you mean 'freeze_step'\?\)"):
        parse_args(["--config", str(bad)])
    bad.write_text("onebit: {freze_step: 3}\n")
    with pytest.raises(ValueError, match=r"unknown key onebit.freze_step \(did you mean 'freeze_step'\?\)"):
        parse_args(["--config", str(bad)])


def test_help_groups_flags_by_component():
    text = build_parser().format_help()
    for key in PretrainConfig.components():
        assert f"\n{key}:\n" in text, key
    assert "--freeze-step" in text and "--outer-codec" in text and "--zero-stage" in text


def test_typed_settings_of_an_unselected_family_are_noted_in_the_banner():
    from megacomp.training.arguments import parse_args

    cfg = parse_args(["--config", "configs/gpt_tiny.yaml", "--outer-steps", "7", "--outer-lr", "0.5", "--ft-timeout",
                      "3", "--zero-stage", "2"])
    assert resolve(cfg, 1) == [
        "note: --ft-timeout is set, but this run does not use the fault_tolerance family: no effect",
        "note: --outer-lr, --outer-steps are set, but this run does not use the outer family: no effect"]
    used = parse_args(["--config", "configs/gpt_tiny.yaml", "--outer-algorithm", "diloco", "--num-replicas", "2",
                       "--outer-steps", "7"])
    assert not any("no effect" in line for line in resolve(used, 2))


def test_help_is_printed_by_rank_zero_only(capsys, monkeypatch):
    """Under torchrun every rank parses ``--help``: rank 0 prints it, the others print nothing; all exit 0."""
    for rank, printed in (("0", True), ("1", False), ("3", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as stop:
            build_parser().parse_args(["--help"])
        assert stop.value.code == 0 and ("--outer-codec" in capsys.readouterr().out) is printed


def test_only_choice_is_made_and_said_but_never_over_a_typed_flag():
    cfg = PretrainConfig(optimizer="zero_one_adam")
    cfg.explicit = frozenset()
    lines = resolve(cfg, 4)
    assert cfg.zero.shard is False and any("unsharded" in line for line in lines)
    lomo = PretrainConfig(optimizer="lomo", micro_batch_size=4, global_batch_size=16)
    lomo.explicit = frozenset({"optimizer"})  # the batch sizes came from a config file
    assert any("global_batch_size 8" in line for line in resolve(lomo, 2)) and lomo.global_batch_size == 8
    typed = PretrainConfig(optimizer="lomo", micro_batch_size=4, global_batch_size=16)  # typed: refused, not changed
    assert resolve(typed, 2) == [] and typed.global_batch_size == 16


def _every_family_body(rank, world, base, yaml_path):
    out = {}
    for name, (tp, pp, settings, kind) in CASES.items():
        cfg = replace(parse_args(["--config", str(yaml_path)]), tensor_model_parallel_size=tp,
                      pipeline_model_parallel_size=pp, **settings, **base)
        trainer = Trainer(cfg)
        try:
            history = trainer.train()
        finally:
            trainer.close()
        sent = [h["traffic"].get(kind, [0, 0]) for h in history]
        out[name] = [list(s) for s in sent]
    return out


def test_every_family_builds_from_one_yaml_that_sets_every_path(tmp_path):
    path = tmp_path / "every_path.yaml"
    assert set(ALL_TRAFFIC_PATHS) <= set(EVERY_PATH)
    path.write_text(yaml.safe_dump({"compression": EVERY_PATH}))
    # the Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases, untied output): every family
    # trains it with every path compressed; the GPT's families are pinned by tests/test_golden.py's features
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=512,
                position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
                add_bias_linear=False, untie_embeddings_and_output_weights=True,
                micro_batch_size=2, train_iters=3, lr=1e-3, lr_warmup_iters=2,
                data_path=default_corpus_files()[:40], data_cache_dir=str(tmp_path / "cache"),
                tokenizer_max_bytes=400_000, log_interval=1000, loss_divergence_factor=0.0)
    per_rank = run_ranks(_every_family_body, 4, base, path)
    for name, (_, _, _, kind) in CASES.items():
        wire = sum(w for w, _ in per_rank[0][name])
        plain = sum(u for _, u in per_rank[0][name])
        assert 0 < wire < plain, (name, kind, per_rank[0][name])

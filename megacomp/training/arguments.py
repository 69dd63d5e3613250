"""The pretraining command line and YAML files, generated from the configuration tree
(megacomp.training.pretrain_config), and the checks a configuration must pass.

    python -m megacomp.pretrain --config configs/gpt_tiny.yaml --tensor-model-parallel-size 2 \
        --train-iters 50 --compression loco4 --log-dir runs/a

Every field of the tree has a flat, Megatron-style name: a ``--flag-name`` on the command line (dashes for
underscores) and a YAML key (``freeze_step: 100``); a YAML file may also nest a component
(``onebit: {freeze_step: 100}``). The command line wins over the file. ``--help`` lists the flags grouped by
component, each with its docstring and default. ``compression`` is a preset name (``configs/compression/NAME.yaml``),
a YAML file, or an inline mapping in the config. Unknown keys and inconsistent sizes raise ValueError naming the
fix; settings a training family must choose because only one works are chosen (:func:`resolve`) and said in the
banner, never for a flag the user typed.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from typing import Any, Optional

from ..config import load_yaml
from ..models.chunks import layers_per_virtual_stage_to_chunks
from ..pipeline_parallel.interleaved import check_interleaving
from .config_tree import component_fields, default_of, did_you_mean, field_docs, flat_name
from .features import FEATURES, OPTIMIZERS
from .megatron_flags import add_megatron_aliases, apply_megatron_aliases
from .trackers import check_packages
from .pretrain_config import COMPRESSION_DOC, REPO_CONFIGS, PretrainConfig, load_compression  # noqa: F401 (re-exported)

def _flag(name: str) -> str:
    """The command-line flag of flat name ``name`` (``global_batch_size`` -> ``--global-batch-size``): what every
    message about a setting names, since the docs promise flags (a YAML key is the same name with underscores)."""
    return "--" + name.replace("_", "-")


def first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence: the first ``.``, ``!`` or ``?`` outside parentheses that
    ends the text or is followed by a space (so ``tp_fp8.yaml`` or ``e4m3)`` do not end it)."""
    depth = 0
    for i, c in enumerate(text):
        depth += (c in "([") - (c in ")]")
        if c in ".!?" and depth <= 0 and (i + 1 == len(text) or text[i + 1].isspace()):
            return text[:i + 1]
    return text


def presets_epilog() -> str:
    """The compression presets of configs/compression/ with the first sentence of each file's leading
    comment (its ``#`` lines joined)."""
    lines = ["compression presets (--compression NAME, or a YAML file):"]
    for path in sorted((REPO_CONFIGS / "compression").glob("*.yaml")):
        comment = []
        for ln in path.read_text(encoding="utf-8").splitlines():
            if not ln.startswith("#"):
                break
            comment.append(ln.lstrip("#").strip())
        lines.append(f"  {path.stem:<12} {first_sentence(' '.join(x for x in comment if x))}")
    return "\n".join(lines)


def _add_flag(group, name: str, annotation: str, doc: str, default: Any) -> None:
    stated = re.search(r"\bdefault\b", doc, re.I)  # the docstring says what the default means: no second one
    text = (doc if stated else f"{doc} (default {default!r})").replace("%", "%%")
    if "bool" in annotation:
        group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=text)
    elif "list" in annotation:  # --data-path, --json-keys: several values, as Megatron's
        group.add_argument(_flag(name), dest=name, nargs="+", default=None, help=text)
    else:
        kind = int if "int" in annotation else float if "float" in annotation else str
        group.add_argument(_flag(name), dest=name, type=kind, default=None, help=text)


class CommandLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ValueError (one line, with a "did you mean" for a misspelled flag)
    instead of printing the usage and exiting: the entry point prints it once, from one rank, like every
    other bad input (megacomp.pretrain), where argparse would print it from every rank."""

    def error(self, message: str):
        """Raise ValueError with ``message``, the closest known flag for each unknown one, and where to look.

        Raises:
            ValueError: always."""
        known = list(self._option_string_actions)
        hints = [f"{flag}{did_you_mean(flag, known)}" for flag in re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", message)
                 if flag not in known and did_you_mean(flag, known)]
        hint = f" ({'; '.join(h.replace(' (', ': ', 1).rstrip(')') for h in hints)})" if hints else ""
        raise ValueError(f"{message}{hint}; megacomp-pretrain --help lists every flag")

    def print_help(self, file=None):
        """Print the help from rank 0 only (torchrun's ``RANK``; a process without one prints it): under a
        launcher every rank parses the same ``--help``, and one copy is enough. Every rank then exits 0."""
        if os.environ.get("RANK", "0") in ("", "0"):
            super().print_help(file)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser: ``--config FILE`` and one ``--flat-name`` flag per field of the configuration tree,
    grouped by component (each group titled with the component's YAML key and docstring).

    Bool fields take ``--x/--no-x``, list fields (``--data-path``, ``--json-keys``) several values, the others are
    parsed as int, float or str by their annotation. Every flag defaults to None, so parse_args can tell which were
    given.
    """
    p = CommandLineParser(prog="megacomp-pretrain", description="GPT pretraining with compressed communication "
                                "over tensor x pipeline x data parallelism. YAML keys and flags are the same names; "
                                "a YAML file may also nest them under their component (e.g. onebit: {freeze_step: "
                                "100}).", epilog=presets_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with the settings below (flags override it)")
    for key, cls in PretrainConfig.components().items():
        group = p.add_argument_group(f"{key}", (cls.__doc__ or "").strip().splitlines()[0])
        docs = field_docs(cls)
        for f in component_fields(cls):
            _add_flag(group, flat_name(cls, f), str(f.type), docs.get(f.name, ""), default_of(f))
    group = p.add_argument_group("compression", "A codec per traffic path (every path the run sends).")
    _add_flag(group, "compression", "str", COMPRESSION_DOC, "none")
    add_megatron_aliases(p)
    return p


def config_values(data: dict, source: str) -> dict[str, Any]:
    """The flat settings of a YAML mapping that may use flat keys and nested components.

    Raises:
        ValueError: an unknown key (one line, with the closest known key), or a component that is not a mapping.
    """
    comps, flat = PretrainConfig.components(), PretrainConfig.flat_fields()
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in comps:
            if not isinstance(value, dict):
                raise ValueError(f"{source}: {key} must be a mapping of its settings, got {value!r}")
            names = {f.name: flat_name(comps[key], f) for f in component_fields(comps[key])}
            for leaf, v in value.items():
                if leaf not in names:
                    hint = did_you_mean(leaf, names)  # with a close match, the list of keys is noise
                    raise ValueError(f"{source}: unknown key {key}.{leaf}{hint}; " + (
                        "megacomp-pretrain --help lists every key" if hint else f"the {key} keys are {', '.join(names)}"))
                out[names[leaf]] = v
        elif key in flat or key == "compression":
            out[key] = value
        else:
            raise ValueError(f"{source}: unknown key {key!r}{did_you_mean(key, list(flat) + list(comps))}; "
                             f"megacomp-pretrain --help lists every key")
    return out


def parse_args(argv=None) -> PretrainConfig:
    """YAML (``--config``) then CLI overrides -> a validated PretrainConfig (:func:`check`). The flags given on
    the command line are recorded in ``cfg.explicit`` (a family never changes those, see :func:`resolve`).

    Raises:
        ValueError: bad command-line flags (:class:`CommandLineParser`), unknown keys in the YAML file, a top
            level that is not a mapping, or settings that :func:`check` rejects.
        FileNotFoundError: the ``--config`` file does not exist.
        SystemExit: ``--help`` (after printing it).
    """
    args = build_parser().parse_args(argv)
    values = config_values(load_yaml(args.config), args.config) if args.config else {}
    given = {name: v for name, v in vars(args).items() if name != "config" and v is not None}
    given = apply_megatron_aliases(given, values)  # --disable-bias-linear, --bf16, ...: the fields they stand for
    cfg = PretrainConfig(**{**values, **given})
    cfg.explicit = frozenset(given)
    # checked as the run will use it: a setting only one value of can work is chosen at start (resolve, said in
    # the banner), so a copy is resolved for the check and the command line's config stays as typed
    check_numbers(cfg)
    trial = dataclasses.replace(cfg)
    resolve(trial, int(os.environ.get("WORLD_SIZE", "0") or 0) or None)
    check(trial)
    return cfg


def number_ranges() -> dict:
    """The numbers a user types for the run itself, by flat name: (lowest allowed, whether the lowest is excluded,
    highest allowed or None, whether the highest is excluded). A training family checks its own (features.*)."""
    return {
        **{name: (1, False, None, False) for name in (
            "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size",
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
            "micro_batch_size", "global_batch_size", "train_iters", "loss_scale_window", "dataset_samples",
            "tokenizer_max_bytes", "log_interval", "eval_interval", "eval_iters")},
        **{name: (0, False, None, False) for name in (
            "validate_collectives_every", "lr_warmup_iters", "seed", "max_skipped_steps", "exit_interval",
            "save_interval", "keep_checkpoints", "lr", "min_lr", "weight_decay", "clip_grad")},
        "distributed_timeout_minutes": (0, True, None, False),
        "outer_timeout": (0, True, None, False),
        "initial_loss_scale": (0, True, None, False),
        "adam_beta1": (0, False, 1, True),
        "adam_beta2": (0, False, 1, True),
    }


def _range_text(low, low_open, high, high_open) -> str:
    if high is None:
        return f"> {low}" if low_open else f">= {low}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_numbers(cfg: PretrainConfig) -> None:
    """Every number of :func:`number_ranges` that is set: of its field's type (an int for an int field; a finite
    number for a float field) and in its range. The message names the flag (the YAML key is the same name).

    Raises:
        ValueError: the first number that is not, e.g. ``--train-iters must be >= 1, got 0``.
    """
    flat = PretrainConfig.flat_fields()
    values = cfg.flat()
    for name, (low, low_open, high, high_open) in number_ranges().items():
        value = values.get(name)
        if value is None or name not in flat:
            continue
        want_int = "int" in str(_field_type(name))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (want_int and not isinstance(value, int)):
            raise ValueError(f"{_flag(name)} must be {'an integer' if want_int else 'a number'}, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{_flag(name)} must be a finite number {_range_text(low, low_open, high, high_open)}, "
                             f"got {value!r}")
        if value < low or (low_open and value == low) or (
                high is not None and (value > high or (high_open and value == high))):
            raise ValueError(f"{_flag(name)} must be {_range_text(low, low_open, high, high_open)}, got {value!r}")


def _field_type(name: str):
    for cls in PretrainConfig.components().values():
        for f in component_fields(cls):
            if flat_name(cls, f) == name:
                return f.type
    return None


def resolve(cfg: PretrainConfig, world_size: Optional[int] = None) -> list[str]:
    """Let each selected family set what only one value of can work (never a flag in ``cfg.explicit``); returns
    one banner line per choice. A sharding no family chose is ZeRO-1's (sharded)."""
    lines = [line for f in FEATURES if f.selected(cfg) for line in f.resolve(cfg, world_size)]
    if cfg.zero.shard is None:
        cfg.zero.shard = True
    return lines + unused_settings(cfg)


def unused_settings(cfg: PretrainConfig) -> list[str]:
    """One banner note per training family that this run does not select but whose settings were typed on the
    command line with a value other than the default (e.g. ``--outer-steps 50`` without ``--outer-algorithm``):
    they have no effect, which the user should see rather than discover later. Settings from a YAML file are not
    reported (a shared config file may set every family's options)."""
    flat = PretrainConfig.flat_fields()
    out = []
    for f in FEATURES:
        if f.config_key is None or f.config_shared or f.selected(cfg):
            continue
        default, mine = f.CONFIG(), getattr(cfg, f.config_key)
        typed = [n for n in sorted(getattr(cfg, "explicit", ()))
                 if flat.get(n, (None,))[0] == f.config_key and getattr(mine, flat[n][1]) != getattr(default, flat[n][1])]
        if typed:
            out.append(f"note: {', '.join(_flag(n) for n in typed)} {'is' if len(typed) == 1 else 'are'} set, but this "
                       f"run does not use the {f.name} family: no effect")
    return out


def check(cfg: PretrainConfig, world_size: Optional[int] = None) -> None:
    """Sizes that must agree, then each training family's own checks; raises ValueError naming the fix.

    Always checked: every number the user types is in range (:func:`check_numbers`), hidden size divisible by the heads, ``params_dtype``, the optimizer's name, the guard's
    settings, fine-tuning's directories, that no directory flag (``--save``, ``--log-dir``, ``--data-cache-dir``)
    names an existing regular file (what ``--load`` may name: megacomp.training.checkpoint_paths). With a world size (the argument, else ``$WORLD_SIZE``) also: TP x PP
    divides it, the global batch is a multiple of micro batch x DP, the micro-batches per iteration are a multiple
    of the pipeline stages, at least one layer per stage, and under sequence parallelism ``seq_length`` divisible
    by TP. Each family (megacomp.training.features) checks its own settings, and that nothing it refuses is
    asked of it.

    Raises:
        ValueError: the first check that fails (also a ``$WORLD_SIZE`` that is not an integer).
    """
    m, p, t, c = cfg.model, cfg.parallel, cfg.training, cfg.checkpoint
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "0")) or None
    check_numbers(cfg)
    if m.hidden_size % m.num_attention_heads:
        raise ValueError(f"{_flag('hidden_size')} {m.hidden_size} must be divisible by {_flag('num_attention_heads')} "
                         f"{m.num_attention_heads}")
    if c.keep_checkpoints < 0 or t.max_skipped_steps < 0:
        raise ValueError(f"{_flag('keep_checkpoints')} and {_flag('max_skipped_steps')} must be >= 0, got "
                         f"{c.keep_checkpoints} and "
                         f"{t.max_skipped_steps}")
    if t.loss_divergence_factor < 0 or 0 < t.loss_divergence_factor <= 1:
        raise ValueError(f"{_flag('loss_divergence_factor')} must be 0 (off) or > 1, got {t.loss_divergence_factor}")
    if t.optimizer not in OPTIMIZERS:
        raise ValueError(f"{_flag('optimizer')} must be one of {', '.join(OPTIMIZERS)}, got {t.optimizer!r}"
                         f"{did_you_mean(str(t.optimizer), OPTIMIZERS)}")
    if m.params_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"{_flag('params_dtype')} must be float32, bfloat16 or float16, got {m.params_dtype!r}")
    if m.params_dtype == "float16" and t.optimizer not in ("lomo", "adalomo"):
        raise ValueError(f"{_flag('params_dtype')} float16 (with dynamic loss scaling) is supported by --optimizer "
                         f"lomo / adalomo; optimizer {t.optimizer} keeps fp32 masters of bfloat16 parameters: use "
                         f"bfloat16")
    if t.initial_loss_scale <= 0 or t.loss_scale_window < 1:
        raise ValueError(f"{_flag('initial_loss_scale')} must be > 0 and {_flag('loss_scale_window')} >= 1, got "
                         f"{t.initial_loss_scale} and {t.loss_scale_window}")
    for flag, path in (("--save", c.save), ("--log-dir", cfg.logging.log_dir), ("--data-cache-dir", cfg.data.data_cache_dir)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"{flag} {path}: is a file, not a directory; point {flag} at a directory (it is created if "
                             f"missing)")
    check_packages(cfg)  # --tensorboard-dir / --wandb-project: their packages are installed
    if c.finetune and not c.load:
        raise ValueError(f"{_flag('finetune')} starts from a checkpoint's model weights: give it with --load DIR")
    if c.finetune and c.save and os.path.abspath(c.save) == os.path.abspath(c.load):
        raise ValueError(f"{_flag('finetune')} with --save equal to --load would restart from weights only on every "
                         "requeue: save the fine-tuning run to its own directory (a restart then resumes from it)")
    if p.dp_collectives not in ("auto", "flat"):
        raise ValueError(f"{_flag('dp_collectives')} must be auto (hop by hop where the DP group spans nodes with "
                         f"several ranks on each) or flat, got {p.dp_collectives!r}")
    if p.ranks_per_node < 0 or p.nodes_per_site < 0:
        raise ValueError(f"{_flag('ranks_per_node')} and {_flag('nodes_per_site')} must be >= 0 (0: from the "
                         f"launcher / one site), got {p.ranks_per_node} and {p.nodes_per_site}")
    if world_size is not None and p.ranks_per_node and world_size % p.ranks_per_node:
        raise ValueError(f"{_flag('ranks_per_node')} {p.ranks_per_node} does not divide the {world_size} ranks: every "
                         f"node holds the same number of ranks; fix {_flag('ranks_per_node')}")
    for feature in FEATURES:
        feature.check(cfg, world_size)
    virtual_chunks(cfg)  # raises on a bad num_layers_per_virtual_pipeline_stage
    if world_size is None:
        return
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if world_size % mp:
        raise ValueError(f"{_flag('tensor_model_parallel_size')} ({p.tensor_model_parallel_size}) x "
                         f"{_flag('pipeline_model_parallel_size')} ({p.pipeline_model_parallel_size}) = {mp} does not "
                         f"divide the world size {world_size}; pick sizes whose product divides the number of ranks")
    dp = world_size // mp
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ValueError(f"{_flag('global_batch_size')} {t.global_batch_size} is not a multiple of "
                         f"{_flag('micro_batch_size')} {t.micro_batch_size} x data-parallel size {dp}")
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    if micro % p.pipeline_model_parallel_size:
        raise ValueError(f"{micro} micro-batches per iteration ({_flag('global_batch_size')} {t.global_batch_size} / "
                         f"({_flag('micro_batch_size')} {t.micro_batch_size} x DP {dp})) is not a multiple of the "
                         f"{p.pipeline_model_parallel_size} pipeline stages; raise {_flag('global_batch_size')}")
    if p.pipeline_model_parallel_size > m.num_layers:
        raise ValueError(f"{p.pipeline_model_parallel_size} pipeline stages ({_flag('pipeline_model_parallel_size')}) "
                         f"for {m.num_layers} layers ({_flag('num_layers')}): every stage needs at least one layer")
    if p.sequence_parallel and m.seq_length % p.tensor_model_parallel_size:
        raise ValueError(f"{_flag('sequence_parallel')} needs {_flag('seq_length')} ({m.seq_length}) divisible by the "
                         f"TP size ({p.tensor_model_parallel_size})")
    if p.num_layers_per_virtual_pipeline_stage is not None:
        check_interleaving(micro, p.pipeline_model_parallel_size, virtual_chunks(cfg))


def virtual_chunks(cfg: PretrainConfig) -> int:
    """Model chunks per pipeline stage: 1 without ``num_layers_per_virtual_pipeline_stage``, else as Megatron
    (raises ValueError naming the fix, see megacomp.models.chunks)."""
    p = cfg.parallel
    if p.num_layers_per_virtual_pipeline_stage is None:
        return 1
    return layers_per_virtual_stage_to_chunks(cfg.model.num_layers, p.pipeline_model_parallel_size,
                                              p.num_layers_per_virtual_pipeline_stage)

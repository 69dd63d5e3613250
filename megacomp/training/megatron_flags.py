"""Megatron-LM's flags that megacomp spells another way, accepted as they are so that a user's pretraining script runs
with its model arguments unchanged.

Megatron-LM writes some model settings as switches where megacomp has one field (``--disable-bias-linear`` for
``add_bias_linear: false``) and asks for a flag megacomp does not need (``--group-query-attention`` beside
``--num-query-groups``; ``--max-position-embeddings`` beside ``--seq-length``). Each alias sets the field it stands
for, exactly as the field's own flag would (it counts as given on the command line); one that contradicts the rest of
the command line is refused with one line naming both flags.
"""
from __future__ import annotations

import argparse
from typing import Any

from .pretrain_config import ModelConfig

ALIASES = {
    "disable_bias_linear": ("--disable-bias-linear", "no biases in the attention and MLP linear layers (Megatron-LM's "
                            "name for --no-add-bias-linear)"),
    "group_query_attention": ("--group-query-attention", "grouped-query attention (Megatron-LM's switch: the number "
                              "of key/value heads is --num-query-groups, which it requires)"),
    "use_rotary_position_embeddings": ("--use-rotary-position-embeddings", "RoPE (Megatron-LM's older name for "
                                       "--position-embedding-type rope)"),
    "bf16": ("--bf16", "bfloat16 parameters with fp32 masters (Megatron-LM's name for --params-dtype bfloat16)"),
}
"""Switch aliases: destination -> (flag, help)."""

MAX_POSITION_EMBEDDINGS = "max_position_embeddings"


def add_megatron_aliases(parser: argparse.ArgumentParser) -> None:
    """Add the aliases to ``parser`` in a group of their own (defaults None, so parse_args can tell they were given)."""
    group = parser.add_argument_group("Megatron-LM aliases", "Megatron-LM's spellings of the settings above.")
    for dest, (flag, text) in ALIASES.items():
        group.add_argument(flag, dest=dest, action="store_const", const=True, default=None, help=text)
    group.add_argument("--max-position-embeddings", dest=MAX_POSITION_EMBEDDINGS, type=int, default=None,
                       help="accepted for Megatron-LM scripts and checked to be >= the sequence length (positions, "
                            "learned or rotary, cover --seq-length)")


def apply_megatron_aliases(given: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """``given`` (the command line's settings, by flat name) with each alias replaced by the field it stands for.

    ``values`` are the --config file's settings, read to check a contradiction against the whole run.

    Raises:
        ValueError: an alias that contradicts a flag given with it (``--disable-bias-linear --add-bias-linear``,
            ``--bf16 --params-dtype float32``, ``--use-rotary-position-embeddings --position-embedding-type
            learned_absolute``), ``--group-query-attention`` without ``--num-query-groups`` (command line or
            config), or ``--max-position-embeddings`` below the sequence length.
    """
    out = dict(given)
    setting = {"disable_bias_linear": ("add_bias_linear", False, "--add-bias-linear"),
               "use_rotary_position_embeddings": ("position_embedding_type", "rope", "--position-embedding-type"),
               "bf16": ("params_dtype", "bfloat16", "--params-dtype")}
    for alias, (name, value, own_flag) in setting.items():
        if out.pop(alias, None):
            if name in out and out[name] != value:
                raise ValueError(f"{ALIASES[alias][0]} sets {own_flag} {value}, but {own_flag} {out[name]} was given "
                                 f"too; keep one of them")
            out[name] = value
    if out.pop("group_query_attention", None):
        if out.get("num_query_groups", values.get("num_query_groups")) is None:
            raise ValueError("--group-query-attention needs --num-query-groups N (the key/value heads, dividing "
                             "--num-attention-heads); add it")
    positions = out.pop(MAX_POSITION_EMBEDDINGS, None)
    if positions is not None:
        seq = out.get("seq_length", values.get("seq_length", ModelConfig.seq_length))
        if positions < seq:
            raise ValueError(f"--max-position-embeddings {positions} is below --seq-length {seq}: positions must cover "
                             f"every token of a sample; raise it or lower --seq-length")
    return out

"""Megatron-LM's spellings of model flags (megacomp.training.megatron_flags): each sets the field it stands for, as
that field's own flag does; a contradiction is one line naming both flags."""
import pytest

from megacomp.training import parse_args

LLAMA = "configs/llama_tiny.yaml"


def test_aliases_set_the_fields_as_their_own_flags_do():
    aliased = parse_args(["--config", LLAMA, "--disable-bias-linear", "--group-query-attention", "--bf16",
                          "--use-rotary-position-embeddings", "--max-position-embeddings", "4096"])
    own = parse_args(["--config", LLAMA, "--no-add-bias-linear", "--params-dtype", "bfloat16",
                      "--position-embedding-type", "rope"])
    assert aliased.to_dict() == own.to_dict()
    assert aliased.explicit == own.explicit == {"add_bias_linear", "params_dtype", "position_embedding_type"}


@pytest.mark.parametrize("flags, message", [
    (["--group-query-attention"], "--group-query-attention needs --num-query-groups N"),
    (["--max-position-embeddings", "32", "--seq-length", "64"],
     "--max-position-embeddings 32 is below --seq-length 64"),
    (["--bf16", "--params-dtype", "float32"], "--bf16 sets --params-dtype bfloat16, but --params-dtype float32"),
    (["--disable-bias-linear", "--add-bias-linear"], "--disable-bias-linear sets --add-bias-linear False, but"),
])
def test_a_contradiction_is_one_line_naming_both_flags(flags, message):
    with pytest.raises(ValueError) as e:
        parse_args(flags)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_group_query_attention_takes_the_query_groups_of_the_config_file():
    assert parse_args(["--config", LLAMA, "--group-query-attention"]).num_query_groups == 2

"""The Llama-style model against megatron-core's own GPTModel with the same options (megatron-core 0.16.1, CPU, gloo).

megatron-core is built with Megatron-LM's Llama settings (local layer spec, ``normalization="RMSNorm"``,
``gated_linear_unit=True`` with ``activation_func=silu``, ``add_bias_linear=False``, ``num_query_groups``,
``position_embedding_type="rope"`` with ``rotary_base``, untied output layer) at TP 1 and TP 2, with random weights.
Its TP shards are gathered into full weights, converted to megacomp's names (fc1 with
megacomp.models.fc1_from_megatron; the QKV layout is the same) and loaded into megacomp's model on each rank: the
per-token losses, the logits and every gradient agree within fp32 round-off (tests/test_models_llama.py's ``close``:
assert_close's fp32 defaults with atol scaled by the reference's magnitude). This checks the RoPE convention, the
RMSNorm, the SwiGLU gate / up order and the grouped-query head mapping against Megatron's, not against megacomp's
own code.

megatron-core's CPU path needs three test-only shims in the rank processes: its rotary embedding moves its
frequencies to ``torch.cuda.current_device()`` (answered with "cpu"), its attention dropout forks the CUDA RNG
tracker (a no-op here: dropout is 0), and its default causal mask is made on CUDA (an explicit causal mask is given).
"""
import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_ranks
from test_models_llama import close

pytest.importorskip("megatron.core", reason="CI installs megatron-core==0.16.1 (scripts/install.sh test)")
warnings.filterwarnings("ignore", module="megatron")

from megacomp.config import ModelParallelConfig  # noqa: E402
from megacomp.models import fc1_from_megatron, llama_config  # noqa: E402
from megacomp.models.gpt import GPTModel  # noqa: E402
from megacomp.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402

S, B, H, HEADS, GROUPS, FFN, V, LAYERS, BASE = 8, 2, 32, 4, 2, 48, 64, 2, 500000


def _megatron_model(tp):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import TransformerConfig

    torch.cuda.current_device = lambda: "cpu"  # shims (module docstring); this forked rank process only
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS,
                            ffn_hidden_size=FFN, normalization="RMSNorm", layernorm_epsilon=1e-5,
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
                            attention_dropout=0.0,
                            tensor_model_parallel_size=tp, use_cpu_initialization=True, bias_dropout_fusion=False,
                            apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                            gradient_accumulation_fusion=False)
    model = MegatronGPT(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=V, max_sequence_length=S,
                        position_embedding_type="rope", rotary_base=BASE, share_embeddings_and_output_weights=False)
    with torch.no_grad():  # random weights: a TP shard from (name, rank), a replicated parameter from its name
        for i, (name, p) in enumerate(model.named_parameters()):
            sharded = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(1000 * i + (ps.get_tensor_model_parallel_rank() if sharded else 0))
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if name.endswith("layernorm.weight") else 0.0))
    return model, ps


def _full(t, param, tp, group):
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def _to_megacomp(name, full, tp):
    """megatron name and full tensor -> megacomp name and tensor."""
    n = name.replace("embedding.word_embeddings", "word_embeddings").replace("decoder.final_layernorm", "final_norm")
    n = n.replace("decoder.layers.", "layers.").replace("input_layernorm", "ln1").replace("pre_mlp_layernorm", "ln2")
    n = n.replace("self_attention.linear_qkv", "attention.qkv").replace("self_attention.linear_proj", "attention.proj")
    n = n.replace("mlp.linear_fc2", "mlp.fc2")
    if "mlp.linear_fc1" in n:
        return n.replace("mlp.linear_fc1", "mlp.fc1"), fc1_from_megatron(full, tp)
    return n, full


def _body(rank, world, tp):
    meg, ps = _megatron_model(tp)
    group = ps.get_tensor_model_parallel_group()
    r = ps.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen)
    pos, mask = torch.arange(S).expand(B, S), torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    meg_logits = meg(ids, pos, mask)  # [b, s, V / tp]
    meg_loss = meg(ids, pos, mask, labels=labels)  # per token [b, s]
    meg_loss.sum().backward()

    solo = [dist.new_group([q]) for q in range(world)][rank]
    ours = GPTModel(llama_config(hidden_size=H, num_attention_heads=HEADS, num_query_groups=GROUPS, ffn_hidden_size=FFN,
                                 num_layers=LAYERS, vocab_size=V, max_seq_length=S, rotary_base=BASE),
                    ModelParallelConfig(), tp_group=solo)
    params = dict(ours.named_parameters())
    grads = {}
    with torch.no_grad():
        for name, p in meg.named_parameters():
            n, w = _to_megacomp(name, _full(p, p, tp, group), tp)
            params.pop(n).copy_(w)
            grads[n] = _to_megacomp(name, _full(p.grad, p, tp, group), tp)[1]
    assert not params, f"megacomp parameters megatron has no counterpart for: {sorted(params)}"
    logits = ours(ids)  # [s, b, V]
    close(logits.transpose(0, 1)[..., r * V // tp:(r + 1) * V // tp], meg_logits, "logits")
    losses = vocab_parallel_cross_entropy(logits, labels.t().contiguous(), tp_group=solo)  # [s, b]
    close(losses.t(), meg_loss, "per-token loss")
    losses.sum().backward()
    for n, p in ours.named_parameters():
        close(p.grad, grads[n], n)
    ps.destroy_model_parallel()
    return True


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_matches_megatron_core(tp):
    assert all(run_ranks(_body, tp, tp, timeout=240))

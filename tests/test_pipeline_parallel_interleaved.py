"""Interleaved 1F1B (virtual pipeline stages) vs the non-interleaved schedule and the unsplit model.

- Compression off, PP2 x VP2, PP4 x VP2, and TP2 x PP2 x VP2 and TP2 x PP4 x VP2 with sequence parallelism: per-micro-batch
  losses and every parameter's gradient are bit-identical to the non-interleaved schedule's (same layers,
  same micro-batch order per parameter), and equal the unsplit model's within fp32 round-off; the
  forward-only path gives the same losses and leaves no gradients.
- Compressed (int8 activations, int8 + error feedback gradients): the run completes and the gradient
  error-feedback state holds one key per virtual boundary and micro-batch.
- Megatron's rules: micro-batches not a multiple of the stages, one chunk, layers that do not split into
  virtual stages, are refused with the fix in the message.
"""
import pytest
import torch

from distributed import run_ranks
from megacomp import parallel_state
from megacomp.config import CommCompressionConfig, ModelParallelConfig
from megacomp.models.chunks import GPTChunks, layers_per_virtual_stage_to_chunks
from megacomp.models.gpt import GPTConfig, GPTModel, split_layers, sync_tied_embedding_grads
from megacomp.pipeline_parallel import (PipelineCommunicator, check_interleaving,
                                        forward_backward_pipelining_with_interleaving,
                                        forward_backward_pipelining_without_interleaving)
from megacomp.tensor_parallel import allreduce_sequence_parallel_gradients

CFG = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_layers=8, max_seq_length=16, seed=11)
S, B = 16, 2


def micro_batch(k, dp_rank=0):
    g = torch.Generator().manual_seed(1000 * dp_rank + k)
    toks = torch.randint(0, CFG["vocab_size"], (B, S + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def emb_group_of(groups, tp, pp):
    import torch.distributed as dist
    found = None
    for ranks in parallel_state.rank_grid(dist.get_world_size(), tp, pp)[2]:
        g = dist.new_group([ranks[0], ranks[-1]])  # every rank creates every group
        if tuple(ranks) == tuple(groups.pp_ranks):
            found = g
    return found


def global_grads(chunks, layer_ranges, tp_rank):
    """{(tp rank, name in the unsplit model): gradient} of this stage's parameters."""
    out = {}
    for model, lr in zip(chunks, layer_ranges):
        for name, p in model.named_parameters():
            if name.startswith("layers."):
                j = int(name.split(".")[1])
                name = f"layers.{lr[j]}." + name.split(".", 2)[2]
            out[(tp_rank, name)] = p.grad.clone()
    return out


def _body(rank, world, tp, pp, sp, M, compressed, batched=False):
    groups = parallel_state.initialize_model_parallel(tp, pp)
    emb = emb_group_of(groups, tp, pp)
    comp = (CommCompressionConfig(pp_activation="int8", pp_gradient="int8", pp_gradient_error_feedback="ef",
                                  min_compress_numel=0)
            if compressed else CommCompressionConfig())
    mpc = ModelParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                              compression=comp)
    cfg = GPTConfig(**CFG)
    r, shape = groups.pp_rank, (S // tp if sp else S, B, CFG["hidden_size"])

    def finish(models):
        for m in models:
            if m.pre_process or m.post_process:
                sync_tied_embedding_grads(m, emb)
        allreduce_sequence_parallel_gradients([p for m in models for p in m.parameters()], groups.tp)

    # interleaved: 2 chunks per stage
    inter = GPTChunks(cfg, mpc, pp_size=pp, pp_rank=r, num_chunks=2)
    comm_i = PipelineCommunicator(groups.pp_ranks, comp, batched_p2p=batched)

    def fwd_i(x, k, v):
        m = inter.chunks[v]
        ids, labels = micro_batch(k, groups.dp_rank)
        inp = ids if m.pre_process else x
        return m(inp, labels) if m.post_process else m(inp)
    losses_i = forward_backward_pipelining_with_interleaving(
        stage_forward=fwd_i, num_microbatches=M, communicator=comm_i, activation_shape=shape, num_model_chunks=2,
        models=list(inter.chunks))
    finish(list(inter.chunks))  # the tied pair: chunk 0 of the first stage, the last chunk of the last stage
    grads_i = global_grads(inter.chunks, inter.layer_ranges, groups.tp_rank)
    if compressed:
        return losses_i, sorted(comm_i.error_feedback.keys())
    # forward-only gives the same losses and no gradients
    inter.zero_grad(set_to_none=True)
    eval_i = forward_backward_pipelining_with_interleaving(
        stage_forward=fwd_i, num_microbatches=M, communicator=comm_i, activation_shape=shape, num_model_chunks=2,
        forward_only=True)
    assert eval_i == losses_i and all(p.grad is None for p in inter.parameters())

    # non-interleaved on the same ranks
    plain = GPTModel(cfg, mpc, pre_process=r == 0, post_process=r == pp - 1, layer_range=split_layers(8, pp, r))
    comm_p = PipelineCommunicator(groups.pp_ranks, comp)

    def fwd_p(x, k):
        ids, labels = micro_batch(k, groups.dp_rank)
        inp = ids if plain.pre_process else x
        return plain(inp, labels) if plain.post_process else plain(inp)
    losses_p = forward_backward_pipelining_without_interleaving(
        stage_forward=fwd_p, num_microbatches=M, communicator=comm_p, activation_shape=shape)
    finish([plain])
    grads_p = global_grads([plain], [plain.layer_range], groups.tp_rank)
    # the unsplit model on one process (compared under TP 1)
    import torch.distributed as dist
    solo = [dist.new_group([k]) for k in range(world)][rank]
    ref = GPTModel(cfg, ModelParallelConfig(), tp_group=solo)
    ref_losses = []
    for k in range(M):
        loss = ref(*micro_batch(k, groups.dp_rank))
        (loss / M).backward()
        ref_losses.append(loss.item())
    ref_grads = {n: p.grad for n, p in ref.named_parameters()} if tp == 1 and rank == 0 else None
    parallel_state.destroy_model_parallel()
    return losses_i, losses_p, grads_i, grads_p, ref_losses, ref_grads


@pytest.mark.parametrize("world,tp,pp,sp,M,batched", [(2, 1, 2, False, 4, False), (2, 1, 2, False, 2, False),
                                                      (4, 1, 4, False, 8, False), (4, 1, 4, False, 8, True),
                                                      (4, 2, 2, True, 4, False), (8, 2, 4, True, 8, False)],
                         ids=["pp2xvp2", "pp2xvp2-all-warmup", "pp4xvp2", "pp4xvp2-batched", "tp2xpp2xvp2-sp",
                              "tp2xpp4xvp2-sp"])
def test_interleaved_equals_non_interleaved_and_unsplit(world, tp, pp, sp, M, batched):
    results = run_ranks(_body, world, tp, pp, sp, M, False, batched)
    last = [res for res in results if res[0]]
    assert last and all(res[0] == res[1] for res in last), "losses differ from the non-interleaved schedule"
    gi, gp = {}, {}
    for _, _, a, b, _, _ in results:
        for k, v in a.items():
            if k[1] != "output_weight":
                gi[k] = v
        for k, v in b.items():
            if k[1] != "output_weight":
                gp[k] = v
    assert gi.keys() == gp.keys()
    for k in gi:
        assert torch.equal(gi[k], gp[k]), f"{k}: interleaved gradient differs from the non-interleaved one"
    ref_losses, ref_grads = results[0][4], results[0][5]
    torch.testing.assert_close(torch.tensor(last[0][0]), torch.tensor(ref_losses))
    if ref_grads is not None:
        for (_, name), g in gi.items():
            torch.testing.assert_close(g, ref_grads[name], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("batched", [False, True], ids=["p2p", "batched"])
def test_compressed_interleaved_runs_with_one_error_key_per_virtual_boundary(batched):
    results = run_ranks(_body, 2, 1, 2, False, 4, True, batched)
    losses = results[1][0]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    # stage 0 sends back from virtual stage 2 (chunk 1), stage 1 from virtual stages 1 and 3
    assert results[0][1] == [f"pp_gradient/s2->s1/mb{k}" for k in range(4)]
    assert results[1][1] == sorted(f"pp_gradient/s{v}->s{v - 1}/mb{k}" for v in (1, 3) for k in range(4))


def test_megatron_rules_are_enforced():
    with pytest.raises(ValueError, match="multiple of the pipeline"):
        check_interleaving(6, 4, 2)
    with pytest.raises(ValueError, match="at least 2 pipeline stages"):
        check_interleaving(4, 2, 1)
    with pytest.raises(ValueError, match="divisible by pipeline size"):
        layers_per_virtual_stage_to_chunks(8, 2, 3)
    with pytest.raises(ValueError, match="one chunk"):
        layers_per_virtual_stage_to_chunks(8, 2, 4)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size >= 2"):
        layers_per_virtual_stage_to_chunks(8, 1, 2)
    assert layers_per_virtual_stage_to_chunks(8, 2, 2) == 2 and layers_per_virtual_stage_to_chunks(8, 4, 1) == 2

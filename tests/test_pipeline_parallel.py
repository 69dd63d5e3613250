"""1F1B pipeline of a GPT split into stages vs the unsplit model (megacomp.pipeline_parallel).

- Compression off: PP 2 and 4 (and PP 2 x TP 2, with sequence parallelism) give the unsplit model's
  per-micro-batch losses and gradients (fp32 tolerance), and are bit-identical to the same schedule on
  plain torch.distributed p2p, and to the batched (batch_isend_irecv, the NCCL path) exchange.
- Errors: mismatched activation shapes between stages raise on both sides; more stages than layers
  raise; a dead rank makes its neighbour fail within the process-group timeout.
"""
import os

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from megacomp import parallel_state
from megacomp.comm import p2p as comm_p2p
from megacomp.config import CommCompressionConfig, ModelParallelConfig
from megacomp.models.gpt import GPTConfig, GPTModel, split_layers, sync_tied_embedding_grads
from megacomp.pipeline_parallel import PipelineCommunicator, forward_backward_pipelining_without_interleaving
from megacomp.tensor_parallel import allreduce_sequence_parallel_gradients

CFG = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_layers=4, max_seq_length=16, seed=7)
S, B, M = 16, 2, 4


def micro_batch(k, dp_rank=0):
    g = torch.Generator().manual_seed(100 * dp_rank + k)
    toks = torch.randint(0, CFG["vocab_size"], (B, S + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def build_stage(tp, pp, sp, compression=None):
    groups = parallel_state.initialize_model_parallel(tp, pp)
    world = dist.get_world_size()
    # embedding groups (first and last stage of every pipeline) and one-rank groups, created by all ranks
    emb_groups = {}
    for ranks in parallel_state.rank_grid(world, tp, pp)[2]:
        g = dist.new_group([ranks[0], ranks[-1]]) if len(ranks) > 1 else None
        emb_groups[tuple(ranks)] = g
    solo = [dist.new_group([r]) for r in range(world)][dist.get_rank()]
    stage = groups.pp_rank
    mpc = ModelParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                              compression=compression or CommCompressionConfig())
    cfg = GPTConfig(**CFG)
    model = GPTModel(cfg, mpc, pre_process=stage == 0, post_process=stage == pp - 1,
                     layer_range=split_layers(cfg.num_layers, pp, stage))
    return groups, model, emb_groups[tuple(groups.pp_ranks)], solo, cfg


def run_pipeline(groups, model, emb_group, tp, sp, compression=None, steps=1, batched=None):
    comm_ = PipelineCommunicator(groups.pp_ranks, compression, batched_p2p=batched)
    d = groups.dp_rank

    def stage_forward(x, k):
        ids, labels = micro_batch(k, d)
        inp = ids if model.pre_process else x
        return model(inp, labels) if model.post_process else model(inp)

    shape = (S // tp if sp else S, B, CFG["hidden_size"])
    all_losses = []
    for _ in range(steps):
        model.zero_grad()
        all_losses.append(forward_backward_pipelining_without_interleaving(
            stage_forward=stage_forward, num_microbatches=M, communicator=comm_, activation_shape=shape))
    sync_tied_embedding_grads(model, emb_group)
    allreduce_sequence_parallel_gradients(model.parameters(), groups.tp)
    return all_losses[-1], {n: p.grad.clone() for n, p in model.named_parameters()}


def plain_p2p_shim():
    """The pipeline's message preparation as plain torch.distributed tensors: each message is the tensor itself,
    received straight into the output (the channels must be uncompressed)."""
    def prepare_isend(ch, t, dst, *args, **_):
        assert not ch.lossy
        return [t], lambda: None

    def prepare_irecv(ch, out, src, *args, **_):
        assert not ch.lossy
        return [out], lambda works: [w.wait() for w in works]
    return {"prepare_isend": prepare_isend, "prepare_irecv": prepare_irecv}


def _pipeline_body(rank, world, tp, pp, sp):
    groups, model, emb_group, solo, cfg = build_stage(tp, pp, sp)
    losses, grads = run_pipeline(groups, model, emb_group, tp, sp)
    real = {n: getattr(comm_p2p, n) for n in ("prepare_isend", "prepare_irecv")}
    for n, f in plain_p2p_shim().items():
        setattr(comm_p2p, n, f)
    try:
        plain_losses, plain_grads = run_pipeline(groups, model, emb_group, tp, sp)
    finally:
        for n, f in real.items():
            setattr(comm_p2p, n, f)
    assert losses == plain_losses and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    # batch_isend_irecv (the NCCL path) gives the same numbers on gloo
    b_losses, b_grads = run_pipeline(groups, model, emb_group, tp, sp, batched=True)
    assert losses == b_losses and all(torch.equal(grads[n], b_grads[n]) for n in grads)
    # the unsplit single-device model on the same micro-batches
    ref = GPTModel(cfg, ModelParallelConfig(), tp_group=solo)
    ref_losses = []
    for k in range(M):
        loss = ref(*micro_batch(k, groups.dp_rank))
        (loss / M).backward()
        ref_losses.append(loss.item())
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        ref_name = name.replace("output_weight", "word_embeddings.weight")
        if name.startswith("layers."):
            j = int(name.split(".")[1])
            ref_name = f"layers.{model.layer_range[j]}." + name.split(".", 2)[2]
        want = ref_params[ref_name].grad
        if getattr(p, "tensor_model_parallel", False):
            want = want.chunk(tp, dim=p.partition_dim)[groups.tp_rank]
        torch.testing.assert_close(grads[name], want, msg=lambda m: f"{name}: {m}")
    if model.post_process:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    # the forward-only path (evaluation) gives the same losses and leaves no gradients behind
    model.zero_grad()

    def stage_forward(x, k):
        ids, labels = micro_batch(k, groups.dp_rank)
        inp = ids if model.pre_process else x
        return model(inp, labels) if model.post_process else model(inp)
    shape = (S // tp if sp else S, B, CFG["hidden_size"])
    eval_losses = forward_backward_pipelining_without_interleaving(
        stage_forward=stage_forward, num_microbatches=M, communicator=PipelineCommunicator(groups.pp_ranks),
        activation_shape=shape, forward_only=True)
    if model.post_process:
        torch.testing.assert_close(torch.tensor(eval_losses), torch.tensor(ref_losses))
    assert all(p.grad is None for p in model.parameters())
    parallel_state.destroy_model_parallel()
    return len(grads)


@pytest.mark.parametrize("world,tp,pp,sp", [(2, 1, 2, False), (4, 1, 4, False), (4, 2, 2, False), (4, 2, 2, True)],
                         ids=["pp2", "pp4", "pp2xtp2", "pp2xtp2-sp"])
def test_pipeline_matches_unsplit_model_and_plain_p2p(world, tp, pp, sp):
    assert all(n > 0 for n in run_ranks(_pipeline_body, world, tp, pp, sp))


def _mismatch_body(rank, world):
    groups = parallel_state.initialize_model_parallel(1, 2)
    c = PipelineCommunicator(groups.pp_ranks)
    shape = (16, 2, 32) if rank == 0 else (16, 4, 32)
    try:
        c.handshake(shape, torch.float32)
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatched_stage_shapes_raise_on_both_stages():
    sender, receiver = run_ranks(_mismatch_body, 2)
    assert "stages 0 and 1 disagree" in receiver and "sends shape (16, 2, 32)" in receiver
    assert "stage 1 expects a different activation shape" in sender


def _schedule_errors_body(rank, world):
    groups = parallel_state.initialize_model_parallel(1, 2)
    c = PipelineCommunicator(groups.pp_ranks)
    msgs = []
    for kwargs in (dict(num_microbatches=3), dict(num_microbatches=2, model=torch.nn.Identity())):
        try:
            forward_backward_pipelining_without_interleaving(stage_forward=lambda x, k: x, communicator=c,
                                                             activation_shape=(2, 2), **kwargs)
        except ValueError as e:
            msgs.append(str(e))
    parallel_state.destroy_model_parallel()
    return msgs


def test_uneven_micro_batches_and_empty_stages_are_refused():
    for msgs in run_ranks(_schedule_errors_body, 2):
        assert "num_microbatches (3) must be a positive multiple of the pipeline stages (2)" in msgs[0]
        assert "has no trainable parameters" in msgs[1]


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        split_layers(2, 4, 0)
    assert [list(split_layers(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]


def _dead_rank_body(rank, world):
    groups, model, emb_group, solo, cfg = build_stage(1, 2, False)
    if rank == 1:
        os._exit(3)  # the last stage dies before the first message
    import time
    t0 = time.monotonic()
    try:
        run_pipeline(groups, model, emb_group, 1, False)
    except Exception as e:  # gloo reports the closed connection (or the timeout)
        return time.monotonic() - t0, type(e).__name__
    return None


def test_dead_rank_makes_the_neighbour_fail_fast():
    from distributed import RankFailure
    with pytest.raises(RankFailure) as info:
        run_ranks(_dead_rank_body, 2, timeout=60, pg_timeout=20)
    assert "rank 1 exited with code 3" in str(info.value)
    elapsed, error = info.value.results[0]  # rank 0 raised, well within the 20 s process-group timeout
    assert elapsed < 20, (elapsed, error)

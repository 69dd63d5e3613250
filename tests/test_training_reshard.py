"""Resuming a checkpoint at another TP x PP x DP layout (megacomp.training.reshard), in real gloo runs.

A source run (TP 2 x DP 2, or PP 2 x DP 2, on 4 ranks; the tiny config for 5 iterations) stops at iteration 3
with a checkpoint. Each case resumes it at another layout and checks:
* the state moved exactly: the global model, fp32 masters and Adam moments assembled from every rank of the
  resumed run equal, bit for bit, those of the source run at the checkpoint;
* the loss curve continues: the resumed run's losses at iterations 4 and 5 lie within the round-off envelope of
  the layouts, i.e. no farther from the uninterrupted run at the new layout (from the same initial parameters:
  the initialisation does not depend on the layout) than that run is from the uninterrupted source-layout run
  (same-layout resume, bit-identical to it) at any iteration, or than four roundings of the fp32 loss. Two
  layouts sum in different orders, so their losses differ by round-off that the steps carry on; a resume that
  moved anything wrongly is off by orders of magnitude more (the losses change by ~0.07 per iteration here).
With compression (loco4: int4 DP gradients with LoCo error feedback), DP 2 -> 4 resumes every DP rank from the
mean of the saved residuals: the residual sum divided by the DP size, which the next reduction owes, is kept; the
int4 blocks then cover other buckets, so the losses differ by the codec's error, and the check is that the curve
continues (within one iteration's mean progress).
"""
import dataclasses
import json
import os
from dataclasses import replace

import pytest
import torch

from distributed import RankFailure, run_ranks
from megacomp.training import Trainer
from megacomp.training.checkpoint import check_compatible, FORMAT_VERSION
from megacomp.training.reshard import global_names

ITERS, SAVE_AT = 5, 3


def _global_state(trainer) -> list:
    """This rank's pieces of the global state: (kind, global name, split dim, tp rank, tp size, local shape,
    start in the local flat, values), for the model and the optimizer's masters, moments and DP residuals."""
    g, opt, model = trainer.groups, trainer.optimizer, trainer.model
    names = global_names(model)
    local_of = {id(p): n for n, p in model.named_parameters()}
    out = []
    if g.dp_rank == 0:
        for n, p in model.named_parameters():
            glob, dim = names[n]
            out.append(("model", glob, dim, g.tp_rank, g.tp_size, tuple(p.shape), 0, p.detach().reshape(-1).clone()))
    for b, m in zip(opt.buckets, opt.masters):
        lo, hi = b.shard_range(opt.shard_index, opt.parts)
        kinds = {"master": m.detach()}
        kinds.update({k: v for k, v in opt.optimizer.state[m].items() if torch.is_tensor(v) and v.dim() == 1})
        for kind, flat in kinds.items():
            for p, off in zip(b.params, b.offsets):
                a, z = max(off, lo), min(off + p.numel(), hi)
                if a < z:
                    glob, dim = names[local_of[id(p)]]
                    out.append((kind, glob, dim, g.tp_rank, g.tp_size, tuple(p.shape), a - off,
                                flat[a - lo:z - lo].clone()))
        if opt.ef is not None and b.compressed:  # the residual over the whole bucket, per DP rank: summed here
            e = _bucket_residual(opt, b)
            for p, off in zip(b.params, b.offsets):
                glob, dim = names[local_of[id(p)]]
                vals = e[off:off + p.numel()].clone() if e is not None else torch.zeros(p.numel())
                out.append((f"residual/dp{g.dp_size}", glob, dim, g.tp_rank, g.tp_size, tuple(p.shape), 0,
                            vals / g.dp_size))
    return out


def _bucket_residual(opt, b):
    """This rank's DP-gradient residual of bucket ``b`` over the whole bucket (None: none yet): a flat exchange's as
    kept; a hop-by-hop exchange's every lossy hop's, each added at the chunks it covers (torch's order)."""
    ch = opt.grad_channel
    if getattr(ch, "hierarchy", None) is None:
        return opt.ef.error(f"dp_gradient/b{b.index}/worker")
    chunk, out = b.padded // opt.world, torch.zeros(b.padded)
    for link, codec in ch.hop_codecs.items():
        e = None if codec.is_identity else opt.ef.error(ch.residual_key(f"dp_gradient/b{b.index}", link))
        if e is not None:
            for k, g in enumerate(ch.residual_chunks(link)[0]):
                out[g * chunk:(g + 1) * chunk] += e[k * chunk:(k + 1) * chunk]
    return out


def _assemble(pieces: list) -> dict:
    """{(kind, global name): global tensor} from every rank's pieces (residual pieces are summed over DP)."""
    local: dict = {}
    for kind, glob, dim, tp, tps, shape, start, vals in pieces:
        key = (kind, glob)
        flat = local.setdefault(key, {}).setdefault(tp, (dim, shape, torch.zeros(torch.Size(shape).numel(),
                                                                                dtype=vals.dtype)))[2]
        if kind.startswith("residual"):
            flat[start:start + vals.numel()] += vals
        else:
            flat[start:start + vals.numel()] = vals
    out = {}
    for key, by_tp in local.items():
        parts = [by_tp[t] for t in sorted(by_tp)]
        dim = parts[0][0]
        tensors = [f.view(shape) for _, shape, f in parts]
        out[key] = tensors[0] if dim is None else torch.cat(tensors, dim=dim)
    return out


def _run(rank, world, cfg, state_at_start):
    trainer = Trainer(cfg)
    try:
        start = _global_state(trainer) if state_at_start else None
        losses = [h["loss"] for h in trainer.train()]
        return losses, (start if state_at_start else _global_state(trainer)), trainer.resumed
    finally:
        trainer.close()


def _gather(results) -> dict:
    return _assemble([piece for _, pieces, _ in results for piece in pieces])


def _source(cfg, world, root):
    """(losses 1..5 of the uninterrupted source run, global state at the checkpoint of iteration 3)."""
    first = run_ranks(_run, world, replace(cfg, save=str(root), save_interval=SAVE_AT, exit_interval=SAVE_AT), False)
    rest = run_ranks(_run, world, replace(cfg, load=str(root)), False)
    return first[0][0] + rest[0][0], _gather(first)


@pytest.fixture(scope="module")
def base(tiny_config):
    return replace(tiny_config, train_iters=ITERS)


@pytest.fixture(scope="module")
def tp2(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2") / "ckpt"
    return (*_source(replace(base, tensor_model_parallel_size=2), 4, root), root)


def _check_resume(cfg, world, root, source_losses, source_state, kinds=("model", "master", "exp_avg", "exp_avg_sq"),
                  lossy=False):
    """Resume ``root`` at ``cfg``'s layout on ``world`` ranks; check the state and the losses (see the module
    docstring; ``lossy``: a codec quantizes other buckets at the new layout, so the losses may differ by the codec's
    error rather than round-off: they must then stay within one iteration's mean progress of the uninterrupted run
    at the new layout, which a resume that lost or misplaced state does not). Returns (resumed losses,
    uninterrupted losses, resumed global state)."""
    resumed = run_ranks(_run, world, replace(cfg, load=str(root)), True)
    assert all(r[2] for r in resumed)
    state = _gather(resumed)
    for key, value in source_state.items():
        if key[0] in kinds:
            assert torch.equal(state[key], value), key  # moved bit for bit
    straight = run_ranks(_run, world, cfg, False)[0][0]  # uninterrupted at the new layout, same initial parameters
    got = resumed[0][0]
    assert len(got) == ITERS - SAVE_AT
    # the layouts' own distance, and at least a few roundings of the fp32 loss: weights that differ in their last bits
    # (the layouts' sums) can leave the losses of the uninterrupted runs equal while a resumed one moves by an ulp
    rounding = 4 * torch.finfo(torch.float32).eps * max(abs(x) for x in straight)
    envelope = max(rounding, *(abs(a - b) for a, b in zip(source_losses, straight)))
    if lossy:
        envelope = sum(abs(a - b) for a, b in zip(straight, straight[1:])) / (len(straight) - 1)
    for i, loss in enumerate(got, start=SAVE_AT):
        assert abs(loss - straight[i]) <= envelope, (i, loss, straight[i], envelope)
    return got, straight, state


@pytest.mark.slow
@pytest.mark.parametrize("layout,world", [({}, 4), ({}, 2)], ids=["tp2dp2-to-dp4", "tp2dp2-to-tp1-on-2-ranks"])
def test_resume_at_another_tp_and_dp(base, tp2, layout, world):
    losses, state, root = tp2
    _check_resume(replace(base, **layout), world, root, losses, state)


@pytest.mark.slow
def test_resume_pp2_at_pp1(base, tmp_path):
    cfg = replace(base, pipeline_model_parallel_size=2)
    losses, state = _source(cfg, 4, tmp_path / "ckpt")
    _check_resume(base, 2, tmp_path / "ckpt", losses, state)


def test_mismatch_names_only_the_differing_fields():
    saved = {"format_version": FORMAT_VERSION, "hidden_size": 32, "seed": 1,
             "compression_resolved": {"dp_gradient": {"name": "int4", "block_size": 128}, "tp_forward": None}}
    mine = {**saved, "compression_resolved": {"dp_gradient": {"name": "int8", "block_size": 128}, "tp_forward": None}}
    with pytest.raises(ValueError) as info:
        check_compatible(saved, mine, "ck/iter_0000003")
    text = str(info.value)
    assert "compression_resolved.dp_gradient.name: checkpoint 'int4' vs this run 'int8'" in text
    assert "block_size" not in text and "tp_forward" not in text and "\n" not in text
    with pytest.raises(ValueError, match=r"another data order \(seed: checkpoint 1 vs this run 2\).*"
                                         r"--allow-data-order-change"):
        check_compatible(saved, {**saved, "seed": 2}, "ck/iter_0000003")
    check_compatible(saved, {**saved, "seed": 2, "allow_data_order_change": True}, "ck/iter_0000003")
    check_compatible(saved, {**saved, "tensor_model_parallel_size": 2, "world_size": 8}, "ck")  # resharded


@pytest.mark.slow
def test_finetune_from_another_layout(base, tp2):
    _, state, root = tp2
    tuned = run_ranks(_run, 2, replace(base, load=str(root), finetune=True, train_iters=1), True)
    assert not any(r[2] for r in tuned)  # iteration 0: a fine-tuning run, not a resume
    got = _gather(tuned)
    for key, value in state.items():
        if key[0] == "model":
            assert torch.equal(got[key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("source,resumed", [({"tensor_model_parallel_size": 2}, {}),
                                             ({"tensor_model_parallel_size": 2}, {"ranks_per_node": 2}),
                                             ({"ranks_per_node": 2}, {"tensor_model_parallel_size": 2})],
                         ids=["flat-tp2dp2-to-dp4", "flat-tp2dp2-to-hops-dp4", "hops-dp4-to-flat-tp2dp2"])
def test_error_feedback_residuals_keep_their_sum_at_another_dp_size(base, tmp_path, source, resumed):
    """``ranks_per_node=2``: 2 nodes x 2 ranks, where DP 4 runs hop by hop (its residuals on the inter-node hop,
    per node's chunk) and TP 2 x DP 2 flat (each DP group has one rank per node)."""
    cfg = replace(base, compression="loco4")
    losses, state = _source(replace(cfg, **source), 4, tmp_path / "ckpt")
    _, _, resumed_state = _check_resume(replace(cfg, **resumed), 4, tmp_path / "ckpt", losses, state, lossy=True)
    old_dp = 4 // source.get("tensor_model_parallel_size", 1)
    new_dp = 4 // resumed.get("tensor_model_parallel_size", 1)
    saved = {k[1]: v for k, v in state.items() if k[0] == f"residual/dp{old_dp}"}
    assert saved and any(v.abs().max() > 0 for v in saved.values())  # the codec left residuals to move
    for glob, before in saved.items():
        after = resumed_state[(f"residual/dp{new_dp}", glob)]  # sum over the new DP ranks (and hops) of e / DP
        # each new residual is the saved ranks' sum scaled once (one rounding each), and both sides sum at most four
        # terms in fp32 (<= 3 roundings of values up to DP max|e|): 8 eps DP max|e| covers them all
        bound = 8 * max(old_dp, new_dp) * torch.finfo(torch.float32).eps * before.abs().max().item()
        assert (after - before).abs().max().item() <= bound, glob

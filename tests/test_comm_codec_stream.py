"""megacomp.comm.codec_stream: the ordering of a bucket's launch on the side stream (ready -> launch -> done ->
join), checked on CPU where the same steps run inline; and DistributedOptimizer(codec_stream=...) launching each
bucket during backward and joining it in step(), with the results of the run without it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megacomp.comm.codec_stream import CodecStream, JoinedWork

from distributed import run_ranks


def test_steps_in_order_and_misuse_refused():
    cs = CodecStream("cpu", record=True)
    assert not cs.active and cs.side is None
    ran = []
    with cs.launching("b0", keep=(torch.zeros(3), None)):
        ran.append("body b0")
    with cs.launching("b1"):
        ran.append("body b1")
    assert cs.pending() == ["b0", "b1"]
    with pytest.raises(RuntimeError, match="launched again"):
        with cs.launching("b0"):
            pass
    work = JoinedWork(cs, "b1", None)
    assert work.is_completed() and work.wait() and work.wait()  # a second wait joins once
    cs.join("b0")
    with pytest.raises(RuntimeError, match="never launched"):
        cs.join("b0")
    assert ran == ["body b0", "body b1"]
    assert cs.steps == [("ready", "b0"), ("launch", "b0"), ("done", "b0"), ("ready", "b1"), ("launch", "b1"),
                        ("done", "b1"), ("join", "b1"), ("join", "b0")]  # the refused launch left no step
    assert cs.pending() == []


def _train(rank, world, stage, use_stream):
    from megacomp.optimizer import DistributedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    cs = CodecStream("cpu", record=True) if use_stream else False
    opt = DistributedOptimizer(model.parameters(), torch.optim.AdamW, grad_codec="int8", error_feedback="ef",
                               min_compress_numel=0, bucket_size=4096, zero_stage=stage, codec_stream=cs,
                               max_grad_norm=1.0, lr=1e-2)
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(3):
        x = torch.randn(16, 64, generator=gen)
        model(x).square().mean().backward()
        if use_stream:
            cs.steps.append(("backward_end", ""))
        opt.step()
        if use_stream:
            cs.steps.append(("step_end", ""))
    return {"params": [p.detach().clone() for p in model.parameters()],
            "steps": cs.steps if use_stream else None, "buckets": len(opt.buckets)}


def _stream_vs_inline(rank, world, stage):
    return _train(rank, world, stage, True), _train(rank, world, stage, False)


@pytest.mark.parametrize("stage", [1, 2])
def test_buckets_launch_in_backward_join_in_step_and_results_unchanged(stage):
    for streamed, inline in run_ranks(_stream_vs_inline, 2, stage):
        for a, b in zip(streamed["params"], inline["params"]):
            assert torch.equal(a, b)
        steps, nb = streamed["steps"], streamed["buckets"]
        assert nb >= 2
        iterations, cur = [], []
        for s in steps:
            cur.append(s)
            if s[0] == "step_end":
                iterations.append(cur)
                cur = []
        assert len(iterations) == 3 and not cur
        for it in iterations:
            end = it.index(("backward_end", ""))
            for i in range(nb):
                tag = f"b{i}"
                mine = [k for k, (step, t) in enumerate(it) if t == tag]
                names = [it[k][0] for k in mine]
                assert names == ["ready", "launch", "done", "join"], (tag, it)  # one launch per step and bucket
                assert mine[2] < end, (tag, it)  # launched during backward
                if stage == 1:
                    assert end < mine[3], (tag, it)  # joined in step()
            if stage == 2:  # at most one in flight: a bucket is joined before the next one launches
                launches = [k for k, (step, _) in enumerate(it) if step == "launch"]
                joins = [k for k, (step, _) in enumerate(it) if step == "join"]
                assert all(j < nxt for j, nxt in zip(joins, launches[1:])), it

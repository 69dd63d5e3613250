"""Interleaved 1F1B pipeline schedule with virtual stages (Megatron's
forward_backward_pipelining_with_interleaving), on megacomp's compressed stage-to-stage channels.

Layout: P stages (ranks), V model chunks per stage, so P x V virtual stages; chunk v of stage s is virtual
stage ``v * P + s`` (megacomp.models.chunks.GPTChunks). An activation crosses a rank boundary at every
virtual-stage boundary, so the stages form a ring: stage P-1's chunk v feeds stage 0's chunk v + 1.

Order of work on every stage (M micro-batches, M a multiple of P; N = M x V forwards and as many backwards):
  forward k   runs chunk ``(k // P) % V`` on micro-batch ``(k // (P V)) P + k % P``: groups of P
              micro-batches go through chunk 0, then chunk 1, ...;
  backward k  the same micro-batch order through the chunks in reverse (chunk ``V - 1 - (k // P) % V``);
  warm-up     ``(P - s - 1) x 2 + (V - 1) x P`` forwards (all N when M == P), then 1F1B rounds of one
              forward and one backward, then the remaining backwards.
Each step posts its receives and sends together and waits for all of them (PipelineCommunicator.exchange);
which step receives what follows Megatron's schedule, so messages meet their receives without deadlock.
Received tensors are queued per chunk: a stage receives its activations (and gradients) in the order of
its own forwards (backwards) that need one, because every stage runs the same order.

Compared with the non-interleaved schedule the bubble shrinks from (P-1)/M to (P-1)/(V M) of an iteration
and the boundary crossings (the traffic megacomp compresses) grow V-fold. Each micro-batch meets the same
layers in the same order and each parameter accumulates its micro-batch gradients in the same order, so with
compression off the losses and gradients equal the non-interleaved schedule's bit for bit.

Data-parallel gradients: the backward of chunk c's last micro-batch runs outside ``no_sync`` (the others
inside), so that chunk's buckets can start reducing while the other chunks still compute.

Failure behaviour: ValueError when M is not a positive multiple of P, when there are fewer than two stages
or chunks (use the non-interleaved schedule), or when a chunk has no trainable parameters.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable, Optional, Sequence

import torch

from .communicator import PipelineCommunicator
from .schedules import _backward


def check_interleaving(num_microbatches: int, num_stages: int, num_model_chunks: int) -> None:
    """Megatron's rules for the interleaved schedule; raises ValueError naming the fix."""
    if num_model_chunks < 2 or num_stages < 2:
        raise ValueError(f"the interleaved schedule needs at least 2 pipeline stages and 2 model chunks per stage "
                         f"(got {num_stages} stages x {num_model_chunks} chunks); use the non-interleaved schedule")
    if num_microbatches < num_stages or num_microbatches % num_stages:
        raise ValueError(f"number of micro-batches ({num_microbatches}) is not a positive multiple of the pipeline "
                         f"stages ({num_stages}), which the interleaved schedule requires; choose global_batch_size "
                         f"= k * {num_stages} * micro_batch_size * data-parallel size")


def forward_backward_pipelining_with_interleaving(
        *, stage_forward: Callable[[Optional[torch.Tensor], int, int], torch.Tensor], num_microbatches: int,
        communicator: PipelineCommunicator, activation_shape: Sequence[int], num_model_chunks: int,
        dtype: torch.dtype = torch.float32, forward_only: bool = False,
        no_sync: Optional[Callable[[], contextlib.AbstractContextManager]] = None,
        models: Optional[Sequence[torch.nn.Module]] = None,
) -> list[float]:
    """Run one global batch through the interleaved pipeline; returns the micro-batch losses (in micro-batch
    order) on the last stage, [] elsewhere.

    ``stage_forward(input, k, chunk)``: chunk ``chunk`` of this stage on micro-batch ``k`` (``input`` is None
    for virtual stage 0, which reads its own data); the last virtual stage returns the micro-batch's loss.
    ``models``: this stage's chunks, each checked to hold trainable parameters. Other arguments as
    :func:`megacomp.pipeline_parallel.forward_backward_pipelining_without_interleaving`.
    """
    c, P, V, M = communicator, communicator.num_stages, num_model_chunks, num_microbatches
    check_interleaving(M, P, V)
    for v, m in enumerate(models or ()):
        if not any(p.requires_grad for p in m.parameters()):
            raise ValueError(f"model chunk {v} of pipeline stage {c.stage} (virtual stage {v * P + c.stage}) has no "
                             f"trainable parameters; give every virtual stage at least one layer")
    c.handshake(activation_shape, dtype)
    shape, r, N = tuple(activation_shape), c.stage, M * V

    def chunk_of(k: int, forward: bool) -> int:
        v = (k // P) % V
        return v if forward else V - 1 - v

    def microbatch_of(k: int) -> int:
        return (k // (P * V)) * P + k % P

    def first_virtual(v: int) -> bool:
        return r == 0 and v == 0

    def last_virtual(v: int) -> bool:
        return r == P - 1 and v == V - 1

    # the (chunk, micro-batch) each received tensor is for, in arrival order (see the module docstring)
    act_for = deque((chunk_of(k, True), microbatch_of(k)) for k in range(N) if not first_virtual(chunk_of(k, True)))
    grad_for = iter([chunk_of(k, False) for k in range(N) if not last_virtual(chunk_of(k, False))])
    inputs = [deque() for _ in range(V)]  # received activations not yet used by a forward
    grads = [deque() for _ in range(V)]  # received output gradients not yet used by a backward
    saved = [deque() for _ in range(V)]  # (input, output) of forwards whose backward is still to come
    losses: list[float] = []

    def queue(act, grad) -> None:
        if act is not None:
            inputs[act_for.popleft()[0]].append(act)
        if grad is not None:
            grads[next(grad_for)].append(grad)

    def incoming(wanted: bool) -> Optional[tuple]:
        """(boundary, micro-batch) of the next activation to receive, when one is wanted now."""
        if not wanted:
            return None
        v, mb = act_for[0]
        return v * P + r, mb

    def forward(k: int) -> Optional[tuple]:
        """Forward k; returns ``(output, boundary, micro-batch)`` to send (None from the last virtual stage)."""
        v, mb = chunk_of(k, True), microbatch_of(k)
        x = None if first_virtual(v) else inputs[v].popleft()
        if forward_only:
            with torch.no_grad():
                out = stage_forward(x, mb, v)
        else:
            out = stage_forward(x, mb, v)
        if last_virtual(v):
            losses.append((mb, out.detach().item()))
            out = out / M
        if not forward_only:
            saved[v].append((x, out))
        return None if last_virtual(v) else (out, v * P + r + 1, mb)

    sync_ctx = no_sync or contextlib.nullcontext

    def backward(k: int) -> Optional[tuple]:
        """Backward k; returns ``(input gradient, virtual stage, micro-batch)`` to send, or None."""
        v, mb = chunk_of(k, False), microbatch_of(k)
        x, out = saved[v].popleft()
        grad = None if last_virtual(v) else grads[v].popleft()
        with (contextlib.nullcontext() if mb == M - 1 else sync_ctx()):  # the chunk's last micro-batch reduces
            g = _backward(out, grad, x)
        return None if first_virtual(v) else (g, v * P + r, mb)

    all_warmup = forward_only or M == P
    warmup = N if all_warmup else min(N, (P - r - 1) * 2 + (V - 1) * P)
    remaining = N - warmup

    if not first_virtual(0):  # the first forward's input
        queue(c.exchange(shape, dtype, recv_prev=incoming(True))[0], None)
    for k in range(warmup):
        out = forward(k)
        recv_prev = k < N - 1 and not first_virtual(chunk_of(k + 1, True))
        recv_next = k == warmup - 1 and not all_warmup and r != P - 1  # the first backward's gradient
        queue(*c.exchange(shape, dtype, send_next=out, recv_prev=incoming(recv_prev), recv_next=recv_next))

    for i in range(remaining):
        fk, bk = warmup + i, i
        out = forward(fk)
        back = backward(bk)
        # what arrives now was sent P - 1 steps ago by the neighbour across the ring's seam
        if r == 0:
            recv_prev = chunk_of(fk - (P - 1), True) != V - 1
        else:
            recv_prev = True
        if r == P - 1:
            recv_next = chunk_of(bk - (P - 1), False) != 0
        else:
            recv_next = True
        recv_prev = recv_prev and i < remaining - 1
        queue(*c.exchange(shape, dtype, send_next=out, send_prev=back, recv_prev=incoming(recv_prev),
                          recv_next=recv_next))

    if not forward_only:
        if all_warmup and r != P - 1:
            queue(None, c.exchange(shape, dtype, recv_next=True)[1])
        for k in range(remaining, N):
            back = backward(k)
            recv_next = k < N - 1 and not (r == P - 1 and chunk_of(k + 1, False) == V - 1)
            queue(*c.exchange(shape, dtype, send_prev=back, recv_next=recv_next))
    return [loss for _, loss in sorted(losses)]

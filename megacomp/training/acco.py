"""ACCO inside pretraining (``--overlap-optimizer acco``; the algorithm is megacomp.optimizer.acco).

An iteration's M micro-batches run in two halves of M / 2 (each a whole number of 1F1B rounds under PP). After
each half the model-parallel gradient sums run as usual (tied embedding over the embedding group, sequence-parallel
norms over TP: megacomp.training.trainer's ``_finalize_grads``), on that half's gradients alone, since ACCO moves
every half's gradients out of the buckets; then half A ends with ``estimate`` and half B with ``step``. What the
iteration's record says: the loss of both halves (at θ̃_t and θ_t), and wire bytes of the jobs this iteration waited
for (the previous step's update and this step's estimate); ``skipped``/``grad_norm`` are the previous step's
update's, the one that finished during this iteration. The run's last iteration waits for its own update, and a run
stopped early books the update in flight into its last record (:func:`book_acco_tail`), so every byte is counted.
"""
from __future__ import annotations

from .metrics import gather_traffic


def acco_summary(num_microbatches: int, compensated: bool = True) -> str:
    """The start-up banner's line."""
    if not compensated:
        return ("DPU (ACCO without delay compensation): each step's gradient reduce-scatter, update and parameter "
                "all-gather run in a background thread during the next step, whose gradients are computed at the "
                "parameters before that update (one step stale); DistributedOptimizer's bytes, overlapped")
    half = num_microbatches // 2
    return (f"ACCO: {num_microbatches} micro-batches per iteration in two halves of {half}; each half's gradient "
            f"reduce-scatter, update and parameter all-gather run in a background thread while the other half "
            f"computes (an estimate from half A, the update from both halves): 2x the dp_gradient and dp_parameter "
            f"bytes of the step, overlapped")


def acco_halves(trainer, batches) -> tuple[list[float], bool]:
    """One iteration under ACCO: half A at the estimate while the previous update finishes, ``estimate``, half B at
    the parameters while the estimate is computed, ``step``. Returns the losses and whether the previous step's
    update stepped (the verdict on this step's update arrives with the next iteration). The last iteration of the run
    waits for its update, so every byte is booked; the trainer then leaves θ_T in the model (``finish``)."""
    acco, half, M = trainer.optimizer, len(batches) // 2, len(batches)
    if not acco.compensated:  # DPU: the whole step's gradients, applied one step late
        losses = trainer._forward_backward(batches)
        trainer._finalize_grads()
        acco.step()
        return losses, _last_iteration_waits(trainer, acco)
    pipelined = trainer.communicator is not None  # the 1F1B schedule divides each half's losses by M / 2
    losses = trainer._forward_backward(batches[:half])
    trainer._finalize_grads()
    acco.estimate(1.0 if pipelined else M / half)
    losses += trainer._forward_backward(batches[half:])
    trainer._finalize_grads()
    acco.step(half / M if pipelined else 1.0)
    return losses, _last_iteration_waits(trainer, acco)


def _last_iteration_waits(trainer, acco) -> bool:
    """The run's last iteration waits for its own update (its bytes go into this iteration's record) but keeps the
    estimate for the final checkpoint, so a resume with more iterations continues bit for bit; returns whether the
    update waited for last stepped."""
    if trainer.iteration + 1 == trainer.cfg.train_iters:
        with acco.synchronized():
            pass
    return acco.last_stepped is not False


def book_acco_tail(trainer, record: dict) -> None:
    """A run stopped before ``train_iters``: wait for the update in flight (the estimate stays for the checkpoint) and
    add its wire bytes to the last iteration's record and the run's totals, so the summary counts every byte. A
    collective (every rank stops at the same iteration)."""
    with trainer.optimizer.synchronized():  # waits for the update, whose bytes are booked at the wait
        pass
    for kind, (w, u) in gather_traffic().items():
        for table in (record["traffic"], trainer.totals.traffic):
            row = table.setdefault(kind, [0, 0])
            row[0] += w
            row[1] += u

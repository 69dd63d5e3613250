"""Rank bodies shared by the pretraining tests (each runs under distributed.run_ranks)."""
from megacomp.training import Trainer


def train_losses(rank, world, cfg):
    """Train ``cfg`` with megacomp's Trainer (closed after): (every iteration's loss of this run, its last
    iteration)."""
    trainer = Trainer(cfg)
    try:
        return [h["loss"] for h in trainer.train()], trainer.iteration
    finally:
        trainer.close()

"""The pretraining loop's checkpoint side: what a checkpoint records (the run's settings, the RNG, the channels' error
feedback, each family's state), the ``--save`` directory's lock, resuming (``--load``, ``--finetune``, a restarted
job's own ``--save``) and saving, as a base class of megacomp.training.trainer.Trainer.

Failure behaviour: a ``--save`` held by another live run, a file or an iteration directory, a ``--load`` that holds no
resumable checkpoint, or a checkpoint written with other settings or other family state raises ValueError with one
line (the same on every rank); a checkpoint whose files fail verification is refused naming the file, or skipped for
an older one with ``--load-fallback`` (megacomp.training.checkpoint.select_checkpoint).
"""
from __future__ import annotations

import atexit
import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from .checkpoint import latest_iteration, load_checkpoint, load_model_weights, save_checkpoint, select_checkpoint
from .checkpoint_integrity import SaveDirLock
from .checkpoint_paths import check_save_dir, prune_checkpoints, remove_partial_saves, resolve_load
from .features import FEATURES


class TrainerCheckpointing:
    """Saving and resuming for :class:`megacomp.training.trainer.Trainer` (which sets the attributes these read:
    cfg, model, optimizer, groups, channels, features, guard, evaluation, replica, device, world, lock, iteration,
    is_logger, compression_spec, gpt)."""

    def run_info(self) -> dict:
        """The run's configuration as recorded in megacomp.json (the fields a resume must match), under the flat
        names (checkpoints written before the configuration became a tree compare equal)."""
        info = {k: v for k, v in self.cfg.flat().items()}
        info["vocab_size"] = self.gpt.vocab_size
        # the error probe is a diagnostic: a resume may turn it on, off or change its interval
        info["compression_resolved"] = {k: v for k, v in self.compression_spec.to_dict().items()
                                        if k != "error_probe_interval"}
        info["world_size"] = self.world
        return info

    def _extra_state(self) -> dict:
        # the channels' error feedback (TP backward per layer, PP gradients per slot) and stochastic streams;
        # the DP gradient error lives in the optimizer's sharded state; each family's own under its key
        extra = {"rng": torch.get_rng_state(),
                 "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
                 "channels": self.channels.state_dict(skip_error_feedback=("dp_gradient",)),
                 "guard": self.guard.state_dict(),  # the lowest loss so far: a resumed run judges against it
                 "evaluation": self.evaluation.state_dict()}  # the validation losses so far
        extra.update({f.state_key: None for f in FEATURES if f.state_key})
        extra.update({f.state_key: f.state_dict() for f in self.features if f.state_key})
        return extra

    def _lock_save_dir(self, save: Optional[str]) -> tuple[Optional[SaveDirLock], Optional[str]]:
        """Rank 0 takes the lock of the ``--save`` directory (megacomp.training.checkpoint_integrity); every rank
        raises the same ValueError when another live run holds it. Returns (rank 0's lock, a banner line when a
        stale lock was taken over)."""
        if not save:
            return None, None
        lock, outcome = None, (None, None)
        if dist.get_rank() == 0:
            lock = SaveDirLock(save)
            try:
                check_save_dir(save)  # a file, or one iteration's checkpoint: one line naming the directory to use
                outcome = (lock.acquire(), None)
                atexit.register(lock.release)  # also when construction fails after this point
            except ValueError as e:
                lock, outcome = None, (None, str(e))
            except OSError as e:
                lock, outcome = None, (None, f"--save {save}: cannot create the checkpoint directory or its lock "
                                             f"({e.strerror or e}); point --save at a writable directory")
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        if box[0][1]:
            raise ValueError(box[0][1])
        return lock, box[0][0]

    def _load(self, root: str, iteration: Optional[int] = None) -> Optional[str]:
        """Resume from the checkpoint under ``root`` that verifies (select_checkpoint; ``iteration``: the one
        ``--load`` named); returns the note when it is not the latest (``--load-fallback``)."""
        it, note = select_checkpoint(root, self.cfg.checkpoint.load_fallback, iteration)
        self.iteration, extra = load_checkpoint(root, self.model, self.optimizer, self.groups, self.run_info(),
                                                replica=self.replica, iteration=it)
        torch.set_rng_state(extra["rng"])
        if extra.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(extra["cuda_rng"])
        self.channels.load_state_dict(extra["channels"])  # error feedback and seeded stochastic streams continue
        active = {f.state_key: f for f in self.features if f.state_key}
        for key in sorted({f.state_key for f in FEATURES if f.state_key}):
            if (extra.get(key) is None) != (key not in active):
                raise ValueError(f"checkpoint {root} was written {'with' if extra.get(key) is not None else 'without'} "
                                 f"{key} state and this run is {'with' if key in active else 'without'} it; resume "
                                 f"with the same settings (e.g. the same --outer-algorithm and compression)")
            if key in active:
                active[key].load_state_dict(extra[key])
        guard = extra.get("guard") or {}  # a checkpoint from before the guard's state was saved: a fresh guard
        self.guard.load_state_dict(guard)
        self.evaluation.load_state_dict(extra.get("evaluation"))
        notes = ([note] if note else []) + list(extra.get("resharded") or [])  # another layout: what moved, what reset
        return "\n  ".join(notes) or None

    def save(self) -> None:
        """Write a checkpoint of this iteration under ``checkpoint.save`` (a collective: every rank calls it), say
        where (rank 0), and keep only the newest ``keep_checkpoints`` when that is set. Work in flight lands first
        (the families' ``before_save``: e.g. ACCO's update, the overlapped parameter all-gather)."""
        c = self.cfg.checkpoint
        with contextlib.ExitStack() as stack:
            for f in self.features:
                stack.enter_context(f.before_save(self))
            path = save_checkpoint(c.save, self.iteration, self.model, self.optimizer, self._extra_state(),
                                   self.groups, self.run_info(), replica=self.replica, lock=self.lock)
        if self.is_logger:
            removed = prune_checkpoints(c.save, c.keep_checkpoints) if c.keep_checkpoints else []
            extra = f" (removed {len(removed)} older: --keep-checkpoints {c.keep_checkpoints})" if removed else ""
            print(f"megacomp-pretrain: saved checkpoint to {path}{extra}", flush=True)

    def _resume(self, chosen: list) -> tuple[Optional[str], list]:
        """Resume, fine-tune or start fresh as ``--load`` / ``--finetune`` / ``--save`` say; returns (the banner's
        resume line or None, ``chosen`` with a line when partial saves of an interrupted run were removed).

        Raises:
            ValueError: ``--load`` at a file, an iteration directory or an unreadable checkpoint (resolve_load), a
                checkpoint of other settings (load_checkpoint), family state that does not match.
            FileNotFoundError: ``--finetune`` with no checkpoint under ``--load``."""
        resumed = None
        c = self.cfg.checkpoint
        load = resolve_load(c.load)  # a file, an iteration directory, an unreadable one: one line (ValueError)
        if c.finetune and c.save and latest_iteration(c.save) is not None:  # a restarted fine-tuning job
            note = self._load(c.save)
            resumed = f"resumed the fine-tuning run from {c.save} at iteration {self.iteration} (--finetune: " \
                      f"{c.load} is only read when {c.save} holds no checkpoint yet)" + (f"; {note}" if note else "")
        elif c.finetune:  # raises FileNotFoundError when --load holds no checkpoint
            # no checkpoint at all: load_model_weights says so in fine-tuning's words
            it, note = (select_checkpoint(load.root, c.load_fallback, load.iteration) if load.has_checkpoint
                        else (None, None))
            it = load_model_weights(load.root, self.model, self.groups, self.run_info(), iteration=it)
            for f in self.features:
                f.weights_loaded(self)  # e.g. the optimizer's fp32 masters from the loaded weights
            resumed = (f"fine-tuning from the model weights of {c.load} (iteration {it}); optimizer, RNG, error "
                       f"feedback and data order start fresh at iteration 0") + (f"; {note}" if note else "")
        elif load.has_checkpoint:
            note = "; ".join(n for n in (load.note, self._load(load.root, load.iteration)) if n)
            resumed = f"resumed from {load.root} at iteration {self.iteration}" + (f"; {note}" if note else "")
        elif c.load:
            resumed = load.note
        if self.lock is not None:  # this run owns --save: saves a killed run left half-written go (chosen already)
            gone = remove_partial_saves(c.save)
            chosen = chosen + ([f"removed {len(gone)} partial save(s) an interrupted run left: {', '.join(gone)}"]
                               if gone else [])
        return resumed, chosen

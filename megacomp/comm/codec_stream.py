"""A side CUDA stream for the launch of compressed collectives, ordered by events, never by synchronising.

Why: a bucket's compressed reduction starts in backward (megacomp.optimizer.reduction). On the compute stream its
codec kernels (error feedback, encode) queue behind the backward kernels issued before it and in front of the next
bucket's backward; on a side stream they run beside the rest of backward, as NCCL's own stream does for the wire.

Ordering, per launch ``tag`` (a bucket):
  1. ``ready``: an event recorded on the current (compute) stream, after everything queued so far (the bucket's
     gradients); the side stream waits for it, so the codec reads complete gradients;
  2. ``launch``: the collective is issued with the side stream current: its kernels and the backend's transfer
     (NCCL's stream, or gloo's staging copies, wait for the side stream) follow the codec kernels;
  3. ``done``: an event recorded on the side stream after the launch;
  4. ``join``: before the result is used (``wait()`` of the returned handle), the current stream waits for ``done``.
Tensors allocated on the compute stream that the side stream reads and that may be freed before it is done (ZeRO-2
frees a bucket's gradient buffer right after the launch) are handed to ``record_stream`` (``keep``), so the caching
allocator does not give their memory to the compute stream too early. Memory the side stream allocates is only
reused on the side stream, or after a later ``ready``: every launch first waits for the compute stream's position.
No call here waits on the host.

On a CPU device (or with ``enabled=False``) every method runs inline on the caller's thread: the same steps in the
same order, with no stream. ``steps`` (``record=True``) lists them as ``(step, tag)`` pairs in the order they were
issued, so the ordering logic is checked on a CPU (tests/test_comm_codec_stream.py); on a GPU the profiler
trace of scripts/device_checks.sh shows the kernels on the side stream.

Failure behaviour: ``join`` of a tag that was never launched, or a second ``launch`` of a tag not yet joined,
raises RuntimeError (a caller bug: a result would be read before its codec ran, or an event lost).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch


class CodecStream:
    """The side stream of one device (see the module docstring).

    Args:
        device: the device of the tensors; a side stream exists only for a CUDA device.
        enabled: False runs everything inline (the CPU behaviour) on any device.
        record: keep ``steps``, the ordered list of ``(step, tag)`` (``ready``, ``launch``, ``done``, ``join``).
    """

    def __init__(self, device, enabled: bool = True, record: bool = False) -> None:
        self.device = torch.device(device)
        self.active = bool(enabled) and self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.active else None
        self.steps: Optional[list[tuple[str, str]]] = [] if record else None
        self._done: dict[str, Optional[torch.cuda.Event]] = {}

    def _log(self, step: str, tag: str) -> None:
        if self.steps is not None:
            self.steps.append((step, tag))

    @contextlib.contextmanager
    def launching(self, tag: str, keep: Iterable[Optional[torch.Tensor]] = ()):
        """Run the body on the side stream after the current stream's work so far (steps 1 to 3); ``keep``: tensors
        from the compute stream the body reads that may be freed before the side stream is done with them."""
        if tag in self._done:
            raise RuntimeError(f"megacomp CodecStream: {tag!r} was launched again before its result was joined")
        self._log("ready", tag)
        if not self.active:
            self._log("launch", tag)
            yield
            self._log("done", tag)
            self._done[tag] = None
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.side.wait_event(ready)
        for t in keep:
            if t is not None:
                t.record_stream(self.side)
        with torch.cuda.stream(self.side):
            self._log("launch", tag)
            yield
            done = torch.cuda.Event()
            done.record(self.side)
        self._log("done", tag)
        self._done[tag] = done

    def join(self, tag: str) -> None:
        """Step 4: the current stream waits for ``tag``'s launch (an event wait on the device, not on the host)."""
        if tag not in self._done:
            raise RuntimeError(f"megacomp CodecStream: {tag!r} is joined but was never launched (or joined twice)")
        done = self._done.pop(tag)
        self._log("join", tag)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def pending(self) -> list[str]:
        """Tags launched and not yet joined, in launch order."""
        return list(self._done)


class JoinedWork:
    """A collective's handle whose ``wait()`` first joins its launch on the side stream (``stream.join(tag)``), then
    waits for the collective; ``is_completed`` asks the handle (a finished backend reduction may be reaped early)."""

    def __init__(self, stream: CodecStream, tag: str, work) -> None:
        self.stream, self.tag, self.work = stream, tag, work
        self._joined = False

    def wait(self, timeout=None) -> bool:
        """Join the side stream (once), then wait for the collective; True."""
        if not self._joined:
            self._joined = True
            self.stream.join(self.tag)
        if self.work is not None:
            self.work.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the collective's own handle reports it finished (no handle: True)."""
        return self.work is None or self.work.is_completed()

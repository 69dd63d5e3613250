"""How a compressed collective moves and checks its bytes: one immutable settings object per traffic path.

These used to be process-wide toggles (``set_validation``, ``set_duplex``, ``set_pipeline_numel``); one of
them changed the numbers (scale blocks restart at segment boundaries), so a library that wanted a
different segment size for one path changed every other path's results too. Now each
:class:`megacomp.comm.Channel` holds its own ``CommOptions``, and the free functions build one per call
from their keyword arguments. Environment variables supply defaults, read only by :meth:`from_env`
(when a channel or a free call is built), never consulted in the middle of a collective.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

SEGMENT_NUMEL = 1 << 20
"""Default elements per pipeline segment of a compressed collective."""


@dataclass(frozen=True)
class CommOptions:
    """Transport and checking settings of one traffic path (every rank of a group must use the same)."""

    validate: bool = True
    """All-gather a small description of each call's arguments first (sizes, dtype, codec, op), so a
    mismatch raises the same ValueError on every rank instead of hanging. One tiny collective per call:
    turn it off only on hot paths whose shapes are fixed (the trainer does after its first iteration)."""
    duplex: Optional[bool] = None
    """Move compressed bytes with direction-split tagged p2p (True), with the backend's collectives
    (False), or decide by backend (None: p2p on gloo, whose TCP pairs do not overlap the two directions;
    see megacomp.comm.transport). Results and wire bytes are identical either way."""
    segment_numel: int = SEGMENT_NUMEL
    """Elements per pipeline segment (0: never segment): larger tensors are cut into segments whose encode,
    transfer and decode overlap. This changes the numbers of scaled codecs (a segment's chunks start new
    scale blocks; a per-tensor scale becomes a per-segment scale), so it is part of a run's recorded
    compression config and a checkpoint written with another value is refused."""
    two_rank_server: bool = False
    """A lossy all-reduce over two ranks: run the reduce-scatter and the re-encoded all-gather as for more ranks
    (two quantizations; the server error kept under ``key + '/server'``) instead of the direct exchange (one
    quantization, no server error). The 1-bit optimizers set it: DeepSpeed's compressed all-reduce always
    quantizes twice, with worker and server error feedback. The bytes on the wire are the same."""

    def __post_init__(self) -> None:
        if not isinstance(self.segment_numel, int) or self.segment_numel < 0:
            raise ValueError(f"CommOptions.segment_numel must be an int >= 0 (0 = never segment), "
                             f"got {self.segment_numel!r}")
        if self.duplex not in (None, True, False):
            raise ValueError(f"CommOptions.duplex must be None (auto), True or False, got {self.duplex!r}")

    @classmethod
    def from_env(cls, **overrides) -> "CommOptions":
        """Defaults from ``MEGACOMP_DUPLEX`` (auto/1/0) and ``MEGACOMP_PIPELINE_NUMEL``, then ``overrides``
        (keys whose value is None are ignored; build ``CommOptions(...)`` directly to force automatic duplex).

        Raises:
            ValueError: an environment variable holds something other than the values above.
        """
        env = os.environ.get("MEGACOMP_DUPLEX", "auto").strip().lower()
        duplex = {"auto": None, "": None, "1": True, "true": True, "on": True, "0": False, "false": False,
                  "off": False}.get(env, "bad")
        if duplex == "bad":
            raise ValueError(f"MEGACOMP_DUPLEX={env!r}: use auto, 1 or 0")
        raw = os.environ.get("MEGACOMP_PIPELINE_NUMEL", str(SEGMENT_NUMEL))
        try:
            segment = int(raw)
        except ValueError:
            raise ValueError(f"MEGACOMP_PIPELINE_NUMEL={raw!r}: use an integer number of elements (0 = never segment)")
        base = cls(duplex=duplex, segment_numel=segment)
        kw = {k: v for k, v in overrides.items() if v is not None}
        return replace(base, **kw) if kw else base

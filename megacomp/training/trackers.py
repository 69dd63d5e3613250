"""Experiment trackers: TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``), rank 0.

Both receive the same scalars (:func:`scalars`), at every iteration the metrics log writes (``--log-interval``, and
every evaluated, probed or skipped iteration), with the iteration as the step. Names follow Megatron-LM where it has
one:

    lm loss, learning-rate, iteration-time, tokens-per-second, iterations-per-second, grad-norm, skipped-step (1: the
                                                      step was skipped for inf/NaN)
    wire-bytes/total, uncompressed-bytes/total        this iteration's traffic, all ranks
    wire-bytes/<kind>, uncompressed-bytes/<kind>      per traffic kind (dp_gradient, tp_forward, ...; one hop of a
                                                      hierarchical exchange is ``<kind>@<link>``)
    wire-bytes-per-link/<link>                        intra_node, inter_node (and inter_site, between_replica_groups
                                                      when used): megacomp.training.report.bytes_per_link
    compression-error/<path>                          the probe's relative error per path (probed iterations)
    lm loss validation, lm loss validation ppl        after an evaluation (megacomp.training.evaluation)
    lm loss test, lm loss test ppl                    after the last iteration, with a test split
    eval-wire-bytes/total, eval-wire-bytes/<kind>     the evaluation's own traffic (not in wire-bytes/*)

TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` on ``--tensorboard-dir``; a resumed run passes
``purge_step`` = its first iteration, so the events a killed attempt wrote after its checkpoint are hidden.
W&B: ``wandb.init(project, name=--wandb-exp-name, dir=--wandb-save-dir, config=the configuration tree, mode)``,
where mode is ``WANDB_MODE`` when set, else ``online`` with an API key (``WANDB_API_KEY``, or the key ``wandb login``
keeps in ``~/.netrc`` / ``$NETRC`` for the host of ``WANDB_BASE_URL``), else ``offline`` (``wandb sync DIR``
uploads it later). A resumed run starts a new W&B run; its steps continue the iterations.

Failure behaviour: a tracker asked for whose package is not installed raises ValueError on every rank at setup,
one line naming ``pip install tensorboard`` / ``pip install wandb``.
"""
from __future__ import annotations

import importlib.util
import netrc
import os
from typing import Optional
from urllib.parse import urlparse

from .report import bytes_per_link

WANDB_HOST = "https://api.wandb.ai"
"""W&B's default server (``WANDB_BASE_URL`` names another)."""


def check_packages(cfg) -> None:
    """The packages of the trackers ``cfg`` asks for are installed; raises ValueError (:func:`require`)."""
    if cfg.logging.tensorboard_dir:
        require("tensorboard", "tensorboard", "--tensorboard-dir")
    if cfg.logging.wandb_project:
        require("wandb", "wandb", "--wandb-project")


def require(module: str, package: str, flag: str) -> None:
    """Raise ValueError (one line: ``flag`` needs ``package``, ``pip install package``) unless ``module`` imports."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        raise ValueError(f"{flag} needs the {package} package, which is not installed: pip install {package}")


def scalars(record: dict, tiers: dict) -> dict[str, float]:
    """The tracker scalars of one logged record (see the module docstring); ``tiers``: the link kind each group
    kind crosses (megacomp.training.report.layout_tiers)."""
    out = {"lm loss": record["loss"], "learning-rate": record["lr"], "iteration-time": record["iteration_time_s"],
           "tokens-per-second": record["tokens_per_second"], "skipped-step": float(bool(record.get("skipped"))),
           "wire-bytes/total": record["wire_bytes"], "uncompressed-bytes/total": record["uncompressed_bytes"]}
    if record.get("grad_norm") is not None:
        out["grad-norm"] = record["grad_norm"]
    if record.get("iterations_per_second"):
        out["iterations-per-second"] = record["iterations_per_second"]
    for kind, (w, u) in record["traffic"].items():
        if u:
            out[f"wire-bytes/{kind}"], out[f"uncompressed-bytes/{kind}"] = w, u
    for link, w in bytes_per_link(record["traffic"], tiers).items():
        if w or link in ("intra_node", "inter_node"):
            out[f"wire-bytes-per-link/{link}"] = w
    for path, summary in (record.get("probe") or {}).get("paths", {}).items():
        out[f"compression-error/{path}"] = summary[0]
    for split, name in (("valid", "validation"), ("test", "test")):
        if f"{split}_loss" in record:
            out[f"lm loss {name}"], out[f"lm loss {name} ppl"] = record[f"{split}_loss"], record[f"{split}_ppl"]
    if "eval_traffic" in record:
        out["eval-wire-bytes/total"] = record["eval_wire_bytes"]
        for kind, (w, u) in record["eval_traffic"].items():
            if u:
                out[f"eval-wire-bytes/{kind}"] = w
    return {k: float(v) for k, v in out.items()}


def wandb_mode() -> tuple[str, str]:
    """(the W&B mode, why): ``WANDB_MODE`` when set, else online with an API key, else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], "WANDB_MODE"
    if os.environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    host = urlparse(os.environ.get("WANDB_BASE_URL") or WANDB_HOST).hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        if os.path.isfile(path) and netrc.netrc(path).authenticators(host):
            return "online", f"wandb login's key for {host} in {path}"
    except (netrc.NetrcParseError, OSError):
        pass  # an unreadable netrc holds no key W&B could use either
    return "offline", "no API key (WANDB_API_KEY or wandb login); wandb sync uploads it later"


class Trackers:
    """The run's TensorBoard writer and W&B run (rank 0; the other ranks only check that the packages are there).

    Args:
        cfg: the PretrainConfig (``logging``'s tracker fields; the W&B run's config is its tree).
        enabled: whether this rank writes (rank 0).
        first_iteration: the iteration the run starts after (a resume's checkpoint iteration, else 0).
        tiers: the link kind each group kind crosses (megacomp.training.report.layout_tiers), for the bytes per link
            kind; None: every group within a node.

    Raises:
        ValueError: a tracker's package is not installed (every rank).
    """

    def __init__(self, cfg, enabled: bool, first_iteration: int = 0, tiers: Optional[dict] = None) -> None:
        lg = cfg.logging
        check_packages(cfg)
        self.tiers = tiers
        self.writer = self.wandb_run = None
        self.lines: list[str] = []
        if not enabled:
            return
        if lg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(lg.tensorboard_dir, purge_step=first_iteration + 1 if first_iteration else None)
            self.lines.append(f"TensorBoard: {lg.tensorboard_dir} (tensorboard --logdir {lg.tensorboard_dir})")
        if lg.wandb_project:
            import wandb
            where = lg.wandb_save_dir or (os.path.join(cfg.checkpoint.save, "wandb") if cfg.checkpoint.save else
                                          os.path.join(lg.log_dir, "wandb") if lg.log_dir else os.getcwd())
            os.makedirs(where, exist_ok=True)
            mode, why = wandb_mode()
            self.wandb_run = wandb.init(project=lg.wandb_project, name=lg.wandb_exp_name, dir=where,
                                        config=cfg.to_dict(), mode=mode)
            self.lines.append(f"W&B: project {lg.wandb_project}, run {self.wandb_run.name}, {mode} ({why}), files "
                              f"under {where}")

    def log(self, record: dict) -> None:
        """Write ``record``'s scalars (:func:`scalars`) at step ``record["iteration"]``."""
        if self.writer is None and self.wandb_run is None:
            return
        values, step = scalars(record, self.tiers or {}), record["iteration"]
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        """Flush and close both (idempotent)."""
        writer, run, self.writer, self.wandb_run = self.writer, self.wandb_run, None, None
        if writer is not None:
            writer.close()
        if run is not None:
            run.finish()

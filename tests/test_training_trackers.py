"""TensorBoard and W&B (megacomp.training.trackers): a real run writes both, and their files are read back."""
import glob
import struct
from dataclasses import replace

import numpy as np
import pytest

from distributed import run_ranks
from megacomp.training import Trainer
from megacomp.training.trackers import require, scalars, wandb_mode


def test_scalars_names_and_the_missing_package_line(monkeypatch, tmp_path):
    record = {"iteration": 3, "loss": 5.0, "lr": 1e-3, "iteration_time_s": 0.5, "tokens_per_second": 512.0,
              "wire_bytes": 300, "uncompressed_bytes": 900, "grad_norm": None, "skipped": False,
              "traffic": {"dp_gradient": [100, 400], "dp_gradient@intra_node": [150, 400], "tp_forward": [50, 100]},
              "valid_loss": 4.0, "valid_ppl": 54.6, "eval_wire_bytes": 20, "eval_traffic": {"tp_forward": [20, 40]}}
    got = scalars(record, {"tp": "intra_node", "pp": "intra_node", "dp": "inter_node"})
    assert got["lm loss"] == 5.0 and got["lm loss validation"] == 4.0 and got["lm loss validation ppl"] == 54.6
    assert got["wire-bytes/dp_gradient@intra_node"] == 150 and got["eval-wire-bytes/tp_forward"] == 20
    # a hop's tag under its own link; the rest under the slowest link its group spans
    assert got["wire-bytes-per-link/inter_node"] == 100 and got["wire-bytes-per-link/intra_node"] == 200
    assert "grad-norm" not in got and "wire-bytes-per-link/inter_site" not in got
    with pytest.raises(ValueError, match=r"^--tensorboard-dir needs the tensorboard package, which is not installed: "
                                         r"pip install tensorboard$"):
        require("megacomp_no_such_module", "tensorboard", "--tensorboard-dir")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode()[0] == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert wandb_mode()[0] == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == ("disabled", "WANDB_MODE")


def wandb_records(path):
    """The protobuf records of a W&B run file (``run-ID.wandb``): a 7-byte header (``:W&B``, magic, version), then
    LevelDB log records in 32 KiB blocks (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
        elif kind == 0:
            break
    return out


def _train(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_tensorboard_and_offline_wandb_hold_the_run(tiny_config, tmp_path, monkeypatch):
    """TP2 with evaluation; no W&B API key (NETRC points at nothing): W&B writes offline, without a network."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    cfg = replace(tiny_config, tensor_model_parallel_size=2, train_iters=2, eval_interval=2, eval_iters=1,
                  split="90,10,0", tensorboard_dir=str(tmp_path / "tb"), wandb_project="megacomp-test",
                  wandb_exp_name="tiny", wandb_save_dir=str(tmp_path / "wb"))
    history = run_ranks(_train, 2, cfg)[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()

    def series(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]
    f32 = np.float32
    assert series("lm loss") == [(h["iteration"], f32(h["loss"])) for h in history]
    assert series("lm loss validation") == [(2, f32(history[-1]["valid_loss"]))]
    assert series("lm loss validation ppl") == [(2, f32(history[-1]["valid_ppl"]))]
    assert series("wire-bytes/tp_forward") == [(h["iteration"], h["traffic"]["tp_forward"][0]) for h in history]
    assert series("wire-bytes-per-link/intra_node") == [(h["iteration"], h["wire_bytes"]) for h in history]
    assert series("eval-wire-bytes/tp_forward") == [(2, history[-1]["eval_traffic"]["tp_forward"][0])]
    # W&B: one offline run under --wandb-save-dir, its history rows the same scalars
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    records = wandb_records(runs[0])
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "megacomp-test" and run.display_name == "tiny"
    rows = [{item.key or "/".join(item.nested_key): item.value_json for item in r.history.item} for r in records
            if r.WhichOneof("record_type") == "history"]
    last = [row for row in rows if "lm loss validation" in row]
    assert len(last) == 1 and float(last[0]["lm loss validation"]) == history[-1]["valid_loss"]
    assert [float(row["lm loss"]) for row in rows] == [h["loss"] for h in history]

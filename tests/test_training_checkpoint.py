"""Checkpoints that cannot run code, and broken checkpoints that say which file and what to do.

Real checkpoints: a 2-rank pretraining run saves iterations 1 and 2; each test breaks a copy of them and
resumes with the trainer, as ``--load`` does. A hostile pickle would ``touch`` a marker file in tmp_path
when unpickled (checked on a control copy); the load must refuse it naming the file, and the marker must
not exist afterwards. A broken file gives one ValueError naming it and suggesting iteration 1.
"""
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
from dataclasses import replace

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from distributed import RankFailure, run_ranks
from megacomp.training import Trainer
from megacomp.training import checkpoint_integrity as integrity
from megacomp.training.checkpoint import METADATA_GLOBALS, latest_iteration, read_metadata

WORLD = 2


class Touch:
    """Unpickling this runs ``touch <marker>`` (what an attacker's payload would do, harmlessly)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _train_body(rank, world, cfg):
    trainer = Trainer(cfg)
    try:
        return [h["loss"] for h in trainer.train()]
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def base(tiny_config):
    return replace(tiny_config, compression="loco4")


@pytest.fixture(scope="module")
def saved(base, tmp_path_factory):
    """(root with iterations 1 and 2, losses of those two iterations)."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    losses = run_ranks(_train_body, WORLD, replace(base, exit_interval=2, save=str(root), save_interval=1))[0]
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]
    return root, losses


@pytest.fixture
def ckpt(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    return root


def _resume_error(base, root) -> str:
    """Resume from ``root`` on every rank; every rank must fail with the same ValueError; returns its text."""
    with pytest.raises(RankFailure) as info:
        run_ranks(_train_body, WORLD, replace(base, load=str(root)), timeout=60)
    errors = info.value.errors
    assert sorted(errors) == list(range(WORLD)), errors  # every rank fails alike (none hangs)
    last = {r: e.strip().splitlines()[-1] for r, e in errors.items()}
    assert len(set(last.values())) == 1 and last[0].startswith("ValueError: checkpoint file "), last
    assert "torch/distributed/checkpoint" not in errors[0] and len(errors[0].splitlines()) < 30, errors[0]
    return last[0]


def _reseal(path):
    """Rewrite the manifest's digests for the files as they are now, as an attacker controlling the directory can
    (the digests catch corruption, not a forger), so that the tests below reach the deserialisation defences."""
    manifest = json.loads((path / "megacomp.json").read_text())
    manifest["files"] = integrity.digest_files(str(path), integrity.checkpoint_files(str(path)))
    manifest["manifest_sha256"] = integrity.manifest_digest(manifest)
    (path / "megacomp.json").write_text(json.dumps(manifest))


def _rewrite_entry(root, fqn, payload: bytes):
    """Point the index entry ``fqn`` of iteration 2 at ``payload`` appended to its shard (as an attacker
    controlling the directory could, resealing the manifest); returns the shard's path."""
    path = root / "iter_0000002"
    md = read_metadata(str(path))
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    shard = path / info.relative_path
    md.storage_data[index] = dataclasses.replace(info, offset=shard.stat().st_size, length=len(payload))
    with open(shard, "ab") as f:
        f.write(payload)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(path)
    return shard


def _with_planner_data(md, obj):
    return dataclasses.replace(md, planner_data={"innocent": obj})


def _saved_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_allow_list_is_what_a_metadata_references(saved):
    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    seen = set()
    Recording(io.BytesIO((saved[0] / "iter_0000002" / ".metadata").read_bytes())).load()
    assert seen <= set(METADATA_GLOBALS), seen - set(METADATA_GLOBALS)
    assert not any("rebuild" in n or "system" in n or m == "builtins" for m, n in METADATA_GLOBALS)


def test_hostile_metadata_is_refused_without_running_it(base, ckpt, tmp_path):
    meta = ckpt / "iter_0000002" / ".metadata"
    md = read_metadata(str(meta.parent))
    control = tmp_path / "control"
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / ".metadata").write_bytes(pickle.dumps(_with_planner_data(md, Touch(control))))
    FileSystemReader(str(tmp_path / "plain")).read_metadata()  # DCP's own reader runs it (the hole)
    assert control.exists()
    marker = tmp_path / "marker"
    meta.write_bytes(pickle.dumps(_with_planner_data(md, Touch(marker))))
    _reseal(meta.parent)
    msg = _resume_error(base, ckpt)
    assert (f"checkpoint file {meta} is refused (its pickle references posix.system, which is not on "
            f"megacomp's allow-list") in msg
    assert f"resume from iteration 1 ({ckpt / 'iter_0000001'})" in msg
    assert not marker.exists()


@pytest.mark.parametrize("entry", ["extra", "extra-inner", "tensor"])
def test_hostile_shard_entry_is_refused_without_running_it(base, ckpt, tmp_path, entry):
    """Every shard entry is a torch.save pickle: tensors, the optimizer's plain fields and each rank's
    ``extra`` bytes (whose content is another torch.save pickle). All are opened weights-only."""
    marker, control = tmp_path / "marker", tmp_path / "control"
    wrap = (lambda b: _saved_bytes(b)) if entry == "extra-inner" else (lambda b: b)
    torch.load(io.BytesIO(_saved_bytes(Touch(control))), weights_only=False)  # a plain torch.load would run it
    assert control.exists()
    fqn = "extra/rank1" if entry.startswith("extra") else "model/pp0_tp0.word_embeddings.weight"
    shard = _rewrite_entry(ckpt, fqn, wrap(_saved_bytes(Touch(marker))))
    msg = _resume_error(base, ckpt)
    assert f"checkpoint file {shard} is refused (its pickle references posix.system" in msg
    assert f"resume from iteration 1 ({ckpt / 'iter_0000001'})" in msg
    assert not marker.exists()


@pytest.mark.parametrize("name,reason", [(".metadata", "truncated or garbled: "),
                                         ("__0_0.distcp", "truncated: "),
                                         ("megacomp.json", "truncated or garbled: "),
                                         ("garbled __0_0.distcp", "corrupt: its SHA-256 is ")])
def test_broken_checkpoint_names_the_file_and_the_previous_iteration(base, ckpt, name, reason):
    target = ckpt / "iter_0000002" / name.split()[-1]
    data = target.read_bytes()
    if name.startswith("garbled"):  # same length, the zip headers of its entries overwritten
        target.write_bytes(data.replace(b"PK\x03\x04", b"XX\x03\x04"))
    else:
        target.write_bytes(data[:len(data) // 2])
    msg = _resume_error(base, ckpt)
    assert msg.startswith(f"ValueError: checkpoint file {target} is unreadable ({reason}"), msg
    assert msg.endswith(f"to resume from iteration 1 ({ckpt / 'iter_0000001'}), write 1 into "
                        f"{ckpt / 'latest_checkpointed_iteration.txt'} and move {ckpt / 'iter_0000002'} "
                        f"out of the way"), msg


def test_broken_latest_file_and_no_older_checkpoint(ckpt):
    latest = ckpt / "latest_checkpointed_iteration.txt"
    latest.write_text("2\x00\x00")
    with pytest.raises(ValueError, match=re.escape(f"checkpoint file {latest} is unreadable (holds ") + ".*" +
                       re.escape(f"to resume from iteration 2 ({ckpt / 'iter_0000002'})")):
        latest_iteration(str(ckpt))
    (ckpt / "iter_0000001" / "megacomp.json").write_text("{")
    (ckpt / "iter_0000002" / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(f"there is no complete checkpoint under {ckpt}: start fresh")):
        latest_iteration(str(ckpt))


def test_clean_checkpoint_resumes_bit_identically(base, saved, ckpt):
    full = run_ranks(_train_body, WORLD, base)[0]
    rest = run_ranks(_train_body, WORLD, replace(base, load=str(ckpt)))[0]
    assert saved[1] + rest == full and len(rest) == 1

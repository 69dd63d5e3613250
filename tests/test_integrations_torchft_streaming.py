"""Streaming DiLoCo across replica groups on torchft's quorum (megacomp.integrations.torchft.OuterSync with
fragments; ``megacomp-pretrain --ft-outer-steps H --ft-fragments F``), with a real Lighthouse on gloo.

Replica groups are spawned processes of one rank (see tests/test_integrations_torchft.py for why spawned), each
joining the quorum at every fragment synchronisation.

- The fragments and their schedule are megacomp's own Streaming DiLoCo's (megacomp.outer.diloco): the same
  partition and, after inner step t, fragment f when (t + f * H // F) % H == 0.
- Compression off and no faults, 2 replicas: the parameters and anchors equal megacomp's own Streaming DiLoCo
  (megacomp.outer.DiLoCo, fragments 2, delay 0, mixing 0) on a plain gloo group of 2 ranks, bit for bit. Both
  take the mean pseudo-gradient as Delta / 2 summed by an all-reduce and apply the same SGD step; a sum of two
  terms is the same in either order, so no round-off bound is needed (with R > 2 replicas the summation order of
  the two all-reduces may differ: about R x 2^-24 x sum |Delta_r| per element, the module docstring's bound).
- A replica killed and restarted rejoins at a fragment synchronisation: it heals from a live peer, and after the
  run the anchors of every fragment and the weights of the last synchronised fragment are the survivors', bit for
  bit (int4 + error feedback on the pseudo-gradients).
- ``megacomp-pretrain``: a replica group started with another ``--ft-fragments`` than the running one is refused
  in one line naming the setting, and the running group continues.
"""
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft")

from distributed import run_ranks  # noqa: E402
from megacomp.integrations.torchft import OuterSync, ReplicaQuorum, TorchFTConfig  # noqa: E402
from megacomp.outer.diloco import _split  # noqa: E402
from test_integrations_torchft import (TIMEOUT_S, _batch, _finish, _kernels_loaded, _kill_and_rejoin,  # noqa: E402,F401
                                       _lighthouse, _log, _model, _ready, _train_locally, _wait)  # _kernels_loaded: autouse fixture

H, F = 4, 2  # outer steps, fragments: fragment 0 after steps 4, 8, ...; fragment 1 after steps 2, 6, ...


def test_fragments_and_schedule_are_megacomp_streaming_diloco_s():
    params = list(_model().parameters())
    sync = OuterSync(params, lr=0.7, momentum=0.9, fragments=F)
    assert [[id(p) for p in f] for f in sync.fragments] == [[id(p) for p in f] for f in _split(params, F)]
    assert [sync.due(t, H) for t in range(9)] == [[0], [], [1], [], [0], [], [1], [], [0]]
    assert OuterSync(params, 0.7, 0.9).due(4, H) == [0] and OuterSync(params, 0.7, 0.9).due(3, H) == []
    with pytest.raises(ValueError, match=r"fragments must be an int in \[1, 4\]"):
        OuterSync(params, 0.7, 0.9, fragments=5)


def test_ft_fragments_settings_it_does_not_cover_are_refused_in_one_line(tiny_config):
    from dataclasses import replace
    from megacomp.training.arguments import check
    cases = [(dict(ft_fragments=2), "set --ft-outer-steps H > 0"),
             (dict(ft_fragments=0, ft_outer_steps=4), "ft_fragments must be an integer >= 1"),
             (dict(ft_fragments=tiny_config.num_layers + 1, ft_outer_steps=4), "use at most one fragment per layer")]
    for kwargs, msg in cases:
        cfg = replace(tiny_config, **{"fault_tolerance": "torchft", **kwargs})
        with pytest.raises(ValueError, match=re.escape(msg)) as e:
            check(cfg, 2)
        assert "\n" not in str(e.value)


def _stream_replica(rid, lighthouse, codec, steps, out, sleep_s=0.0, expect=0):
    """One replica group: local Adam steps; after the steps where fragments are due, a quorum and their
    synchronisation (and one at its start, where a restarted replica meets the others and heals). Logs one line
    per quorum; saves the final parameters and anchors."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    outer = OuterSync(list(model.parameters()), lr=0.7, momentum=0.9, fragments=F)
    it = {"done": 0}
    fresh = set()  # fragments not met since healing: no pseudo-gradient for them

    def load(s):
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        outer.load_state_dict(s["outer"])
        it["done"] = s["iteration"]

    # init_sync off, as megacomp-pretrain runs it: replicas that start together all start from the seed's weights
    # and contribute to every fragment; only a replica that heals from a live peer skips its first round of each
    ft = ReplicaQuorum(TorchFTConfig(lighthouse=lighthouse, replica_id=str(rid), timeout_s=TIMEOUT_S, quorum_timeout_s=60,
                                     connect_timeout_s=5, init_sync=False),
                       state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(),
                                           "outer": outer.state_dict(), "iteration": it["done"]},
                       load_state_dict=load, fingerprint={"model": "mlp16-32-4", "codec": str(codec), "h": H, "f": F})
    ch = ft.channel("outer", codec, error_feedback="ef" if codec else None)
    log = open(os.path.join(out, f"{rid}.log"), "a")

    def meet():
        q = ft.start_step()
        if q.healed:
            fresh.update(range(F))
        due = outer.due(it["done"], H)
        ok = outer.sync(ft, ch, contributes=[f not in fresh for f in due], fragments=due)
        if ok:
            fresh.difference_update(due)
        log.write(f"{time.time():.3f} step={it['done']} replicas={q.replicas} rank={q.rank} batch=-1 "
                  f"healed={int(q.healed)} committed={int(ok)} frag={due[0] if due else -1} took=0\n")
        log.flush()

    _ready(out, rid, expect)
    _train_locally(model, opt, rid, it, out, steps, sleep_s, lambda done: bool(outer.due(done, H)), meet)
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "anchors": [a.detach().clone() for a in outer.anchors], "last": outer.due(it["done"], H)},
               os.path.join(out, f"{rid}.pt"))
    ft.shutdown()


def _megacomp_streaming_body(rank, world, steps):
    """megacomp's own Streaming DiLoCo over the plain gloo world (one rank per replica), the same model and data."""
    from megacomp.outer import DiLoCo, DiLoCoConfig
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    diloco = DiLoCo(model.parameters(), None, DiLoCoConfig(outer_steps=H, outer_lr=0.7, outer_momentum=0.9, fragments=F))
    for t in range(steps):
        x, y = _batch(10000 * rank + t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        diloco.step()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "anchors": [o.detach().clone() for o in diloco.outer]}


@pytest.mark.slow
def test_compression_off_without_faults_equals_megacomp_streaming_diloco_bit_for_bit(tmp_path):
    out = str(tmp_path)
    steps = 3 * H + H // F  # three whole rounds and fragment 1's next synchronisation
    lh, addr = _lighthouse(min_replicas=2)
    try:
        procs = [mp.get_context("spawn").Process(target=_stream_replica, args=(r, addr, None, steps, out),
                                                 kwargs={"expect": 2}) for r in range(2)]
        for p in procs:
            p.start()
        _finish(procs)
    finally:
        lh.terminate()
        lh.wait()
    plain = run_ranks(_megacomp_streaming_body, 2, steps)
    rows = _log(out, 0)
    assert [int(x["frag"]) for x in rows] == [0, 1, 0, 1, 0, 1, 0, 1]  # the staggered schedule, a quorum each
    assert all(x["replicas"] == 2 and x["committed"] for x in rows)
    for r in range(2):
        ft = torch.load(os.path.join(out, f"{r}.pt"))
        for a, b in zip(ft["params"], plain[r]["params"]):
            assert torch.equal(a, b)
        for a, b in zip(ft["anchors"], plain[r]["anchors"]):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_replica_killed_and_rejoined_at_a_fragment_sync_equals_the_survivors_bit_for_bit(tmp_path):
    out = str(tmp_path)
    lh, addr = _lighthouse()
    try:  # 300 s: a spawned replica's start-up includes loading (or, after a source change, building) the codec
        # kernels; three synchronisations after the heal: the joiner has met both fragments since
        restarted = _kill_and_rejoin(_stream_replica, addr, out, ready_s=300, rejoin_records=3, rejoin_s=300,
                                     stop_ahead=3 * H, what="fragment synchronisations")
    finally:
        lh.terminate()
        lh.wait()
    back = [x for x in _log(out, 2) if x["t"] > restarted]
    assert back[0]["healed"] == 1 and back[0]["replicas"] == 3 and back[0]["committed"] == 1
    assert {int(x["frag"]) for x in back} == {0, 1}  # it rejoined at one fragment and met the other later
    final = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(3)]
    last = final[0]["last"]
    assert last and all(f["last"] == last for f in final)
    params = list(_model().parameters())
    ids = [id(p) for p in params]
    frags = [[ids.index(id(p)) for p in f] for f in _split(params, F)]  # the parameter indices of each fragment
    for other in final[1:]:
        for a, b in zip(final[0]["anchors"], other["anchors"]):
            assert torch.equal(a, b)  # every fragment's anchor, bit for bit
        for i in frags[last[0]]:
            assert torch.equal(final[0]["params"][i], other["params"][i])  # the fragment synchronised last


@pytest.mark.slow
def test_a_group_started_with_another_ft_fragments_is_refused_in_one_line_and_the_others_continue(tmp_path):
    lh, addr = _lighthouse()

    def group(rid, fragments, iters):
        cmd = [sys.executable, "-m", "megacomp.pretrain", "--config", "configs/gpt_tiny.yaml", "--train-iters",
               str(iters), "--log-interval", "1", "--fault-tolerance", "torchft", "--ft-lighthouse", addr,
               "--ft-replica-id", str(rid), "--ft-outer-steps", str(H), "--ft-fragments", str(fragments),
               "--ft-timeout", str(TIMEOUT_S), "--log-dir", str(tmp_path / f"r{rid}")]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        return subprocess.Popen(cmd, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    metrics = tmp_path / "r0" / "metrics.jsonl"
    running = group(0, F, 100000)
    try:
        _wait(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= H, 300, "group 0's first round")
        joiner = group(1, 1, 100000)  # the same run but DiLoCo (one fragment)
        text, _ = joiner.communicate(timeout=300)
        trained = len(metrics.read_text().splitlines())
        _wait(lambda: len(metrics.read_text().splitlines()) >= trained + H, 120, "group 0 to continue")
        assert running.poll() is None
    finally:
        running.kill()
        running.wait()
        lh.terminate()
        lh.wait()
    assert joiner.returncode != 0
    lines = [line for line in text.splitlines() if "ft_fragments: 1 here, 2 in the quorum" in line]
    assert lines, text[-3000:]
    assert lines[0].rstrip().endswith("restart it with the quorum's settings")

"""megacomp.integrations.torchft: compressed replica traffic on torchft's quorum, with a real Lighthouse on gloo.

Each replica group is one spawned process (one rank; spawned, not forked: a fork of a test process that ran
other tests inherits their threads and process-group objects, and aborted at garbage collection) joining a Lighthouse that runs in its own process
(``python -m megacomp.integrations.torchft``, torchft's LighthouseServer); replicas are killed with SIGKILL and
restarted, as a preempted node would be.

- Kill and rejoin (int8 + error feedback, 3 replicas): the survivors keep committing steps without a restart,
  the restarted replica heals from a live peer, and at the end every replica's parameters are equal bit for bit;
  no replica-batch is trained twice or skipped (the committed data positions are consecutive).
- A replica that dies inside a compressed all-reduce (SIGKILL between issuing and finishing it) does not hang the
  others: their step fails within the group's timeout (``timeout_s``), is not committed, and they continue.
- Compression off and no faults: the torchft run trains bit-identically to the same loop on a plain gloo group.
- Bad input: an unreachable Lighthouse and a replica with another compression setting fail in one line each.
"""
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft")

from distributed import run_ranks  # noqa: E402
from megacomp.integrations.torchft import LighthouseUnreachable, ReplicaQuorum, TorchFTConfig  # noqa: E402

TIMEOUT_S = 5.0  # the replicas' collective timeout: the bound on a step a dead peer is part of
HEARTBEAT_MS = 1000  # the Lighthouse declares a silent replica dead after this


@pytest.fixture(autouse=True, scope="module")
def _kernels_loaded():
    """Build the C++ codec kernels once (cached on disk) before replicas are spawned, so no replica spends its
    first step building them."""
    from megacomp import kernels
    kernels.backend_name("cpu")


def _lighthouse(min_replicas=1):
    proc = subprocess.Popen([sys.executable, "-m", "megacomp.integrations.torchft", "--bind", "[::]:0",
                             "--min-replicas", str(min_replicas), "--join-timeout-ms", "300",
                             "--heartbeat-timeout-ms", str(HEARTBEAT_MS)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    m = re.search(r"lighthouse: (\S+)", line)
    assert m, f"the Lighthouse did not start: {line!r}"
    port = m.group(1).rsplit(":", 1)[1]
    return proc, f"http://localhost:{port}"


def _batch(b):
    g = torch.Generator().manual_seed(1000 + b)
    x = torch.randn(8, 16, generator=g)
    return x, x @ torch.linspace(-1, 1, 16 * 4).view(16, 4) + 0.1 * torch.randn(8, 4, generator=g)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _train_step(model, opt, flat_grad_fn, b):
    """Forward/backward of replica-batch ``b``; ``flat_grad_fn(flat)`` averages the flat gradient over the
    replicas and returns whether to step."""
    params = list(model.parameters())
    x, y = _batch(b)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    if not flat_grad_fn(flat):
        return False
    o = 0
    for p in params:
        p.grad.copy_(flat[o:o + p.numel()].view_as(p))
        o += p.numel()
    opt.step()
    return True


def _replica(rid, lighthouse, codec, steps, out, sleep_s=0.0, die_inside_at=None, expect=0):
    """One replica group: train ``steps`` committed steps, log one line per step, save the final parameters."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ft = ReplicaQuorum(TorchFTConfig(lighthouse=lighthouse, replica_id=str(rid), timeout_s=TIMEOUT_S,
                                     quorum_timeout_s=60, connect_timeout_s=5),
                       state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
                       load_state_dict=lambda s: (model.load_state_dict(s["model"]), opt.load_state_dict(s["opt"])),
                       fingerprint={"model": "mlp16-32-4", "codec": str(codec)})
    ch = ft.channel("dp_replicas", codec, error_feedback="ef" if codec else None)
    log = open(os.path.join(out, f"{rid}.log"), "a")
    _ready(out, rid, expect)
    while ft.current_step() < _target(out, steps):
        q = ft.start_step()
        b = q.batches_committed + q.rank
        t0 = time.time()

        def reduce(flat):
            if die_inside_at is not None and q.step == die_inside_at and q.replicas > 1:
                ch.all_reduce(flat.div_(q.replicas), key="grads", async_op=True)  # the bytes are on their way...
                os.kill(os.getpid(), signal.SIGKILL)  # ...and this replica dies before finishing the collective
            ok = ft.all_reduce_mean(ch, flat, key="grads")
            return ft.should_commit() and ok

        committed = _train_step(model, opt, reduce, b)
        log.write(f"{time.time():.3f} step={q.step} replicas={q.replicas} rank={q.rank} batch={b} healed={int(q.healed)} "
                  f"committed={int(committed)} took={time.time() - t0:.3f}\n")
        log.flush()
        time.sleep(sleep_s)
    torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out, f"{rid}.pt"))
    ft.shutdown()


def _ready(out, rid, expect):
    """Start together: announce this replica and wait until ``expect`` replicas have (0: a restarted replica, which
    joins whatever quorum is running). Replicas started a moment apart would otherwise start in separate quorums of
    one and heal from each other, which is correct but not what these tests look at."""
    open(os.path.join(out, f"ready.{rid}"), "w").close()
    _wait(lambda: sum(f.startswith("ready.") for f in os.listdir(out)) >= expect, 120, "the other replicas")


def _target(out, steps):
    """The last step: ``steps``, or the one the test wrote to ``stop`` (the same number for every replica)."""
    path = os.path.join(out, "stop")
    if os.path.exists(path):
        text = open(path).read().strip()
        if text:
            return min(steps, int(text))
    return steps


def _stop_at(out, rid, ahead=10):
    """Make every replica stop ``ahead`` steps after replica ``rid``'s last logged step."""
    tmp = os.path.join(out, "stop.tmp")
    with open(tmp, "w") as f:
        f.write(str(int(_log(out, rid)[-1]["step"]) + ahead))
    os.replace(tmp, os.path.join(out, "stop"))


def _start(*args, **kwargs):
    p = mp.get_context("spawn").Process(target=_replica, args=args, kwargs=kwargs)
    p.start()
    return p


def _log(out, rid):
    path = os.path.join(out, f"{rid}.log")
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        t, *kv = line.split()
        rows.append({"t": float(t), **{k: float(v) for k, v in (x.split("=") for x in kv)}})
    return rows


def _wait(pred, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _finish(procs, timeout=120):
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a replica did not finish"


@pytest.mark.slow
def test_killed_replica_survivors_continue_and_rejoined_replica_equals_them_bit_for_bit(tmp_path):
    out = str(tmp_path)
    lh, addr = _lighthouse()
    steps = 100000  # until told (_stop_at)
    try:
        procs = {r: _start(r, addr, "int8", steps, out, 0.05, expect=3) for r in range(3)}
        _wait(lambda: len([x for x in _log(out, 2) if x["committed"] and x["replicas"] == 3]) >= 5, 90, "3 replicas")
        procs[2].kill()  # SIGKILL: a preempted node
        killed = time.time()
        _wait(lambda: any(x["t"] > killed and x["committed"] and x["replicas"] == 2 for x in _log(out, 0)), 30,
              "the survivors' next step")
        survivors_back = min(x["t"] for x in _log(out, 0) if x["t"] > killed and x["committed"] and x["replicas"] == 2)
        _wait(lambda: sum(1 for x in _log(out, 0) if x["t"] > killed and x["committed"]) >= 5, 60, "survivors stepping")
        procs[2].join()
        restarted = time.time()
        procs[2] = _start(2, addr, "int8", steps, out, 0.05)  # restarted with the same replica id
        _wait(lambda: sum(1 for x in _log(out, 2) if x["t"] > restarted and x["committed"]) >= 5, 90, "the rejoin")
        _stop_at(out, 0)
        _finish(list(procs.values()))
    finally:
        lh.terminate()
        lh.wait()
    # the survivors stepped again without a restart, within the heartbeat timeout plus the group's timeout
    assert survivors_back - killed < HEARTBEAT_MS / 1000 + TIMEOUT_S + 2
    rejoin = [x for x in _log(out, 2) if x["t"] > killed]
    assert rejoin[0]["healed"] == 1 and rejoin[0]["replicas"] == 3  # received the state from a live peer
    final = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(3)]
    for other in final[1:]:
        for a, b in zip(final[0], other):
            assert torch.equal(a, b)  # bit for bit
    # data accounting: the committed replica-batches of all replicas are 0, 1, 2, ... each exactly once
    batches = sorted(int(x["batch"]) for r in range(3) for x in _log(out, r) if x["committed"])
    assert batches == list(range(len(batches)))


@pytest.mark.slow
def test_replica_dying_inside_a_compressed_collective_does_not_hang_the_others(tmp_path):
    out = str(tmp_path)
    lh, addr = _lighthouse()
    try:
        procs = [_start(0, addr, "int4", 12, out, expect=3), _start(1, addr, "int4", 12, out, expect=3),
                 _start(2, addr, "int4", 12, out, die_inside_at=4, expect=3)]
        procs[2].join(120)
        assert procs[2].exitcode == -signal.SIGKILL
        _finish(procs[:2])
    finally:
        lh.terminate()
        lh.wait()
    rows = _log(out, 0)
    failed = [x for x in rows if not x["committed"]]
    assert failed, "the step the replica died in must not commit"
    assert all(x["took"] < TIMEOUT_S + 2 for x in failed)  # bounded by the group's timeout, not a hang
    assert rows[-1]["replicas"] == 2 and rows[-1]["step"] == 11


def _plain_body(rank, world, steps):
    import torch.distributed as dist
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def reduce(flat):
        flat.div_(world)
        dist.all_reduce(flat)
        return True

    for step in range(steps):
        _train_step(model, opt, reduce, step * world + rank)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_compression_off_without_faults_equals_the_plain_gloo_run_bit_for_bit(tmp_path):
    out = str(tmp_path)
    lh, addr = _lighthouse(min_replicas=2)
    try:
        _finish([_start(r, addr, None, 6, out, expect=2) for r in range(2)])
    finally:
        lh.terminate()
        lh.wait()
    plain = run_ranks(_plain_body, 2, 6)[0]
    for r in range(2):
        ft = torch.load(os.path.join(out, f"{r}.pt"))
        for a, b in zip(plain, ft):
            assert torch.equal(a, b)
    assert all(x["replicas"] == 2 and x["committed"] for x in _log(out, 0))


def _mismatched(rid, lighthouse, codec, out):
    try:
        _replica(rid, lighthouse, codec, 100000, out, 0.05)
    except ValueError as e:
        open(os.path.join(out, f"{rid}.err"), "w").write(str(e))
        os._exit(3)


@pytest.mark.slow
def test_a_replica_with_another_compression_setting_is_refused_in_one_line_and_the_others_continue(tmp_path):
    out = str(tmp_path)
    lh, addr = _lighthouse()
    ctx = mp.get_context("spawn")
    try:
        procs = [ctx.Process(target=_mismatched, args=(0, addr, "int8", out))]
        procs[0].start()
        _wait(lambda: len(_log(out, 0)) >= 3, 90, "replica 0")
        procs.append(ctx.Process(target=_mismatched, args=(1, addr, "int4", out)))  # joins with another codec
        procs[1].start()
        procs[1].join(90)
        _stop_at(out, 0, ahead=5)
        _finish(procs)
    finally:
        lh.terminate()
        lh.wait()
    assert [p.exitcode for p in procs] == [0, 3]
    err = open(os.path.join(out, "1.err")).read()
    assert "\n" not in err and "codec: 'int4' here, 'int8' in the quorum" in err
    assert err.endswith("restart it with the quorum's settings")
    assert int(_log(out, 0)[-1]["step"]) >= 5  # the live replica kept stepping


def test_unreachable_lighthouse_is_one_clear_line():
    t0 = time.time()
    with pytest.raises(LighthouseUnreachable, match=r"cannot be reached within 1 s: start it first") as e:
        ReplicaQuorum(TorchFTConfig(lighthouse="http://localhost:9", connect_timeout_s=1), state_dict=dict,
                      load_state_dict=lambda s: None, fingerprint={})
    assert "\n" not in str(e.value) and time.time() - t0 < 10
    with pytest.raises(ValueError, match="no Lighthouse address"):
        os.environ.pop("TORCHFT_LIGHTHOUSE", None)
        ReplicaQuorum(TorchFTConfig(), state_dict=dict, load_state_dict=lambda s: None, fingerprint={})


def _diloco_replica(rid, lighthouse, codec, steps, out, h=4, sleep_s=0.0, expect=0):
    """One DiLoCo replica group: local Adam steps, a quorum and an OuterSync every ``h`` steps (and once at its
    start, where a restarted replica meets the others and receives the outer state)."""
    from megacomp.integrations.torchft import OuterSync
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    outer = OuterSync(list(model.parameters()), lr=0.7, momentum=0.9)
    it = {"done": 0}

    def load(s):
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        outer.load_state_dict(s["outer"])
        it["done"] = s["iteration"]

    ft = ReplicaQuorum(TorchFTConfig(lighthouse=lighthouse, replica_id=str(rid), timeout_s=TIMEOUT_S, quorum_timeout_s=60,
                                     connect_timeout_s=5),
                       state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict(),
                                           "outer": outer.state_dict(), "iteration": it["done"]},
                       load_state_dict=load, fingerprint={"model": "mlp16-32-4", "codec": str(codec), "h": h})
    ch = ft.channel("outer", codec, error_feedback="ef" if codec else None)
    log = open(os.path.join(out, f"{rid}.log"), "a")

    def meet():
        q = ft.start_step()
        ok = outer.sync(ft, ch, contributes=not q.healed)
        log.write(f"{time.time():.3f} step={it['done']} replicas={q.replicas} rank={q.rank} batch=-1 healed={int(q.healed)} "
                  f"committed={int(ok)} took=0\n")
        log.flush()

    _ready(out, rid, expect)
    _train_locally(model, opt, rid, it, out, steps, sleep_s, lambda done: done % h == 0, meet)
    torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out, f"{rid}.pt"))
    ft.shutdown()


def _train_locally(model, opt, rid: int, it: dict, out: str, steps: int, sleep_s: float, syncs, meet) -> None:
    """The outer-loop replicas' body: meet the others, then inner steps on replica ``rid``'s own batches until the
    target step, meeting again after every step for which ``syncs(done)`` holds (``it["done"]`` counts the steps)."""
    meet()
    while it["done"] < _target(out, steps):
        x, y = _batch(10000 * rid + it["done"])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        it["done"] += 1
        if syncs(it["done"]):
            meet()
        time.sleep(sleep_s)


def _kill_and_rejoin(target, addr: str, out: str, *, ready_s: float, rejoin_records: int, rejoin_s: float,
                     stop_ahead: int, what: str) -> float:
    """Start replicas 0-2 of ``target`` (spawned) on the Lighthouse at ``addr``, kill replica 2 once it has committed 3
    steps with all three, wait for two of the survivors' synchronisations without it, restart it, wait for
    ``rejoin_records`` of its committed records, then stop every replica ``stop_ahead`` steps past replica 0 and
    return the time of the restart (records after it are the rejoined replica's)."""
    ctx = mp.get_context("spawn")

    def start(r, expect=0):
        p = ctx.Process(target=target, args=(r, addr, "int4", 100000, out), kwargs={"sleep_s": 0.05, "expect": expect})
        p.start()
        return p

    procs = {r: start(r, expect=3) for r in range(3)}
    _wait(lambda: sum(1 for x in _log(out, 2) if x["replicas"] == 3 and x["committed"]) >= 3, ready_s, "3 replicas")
    procs[2].kill()
    killed = time.time()
    _wait(lambda: sum(1 for x in _log(out, 0) if x["t"] > killed and x["committed"] and x["replicas"] == 2) >= 2,
          60, f"the survivors' {what}")
    procs[2].join()
    restarted = time.time()
    procs[2] = start(2)
    _wait(lambda: sum(1 for x in _log(out, 2) if x["t"] > restarted and x["committed"]) >= rejoin_records, rejoin_s,
          "the rejoin")
    _stop_at(out, 0, ahead=stop_ahead)  # replica 0's last record is a synchronisation step: all three reach it
    _finish(list(procs.values()))
    return restarted


@pytest.mark.slow
def test_diloco_replica_killed_and_rejoined_at_an_outer_step_equals_the_survivors_bit_for_bit(tmp_path):
    out = str(tmp_path)
    lh, addr = _lighthouse()
    try:  # outer steps every 4 iterations: stop 12 past replica 0, a multiple of 4
        restarted = _kill_and_rejoin(_diloco_replica, addr, out, ready_s=90, rejoin_records=2, rejoin_s=90,
                                     stop_ahead=12, what="outer steps")
    finally:
        lh.terminate()
        lh.wait()
    back = [x for x in _log(out, 2) if x["t"] > restarted]
    assert back[0]["healed"] == 1 and back[0]["replicas"] == 3 and back[0]["committed"] == 1
    final = [torch.load(os.path.join(out, f"{r}.pt")) for r in range(3)]
    for other in final[1:]:
        for a, b in zip(final[0], other):
            assert torch.equal(a, b)  # the same anchor after the last outer step, bit for bit


# -- the pretraining path: megacomp-pretrain --fault-tolerance torchft (megacomp.training.features.fault_tolerance) --

def _pretrain_body(rank, world, cfg):
    from megacomp.training.trainer import Trainer
    trainer = Trainer(cfg)
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return [(h["loss"], h.get("ft_replicas"), h.get("ft_committed")) for h in history], \
        [p.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.slow
def test_pretraining_one_replica_group_on_torchft_equals_the_run_without_it_bit_for_bit(tiny_config):
    """One replica group: the mean over one member is the identity and the data position is the plain run's, so
    the losses and final parameters equal the run without torchft, compression preset and all."""
    from dataclasses import replace
    base = replace(tiny_config, compression="dp_int8")
    lh, addr = _lighthouse()
    try:
        ft = run_ranks(_pretrain_body, 2, replace(base, fault_tolerance="torchft", ft_lighthouse=addr, ft_codec="int8",
                                                 ft_error_feedback="ef"), timeout=600, pg_timeout=300,
                       start_method="spawn")[0]  # spawned ranks import torch and join a quorum: slow on busy cores
    finally:
        lh.terminate()
        lh.wait()
    plain = run_ranks(_pretrain_body, 2, base)[0]
    assert [h[0] for h in ft[0]] == [h[0] for h in plain[0]]
    assert all(h[1] == 1 and h[2] for h in ft[0])  # one replica group, every step committed
    for a, b in zip(ft[1], plain[1]):
        assert torch.equal(a, b)


def test_fault_tolerance_settings_it_does_not_cover_are_refused_in_one_line(tiny_config):
    from dataclasses import replace
    from megacomp.training.arguments import check
    cases = [(dict(optimizer="onebit_adam"), "--optimizer onebit_adam is not covered: use --optimizer adamw"),
             (dict(zero_stage=2), "use --zero-stage 1"),
             (dict(outer_algorithm="diloco", num_replicas=2), "drop --outer-algorithm"),
             (dict(ft_outer_steps=-1), "ft_outer_steps must be >= 0"),
             (dict(fault_tolerance="yes"), "fault_tolerance must be one of none, torchft")]
    for kwargs, msg in cases:
        cfg = replace(tiny_config, **{"fault_tolerance": "torchft", **kwargs})
        with pytest.raises(ValueError, match=re.escape(msg)) as e:
            check(cfg, 2)
        assert "\n" not in str(e.value)


def test_a_preset_with_replicas_int8_gives_the_channel_codec_of_ft_codec_int8(tmp_path):
    """The cross-replica channel's codec comes from --ft-codec, else the compression preset's ``replicas:`` entry,
    else the dp_gradient (per step) / outer (DiLoCo) path; the banner names the source."""
    from megacomp.comm import Channel
    from megacomp.training.features.fault_tolerance import FaultToleranceConfig, replica_channel_settings
    from megacomp.training.pretrain_config import load_compression
    preset = tmp_path / "replicas_int8.yaml"
    preset.write_text("dp_gradient: {name: int4, block_size: 64}\nreplicas: int8\n")
    by_preset = replica_channel_settings(FaultToleranceConfig(mode="torchft"), load_compression(str(preset)))
    by_flag = replica_channel_settings(FaultToleranceConfig(mode="torchft", codec="int8"), load_compression("none"))
    assert Channel("replicas", by_preset[0]).codec == Channel("replicas", by_flag[0]).codec
    assert str(Channel("replicas", by_preset[0]).codec).startswith("int8")
    assert by_preset[1] is None and by_preset[2] == "the compression config's replicas"
    assert by_flag[2] == "--ft-codec"
    # the flag overrides the preset; neither set: today's default paths, with their error feedback
    assert replica_channel_settings(FaultToleranceConfig(mode="torchft", codec="int4"),
                                    load_compression(str(preset)))[2] == "--ft-codec"
    loco4 = load_compression("loco4")
    codec, ef, source = replica_channel_settings(FaultToleranceConfig(mode="torchft"), loco4)
    assert codec is loco4.dp_gradient and ef is loco4.dp_gradient_error_feedback and "dp_gradient" in source
    preset.write_text("outer: int4\nouter_error_feedback: ef\nreplicas: int8\nreplicas_error_feedback: ef\n")
    codec, ef, source = replica_channel_settings(FaultToleranceConfig(mode="torchft", outer_steps=4),
                                                 load_compression(str(preset)))
    assert str(Channel("replicas", codec).codec).startswith("int8") and ef is not None and source.endswith("replicas")

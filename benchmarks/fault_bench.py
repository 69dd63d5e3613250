"""Fault benchmark: replica groups of `megacomp-pretrain --fault-tolerance torchft` killed with SIGKILL every N
seconds and restarted, against the same run without faults.

    python -m benchmarks.fault_bench --replicas 4 --kill-every 30 60 120 --duration 250 --seeds 1 2 3 \
        --straggler-outer-steps 0 20 --out benchmarks/results/fault_tolerance

Per kill interval N: a Lighthouse (scripts/torchft_lighthouse.sh's), R replica groups of one rank each training
the tiny GPT (configs/gpt_tiny.yaml; ``--config`` for another) with int8 + error feedback on the cross-replica
gradients; every N seconds the next group in turn is killed with SIGKILL and restarted at once with the same
command (its Python start-up is part of the rejoin time, as a restarted node's would be). A fault-free run of the
same seed and length is the reference. From the metrics every group logs (``ft_time``, ``ft_replicas``,
``ft_committed`` per iteration) it reports, per kill:

  survivors next step   seconds from the kill to the first committed step of a surviving group
  rejoined steps        seconds from the kill to the restarted group's first committed step
  back to rate          seconds from the kill until the survivors' step rate (5-step window) is back to 90% of
                        the fault-free run's
and per run: goodput = replica-batches committed by live groups / (R x wall time x the fault-free run's
replica-batches per second per group), wall time from the first committed step (the start-up of the first launch
is left out of both), and the loss at the last common iteration against the fault-free run's.

Writes ``results.json``, ``README``-ready ``table.md`` and ``fault_timeline.png`` (committed steps per group over
time, kills marked) to ``--out``; prints the table. Measures; asserts nothing. Goals (stated beside the figure in
the README): survivors step again within 5 s of a kill, the rejoined group within 30 s, goodput >= 90% at one kill
per minute with 4 groups, loss within 1% of the fault-free run.

Loss: the mean, over the last 20 iterations both launches committed, of the mean loss of the groups that committed
each iteration (one group's loss is one batch's and moves by several percent from step to step), relative to the
fault-free launch of the same seed; with ``--seeds`` several seeds give its mean and spread, next to the
fault-free launches' own seed-to-seed spread (the noise floor a 1% verdict has to clear).

Straggler (``--straggler-outer-steps 0 20``): launches without faults in which group 0 is slowed ``--slowdown``
times by the benchmark, once per schedule (0: per-step quorum; H: DiLoCo's quorum every H steps), each next to the
same schedule without the straggler; reports the other groups' iterations per second with and without it. The
slowdown is a pause per step, applied from outside (no change to the trainer): after each iteration group 0 logs,
it is stopped (SIGSTOP, then SIGCONT) for (slowdown - 1) x the step time of the launch without the straggler. A pause
rather than a duty cycle: on cores shared by more processes than cores, a process stopped part of the time loses
little (the others' share grows, its own shrinks less), so a duty cycle barely slows it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _lighthouse(heartbeat_ms: int, min_replicas: int):
    proc = subprocess.Popen([sys.executable, "-m", "megacomp.integrations.torchft", "--bind", "[::]:0",
                             "--heartbeat-timeout-ms", str(heartbeat_ms), "--join-timeout-ms", "500",
                             "--min-replicas", str(min_replicas)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    m = re.search(r"lighthouse: \S+:(\d+)", proc.stdout.readline())
    if not m:
        proc.kill()
        raise RuntimeError("fault_bench: the Lighthouse did not start")
    return proc, f"http://localhost:{m.group(1)}"


def _replica(args, lighthouse: str, rid: int, log_dir: Path, seed: int, outer_steps: int = 0):
    cmd = [sys.executable, "-m", "megacomp.pretrain", "--config", args.config, "--train-iters", str(args.iters),
           "--log-interval", "1", "--compression", "dp_int8", "--ft-codec", args.codec, "--ft-error-feedback", "ef",
           "--fault-tolerance", "torchft", "--ft-lighthouse", lighthouse, "--ft-replica-id", str(rid),
           "--ft-timeout", str(args.timeout), "--ft-min-replicas", str(args.min_replicas), "--log-dir", str(log_dir),
           "--seed", str(seed), "--ft-outer-steps", str(outer_steps), *args.model_args.split()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=open(f"{log_dir}.out", "w"), stderr=subprocess.STDOUT, cwd=REPO, env=env)


KEEP = ("iteration", "loss", "ft_time", "ft_committed", "ft_replicas", "ft_healed")
"""The fields of each logged iteration the analysis reads (the results file keeps only these)."""


def _short(value):
    """Floats to 4 decimals (milliseconds of wall time; losses to 1e-4), so the results file stays small."""
    return round(value, 4) if isinstance(value, float) else value


def _records(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def run(args, kill_every: float | None, out: Path, seed: int, *, outer_steps: int = 0, pause_s: float = 0.0,
        duration: float | None = None, tag: str | None = None) -> dict:
    """One launch (``kill_every`` None: no faults; ``pause_s`` > 0: group 0 is a straggler, stopped that long after
    each iteration it logs); returns its timeline."""
    tag = tag or (f"seed{seed}/kill{int(kill_every)}" if kill_every else f"seed{seed}/fault_free")
    duration = duration or args.duration
    base = out / "runs" / tag
    base.mkdir(parents=True, exist_ok=True)
    lh, addr = _lighthouse(args.heartbeat_ms, args.min_replicas)
    lives = {r: 0 for r in range(args.replicas)}
    procs = {r: _replica(args, addr, r, base / f"r{r}.{0}", seed, outer_steps) for r in range(args.replicas)}
    kills, t0 = [], time.time()
    next_kill, victim = t0 + (kill_every or 1e18), 0
    stopped_until, seen = 0.0, 0  # the straggler: stopped until this time after each iteration it logs
    metrics = base / "r0.0" / "metrics.jsonl"
    try:
        while time.time() - t0 < duration and any(p.poll() is None for p in procs.values()):
            if time.time() >= next_kill:
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                kills.append({"t": time.time(), "replica": victim, "life": lives[victim] + 1})
                lives[victim] += 1
                procs[victim] = _replica(args, addr, victim, base / f"r{victim}.{lives[victim]}", seed, outer_steps)
                victim = (victim + 1) % args.replicas
                next_kill += kill_every
            if pause_s > 0 and procs[0].poll() is None:
                now = time.time()
                if stopped_until and now >= stopped_until:
                    procs[0].send_signal(signal.SIGCONT)
                    stopped_until = 0.0
                elif not stopped_until and metrics.exists():
                    lines = metrics.read_bytes().count(b"\n")
                    if lines > seen:
                        seen = lines
                        procs[0].send_signal(signal.SIGSTOP)
                        stopped_until = now + pause_s
            time.sleep(0.005 if pause_s > 0 else 0.05)
    finally:
        end = time.time()
        if stopped_until:
            procs[0].send_signal(signal.SIGCONT)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        lh.terminate()
        lh.wait()
    steps = {}
    for r in range(args.replicas):
        rows = []
        for life in range(lives[r] + 1):
            rows += [{**{k: _short(x.get(k)) for k in KEEP}, "life": life} for x in _records(base / f"r{r}.{life}")
                     if x.get("ft_time")]
        steps[r] = rows
    return {"kill_every": kill_every, "seed": seed, "outer_steps": outer_steps, "pause_s": pause_s, "t0": t0,
            "end": end, "kills": kills, "steps": steps, "load_average_1min_at_end": os.getloadavg()[0]}


def _mean_loss_by_iteration(run_: dict) -> dict[int, float]:
    """Iteration -> the mean loss of the groups that committed it."""
    by_it: dict[int, list] = {}
    for rows in run_["steps"].values():
        for x in rows:
            if x.get("ft_committed") and x.get("loss") is not None:
                by_it.setdefault(int(x["iteration"]), []).append(x["loss"])
    return {i: sum(v) / len(v) for i, v in by_it.items()}


def analyse(fault: dict, free: dict, replicas: int, tokens_per_step: int) -> dict:
    """The figures of one faulty run against the fault-free one (see the module docstring)."""
    def committed(run, r=None):
        return sorted(x["ft_time"] for rr, rows in run["steps"].items() if r is None or rr == r
                      for x in rows if x.get("ft_committed") and x["ft_time"] <= run["end"])

    free_times = committed(free, 0)
    free_rate = (len(free_times) - 1) / (free_times[-1] - free_times[0]) if len(free_times) > 1 else float("nan")
    per_kill = []
    for k in fault["kills"]:
        survivors = [x for r, rows in fault["steps"].items() if r != k["replica"] for x in rows
                     if x["ft_time"] > k["t"] and x.get("ft_committed")]
        back = [x for x in fault["steps"][k["replica"]] if x["life"] == k["life"] and x.get("ft_committed")]
        s_times = sorted({round(x["ft_time"], 3) for x in survivors if x["ft_time"] > k["t"]})
        rate_back = None
        for i in range(len(s_times) - 5):
            if 5 / max(s_times[i + 5] - s_times[i], 1e-9) >= 0.9 * free_rate and (not back or s_times[i] >= back[0]["ft_time"]):
                rate_back = s_times[i + 5] - k["t"]
                break
        per_kill.append({"replica": k["replica"], "survivors_next_step_s": (s_times[0] - k["t"]) if s_times else None,
                         "rejoined_steps_s": (back[0]["ft_time"] - k["t"]) if back else None,
                         "back_to_rate_s": rate_back})
    times = committed(fault)
    wall = fault["end"] - times[0] if times else float("nan")  # from the first committed step: start-up excluded,
    batches = len(times)                                         # as it is from the fault-free rate
    goodput = batches / (replicas * wall * free_rate) if free_rate == free_rate and free_rate > 0 else float("nan")
    last_f, last_0 = _mean_loss_by_iteration(fault), _mean_loss_by_iteration(free)
    common = sorted(set(last_f) & set(last_0))
    window = common[-20:]  # one batch's loss is noisy: the mean over the last 20 common iterations is steadier
    mean_f = sum(last_f[i] for i in window) / len(window) if window else None
    mean_0 = sum(last_0[i] for i in window) / len(window) if window else None
    return {"seed": fault.get("seed"), "kill_every_s": fault["kill_every"], "kills": per_kill, "wall_s": wall,
            "goodput": goodput, "fault_free_steps_per_s": free_rate, "tokens_per_step": tokens_per_step,
            "loss_window": [window[0], window[-1]] if window else None, "loss_mean20": mean_f,
            "loss_mean20_fault_free": mean_0, "loss_mean20_rel_diff": (mean_f / mean_0 - 1) if window else None}


def _ms(values: list, spec: str = "+.2f") -> str:
    """``mean ± sample sd`` of the finite values (the mean in ``spec``)."""
    v = [x for x in values if x is not None and x == x]
    if not v:
        return "-"
    mean = sum(v) / len(v)
    sd = (sum((x - mean) ** 2 for x in v) / (len(v) - 1)) ** 0.5 if len(v) > 1 else 0.0
    return f"{mean:{spec}} ± {sd:{spec.lstrip('+')}}"


def straggler_rates(run_: dict, straggler: int = 0) -> dict:
    """Iterations per second of the straggler and of the other groups (each group's first logged iteration to its
    last, in the second half of the launch, where start-up is over), averaged over the others."""
    mid = run_["t0"] + (run_["end"] - run_["t0"]) / 2
    rates = {}
    for r, rows in run_["steps"].items():
        pts = [(x["ft_time"], x["iteration"]) for x in rows if x["ft_time"] >= mid and x.get("ft_committed")]
        if len(pts) > 1 and pts[-1][0] > pts[0][0]:
            rates[r] = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
    others = [v for r, v in rates.items() if r != straggler]
    return {"straggler_it_per_s": rates.get(straggler), "others_it_per_s": sum(others) / len(others) if others else None}


def _fmt(v, spec=".1f"):
    return "-" if v is None or v != v else format(v, spec)


def table(results: list[dict], free_losses: list) -> str:
    """Markdown: one row per kill interval over every seed (per-kill times as median / max over all kills; goodput
    and loss as mean ± spread over seeds), then one row per launch."""
    def mm(rs, key):
        vals = sorted(k[key] for r in rs for k in r["kills"] if k[key] is not None)
        missing = sum(1 for r in rs for k in r["kills"] if k[key] is None)
        text = f"{_fmt(vals[len(vals) // 2])} / {_fmt(vals[-1])}" if vals else "-"
        return text + (f" ({missing} never)" if missing else "")

    def pct(x):
        return None if x is None else 100 * x

    rows = ["| kill every | seeds | kills | survivors next step (s) median / max | rejoined steps (s) median / max | "
            "back to 90% rate (s) median / max | goodput (%) mean ± sd | loss vs fault-free (%) mean ± sd |",
            "|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["kill_every_s"] for r in results}):
        rs = [r for r in results if r["kill_every_s"] == n]
        rows.append(f"| {n:g} s | {len(rs)} | {sum(len(r['kills']) for r in rs)} | {mm(rs, 'survivors_next_step_s')} | "
                    f"{mm(rs, 'rejoined_steps_s')} | {mm(rs, 'back_to_rate_s')} | "
                    f"{_ms([pct(r['goodput']) for r in rs], '.0f')} | {_ms([pct(r['loss_mean20_rel_diff']) for r in rs])} |")
    floor = [x for x in free_losses if x is not None]
    if len(floor) > 1:
        mean = sum(floor) / len(floor)
        rows.append(f"\nFault-free launches' mean loss (last 20 iterations) over {len(floor)} seeds: {mean:.4f}, spread "
                    f"(sample sd) {100 * (sum((x - mean) ** 2 for x in floor) / (len(floor) - 1)) ** 0.5 / mean:.2f}% of it "
                    f"(the seed-to-seed noise floor).")
    rows += ["", "| seed | kill every | kills | goodput | loss, last 20 common iterations (all groups' mean) vs fault-free |",
             "|---|---|---|---|---|"]
    for r in results:
        window = r.get("loss_window") or ["-", "-"]
        rows.append(f"| {r.get('seed')} | {r['kill_every_s']:g} s | {len(r['kills'])} | {_fmt(pct(r['goodput']), '.0f')}% | "
                    f"{_fmt(r['loss_mean20'], '.4f')} vs {_fmt(r['loss_mean20_fault_free'], '.4f')} "
                    f"({_fmt(pct(r['loss_mean20_rel_diff']), '+.2f')}%), iterations {window[0]}-{window[1]} |")
    return "\n".join(rows)


def straggler_table(rows_: list[dict], slowdown: float) -> str:
    """Markdown: per schedule, the other groups' rate without and with a straggler."""
    rows = [f"| schedule | others it/s, no straggler | pause per step of group 0 (s) | others it/s with it | others "
            f"slowed by | straggler's own it/s ({slowdown:g}x slower would be) |", "|---|---|---|---|---|---|"]
    for r in rows_:
        even, slow = r["even"]["others_it_per_s"], r["slow"]["others_it_per_s"]
        name = "per-step quorum" if not r["outer_steps"] else f"DiLoCo, quorum every {r['outer_steps']} steps"
        factor = f"{even / slow:.2f}x" if even and slow else "-"
        rows.append(f"| {name} | {_fmt(even, '.2f')} | {_fmt(r.get('pause_s'), '.3f')} | {_fmt(slow, '.2f')} | "
                    f"{factor} | {_fmt(r['slow']['straggler_it_per_s'], '.2f')} "
                    f"({_fmt(even / slowdown if even else None, '.2f')}) |")
    return "\n".join(rows)


def plot(runs: list[dict], path: Path) -> None:
    """Committed steps per replica group over time, one panel per run, kills marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, run_ in zip(axes[:, 0], runs):
        for r, rows in run_["steps"].items():
            pts = [(x["ft_time"] - run_["t0"], x["iteration"]) for x in rows if x.get("ft_committed")]
            if pts:
                ax.plot(*zip(*pts), ".", ms=3, label=f"group {r}")
        for k in run_["kills"]:
            ax.axvline(k["t"] - run_["t0"], color="red", lw=0.8, ls="--")
        ax.set_ylabel("iteration")
        ax.set_title(f"kill every {run_['kill_every']:g} s" if run_["kill_every"] else "fault-free", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("seconds (red: SIGKILL, restarted at once)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _int_keys(runs: list[dict]) -> None:
    for r in runs:
        r["steps"] = {int(k): v for k, v in r["steps"].items()}


def main(argv=None) -> None:
    """Run the launches (or ``--from-results``: rebuild the tables and plot) and print the tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kill-every", type=float, nargs="*", default=[30, 60, 120])
    p.add_argument("--duration", type=float, default=250, help="seconds per launch")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234], help="one fault-free + faulty launches per seed")
    p.add_argument("--iters", type=int, default=100000, help="train_iters (large: the duration ends the launch)")
    p.add_argument("--config", default="configs/gpt_tiny.yaml")
    p.add_argument("--model-args", default="", help="extra pretraining flags, e.g. '--hidden-size 256' (3.44M GPT)")
    p.add_argument("--codec", default="int8")
    p.add_argument("--timeout", type=float, default=10, help="--ft-timeout of the groups")
    p.add_argument("--heartbeat-ms", type=int, default=2000)
    p.add_argument("--min-replicas", type=int, default=2,
                   help="smallest quorum (Lighthouse and --ft-min-replicas): groups that start alone wait for it")
    p.add_argument("--straggler-outer-steps", type=int, nargs="*", default=[],
                   help="schedules of the straggler study (0: per-step quorum; H: DiLoCo every H steps); none: skip")
    p.add_argument("--slowdown", type=float, default=2.0, help="the straggler's slowdown")
    p.add_argument("--straggler-duration", type=float, default=120)
    p.add_argument("--out", default="benchmarks/results/fault_tolerance")
    p.add_argument("--from-results", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        saved = json.load(open(out / "results.json"))
        runs, stragglers, args_saved = saved["runs"], saved.get("stragglers", []), saved["args"]
        _int_keys(runs)
        replicas, tokens, slowdown = args_saved["replicas"], 0, args_saved.get("slowdown", 2.0)
    else:
        import yaml
        cfg = yaml.safe_load(open(REPO / args.config))
        replicas, tokens, slowdown = args.replicas, cfg["global_batch_size"] * cfg["seq_length"], args.slowdown
        runs = []
        for seed in args.seeds if args.kill_every else []:
            runs.append(run(args, None, out, seed))
            runs += [run(args, n, out, seed) for n in args.kill_every]
        stragglers = []
        for h in args.straggler_outer_steps:
            pair = {"outer_steps": h}
            even = run(args, None, out, args.seeds[0], outer_steps=h, duration=args.straggler_duration,
                       tag=f"straggler/H{h}_even")
            pair["even"] = straggler_rates(even)
            step_s = 1 / pair["even"]["others_it_per_s"]
            pair["pause_s"] = (args.slowdown - 1) * step_s
            slow = run(args, None, out, args.seeds[0], outer_steps=h, pause_s=pair["pause_s"],
                       duration=args.straggler_duration, tag=f"straggler/H{h}_slow")
            pair["slow"] = straggler_rates(slow)
            stragglers.append(pair)
        saved_runs = [dict(r, steps={str(k): v for k, v in r["steps"].items()}) for r in runs]
        json.dump({"args": vars(args), "runs": saved_runs, "stragglers": stragglers}, open(out / "results.json", "w"),
                  separators=(",", ":"))
    free = {r["seed"]: r for r in runs if not r["kill_every"]}
    results = [analyse(r, free[r["seed"]], replicas, tokens) for r in runs if r["kill_every"]]
    free_losses = []
    for r in free.values():
        losses = _mean_loss_by_iteration(r)
        tail = [losses[i] for i in sorted(losses)[-20:]]
        free_losses.append(sum(tail) / len(tail) if tail else None)
    text = table(results, free_losses) if results else ""
    if stragglers:
        text += ("\n\n" if text else "") + straggler_table(stragglers, slowdown)
    (out / "table.md").write_text(text + "\n")
    print(text)
    if runs:
        try:
            first = [r for r in runs if r["seed"] == runs[0]["seed"]]
            plot(first, out / "fault_timeline.png")
        except ImportError:
            print("fault_bench: matplotlib is not installed: no plot (pip install matplotlib)")


if __name__ == "__main__":
    main()

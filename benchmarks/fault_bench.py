"""Fault benchmark: replica groups of `megacomp-pretrain --fault-tolerance torchft` killed with SIGKILL every N
seconds and restarted, against the same run without faults.

    python -m benchmarks.fault_bench --replicas 4 --kill-every 30 60 --duration 150 \
        --out benchmarks/results/fault_tolerance

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


def _replica(args, lighthouse: str, rid: int, log_dir: Path):
    cmd = [sys.executable, "-m", "megacomp.pretrain", "--config", args.config, "--train-iters", str(args.iters),
           "--log-interval", "1", "--compression", "dp_int8", "--ft-codec", args.codec, "--ft-error-feedback", "ef",
           "--fault-tolerance", "torchft", "--ft-lighthouse", lighthouse, "--ft-replica-id", str(rid),
           "--ft-timeout", str(args.timeout), "--ft-min-replicas", str(args.min_replicas), "--log-dir", str(log_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=open(f"{log_dir}.out", "w"), stderr=subprocess.STDOUT, cwd=REPO, env=env)


def _records(log_dir: Path) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def run(args, kill_every: float | None, out: Path) -> dict:
    """One launch (``kill_every`` None: no faults); returns its timeline."""
    tag = f"kill{int(kill_every)}" if kill_every else "fault_free"
    base = out / "runs" / tag
    base.mkdir(parents=True, exist_ok=True)
    lh, addr = _lighthouse(args.heartbeat_ms, args.min_replicas)
    lives = {r: 0 for r in range(args.replicas)}
    procs = {r: _replica(args, addr, r, base / f"r{r}.{0}") for r in range(args.replicas)}
    kills, t0 = [], time.time()
    next_kill, victim = t0 + (kill_every or 1e18), 0
    try:
        while time.time() - t0 < args.duration and any(p.poll() is None for p in procs.values()):
            if time.time() >= next_kill:
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                kills.append({"t": time.time(), "replica": victim, "life": lives[victim] + 1})
                lives[victim] += 1
                procs[victim] = _replica(args, addr, victim, base / f"r{victim}.{lives[victim]}")
                victim = (victim + 1) % args.replicas
                next_kill += kill_every
            time.sleep(0.05)
    finally:
        end = time.time()
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
            rows += [dict(x, life=life) for x in _records(base / f"r{r}.{life}") if x.get("ft_time")]
        steps[r] = rows
    return {"kill_every": kill_every, "t0": t0, "end": end, "kills": kills, "steps": steps}


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
    last_f = {int(x["iteration"]): x["loss"] for x in fault["steps"][0] if x.get("ft_committed")}
    last_0 = {int(x["iteration"]): x["loss"] for x in free["steps"][0] if x.get("ft_committed")}
    common = sorted(set(last_f) & set(last_0))
    it = common[-1] if common else None
    window = common[-20:]  # one group's loss is one batch's: the mean over the last 20 common iterations is steadier
    mean_f = sum(last_f[i] for i in window) / len(window) if window else None
    mean_0 = sum(last_0[i] for i in window) / len(window) if window else None
    return {"loss_mean20": mean_f, "loss_mean20_fault_free": mean_0,
            "loss_mean20_rel_diff": (mean_f / mean_0 - 1) if window else None, "kill_every_s": fault["kill_every"], "kills": per_kill, "wall_s": wall, "goodput": goodput,
            "fault_free_steps_per_s": free_rate, "tokens_per_step": tokens_per_step, "loss_iteration": it,
            "loss": last_f.get(it), "loss_fault_free": last_0.get(it),
            "loss_rel_diff": (last_f[it] / last_0[it] - 1) if it is not None else None}


def _fmt(v, spec=".1f"):
    return "-" if v is None or v != v else format(v, spec)


def table(results: list[dict]) -> str:
    """The markdown table (one row per kill interval; per-kill times as median / max over the kills)."""
    rows = ["| kill every | kills | survivors next step (s) median / max | rejoined steps (s) median / max | back to "
            "90% rate (s) median / max | goodput | loss vs fault-free (same iteration) | mean loss, last 20 common iterations |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        def mm(key):
            vals = sorted(k[key] for k in r["kills"] if k[key] is not None)
            missing = sum(1 for k in r["kills"] if k[key] is None)
            text = f"{_fmt(vals[len(vals) // 2])} / {_fmt(vals[-1])}" if vals else "-"
            return text + (f" ({missing} never)" if missing else "")
        rows.append(f"| {r['kill_every_s']:g} s | {len(r['kills'])} | {mm('survivors_next_step_s')} | "
                    f"{mm('rejoined_steps_s')} | {mm('back_to_rate_s')} | {_fmt(100 * r['goodput'], '.0f')}% | "
                    f"{_fmt(r['loss'], '.4f')} vs {_fmt(r['loss_fault_free'], '.4f')} at iteration {r['loss_iteration']} "
                    f"({_fmt(100 * r['loss_rel_diff'] if r['loss_rel_diff'] is not None else None, '+.2f')}%) | "
                    f"{_fmt(r.get('loss_mean20'), '.4f')} vs {_fmt(r.get('loss_mean20_fault_free'), '.4f')} "
                    f"({_fmt(100 * r['loss_mean20_rel_diff'] if r.get('loss_mean20_rel_diff') is not None else None, '+.2f')}%) |")
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


def main(argv=None) -> None:
    """Run the launches (or ``--from-results``: rebuild the table and plot) and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kill-every", type=float, nargs="+", default=[30, 60, 120])
    p.add_argument("--duration", type=float, default=240, help="seconds per launch")
    p.add_argument("--iters", type=int, default=100000, help="train_iters (large: the duration ends the launch)")
    p.add_argument("--config", default="configs/gpt_tiny.yaml")
    p.add_argument("--codec", default="int8")
    p.add_argument("--timeout", type=float, default=10, help="--ft-timeout of the groups")
    p.add_argument("--heartbeat-ms", type=int, default=2000)
    p.add_argument("--min-replicas", type=int, default=2,
                   help="smallest quorum (Lighthouse and --ft-min-replicas): groups that start alone wait for it")
    p.add_argument("--out", default="benchmarks/results/fault_tolerance")
    p.add_argument("--from-results", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        saved = json.load(open(out / "results.json"))
        runs = saved["runs"]
        for r in runs:
            r["steps"] = {int(k): v for k, v in r["steps"].items()}
        free = next(r for r in runs if not r["kill_every"])
        results = [analyse(r, free, saved["args"]["replicas"], 0) for r in runs if r["kill_every"]]
    else:
        free = run(args, None, out)
        runs = [free] + [run(args, n, out) for n in args.kill_every]
        import yaml
        cfg = yaml.safe_load(open(REPO / args.config))
        tokens = cfg["global_batch_size"] * cfg["seq_length"]
        results = [analyse(r, free, args.replicas, tokens) for r in runs[1:]]
        for r in runs:  # JSON keys are strings
            r["steps"] = {str(k): v for k, v in r["steps"].items()}
        json.dump({"args": vars(args), "runs": runs, "results": results}, open(out / "results.json", "w"))
    for r in runs:
        r["steps"] = {int(k): v for k, v in r["steps"].items()}
    text = table(results)
    (out / "table.md").write_text(text + "\n")
    print(text)
    try:
        plot(runs, out / "fault_timeline.png")
    except ImportError:
        print("fault_bench: matplotlib is not installed: no plot (pip install matplotlib)")


if __name__ == "__main__":
    main()

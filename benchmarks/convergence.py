"""Loss curves of compressed vs uncompressed pretraining (same seed, same data, same layout).

    python -m benchmarks.convergence --iters 300 --out benchmarks/results/convergence
    python -m benchmarks.convergence --from-results --out benchmarks/results/convergence   # tables and plots only

Runs ``python -m megacomp.pretrain`` under torchrun once per variant on the tiny GPT config (real text:
the Python standard library's sources), keeps each run's logs under ``--runs`` (``<suite>/<variant>/
[seed<n>/]metrics.jsonl``, ``stdout.txt``, ``compression.yaml``; not part of the study) and writes, under
``--out``:
  - ``results.json``                          the study's one results file: per run its suite, variant,
                                              seed, compression preset and extra pretrain arguments,
                                              the loss at every logged iteration and the wire and
                                              uncompressed bytes (per traffic kind, and in total); the
                                              format is benchmarks/plot_metrics.py's (``compact_run``),
  - ``convergence.md``                        a table per suite: final loss (mean of the last 10% of
                                              iterations), its gap to the uncompressed run, wire bytes
                                              per iteration of the compressed traffic kinds (the mean
                                              over every iteration, warm-ups included),
  - ``<suite>_loss.png``, ``<suite>_loss_vs_bytes.png``, ``<suite>_gap.png``  the curves (the gap: each
                                              variant against the same optimizer's uncompressed run).

Suites: ``dp`` (4 DP ranks): none, int4 + LoCo (loco4), int4 without error feedback, int2 without
error feedback, int2 + LoCo, int4 + LoCo with int8 parameter all-gather (ZeRO++ qwZ style), and int4
with one scale per bucket shard (the coarse regime of LoCo's fixed scale) without EF, with LoCo and
with classic EF, and int2 with classic EF;
``pp`` (PP 2 x DP 2): none vs int8 activations + int8 gradients with error feedback;
``frozen``: 1-bit Adam's remedy for Adam x error feedback (uncompressed warm-up for the first 20% of the
iterations, then Adam's second moment frozen while the codec runs), with and without EF;
``zero``: the error-feedback acceptance set over seeds (--seeds 1,2,3): the AdamW and the frozen-variance variants;
``onebit``: 1-bit Adam, 0/1 Adam and 1-bit LAMB, each against its own uncompressed optimizer, with
the DP bytes over the run and after the warm-up and the rounds of communication (--seeds 1,2,3, --iters 600);
``demo_sweep`` and ``structured``: DeMo (learning rates and decays on one seed), then SparseLoCo,
DCT-momentum DiLoCo and DeMo against DiLoCo and DDP-AdamW (4 DP ranks or replicas, --seeds 1,2,3);
``lomo_sweep`` and ``lomo``: LOMO and AdaLomo (updates inside backward) against AdamW, and with int4 +
LoCo gradients against themselves;
``fsdp``: FSDP2 with megacomp's reduce-scatter / all-gather (LoCo int4 gradients, int8 parameters)
against stock FSDP2, paired by seed.
``powersgd``: PowerSGD under torch DDP, megacomp's hook next to torch's at ranks 4 and 1, megacomp's
rank 2, Accordion (rank 4 / rank 1 and rank 2 / rank 1), and PowerSGD on megacomp's sharded optimizer (--seeds 1,2,3);
``accordion_sweep``: Accordion's eta, interval, level pair and per-layer decisions on one seed;
``aqsgd``: AQ-SGD on a pipeline (PP 2, run with --nproc 2): fine-tuning-style epochs over 256
samples, 2- and 4-bit activation deltas against direct 2- and 4-bit quantisation and the uncompressed pipeline,
with the pp_activation bytes of every iteration (warm-up epoch included); ``aqsgd_finetune``: the same variants
fine-tuning (``--finetune``) a checkpoint pretrained on the whole corpus (600 iterations, made once) at a tenth of
the learning rate; ``aqsgd_sweep``: 2-bit settings on one seed;
``diloco``: local-step loops against DDP-AdamW, 4 replicas: DiLoCo (H = 50 uncompressed and
int4 + EF outer, H = 10), Streaming DiLoCo (4 fragments, tau = 5, int4 + EF outer), NoLoCo (groups of 2) and
MT-DAO (one slow momentum: the reference's 0.999 / 0.9, and 0.99 / 0.5).
``diloco_sweep``: DiLoCo's outer and inner learning rates, momentum and H on one seed; ``diloco_regime``:
where the gap to DDP comes from (no synchronisation, plain averaging every 50, 5 and 1 steps, the effective learning rate, 4x the
per-replica batch and 2x the width, each against DDP at the same batch or width).
The table and the plots are drawn from ``results.json`` only, so ``--from-results`` regenerates them
without training. Numbers are measured, never asserted: the tests bound codec errors, this script shows
training quality.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import yaml

from benchmarks import invocation
from benchmarks import plot_metrics as pm  # the results-file format, shared with plot_metrics
from benchmarks.convergence_suites import SUITES  # the variants, data only

DP_KINDS = ("outer", "loqt_merge")  # data-parallel traffic whose kind does not start with dp_ (LoQT's merge gradients)


def is_dp(kind: str) -> bool:
    """Whether a traffic kind is data-parallel (or outer-loop) traffic, the bytes the studies compare."""
    return kind.startswith("dp_") or kind in DP_KINDS


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_").lower()


FREEZE_FLAG = "--adam-freeze-variance-step"


def run_variant(suite: str, name: str, compression: dict, args, seed: Optional[int] = None) -> dict:
    """Train one variant (or reuse its logs under ``--runs``); returns its entry for results.json."""
    run_dir = Path(args.runs) / suite / slug(name) / (f"seed{seed}" if seed is not None else "")
    run_dir.mkdir(parents=True, exist_ok=True)
    compression, extra = dict(compression), []
    flags = compression.pop("args", [])  # further pretrain flags of the variant (e.g. the outer loop)
    # "@f": that fraction of the run's iterations (a freeze step that scales with --iters)
    flags = [str(max(1, int(float(f[1:]) * args.iters))) if f.startswith("@") else f for f in flags]
    baseline = compression.pop("baseline", None)
    hook = compression.pop("hook", None)
    freeze, warmup = compression.pop("freeze", 0.0), compression.pop("warmup", 0.0)
    if freeze:  # variance frozen after, and compression from, the same step
        extra = [FREEZE_FLAG, str(max(1, int(freeze * args.iters)))]
    if (freeze or warmup) and "dp_gradient" in compression:
        compression["dp_gradient_warmup_steps"] = max(1, int((freeze or warmup) * args.iters))
    compression["min_compress_numel"] = 4096
    extra = [*SUITES[suite]["layout"], *extra, *flags]
    done = run_dir / "metrics.jsonl"
    if args.reuse and done.exists() and len(done.read_text().splitlines()) == args.iters:
        print(f"  {suite:3s} {name:28s} {'' if seed is None else f'seed {seed}':9s} reused", flush=True)
    else:
        preset = run_dir / "compression.yaml"
        preset.write_text(yaml.safe_dump(compression))
        entry = ["-m", "megacomp.pretrain", "--compression", str(preset), "--log-interval", "1"]
        if hook is not None:  # a torch-DDP run with that gradient hook (benchmarks/ddp_convergence.py)
            entry = ["-m", "benchmarks.ddp_convergence", "--hook", hook]
        cmd = ["torchrun", "--standalone", "--nproc-per-node", str(args.nproc), *entry,
               "--config", args.config, "--train-iters", str(args.iters),
               "--lr-warmup-iters", str(max(1, args.iters // 20)), "--log-dir", str(run_dir),
               *extra, *(["--seed", str(seed)] if seed is not None else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.time()
        done.unlink(missing_ok=True)  # a fresh run, not appended to an older log
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        (run_dir / "stdout.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode:
            raise SystemExit(f"{suite}/{name} failed ({proc.returncode}); see {run_dir / 'stdout.txt'}")
        print(f"  {suite:3s} {name:28s} {'' if seed is None else f'seed {seed}':9s} {time.time() - t0:6.1f} s",
              flush=True)
    records = pm.read_run(done)
    labels = {"rounds": _rounds(records), **({"baseline": baseline} if baseline is not None else {})}
    return pm.compact_run(records, suite=suite, variant=name, seed=seed, compression=compression, args=extra, **labels)


def split_variants(text: str, known: set) -> tuple[set, set]:
    """The variant names of a ``--variants`` comma list whose names may hold commas themselves ("ACCO, int4+LoCo, int8
    params"): from each position the longest run of comma-separated pieces that names a known variant; a piece that
    starts no known name is returned as unknown."""
    pieces, only, unknown, i = text.split(","), set(), set(), 0
    while i < len(pieces):
        for j in range(len(pieces), i, -1):
            name = ",".join(pieces[i:j])
            if name in known:
                only.add(name)
                i = j
                break
        else:
            if pieces[i].strip():
                unknown.add(pieces[i])
            i += 1
    return only, unknown


def prepare(suite: str, args) -> None:
    """Run a suite's ``prepare`` pretraining once (e.g. the checkpoint a fine-tuning suite loads), unless its
    directory already holds a checkpoint."""
    spec = SUITES[suite].get("prepare")
    if spec is None or (Path(spec["dir"]) / "latest_checkpointed_iteration.txt").exists():
        return
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(spec["nproc"]), "-m", "megacomp.pretrain",
           "--config", args.config, "--lr-warmup-iters", "30", *spec["args"]]
    print(f"  {suite}: preparing {spec['dir']}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{suite}: preparing {spec['dir']} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def _rounds(records: list[dict]) -> Optional[int]:
    """The rounds of data-parallel communication over the run: the optimizer's own count at the end (1-bit family),
    else the iterations that sent any DP or outer traffic (AdamW: every one; a local-step loop: its exchanges)."""
    if records[-1].get("dp_rounds") is not None:
        return records[-1]["dp_rounds"]
    return sum(1 for r in records if any(w for k, (w, _) in r.get("traffic", {}).items() if is_dp(k)))


def frozen(run: dict) -> bool:
    """Whether a results.json run froze Adam's second moment (compared with 'none, frozen v')."""
    return FREEZE_FLAG in run.get("args", [])


def summarise(suite: str, runs: dict[str, list[dict]]) -> list[str]:
    tail = max(1, len(runs["none"]) // 10)
    base = sum(r["loss"] for r in runs["none"][-tail:]) / tail
    kinds = SUITES.get(suite, {}).get("bytes_kinds") or sorted(  # the suite's kinds, else DP and PP traffic
        {k for recs in runs.values() for r in recs for k in r["traffic"] if k.startswith(("dp_", "pp_"))})
    lines = [f"### {suite}: final loss = mean of the last {tail} iterations; bytes = mean per iteration over every "
             f"iteration of the run (warm-ups included)", "",
             "| variant | final loss | vs none | " + " | ".join(f"{k} MB/iter (wire / fp32)" for k in kinds) + " |",
             "|---|---|---|" + "---|" * len(kinds)]
    for name, recs in runs.items():
        final = sum(r["loss"] for r in recs[-tail:]) / tail
        cells = []
        for k in kinds:  # every iteration: a run whose warm-up is uncompressed must not look cheaper than it was
            w = sum(r["traffic"].get(k, [0, 0])[0] for r in recs) / len(recs)
            u = sum(r["traffic"].get(k, [0, 0])[1] for r in recs) / len(recs)
            cells.append(f"{w / 1e6:.3f} / {u / 1e6:.3f}")
        lines.append(f"| {name} | {final:.4f} | {100 * (final - base) / base:+.2f}% | " + " | ".join(cells) + " |")
    return lines + [""]


def summarise_seeds(suite: str, runs: dict[str, list[list[dict]]], frozen_names: set[str]) -> list[str]:
    """Final loss per variant as mean and standard deviation over seeds, and its difference to 'none'
    per seed (same seed = same initialisation and data order, so the paired difference has less noise). Bytes are
    compared with the suite's ``bytes_reference`` variant (default 'none'; FSDP's stock run is not counted)."""
    bytes_ref = SUITES.get(suite, {}).get("bytes_reference", "none")
    kinds = SUITES.get(suite, {}).get("bytes_kinds")  # e.g. ["pp_activation"]; default: DP and outer traffic
    label = ", ".join(kinds) if kinds else "DP"
    counted = (lambda k: k in kinds) if kinds else is_dp
    tail = max(1, len(runs["none"][0]) // 10)
    final = {name: [sum(r["loss"] for r in recs[-tail:]) / tail for recs in per_seed] for name, per_seed in runs.items()}
    lines = [f"### {suite}: final loss (mean of the last {tail} iterations) over {len(final['none'])} seeds", "",
             "Each variant is compared with the uncompressed run of the same optimizer (`none` for AdamW, "
             "`none, frozen v` for the frozen-variance variants), seed by seed.", "",
             f"| variant | final loss, mean ± std | vs none, paired mean ± std | per seed vs none | {label} MB/iter, last "
             f"iteration (wire / uncompressed) | {label}{'' if kinds else ' + outer'} MB over the run (wire) | "
             f"x fewer than {bytes_ref} |",
             "|---|---|---|---|---|---|---|"]
    def dp_bytes(recs):  # every iteration of the run, warm-ups included
        return sum(w for r in recs for k, (w, _) in r["traffic"].items() if counted(k))
    base_bytes = dp_bytes(runs[bytes_ref][0])
    for name, vals in final.items():
        ref = "none, frozen v" if name in frozen_names and "none, frozen v" in final else "none"
        base = final[ref] if name != ref else final["none"]
        rel = [100 * (v - b) / b for v, b in zip(vals, base)]
        last = [wu for k, wu in runs[name][0][-1]["traffic"].items() if (k in kinds if kinds else k.startswith("dp_"))]
        w, u = sum(x for x, _ in last), sum(y for _, y in last)
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        rsd = statistics.stdev(rel) if len(rel) > 1 else 0.0
        total = dp_bytes(runs[name][0])
        fewer = f"{base_bytes / total:.1f}x" if total else "-"
        lines.append(f"| {name} | {statistics.mean(vals):.4f} ± {sd:.4f} | {statistics.mean(rel):+.2f}% ± {rsd:.2f}% | "
                     f"{', '.join(f'{x:+.2f}%' for x in rel)} | {w / 1e6:.3f} / {u / 1e6:.3f} | {total / 1e6:.2f} | "
                     f"{fewer} |")
    return lines + [""]


def summarise_baselines(suite: str, runs: dict[str, list[list[dict]]], meta: dict[str, dict]) -> list[str]:
    """Per variant over seeds: final loss, its paired gap to the variant's own baseline, the DP bytes over every
    iteration of the run (warm-ups included) and per iteration after the warm-up (the last iteration), each
    against the baseline's (a variant without traffic: inf), and the rounds of communication."""
    tail = max(1, len(runs["none"][0]) // 10)
    final = {name: [sum(r["loss"] for r in recs[-tail:]) / tail for recs in per_seed] for name, per_seed in runs.items()}

    def dp(recs):
        return sum(w for r in recs for k, (w, _) in r["traffic"].items() if is_dp(k))

    def dp_last(recs):  # per iteration over the second half of the run (after every warm-up of the suite)
        return dp(recs[len(recs) // 2:]) / max(1, len(recs) - len(recs) // 2)

    lines = [f"### {suite}: final loss (mean of the last {tail} iterations) over {len(final['none'])} seeds", "",
             "Each variant is compared, seed by seed, with its own uncompressed optimizer (column `baseline`). DP bytes "
             "count every data-parallel message of every iteration (warm-up, switch and all-gathers included), "
             "all ranks; `after warm-up` is the mean per iteration over the second half of the run.", "",
             "| variant | baseline | final loss, mean ± std | vs baseline, paired mean ± std | per seed | "
             "DP MB over the run | x fewer than baseline | DP MB/iter after warm-up | x fewer than baseline | rounds / iterations |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    iters = len(runs["none"][0])
    dp_bytes = {name: (dp(per_seed[0]), dp_last(per_seed[0])) for name, per_seed in runs.items()}
    for name, vals in final.items():
        ref = meta[name].get("baseline") or "none"
        rel = [100 * (v - b) / b for v, b in zip(vals, final[ref])]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        rsd = statistics.stdev(rel) if len(rel) > 1 else 0.0
        (total, last), (base_total, base_last) = dp_bytes[name], dp_bytes[ref]
        rounds = meta[name].get("rounds")
        lines.append(f"| {name} | {ref if name != ref else '-'} | {statistics.mean(vals):.4f} ± {sd:.4f} | "
                     f"{statistics.mean(rel):+.2f}% ± {rsd:.2f}% | {', '.join(f'{x:+.2f}%' for x in rel)} | "
                     f"{total / 1e6:.2f} | {(base_total / total) if total else float('inf'):.1f}x | {last / 1e6:.4f} | {(base_last / last) if last else float('inf'):.1f}x | "
                     f"{rounds if rounds is not None else '-'} / {iters} |")
    return lines + [""]


def plot(suite: str, runs: dict[str, list[dict]], out: Path, frozen_names: set[str],
         baselines: Optional[dict] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(raw):
        win = max(1, len(raw) // 30)  # centred-enough running mean: per-iteration losses are noisy
        return [sum(raw[max(0, i - win + 1):i + 1]) / len(raw[max(0, i - win + 1):i + 1]) for i in range(len(raw))]

    colours = plt.get_cmap("tab20").colors
    style = {name: dict(color=colours[i % len(colours)], linestyle="--" if name in frozen_names else "-", linewidth=1.2)
             for i, name in enumerate(runs)}
    kinds = ("loss", "loss_vs_bytes") + (("gap",) if "none" in runs else ())
    for kind in kinds:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        for name, recs in runs.items():
            raw = [r["loss"] for r in recs]
            if kind == "gap":  # against the same optimizer's uncompressed run, iteration by iteration
                ref = (baselines or {}).get(name) or (
                    "none, frozen v" if name in frozen_names and "none, frozen v" in runs else "none")
                if name == ref or name == "none":
                    continue
                raw = [100 * (a["loss"] - b["loss"]) / b["loss"] for a, b in zip(recs, runs[ref])]
            y = smooth(raw)
            if kind in ("loss", "gap"):
                x = [r["iteration"] for r in recs]
            else:
                total, x = 0, []
                for r in recs:
                    total += r["wire_bytes"]
                    x.append(total / 1e6)
            ax.plot(x, y, label=name, **style[name])
        ax.set_xlabel("cumulative wire MB (all ranks)" if kind == "loss_vs_bytes" else "iteration")
        ax.set_ylabel("gap to uncompressed, same optimizer (%)" if kind == "gap"
                      else "training loss (nats/token, running mean)")
        ax.set_title(f"{suite} suite: " + {"loss": "loss vs iteration", "loss_vs_bytes": "loss vs bytes on the wire",
                                            "gap": "loss gap vs iteration (dashed: frozen v)"}[kind])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{suite}_{kind}.png", dpi=110)
        plt.close(fig)


def summarise_probes(suite: str, runs: list[dict]) -> list[str]:
    """Compression error measured during training (runs with ``error_probe_interval``): per variant and path, the
    relative error of what the path delivered, averaged over the probed iterations and seeds, the worst call's and
    the largest kurtosis of its inputs; then per call (layer order) of the suite's last probed variant."""
    probed = [r for r in runs if r.get("probe")]
    if not probed:
        return []
    paths = sorted({p for r in probed for p in r["probe"]["paths"]})
    lines = [f"#### {suite}: compression error during training (relative L2 error of what each path delivers, "
             f"probed every {probed[0]['compression'].get('error_probe_interval', '?')} iterations and on the first; "
             f"mean over probed iterations and seeds / worst call / largest input kurtosis)", "",
             "| variant | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    by_variant: dict[str, list[dict]] = {}
    for r in probed:
        by_variant.setdefault(r["variant"], []).append(r)
    for name, rs in by_variant.items():
        cells = []
        for p in paths:
            rows = [row for r in rs for row in r["probe"]["paths"].get(p, [])]
            cells.append(f"{statistics.mean(x[0] for x in rows):.2e} / {max(x[1] for x in rows):.2e} / "
                         f"{max(x[3] for x in rows):.0f}" if rows else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    last = list(by_variant)[-1]
    calls: dict[str, list] = {}
    for r in by_variant[last]:
        for k, (key, numel, rel, crest, kurt) in r["probe"]["calls"].items():
            c = calls.setdefault(k, [key, numel, [], 0.0, 0.0])
            c[2].append(rel)
            c[3], c[4] = max(c[3], crest), max(c[4], kurt)
    lines += ["", f"Per call of `{last}` (calls of a path in the order a probed iteration makes them; the key "
              f"names the layer or bucket where the caller gives one):", "",
              "| path | call | key | elements | relative error | max crest | max kurtosis |", "|---|---|---|---|---|---|---|"]
    for k in sorted(calls, key=lambda k: (k.split("#")[0], int(k.split("#")[1]))):
        key, numel, rels, crest, kurt = calls[k]
        lines.append(f"| {k.split('#')[0]} | {k.split('#')[1]} | {key} | {numel:,} | {statistics.mean(rels):.2e} | "
                     f"{crest:.1f} | {kurt:.1f} |")
    return lines + [""]


def report(results: dict, out: Path, command: str) -> list[str]:
    """convergence.md's lines and the plots, from a results.json object alone."""
    lines = ["# Convergence: compressed vs uncompressed pretraining", "",
             f"Command: `{results['command']}`; tiny GPT ({results['config']}), {results['nproc']} gloo ranks, "
             f"{results['iters']} iterations, same seed and data order for every variant.", "",
             f"Per-run results: `results.json`. This page and its plots are regenerated from it (no training) by "
             f"`{command}`.", ""]
    for suite in dict.fromkeys(run["suite"] for run in results["runs"]):
        per_seed: dict[str, list[list[dict]]] = {}
        frozen_names = set()
        for run in results["runs"]:
            if run["suite"] == suite:
                per_seed.setdefault(run["variant"], []).append(pm.expand_run(run))
                if frozen(run):
                    frozen_names.add(run["variant"])
        meta = {run["variant"]: run for run in results["runs"] if run["suite"] == suite}
        if any("baseline" in run for run in meta.values()):
            lines += summarise_baselines(suite, per_seed, meta)
        elif any(run["seed"] is not None for run in results["runs"] if run["suite"] == suite):
            lines += summarise_seeds(suite, per_seed, frozen_names)
        else:
            lines += summarise(suite, {name: recs[0] for name, recs in per_seed.items()})
        lines += summarise_probes(suite, [run for run in results["runs"] if run["suite"] == suite])
        lines += [f"![{suite} loss]({suite}_loss.png)", f"![{suite} bytes]({suite}_loss_vs_bytes.png)",
                  f"![{suite} gap]({suite}_gap.png)", ""]
        plot(suite, {name: recs[0] for name, recs in per_seed.items()}, out, frozen_names,  # the first seed
             {name: run.get("baseline") for name, run in meta.items()})
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--config", default="configs/gpt_tiny.yaml")
    p.add_argument("--suites", default="dp,pp", help="dp, pp, ef (the long error-feedback suite), frozen, zero (the error-feedback acceptance set, use --seeds) "
                        "and/or diloco, diloco_sweep, diloco_regime (local steps); every suite: benchmarks/convergence_suites.py")
    p.add_argument("--out", default="results/convergence", help="the study: results.json, convergence.md, plots")
    p.add_argument("--runs", default="results/convergence_runs",
                   help="the runs' own logs (metrics.jsonl, stdout, preset), one directory per suite/variant/seed")
    p.add_argument("--reuse", action="store_true", help="keep runs whose metrics.jsonl in --runs already has --iters "
                                                        "records (same code and settings: the runs are deterministic)")
    p.add_argument("--from-results", action="store_true",
                   help="no training: regenerate convergence.md and the plots from --out/results.json")
    p.add_argument("--seeds", default="", help="comma list of seeds: run every variant once per seed and report "
                                               "mean ± std (plots show the first seed)")
    p.add_argument("--variants", default="", help="comma list: run only these variants of the suites (default: all)")
    p.add_argument("--merge", action="store_true",
                   help="add the runs to --out/results.json (replacing runs of the same suite, variant and seed) "
                        "instead of starting a new one; the commands are recorded one after the other")
    args = p.parse_args()
    out = Path(args.out)
    regenerate = f"python -m benchmarks.convergence --from-results --out {args.out}"
    if args.from_results:
        results = pm.read_results(out / "results.json")
    else:
        out.mkdir(parents=True, exist_ok=True)
        seeds = [int(x) for x in args.seeds.split(",") if x] or [None]
        for suite in args.suites.split(","):
            prepare(suite, args)
        known = {name for suite in args.suites.split(",") for name in SUITES[suite]["variants"]}
        only, unknown = split_variants(args.variants, known)
        if unknown:
            raise SystemExit(f"--variants: {sorted(unknown)} not in suites {args.suites}")
        runs = [run_variant(suite, name, comp, args, seed) for suite in args.suites.split(",")
                for name, comp in SUITES[suite]["variants"].items() if not only or name in only for seed in seeds]
        command = shlex.join([sys.executable.split("/")[-1]] + invocation())  # quoted: variant names have spaces
        if args.merge and (out / "results.json").exists():
            old = pm.read_results(out / "results.json")
            if (old["config"], old["nproc"], old["iters"]) != (args.config, args.nproc, args.iters):
                raise SystemExit(f"--merge: {out / 'results.json'} was made with config/nproc/iters "
                                 f"{old['config']}/{old['nproc']}/{old['iters']}, not {args.config}/{args.nproc}/{args.iters}")
            new = {(r["suite"], r["variant"], r["seed"]) for r in runs}
            runs = [r for r in old["runs"] if (r["suite"], r["variant"], r["seed"]) not in new] + runs
            # the tables list variants in run order: keep the suite's own order (a re-run baseline stays first)
            order = {(s, v): i for s, spec in SUITES.items() for i, v in enumerate(spec["variants"])}
            runs.sort(key=lambda r: order.get((r["suite"], r["variant"]), len(order)))
            command = f"{old['command']}; then {command}"
        results = {"study": "convergence", "command": command,
                   "config": args.config, "nproc": args.nproc, "iters": args.iters, "runs": runs}
        pm.write_results(out / "results.json", results)
    lines = report(results, out, regenerate)
    (out / "convergence.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

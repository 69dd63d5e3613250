"""``python -m megacomp.plan``: rank megacomp's methods for a model on a cluster and write the chosen one's
compression YAML and pretraining config.

    python -m megacomp.plan --model configs/gpt_7b.yaml --gpus 256 --nodes 32 --sites 2 \
        --inter-node 100gbit --inter-site 10gbit,20ms --out plan/

For every method (megacomp.plan.methods) it tries every layout TP x PP x DP (TP inside a node, sequence parallel
when TP > 1; local-step methods one replica per site) and keeps the method's fastest; the table is sorted by step
time. The choice (the fastest, or ``--choose NAME``) is written as ``compression.yaml`` (megacomp's compression
config) and ``pretrain.yaml`` (the model's config with the layout, the method's settings and
``compression: compression.yaml``: ``python -m megacomp.pretrain --config OUT/pretrain.yaml``), and a plot of step
time against the slowest link's bandwidth for the top methods (``step_vs_bandwidth.png``, with matplotlib).

Failure behaviour: unknown hardware or backend, a link that does not parse, GPUs that do not divide into nodes and
sites, or a ``--layout`` that does not divide, print one line naming the fix and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import dataclasses
import sys
from pathlib import Path
from typing import Optional

import yaml

from ..config import load_yaml
from .cluster import TIERS, Cluster, device, parse_link
from .estimate import StepEstimate, estimate
from .methods import Method, catalogue
from .routing import Routes
from .workload import Layout, ModelSpec

REPO = Path(__file__).resolve().parents[2]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: ModelSpec, cluster: Cluster) -> list[Layout]:
    """Every layout that fits: TP a divisor of the GPUs per node (and of the heads), PP a divisor of the layers,
    sequence parallelism on whenever TP > 1."""
    out = []
    for tp in _divisors(cluster.gpus_per_node):
        for pp in _divisors(cluster.gpus // tp):
            dp = cluster.gpus // (tp * pp)
            lay = Layout(tp, pp, dp, 1, tp > 1)
            try:
                lay.check(model, cluster.gpus)
            except ValueError:
                continue
            out.append(lay)
    return out


def best(model: ModelSpec, cluster: Cluster, method: Method, candidates: list[Layout], replicas: int,
         routes: Optional[Routes] = None) -> Optional[StepEstimate]:
    """The fastest estimate of ``method`` over ``candidates`` whose memory fits the device (None when no layout
    fits its replicas or the memory)."""
    found, routes = None, routes or Routes(cluster)
    for lay in candidates:
        if method.schedule == "local_steps" and lay.dp % replicas:
            continue
        e = estimate(model, lay, cluster, method, replicas, routes)
        if e.memory_bytes > cluster.device.memory_bytes:
            continue
        if found is None or e.step_s < found.step_s:
            found = e
    return found


def table(results: list[StepEstimate]) -> str:
    """The ranked table (Markdown)."""
    head = ("| rank | method | settings | layout | step s | compute util. | MFU | B/token intra / inter-node / "
            "inter-site | memory GiB | loss cost (measured on small models) |")
    lines = [head, "|" + "---|" * 10]
    for i, e in enumerate(results, 1):
        bpt = e.bytes_per_token()
        lines.append(f"| {i} | {e.method.name} | {e.method.describe()} | {e.layout} | {e.step_s:.3f} | "
                     f"{100 * e.utilisation:.1f}% | {100 * e.mfu:.1f}% | "
                     + " / ".join(f"{bpt[t]:,.0f}" for t in TIERS)
                     + f" | {e.memory_bytes / 2 ** 30:.1f} | {e.method.loss_cost} |")
    return "\n".join(lines)


def compression_mapping(method: Method) -> dict:
    """The compression config mapping of ``method`` (a preset's file contents for preset methods)."""
    comp = dict(method.compression)
    if "preset" in comp:
        return load_yaml(str(REPO / "configs" / "compression" / f"{comp['preset']}.yaml"))
    return json.loads(json.dumps(comp))  # fresh objects: YAML without anchors and aliases


def pretrain_config(model_yaml: str, e: StepEstimate, compression_file: str) -> dict:
    """The chosen run's pretraining YAML mapping: the model file's settings, the layout, the method's flags."""
    data = dict(load_yaml(model_yaml))
    data.update({"tensor_model_parallel_size": e.layout.tp, "pipeline_model_parallel_size": e.layout.pp,
                 "sequence_parallel": e.layout.sequence_parallel, "compression": compression_file})
    data.update(e.method.flags)
    return data


def flags_text(data: dict) -> str:
    """The same settings as megacomp-pretrain command-line flags."""
    out = []
    for k, v in data.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        elif isinstance(v, dict):
            out.append(f"{flag} '{yaml.safe_dump(v, default_flow_style=True).strip()}'")
        else:
            out.append(f"{flag} {v}")
    return " ".join(out)


def plot(model: ModelSpec, cluster: Cluster, picks: list[StepEstimate], replicas: int, path: str) -> bool:
    """Step time of the top methods (their chosen layouts) against the slowest tier's bandwidth, from 1/16 to 16x
    the given one; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tier = "inter_site" if cluster.sites > 1 else "inter_node" if cluster.nodes > 1 else "intra_node"
    base = cluster.link(tier)
    scales = [2.0 ** k for k in range(-4, 5)]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    clusters = [dataclasses.replace(cluster, **{tier: dataclasses.replace(base, bandwidth_Bps=base.bandwidth_Bps * k)})
                for k in scales]
    routes = [Routes(c) for c in clusters]
    for e in picks:
        xs = [c.link(tier).bandwidth_Bps * 8 / 1e9 for c in clusters]
        ys = [estimate(model, e.layout, c, e.method, replicas, r).step_s for c, r in zip(clusters, routes)]
        ax.plot(xs, ys, marker="o", label=f"{e.method.name} ({e.layout})")
    ax.set(xscale="log", yscale="log", xlabel=f"{tier.replace('_', '-')} bandwidth (Gbit/s)", ylabel="step time (s)",
           title=f"{model.name} on {cluster.gpus} x {cluster.device.name}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m megacomp.plan", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="pretraining YAML with the model and batch (configs/gpt_7b.yaml)")
    p.add_argument("--gpus", type=int, required=True, help="total GPUs")
    p.add_argument("--nodes", type=int, default=1, help="nodes (equal GPUs each)")
    p.add_argument("--sites", type=int, default=1, help="sites / datacenters (equal nodes each)")
    p.add_argument("--hardware", default="h100", help="device: " + ", ".join(["v100", "a100", "h100", "h200", "b200"]))
    p.add_argument("--mfu", type=float, default=None, help="achieved fraction of peak FLOP/s (default: the device's 0.45)")
    p.add_argument("--intra-node", default="3600gbit,3us,0.8", help="per-GPU link inside a node: RATE[,LATENCY[,EFFICIENCY]] "
                   "(latency 3 us and efficiency 0.8 when not given)")
    p.add_argument("--inter-node", default="3200gbit,10us", help="per-node link between nodes of a site (10 us, 0.9 when not given)")
    p.add_argument("--inter-site", default="100gbit,20ms", help="per-site link between sites (20 ms, 0.9 when not given)")
    p.add_argument("--backend", default="nccl", help="the collectives' backend: nccl (GPUs, default) or gloo (CPU "
                   "training): it decides the bytes each link carries (docs/guide/plan.md)")
    p.add_argument("--layout", help="fix the layout as TPxPPxDP (e.g. 4x2x32) instead of searching")
    p.add_argument("--choose", help="write this method's files instead of the fastest's")
    p.add_argument("--out", help="folder for compression.yaml, pretrain.yaml and step_vs_bandwidth.png")
    p.add_argument("--top", type=int, default=4, help="methods in the plot (0: no plot)")
    return p


def run(argv=None) -> list[StepEstimate]:
    """Parse ``argv``, print the table, write the files; returns the ranked estimates. Raises ValueError on bad
    input (``main`` turns it into one line and exit status 2)."""
    a = build_parser().parse_args(argv)
    dev = device(a.hardware)
    if a.mfu:
        dev = dataclasses.replace(dev, mfu=a.mfu)
    cluster = Cluster(dev, a.gpus, a.nodes, a.sites, parse_link(a.intra_node, 3e-6, 0.8),
                      parse_link(a.inter_node, 10e-6), parse_link(a.inter_site, 20e-3), backend=a.backend)
    model = ModelSpec.from_yaml(a.model)
    if a.layout:
        try:
            tp, pp, dp = (int(x) for x in a.layout.lower().split("x"))
        except ValueError:
            raise ValueError(f"--layout {a.layout!r}: write TPxPPxDP, e.g. 4x2x32") from None
        lay = Layout(tp, pp, dp, 1, tp > 1)
        lay.check(model, cluster.gpus)
        candidates = [lay]
    else:
        candidates = layouts(model, cluster)
        if not candidates:
            raise ValueError(f"no TP x PP x DP layout of {cluster.gpus} GPUs fits {model.name} (global batch "
                             f"{model.global_batch_size}, micro batch {model.micro_batch_size}): change the batch or GPUs")
    replicas = cluster.sites
    routes = Routes(cluster)
    results = [e for m in catalogue(replicas) if (e := best(model, cluster, m, candidates, replicas, routes)) is not None]
    results.sort(key=lambda e: e.step_s)
    if not results:
        raise ValueError(f"no method fits {model.name} in {dev.memory_bytes / 2 ** 30:.0f} GiB per {dev.name} on any "
                         f"layout: add GPUs or a bigger device")
    print(f"megacomp plan: {model.name} ({model.params / 1e9:.2f}B parameters, {model.tokens_per_iteration:,} tokens "
          f"per step) on {cluster.gpus} x {dev.name} in {cluster.nodes} nodes, {cluster.sites} sites, "
          f"{cluster.backend}; links: "
          + "; ".join(f"{t.replace('_', '-')} {cluster.link(t)}" for t in TIERS))
    print(f"assumed: MFU {dev.mfu:g}, codec {dev.codec_Bps / 1e9:.0f} GB/s, link efficiencies as given; local-step "
          f"methods: one replica per site ({replicas})")
    print(table(results))
    left = [m.name for m in catalogue(replicas) if m.name not in {e.method.name for e in results}]
    if left:
        print(f"left out (no layout fits {dev.memory_bytes / 2 ** 30:.0f} GiB per device): {', '.join(left)}")
    choice = results[0]
    if a.choose:
        named = [e for e in results if e.method.name == a.choose]
        if not named:
            raise ValueError(f"--choose {a.choose!r}: not one of the ranked methods ({', '.join(e.method.name for e in results)})")
        choice = named[0]
    print(f"choice: {choice.method.name} on {choice.layout}")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        comp = out / "compression.yaml"
        comp.write_text(f"# megacomp plan: {choice.method.name} ({choice.method.describe()})\n"
                        + yaml.safe_dump(compression_mapping(choice.method), sort_keys=False))
        cfg = pretrain_config(a.model, choice, str(comp.resolve()))
        (out / "pretrain.yaml").write_text(f"# megacomp plan: {choice.method.name} on {choice.layout}, "
                                           f"{choice.step_s:.3f} s/step predicted\n" + yaml.safe_dump(cfg, sort_keys=False))
        print(f"wrote {comp} and {out / 'pretrain.yaml'}")
        print(f"pretraining flags: --config {a.model} " + flags_text({k: v for k, v in cfg.items() if k not in load_yaml(a.model)
                                                   or load_yaml(a.model)[k] != v}))
        png = out / "step_vs_bandwidth.png"
        if a.top > 0:
            print(f"plot: {png}" if plot(model, cluster, results[:a.top], replicas, str(png))
                  else "plot skipped: matplotlib not installed")
    return results


def main(argv=None) -> int:
    """Entry point: ``run`` with bad input reported as one line (exit status 2)."""
    try:
        run(argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"megacomp plan: error: {err}", file=sys.stderr)
        return 2
    return 0

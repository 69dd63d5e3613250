"""megacomp.plan: which compression for my cluster — a step-time model of every method.

    from megacomp.plan import Cluster, Layout, ModelSpec, catalogue, device, estimate, parse_link
    model = ModelSpec.from_yaml("configs/gpt_7b.yaml")
    cluster = Cluster(device("h100"), 256, nodes=32, sites=2, inter_node=parse_link("100gbit"),
                      inter_site=parse_link("10gbit,20ms"))
    e = estimate(model, Layout(tp=8, pp=1, dp=32, sequence_parallel=True), cluster, catalogue(2)[0], replicas=2)
    e.step_s, e.utilisation, e.bytes_per_token(), e.memory_bytes

Modules: cluster (devices, links, tiers), workload (model, layout), wire (bytes per collective from the codecs),
routing (bytes per tier), methods (the catalogue), estimate (the step model), calibration (alpha-beta constants
fitted on shaped links), shaped_steps and cpu_work (the DP-step model of the shaped-link runs and the CPU work a
method adds besides its codecs), published (published runs), cli (``python -m megacomp.plan``). The model is an
analytical estimate: its errors against measurements and published runs are in benchmarks/results/plan.
"""
from .cluster import DEVICES, TIERS, Cluster, Device, Link, device, parse_link
from .estimate import StepEstimate, Transfer, collective_seconds, estimate, memory_per_device
from .methods import Method, catalogue, method
from .workload import Layout, ModelSpec

__all__ = ["DEVICES", "TIERS", "Cluster", "Device", "Link", "device", "parse_link", "StepEstimate", "Transfer",
           "collective_seconds", "estimate", "memory_per_device", "Method", "catalogue", "method", "Layout", "ModelSpec"]

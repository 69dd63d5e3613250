"""megacomp.integrations.fsdp on real FSDP2 (torch's fully_shard, gloo, CPU).

- Compression off: parameters after AdamW steps bit-identical to stock FSDP2 at DP 2 and 4 (tiny GPT), and at
  DP 4 with a topology of 2 nodes x 2 ranks (the hop-by-hop channels' uncompressed path is torch's collective).
- Compression on: the reduce-scatter and the all-gather of FSDP's flat buffers within the codec's bound;
  LoCo int4 gradients + int8 parameters train and count their bytes; resume through DCP bit-identical.
- Hop by hop (Topology.uniform(4, 2): 2 nodes x 2 ranks, set by hand): int4 + LoCo trains close to stock FSDP2;
  each hop's bytes equal the count derived from the codec's wire_bytes and FSDP's buffers (the slow hop a third
  of the flat form's, measured in the same run); the per-hop error-feedback state resumes bit for bit through
  DCP; a codec per link kind and a node-local post-forward reshard group (reshard_after_forward=2) run and are
  counted under their links.
- Bad input: non-FSDP paths, PowerSGD, no FSDP unit, several parameter groups per unit, another world
  size or codec on load; a topology of another world size, not a Topology, uneven over the nodes, a per-hop
  setting without a topology or naming a hop not crossed, a flat checkpoint loaded hop by hop: one line each.
"""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

from codec_bounds import elementwise_bound, reduce_scatter_bound
from distributed import run_ranks
from megacomp import comm, parallel_state
from megacomp.compression import make_codec
from megacomp.config import ModelParallelConfig
from megacomp.integrations.fsdp import CompressedAllGather, CompressedReduceScatter, FSDPCompression
from megacomp.models.gpt import GPTConfig, GPTModel
from megacomp.placement import Topology

V, L = 64, 16
LOSSY = {"dp_gradient": {"name": "int4", "block_size": 64}, "dp_gradient_error_feedback": "loco",
         "dp_parameter": {"name": "int8", "block_size": 64}, "min_compress_numel": 0}


def _gpt(**shard):
    groups = parallel_state.initialize_model_parallel(1, 1)
    cfg = GPTConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_layers=2, vocab_size=V,
                    max_seq_length=L, seed=7)
    model = GPTModel(cfg, ModelParallelConfig(process_groups=groups))
    for block in model.layers:
        fully_shard(block, **shard)
    fully_shard(model)
    return model


def _steps(model, opt, first, count):
    losses = []
    for it in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * it + dist.get_rank())
        ids = torch.randint(0, V, (2, L), generator=g)
        loss = model(ids, torch.roll(ids, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _params(model):
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def _resume_through_dcp(build, path, done: int, more: int, after_save):
    """Train ``done`` steps of a fresh ``build()``, save through DCP (``after_save(comp)`` read then), train ``more``;
    then ``build()`` again, load, train the same ``more``. Returns (what after_save read, (losses, parameters) straight
    on, the same resumed)."""
    model, comp, opt = build()
    comm.reset_stats()
    _steps(model, opt, 0, done)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "megacomp": comp}, checkpoint_id=path)
    seen = after_save(comp)
    straight = _steps(model, opt, done, more), _params(model)
    parallel_state.destroy_model_parallel()
    model, comp, opt = build()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "megacomp": comp}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = _steps(model, opt, done, more), _params(model)
    parallel_state.destroy_model_parallel()
    return seen, straight, resumed


def _off_body(rank, world, per_node=0):
    out = {}
    for mode in ("stock", "megacomp"):
        model = _gpt()
        if mode == "megacomp":
            comp = FSDPCompression(None, topology=Topology.uniform(world, per_node) if per_node else None).apply(model)
            assert set(comp.units) == {"<root>", "layers.0", "layers.1"}
            if per_node:  # the units run on hop-by-hop channels over FSDP's own shard group
                assert [h.links for h in comp.hierarchies] == [("intra_node", "inter_node")]
                assert all(isinstance(ch, comm.HierarchicalChannel) for pair in comp.unit_channels.values()
                           for ch in pair)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        comm.reset_stats()
        _steps(model, opt, 0, 3)
        out[mode] = _params(model)
        counted = comm.stats()
        parallel_state.destroy_model_parallel()
    differ = [n for n in out["stock"] if not torch.equal(out["stock"][n], out["megacomp"][n])]
    assert not differ, differ
    return sorted(counted)


@pytest.mark.parametrize("world,per_node", [(2, 0), (4, 0), (4, 2)], ids=["dp2", "dp4", "dp4-2nodes"])
def test_compression_off_is_bit_identical_to_stock_fsdp2(world, per_node):
    for paths in run_ranks(_off_body, world, per_node, timeout=240):
        assert {"dp_gradient", "dp_parameter"} <= set(paths)  # the traffic went through megacomp's channels


def _bound_body(rank, world, spec):
    codec = make_codec(spec)
    comp = FSDPCompression({"dp_gradient": spec, "dp_parameter": spec, "min_compress_numel": 0})
    g = torch.Generator().manual_seed(rank)
    n = 4096
    full = torch.randn(world * n, generator=g) * torch.logspace(-3, 1, world * n)  # mixed magnitudes
    out = torch.empty(n)
    CompressedReduceScatter(comp.channels.dp_gradient, "k")(out, full.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
    parts = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(parts, full)
    chunks = [p[rank * n:(rank + 1) * n] for p in parts]
    exact = sum(c.double() for c in chunks) / world
    ok_rs = ((out.double() - exact).abs() <= reduce_scatter_bound(codec, chunks) / world * (1 + 2 ** -20)).all().item()
    shards = [p[r * n:(r + 1) * n] for r, p in enumerate(parts)]  # rank r's shard: its own chunk r
    gathered = torch.empty(world * n)
    CompressedAllGather(comp.channels.dp_parameter)(gathered, shards[rank].clone(), dist.group.WORLD, async_op=True)
    ok_ag = all(((gathered[r * n:(r + 1) * n].double() - shards[r].double()).abs()
                 <= elementwise_bound(codec, shards[r])).all().item() for r in range(world))
    return ok_rs, ok_ag, not torch.equal(gathered[:n], shards[0])


@pytest.mark.parametrize("spec", [dict(name="int8", block_size=64), dict(name="int4", block_size=32)],
                         ids=["int8", "int4"])
def test_compressed_fsdp_collectives_are_within_the_codec_bound(spec):
    for ok_rs, ok_ag, lossy in run_ranks(_bound_body, 2, spec):
        assert ok_rs and ok_ag and lossy


def _resume_body(rank, world, path):
    def build():
        model = _gpt()
        comp = FSDPCompression(LOSSY).apply(model)
        return model, comp, torch.optim.AdamW(model.parameters(), lr=1e-2)

    (wire, keys), straight, resumed = _resume_through_dcp(
        build, path, 3, 2, lambda comp: (comm.stats(), sorted(comp.channels.dp_gradient.error_feedback.keys())))
    assert straight[0] == resumed[0]
    differ = [n for n in straight[1] if not torch.equal(straight[1][n], resumed[1][n])]
    assert not differ, differ
    grad = wire["dp_gradient"]
    return keys, grad.wire_bytes / grad.uncompressed_bytes, wire["dp_parameter"].ratio


def test_lossy_training_counts_its_bytes_and_resumes_bit_for_bit_through_dcp(tmp_path):
    for keys, grad_ratio, param_ratio in run_ranks(_resume_body, 2, str(tmp_path / "ckpt"), timeout=240):
        assert keys == ["fsdp/<root>/worker", "fsdp/layers.0/worker", "fsdp/layers.1/worker"]
        # int4 + one fp32 scale per 64 values: (4 + 32/64) / 32 of fp32; int8 + scale: (8 + 0.5) / 32
        assert grad_ratio == pytest.approx(4.5 / 32, rel=0.02) and param_ratio == pytest.approx(8.5 / 32, rel=0.02)


def _bad_body(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    with pytest.raises(ValueError, match="no FSDP unit"):
        FSDPCompression(None).apply(torch.nn.Linear(4, 4))
    # two meshes (process groups) in one unit: torch makes two parameter groups and refuses custom collectives
    other = FSDPMeshInfo(mesh=init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("a", "b"))["a"], shard_mesh_dim=0)
    two = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(two, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p is two[1].weight else None)
    with pytest.raises(ValueError, match="one parameter group per unit"):
        FSDPCompression(None).apply(two)
    model = _gpt()
    comp = FSDPCompression(LOSSY).apply(model)
    state = comp.state_dict()
    with pytest.raises(ValueError, match="codec"):
        FSDPCompression(dict(LOSSY, dp_parameter="int4")).apply(model).load_state_dict(state)
    with pytest.raises(ValueError, match="no state for rank"):
        comp.load_state_dict({"rank9": b""})
    parallel_state.destroy_model_parallel()
    return True


def test_bad_input_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not FSDP traffic"):
        FSDPCompression({"tp_forward": "int8"})
    with pytest.raises(ValueError, match="element-wise codec"):
        FSDPCompression({"dp_gradient": {"name": "powersgd", "rank": 2}})
    with pytest.raises(ValueError, match="warmup"):
        FSDPCompression({"dp_gradient": "int4", "dp_gradient_warmup_steps": 3})
    assert all(run_ranks(_bad_body, 4, str(tmp_path), timeout=240))  # 4: a 2-rank mesh is another group


# -- hop by hop: 4 ranks as 2 nodes x 2 ranks ---------------------------------------------------------------------
NODES, PER_NODE = 2, 2


def _unit_numels(model, world):
    """Each FSDP unit's flat gradient / parameter buffer, derived from its parameters' global shapes: dim 0 of every
    parameter the unit manages (not a sub-unit's) padded to a multiple of the shard group's size."""
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    out = dict.fromkeys((u or "<root>" for u in units), 0)
    for name, p in model.named_parameters():
        owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len) or "<root>"
        rows = -(-p.shape[0] // world) * world
        out[owner] += rows * (p.numel() // p.shape[0])
    return out


def _hop_body(rank, world, steps):
    topo = Topology.uniform(world, PER_NODE)
    out = {}
    for mode in ("stock", "flat", "hops"):
        model = _gpt()
        if mode != "stock":
            comp = FSDPCompression(LOSSY, topology=topo if mode == "hops" else None).apply(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        comm.reset_stats()
        losses = _steps(model, opt, 0, steps)
        out[mode] = (losses, {k: (v.calls, v.wire_bytes) for k, v in comm.stats().items() if k.startswith("dp_")})
        if mode == "hops":
            out["numels"] = _unit_numels(model, world)
            out["ef"] = {k: tuple(v.shape) for k, v in
                         comp.unit_channels["layers.0"][0].error_feedback.state_dict()["errors"].items()}
        parallel_state.destroy_model_parallel()
    return out


def test_hop_by_hop_int4_loco_trains_and_its_slow_hop_carries_a_third_of_the_flat_bytes():
    world, steps = NODES * PER_NODE, 2
    res = run_ranks(_hop_body, world, steps, timeout=240)
    g, p = make_codec(LOSSY["dp_gradient"]), make_codec(LOSSY["dp_parameter"])
    numels = res[0]["numels"]
    assert numels == {"<root>": 2624, "layers.0": 8544, "layers.1": 8544}
    # FSDP2's schedule per step: one reduce-scatter per unit; one all-gather per unit in forward and one more in
    # backward for the units resharded after forward (every unit but the root)
    gathers = {u: 1 if u == "<root>" else 2 for u in numels}
    c = {u: n // world for u, n in numels.items()}  # each rank's shard of the unit
    expect_hops = {
        "dp_gradient": (3 * steps, steps * sum((NODES - 1) * g.wire_bytes(c[u]) for u in numels)),
        "dp_gradient@intra_node": (3 * steps, steps * sum((PER_NODE - 1) * (n // PER_NODE) * 4
                                                          for n in numels.values())),
        "dp_parameter": (5 * steps, steps * sum(gathers[u] * (NODES - 1) * p.wire_bytes(c[u]) for u in numels)),
        "dp_parameter@intra_node": (5 * steps, steps * sum(gathers[u] * (PER_NODE - 1) * NODES * c[u] * 4
                                                           for u in numels)),
    }
    expect_flat = {
        "dp_gradient": (3 * steps, steps * sum((world - 1) * g.wire_bytes(c[u]) for u in numels)),
        "dp_parameter": (5 * steps, steps * sum(gathers[u] * (world - 1) * p.wire_bytes(c[u]) for u in numels)),
    }
    for r in res:
        assert r["hops"][1] == expect_hops and r["flat"][1] == expect_flat
        for path in ("dp_gradient", "dp_parameter"):  # the slow link carries each node's bytes once
            assert r["hops"][1][path][1] * (world - 1) == r["flat"][1][path][1] * (NODES - 1)
        # error feedback per unit and hop: the slow hop's residual on the chunk it sends (half the buffer)
        assert r["ef"] == {f"fsdp/{u}/worker": (n // PER_NODE,) for u, n in numels.items()}
        # trains: every step's loss close to stock FSDP2's on the same data (int4 gradients, int8 parameters)
        stock, hops, flat = r["stock"][0], r["hops"][0], r["flat"][0]
        assert all(abs(a - b) < 0.01 * b for a, b in zip(hops, stock)) and hops != stock
        assert all(abs(a - b) < 0.01 * b for a, b in zip(flat, stock))


def _hop_bound_body(rank, world, spec):
    codec = make_codec(spec)
    linear = torch.nn.Linear(8, 8)
    fully_shard(linear)
    comp = FSDPCompression({"dp_gradient": spec, "dp_parameter": spec, "min_compress_numel": 0},
                           topology=Topology.uniform(world, PER_NODE)).apply(linear)
    grad, param = comp.unit_channels["<root>"]
    group = grad.group  # FSDP's own shard group: the one FSDP passes to the collectives
    nodes = [dist.new_group([n * PER_NODE + i for i in range(PER_NODE)]) for n in range(NODES)]
    g = torch.Generator().manual_seed(rank)
    n = 4096
    full = torch.randn(world * n, generator=g) * torch.logspace(-3, 1, world * n)  # mixed magnitudes
    out = torch.empty(n)
    rs = CompressedReduceScatter(grad, "k", comp._fallback("dp_gradient", grad))
    rs(out, full.clone(), group, dist.ReduceOp.AVG)
    parts = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(parts, full)
    exact = sum(x.double() for x in parts)[rank * n:(rank + 1) * n] / world
    sums = [parts[k * PER_NODE] + parts[k * PER_NODE + 1] for k in range(NODES)]  # fp32, as the fast hop adds
    bound = sum(elementwise_bound(codec, s[rank * n:(rank + 1) * n]) for s in sums) / world
    ok_rs = ((out.double() - exact).abs() <= bound + exact.abs() * world * 2.0 ** -22).all().item()
    ag = CompressedAllGather(param, comp._fallback("dp_parameter", param))
    shards = [x[r * n:(r + 1) * n] for r, x in enumerate(parts)]  # rank r's shard: its own chunk r
    gathered = torch.empty(world * n)
    ag(gathered, shards[rank].clone(), group, async_op=True)
    everyone = [torch.empty_like(gathered) for _ in range(world)]
    dist.all_gather(everyone, gathered)
    ok_ag = all(torch.equal(e, gathered) for e in everyone) and all(
        ((gathered[r * n:(r + 1) * n].double() - shards[r].double()).abs() <= elementwise_bound(codec, shards[r])).all()
        for r in range(world))
    # FSDP's calls on another group (here: this rank's node) run flat there, counted under that link
    comm.reset_stats()
    mine = nodes[rank // PER_NODE]
    local = torch.empty(PER_NODE * n)
    ag(local, shards[rank].clone(), mine)
    counted = {k: v.calls for k, v in comm.stats().items()}
    first = (rank // PER_NODE) * PER_NODE  # the node's first rank
    ok_local = all(((local[i * n:(i + 1) * n].double() - shards[first + i].double()).abs()
                    <= elementwise_bound(codec, shards[first + i])).all() for i in range(PER_NODE))
    with pytest.raises(ValueError, match="supports ReduceOp SUM and AVG, got PREMUL_SUM"):
        rs(out, full.clone(), group, dist.ReduceOp.PREMUL_SUM)
    return ok_rs, ok_ag, ok_local, counted


@pytest.mark.parametrize("spec", [dict(name="int8", block_size=64), dict(name="int4", block_size=32)],
                         ids=["int8", "int4"])
def test_hop_by_hop_fsdp_collectives_are_within_the_bound_of_what_each_hop_encodes(spec):
    for ok_rs, ok_ag, ok_local, counted in run_ranks(_hop_bound_body, NODES * PER_NODE, spec):
        assert ok_rs and ok_ag and ok_local
        assert counted == {"dp_parameter@intra_node": 1}


def _hop_resume_body(rank, world, path):
    topo = Topology.uniform(world, PER_NODE)

    def build():
        model = _gpt()
        comp = FSDPCompression(LOSSY, topology=topo).apply(model)
        return model, comp, torch.optim.AdamW(model.parameters(), lr=1e-2)

    keys, straight, resumed = _resume_through_dcp(
        build, path, 2, 2, lambda comp: sorted(comp.unit_channels["<root>"][0].error_feedback.keys()))
    differ = [n for n in straight[1] if not torch.equal(straight[1][n], resumed[1][n])]
    return keys, straight[0] == resumed[0], differ


def test_hop_by_hop_error_feedback_resumes_bit_for_bit_through_dcp(tmp_path):
    for keys, same_losses, differ in run_ranks(_hop_resume_body, NODES * PER_NODE, str(tmp_path / "ckpt"),
                                               timeout=240):
        assert keys == ["fsdp/<root>/worker", "fsdp/layers.0/worker", "fsdp/layers.1/worker"]
        assert same_losses and not differ, differ


def _per_link_body(rank, world):
    model = _gpt(reshard_after_forward=PER_NODE)  # the blocks keep a node-local shard after forward
    spec = dict(LOSSY, dp_gradient={"inter_node": LOSSY["dp_gradient"], "intra_node": "bf16"})
    comp = FSDPCompression(spec, topology=Topology.uniform(world, PER_NODE)).apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm.reset_stats()
    losses = _steps(model, opt, 0, 1)
    ef = {k: tuple(v.shape) for k, v in
          comp.unit_channels["<root>"][0].error_feedback.state_dict()["errors"].items() if k.startswith("fsdp/<root>")}
    stats = {k: (v.calls, v.wire_bytes, v.uncompressed_bytes) for k, v in comm.stats().items() if k.startswith("dp_")}
    numels = _unit_numels(model, world)
    parallel_state.destroy_model_parallel()
    return losses, ef, stats, numels


def test_codec_per_link_kind_and_a_node_local_post_forward_group_run_and_count_per_link():
    world = NODES * PER_NODE
    for losses, ef, stats, numels in run_ranks(_per_link_body, world, timeout=240):
        assert all(l == l and l < 10 for l in losses)  # noqa: E741  (finite)
        n = numels["<root>"]
        # a lossy fast hop keeps its own residual, on the whole buffer it reduce-scatters
        assert ef == {"fsdp/<root>/worker": (n // PER_NODE,), "fsdp/<root>@intra_node/worker": (n,)}
        calls, wire, raw = stats["dp_gradient@intra_node"]
        assert calls == 3 and wire * 2 == raw  # bf16 inside the node
        # forward gathers hop by hop (3 units); the blocks' backward re-gathers run flat on the node-local group,
        # counted under intra_node with the slow-hop-free flat channel (int8)
        assert stats["dp_parameter"][0] == 3 and stats["dp_parameter@intra_node"][0] == 3 + 2


def _bad_topology_body(rank, world):
    errors = []

    def expect(fn, match):
        with pytest.raises(ValueError, match=match) as e:
            fn()
        errors.append(str(e.value))

    expect(lambda: FSDPCompression(LOSSY, topology=Topology.uniform(2 * world, 2)), "places 8 ranks")
    expect(lambda: FSDPCompression(LOSSY, topology=2), "must be a megacomp.placement.Topology")
    model = _gpt()
    expect(lambda: FSDPCompression(LOSSY, topology=Topology((0, 0, 0, 1))).apply(model), "sit unevenly")
    expect(lambda: FSDPCompression(dict(LOSSY, dp_gradient={"inter_site": "int4"}),
                                   topology=Topology.uniform(world, 2)).apply(model), "inter_site hop")
    flat = FSDPCompression(LOSSY).apply(model).state_dict()
    hops = FSDPCompression(LOSSY, topology=Topology.uniform(world, 2)).apply(model)
    expect(lambda: hops.load_state_dict(flat), "saved with flat collectives only, this run has hop by hop")
    parallel_state.destroy_model_parallel()
    return errors


def test_bad_topology_is_refused_in_one_line():
    with pytest.raises(ValueError, match="needs the cluster's topology") as e:
        FSDPCompression({"dp_gradient": {"inter_node": "int4"}})
    assert "\n" not in str(e.value)
    for errors in run_ranks(_bad_topology_body, NODES * PER_NODE, timeout=240):
        assert len(errors) == 5 and all("\n" not in m for m in errors), errors

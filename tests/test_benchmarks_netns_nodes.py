"""benchmarks/netns_nodes.py's pure parts: reading the veth counters, attributing bytes to iterations, the runs'
arguments, the plan's prediction and the table (the namespaces themselves need root and are not built here)."""
import pytest


def nodes():
    """benchmarks.netns_nodes, imported when a test runs: imported while pytest collects every module, it left a
    later forked DTensor test (test_integrations_torchtitan) hanging in the full quick subset."""
    import benchmarks.netns_nodes

    return benchmarks.netns_nodes


NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:  123456     100    0    0    0     0          0         0   123456     100    0    0    0     0       0          0
  mcnA: 5000000    4000    0    0    0     0          0         0  7000000    5000    0    0    0     0       0          0
"""


def test_parse_net_dev():
    assert nodes().parse_net_dev(NET_DEV, "mcnA") == (5_000_000, 7_000_000)
    with pytest.raises(KeyError):
        nodes().parse_net_dev(NET_DEV, "mcnB")


def test_bytes_between_the_samples_that_first_show_each_boundary():
    # (time, metrics lines, tx A, tx B): iteration k ends when line k appears; 1000 bytes per iteration on A
    samples = [(0.0, 0, 0, 0), (1.0, 1, 500, 400), (2.0, 2, 1500, 1400), (2.5, 2, 1700, 1500), (3.0, 3, 2500, 2400),
               (4.0, 4, 3500, 3400)]
    att = nodes().attribute_bytes(samples, skip=2, iters=4)
    assert att["A"]["bytes"] == 2000 and att["A"]["per_iter"] == 1000 and att["B"]["per_iter"] == 1000
    assert att["A"]["per_iter_list"] == [1000, 1000] and att["window_s"] == 2.0
    low, high = att["A"]["bounds"]
    assert low <= 1000 <= high
    with pytest.raises(ValueError, match="iterations 2 and 5"):
        nodes().attribute_bytes(samples, skip=2, iters=5)


def test_run_arguments():
    assert nodes().micro_batch(16, 8) == 2
    with pytest.raises(ValueError, match="must divide by the DP size 6"):
        nodes().micro_batch(16, 6)
    argv = nodes().pretrain_argv("hier", 4, 12, 3, "/tmp/x")
    assert argv[:2] == ["-m", "megacomp.pretrain"]
    assert argv[argv.index("--micro-batch-size") + 1] == "2" and argv[argv.index("--seed") + 1] == "3"
    assert argv[-4:] == ["--compression", "loco4_qwz", "--dp-collectives", "auto"]
    assert nodes().pretrain_argv("flat", 2, 12, 1, "/tmp/x")[-1] == "flat"


def test_the_plans_bytes_do_not_grow_with_m_hop_by_hop_and_do_flat():
    hier = [nodes().planned_bytes("hier", m) for m in (1, 2, 4)]
    flat = [nodes().planned_bytes("flat", m) for m in (1, 2, 4)]
    assert hier[0] == pytest.approx(flat[0])  # one rank per node: nothing to combine
    assert max(hier) < 1.05 * min(hier)  # only the uncompressed 1-D parameters' ring share changes
    assert flat[2] > 2 * flat[0]
    from benchmarks.netns_nodes_check import expected_collective_bytes

    assert expected_collective_bytes("all_to_all", 4, 800) == 4 * 4 * 800 / 8
    assert expected_collective_bytes("all_reduce", 1, 800) == 800


def test_summary_and_table_row():
    metrics = [{"iteration_time_s": 1.0, "loss": 5.0 - i / 10, "wire_bytes": 300, "uncompressed_bytes": 900,
                "traffic": {"dp_gradient": [100, 300], "dp_gradient@intra_node": [200, 200]}} for i in range(4)]
    att = nodes().attribute_bytes([(0.0, 2, 0, 0), (1.0, 4, 100, 100)], skip=2, iters=4)
    rec = {"rate": "100mbit", "variant": "hier", "m": 2, "seed": 1, "run_s": 10.0, **nodes().summarise_run(metrics, att)}
    assert rec["megacomp_intra_node_per_iter"] == 200 and rec["crossing_fraction"] == pytest.approx(50 / 50)
    row = nodes().table([rec])[-1]
    assert row.startswith("| 100mbit | hier (seed 1) | 2 | 4 | 0.00 / 0.00 |") and "4.7000" in row


def engines():
    import benchmarks.netns_nodes_engines

    return benchmarks.netns_nodes_engines


def test_engine_run_arguments():
    argv = nodes().run_argv("fsdp2", "hier", 4, 12, 3, "/tmp/x")
    assert argv[:4] == ["-m", "benchmarks.netns_nodes_engines", "--engine", "fsdp2"]
    assert argv[argv.index("--micro-batch-size") + 1] == "2" and argv[argv.index("--seed") + 1] == "3"
    assert argv[-4:] == ["--compression", "loco4_qwz", "--dp-collectives", "auto"]
    assert nodes().run_argv("ddp_hook", "flat", 2, 12, 1, "/tmp/x")[-1] == "flat"
    assert nodes().run_argv("pretrain", "hier", 4, 12, 3, "/tmp/x") == nodes().pretrain_argv("hier", 4, 12, 3, "/tmp/x")
    assert set(engines().VARIANTS) == set(nodes().VARIANTS)
    with pytest.raises(KeyError, match="unknown engine"):
        engines().engine_argv("zero3", "hier", 2, 12, 1, "/tmp/x")


def test_engine_targets():
    numels = engines().model_numels()
    assert numels == {"total": 3_438_080, "layers": 3_159_040}  # the 3.44M GPT; megacomp.plan's ModelSpec agrees
    from megacomp.compression import make_codec

    grad = make_codec("int4", block_size=128).wire_bytes(numels["total"])
    param = make_codec("int8", block_size=256).wire_bytes
    # two nodes: the all-reduce's reduce-scatter and all-gather each send half the encoding
    assert engines().target_bytes("ddp_hook", "hier", 4, numels) == pytest.approx(grad)
    assert engines().target_bytes("ddp_hook", "hier", 4, numels, nodes=4) == pytest.approx(1.5 * grad)
    # FSDP2: one reduce-scatter, the layers gathered in forward and backward, the root once
    fsdp = engines().target_bytes("fsdp2", "hier", 2, numels)
    assert fsdp == pytest.approx((grad + param(3_438_080) + param(3_159_040)) / 2)
    assert 4.2e6 < fsdp < 4.3e6
    assert engines().target_bytes("fsdp2", "flat", 2, numels) is None
    assert engines().target_bytes("ddp_hook", "none", 1, numels) is None


def test_engine_table_row():
    metrics = [{"iteration_time_s": 1.0, "loss": 5.0 - i / 10, "wire_bytes": 300, "uncompressed_bytes": 900,
                "traffic": {"dp_gradient": [100, 300], "dp_gradient@intra_node": [200, 200]}} for i in range(4)]
    att = nodes().attribute_bytes([(0.0, 2, 0, 0), (1.0, 4, 3_652_000, 3_652_000)], skip=2, iters=4)
    rec = {"engine": "ddp_hook", "rate": "100mbit", "variant": "hier", "m": 2, "seed": 1, "run_s": 10.0,
           **nodes().summarise_run(metrics, att)}
    lines = engines().table([rec, {**rec, "variant": "flat"}])
    assert lines[0].startswith("| engine | link |") and len(lines) == 4
    assert lines[2].startswith("| ddp_hook | 100mbit | hier (seed 1) | 2 | 4 | 1.83 / 1.83 | 1.83 (1.000) |")
    assert "| 1.83 / 1.83 | - |" in lines[3]  # no target for flat

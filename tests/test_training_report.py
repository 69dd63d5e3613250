"""megacomp.training.report: the link kind each group's traffic crosses, and the end-of-run bytes per link kind."""
from __future__ import annotations

from megacomp.training.report import RunTotals, layout_tiers, ranks_per_node, tiers_line, traffic_group


def test_layout_tiers_follow_the_rank_grid():
    # 16 ranks, 8 per node, TP 2 x PP 2 x DP 4: TP and DP groups stay in a node, the two stages sit on two nodes
    assert layout_tiers(16, 2, 2, 8) == {"tp": "intra_node", "dp": "intra_node", "pp": "inter_node"}
    assert layout_tiers(16, 2, 1, 4)["dp"] == "inter_node"
    assert layout_tiers(4, 1, 1, 4) == {"tp": "intra_node", "dp": "intra_node", "pp": "intra_node"}
    assert [traffic_group(k) for k in ("sp_all_gather", "tp_backward", "loqt_merge_tp", "pp_gradient", "outer",
                                       "dp_momentum")] == ["tp", "tp", "tp", "pp", "dp", "dp"]
    assert "TP traffic intra-node" in tiers_line(layout_tiers(16, 2, 2, 8), 8)


def test_ranks_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node(16) == 4
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_node(16) == 16


def test_summary_adds_bytes_per_link_kind():
    t = RunTotals(tiers=layout_tiers(16, 2, 2, 4))  # TP inside a node, DP and PP across nodes
    t.add({"iteration_time_s": 1.0, "loss": 3.0, "iteration": 1,
           "traffic": {"tp_forward": [1e6, 4e6], "dp_gradient": [2e6, 8e6], "pp_activation": [5e5, 2e6]}}, 1000)
    text = t.summary(1)
    assert "intra-node                 1.00 MB, 1,000.0 per token" in text
    assert "inter-node                 2.50 MB, 2,500.0 per token" in text
    assert "per link kind" not in RunTotals().summary(0)
    assert "between-replica-groups" not in text  # only runs across torchft replica groups have that link
    ft = RunTotals(tiers=layout_tiers(2, 1, 1, 2))
    ft.add({"iteration_time_s": 1.0, "loss": 3.0, "iteration": 1,
            "traffic": {"dp_gradient": [1e6, 4e6], "replicas": [3e6, 3e6]}}, 1000)
    text = ft.summary(1)
    assert traffic_group("replicas") == "replicas"
    assert "intra-node                 1.00 MB" in text and "between-replica-groups     3.00 MB, 3,000.0 per token" in text


def test_summary_tokens_per_second_leave_out_the_first_iterations_one_time_costs():
    """The first iteration builds the C++ kernels (a minute on a fresh machine): the summary's rate is over the
    iterations after it, says so, and names the first iteration's time; one iteration reports its own rate."""
    t = RunTotals()
    for it, seconds in ((1, 50.0), (2, 0.25), (3, 0.25)):
        t.add({"iteration_time_s": seconds, "loss": 3.0, "iteration": it, "traffic": {}}, 1000)
    head = t.summary(3).splitlines()[0]
    assert ("3,000 tokens in 50.5 s (4,000 tok/s after the first iteration, which took 50.0 s with the run's one-time "
            "costs)") in head
    one = RunTotals()
    one.add({"iteration_time_s": 2.0, "loss": 3.0, "iteration": 7, "traffic": {}}, 1000)
    assert "1,000 tokens in 2.0 s (500 tok/s, one iteration: one-time costs included)" in one.summary(7)

"""benchmarks.convergence helpers that need no training run."""
from benchmarks.convergence import _rounds, split_variants, summarise_baselines


def test_variant_names_with_commas_split_by_longest_known_name():
    known = {"DPU", "DPU, int4+LoCo, int8 params", "none"}
    assert split_variants("DPU,DPU, int4+LoCo, int8 params", known) == ({"DPU", "DPU, int4+LoCo, int8 params"}, set())
    assert split_variants("none,bogus", known) == ({"none"}, {"bogus"})
    assert split_variants("", known) == (set(), set())


def _records(n, every, kind="dp_gradient", loss=4.0):
    return [{"iteration": i + 1, "loss": loss, "traffic": {kind: [8 if (i + 1) % every == 0 else 0, 8]}}
            for i in range(n)]


def test_rounds_count_the_iterations_that_sent_dp_or_outer_traffic():
    assert _rounds(_records(10, 1)) == 10                     # AdamW: every step reduces gradients
    assert _rounds(_records(10, 5, kind="outer")) == 2        # a local-step loop: its exchanges
    assert _rounds(_records(10, 100, kind="outer")) == 0      # replicas that never synchronise
    assert _rounds([*_records(3, 1)[:-1], {"dp_rounds": 7, "traffic": {}}]) == 7  # the optimizer's own count


def test_baseline_table_compares_bytes_with_the_variants_own_baseline_and_survives_no_traffic():
    runs = {"none": [_records(10, 1)], "none, wide": [_records(10, 1, loss=3.0)],
            "local, wide": [_records(10, 5, "outer", 3.3)], "lone": [_records(10, 100, "outer", 4.4)]}
    for name in ("none, wide", "local, wide"):
        for r in runs[name][0]:
            for k in r["traffic"]:
                r["traffic"][k][0] *= 4  # a wider model: four times the bytes of 'none' per message
    meta = {"none": {}, "none, wide": {}, "local, wide": {"baseline": "none, wide"}, "lone": {"baseline": "none"}}
    rows = {line.split(" | ")[0].lstrip("| "): line for line in summarise_baselines("s", runs, meta) if line.startswith("| ")}
    assert "| 5.0x |" in rows["local, wide"] and "+10.00%" in rows["local, wide"]  # against 'none, wide', not 'none'
    assert "| infx |" in rows["lone"] and "+10.00%" in rows["lone"]

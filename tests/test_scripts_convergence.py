"""scripts/convergence.py helpers that need no training run."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from convergence import split_variants  # noqa: E402


def test_variant_names_with_commas_split_by_longest_known_name():
    known = {"DPU", "DPU, int4+LoCo, int8 params", "none"}
    assert split_variants("DPU,DPU, int4+LoCo, int8 params", known) == ({"DPU", "DPU, int4+LoCo, int8 params"}, set())
    assert split_variants("none,bogus", known) == ({"none"}, {"bogus"})
    assert split_variants("", known) == (set(), set())

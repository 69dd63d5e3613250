"""The quick subset (`pytest -m "not slow" tests`) runs some test of every test module."""

import os
import subprocess
import sys

from conftest import TESTS_BY_MODULE

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = "MEGACOMP_QUICK_SUBSET_CHILD"  # set in the run that collects every module, which must not start another


def test_every_module_keeps_a_quick_test(request):
    modules = {f for f in os.listdir(HERE) if f.startswith("test_") and f.endswith(".py")}
    counts = request.config.stash.get(TESTS_BY_MODULE, {})
    if not modules <= counts.keys():
        # This run collected only some modules: collect them all in a run of this test alone (-k deselects
        # after conftest has counted every module's tests)
        assert not os.environ.get(CHILD), f"{sorted(modules - counts.keys())} were not collected"
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", HERE, "-k", request.node.name],
            cwd=os.path.dirname(HERE),
            env={**os.environ, CHILD: "1"},
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        return
    # A module skipped whole (an optional dependency missing) has no tests to keep
    all_slow = sorted(m for m in modules if counts[m][1] and not counts[m][0])
    assert not all_slow, (
        f"every test of {all_slow} is marked slow, so `pytest -m 'not slow'` leaves the module out: "
        "keep its cheapest test off tests/slow_tests.txt (and unmarked)"
    )

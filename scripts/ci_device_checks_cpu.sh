#!/usr/bin/env bash
# CI: scripts/device_checks.sh (the one command of a lent GPU session) proven on CPU before a GPU's clock runs: its
# dry run (DEVICE_CHECKS_CPU=1: every step on CPU with tiny sizes, about 2 minutes on two cores) must pass and write
# the results page with every section, each step's status, the profiler trace and every codec's rows. A stage of its
# own rather than a test, so the pytest suite stays quick; tests/test_scripts_device_checks.py checks the rest.
#   bash scripts/ci_device_checks_cpu.sh            # work files under results/ci-device-checks (OUT=... elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/results/ci-device-checks}
rm -rf "$OUT" && mkdir -p "$OUT"
OUT=$OUT DEVICE_CHECKS_CPU=1 OMP_NUM_THREADS=1 bash scripts/device_checks.sh
"${PYTHON:-python}" - "$OUT" <<'PY'
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
page = (out / "README.md").read_text()
assert page.startswith("# Device checks: CPU (DEVICE_CHECKS_CPU=1 dry run)"), page[:200]
assert f"Command: `OUT={out} DEVICE_CHECKS_CPU=1 bash scripts/device_checks.sh`" in page
for section in ("## 1. Triton", "## 2. Codec kernels", "### fp32 inputs", "### bf16 inputs",
                "## 3. Host synchronisations", "**Verdict: PASS**", "## 4. End to end", "| off |", "| on (int8"):
    assert section in page, f"the page lacks {section!r}"
steps = [row.split("\t") for row in (out / "steps.tsv").read_text().splitlines()]
assert [s[0] for s in steps] == ["triton kernel tests", "codec kernels fp32", "codec kernels bf16",
                                 "host synchronisations", "end to end"], steps
assert all(s[1] == "0" for s in steps), steps
assert (out / "trace_on_rank0.json.gz").stat().st_size > 0
for dt in ("fp32", "bf16"):
    rows = json.loads((out / f"bench_{dt}.json").read_text())["rows"]
    codecs = {r["codec"].split("/")[0] for r in rows if r["op"] != "memcpy copy_"}
    assert codecs == {"int8", "int4", "int2", "fp8_e4m3", "sign"}, codecs
    assert {r["numel"] for r in rows} == {16 * 1024, 64 * 1024}
    assert sum(r["op"].startswith("ef step") for r in rows) == 10
print(f"ci_device_checks_cpu.sh: passed ({len(steps)} steps, page {out / 'README.md'})")
PY

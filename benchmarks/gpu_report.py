"""The one results page of scripts/device_checks.sh, from the files its steps left in its output folder.

Reads (each optional: a missing one is named on the page, never invented): ``env.txt`` (device, software),
``steps.tsv`` (step, exit status, seconds, limit), ``triton.log`` (pytest's summary), ``bench_<dtype>.json``
(benchmarks.bench_kernels_gpu --json), ``sync_check.md`` (benchmarks.sync_check), ``e2e.md`` (benchmarks.gpu_e2e)
and the profiler trace. Writes one Markdown page.

The kernel table gives, per dtype, size, codec and op, the kernel's bytes read + written per second as a fraction
of the measured device-to-device copy (``copy_``, read + write) of the same run, and at the largest size the
acceptance targets: int8 and int4 encode and decode >= 0.70, fp8 >= 0.80, the fused error-feedback step >= 0.60.

Run:  python -m benchmarks.gpu_report OUT_DIR [--page PATH] [--command "the command line"]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

TARGETS = (("int8", ("encode", "decode"), 0.70), ("int4", ("encode", "decode"), 0.70),
           ("fp8", ("encode", "decode"), 0.80), ("", ("ef step",), 0.60))


def target_for(codec: str, op: str):
    """The acceptance fraction of the copy bandwidth for ``op`` of ``codec``, or None (not a target)."""
    for prefix, ops, frac in TARGETS:
        if codec.startswith(prefix) and any(op.startswith(o) for o in ops):
            if op.startswith("decode+accumulate"):
                return None
            return frac
    return None


def kernel_section(out: pathlib.Path) -> list[str]:
    files = sorted(out.glob("bench_*.json"))
    if not files:
        return ["No kernel measurements (bench_*.json missing: the step failed or was skipped; see its log)."]
    lines, verdicts = [], []
    for f in files:
        data = json.loads(f.read_text())
        rows = data["rows"]
        sizes = sorted({r["numel"] for r in rows})
        lines += [f"### {rows[0]['dtype']} inputs ({data['backend']} backend, median of {data['repeats']})", "",
                  "| elements | op | codec | ms | GB/s (r+w) | fraction of copy | target | met | bit-identical |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            t = target_for(r["codec"], r["op"]) if r["numel"] == sizes[-1] else None
            met = "" if t is None else ("yes" if r["ratio"] >= t else "**NO**")
            if t is not None:
                verdicts.append((f"{r['dtype']} {r['numel']:,} {r['op']} {r['codec']}", r["ratio"], t))
            lines.append(f"| {r['numel']:,} | {r['op']} | {r['codec']} | {r['ms']:.4g} | {r['gbps']:.4g} | "
                         f"{r['ratio']:.2f} | {'' if t is None else f'>= {t:.2f}'} | {met} | {r['identical']} |")
        lines.append("")
    missed = [v for v in verdicts if v[1] < v[2]]
    lines.append(f"Targets at the largest size: {len(verdicts) - len(missed)} of {len(verdicts)} met"
                 + ("." if not missed else "; missed: " + ", ".join(f"{n} ({r:.2f} < {t:.2f})" for n, r, t in missed)))
    return lines


def _read(out: pathlib.Path, name: str):
    p = out / name
    return p.read_text() if p.exists() else None


def page(out: pathlib.Path, command: str) -> str:
    env = _read(out, "env.txt")
    device = "unknown device"
    if env:
        m = re.search(r"\| device ([^|]+?) \|", env)
        device = m.group(1).strip() if m else (env.splitlines()[1] if len(env.splitlines()) > 1 else device)
    lines = [f"# Device checks: {device}", "", f"Command: `{command}`", ""]
    if env:
        lines += ["```", env.strip(), "```", ""]
    steps = _read(out, "steps.tsv")
    if steps:
        lines += ["| step | exit status | seconds | limit s |", "|---|---|---|---|"]
        for row in steps.strip().splitlines():
            name, rc, secs, limit = row.split("\t")
            status = {"0": "passed", "124": "**timed out**", "skipped": "skipped"}.get(rc, f"**failed ({rc})**")
            lines.append(f"| {name} | {status} | {secs} | {limit} |")
        lines.append("")
    lines += ["## 1. Triton codec kernels on the device (tests/test_kernels_triton.py -k cuda)", ""]
    tlog = _read(out, "triton.log")
    if tlog:
        summary = [ln for ln in tlog.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
        sign = [ln for ln in tlog.splitlines() if "sign" in ln and ("FAILED" in ln or "PASSED" in ln)]
        lines += ["```", *(summary[-1:] or ["(no pytest summary line: see triton.log)"]), *sign[:10], "```", ""]
    else:
        lines += ["triton.log missing.", ""]
    lines += ["## 2. Codec kernels against the copy bandwidth (benchmarks/bench_kernels_gpu.py)", ""]
    lines += kernel_section(out) + [""]
    for title, name in (("3. Host synchronisations (benchmarks/sync_check.py)", "sync_check.md"),
                        ("4. End to end (benchmarks/gpu_e2e.py)", "e2e.md")):
        text = _read(out, name)
        lines += [f"## {title}", ""]
        if text:
            body = text.split("## Stacks")[0].strip().splitlines()
            lines += [ln for ln in body if not ln.startswith("# ")] + [""]
            if "## Stacks" in text:
                lines += [f"Stacks of every synchronisation: `{name}`.", ""]
        else:
            lines += [f"{name} missing (the step failed or was skipped; see its log).", ""]
    trace = out / "trace_on_rank0.json.gz"
    lines += ["## Profiler trace", "",
              f"`{trace.name}` (chrome://tracing or Perfetto): one compressed iteration of rank 0, codec kernels on "
              f"the side stream beside backward." if trace.exists() else "No profiler trace (the end-to-end step "
              "did not finish).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the output folder of scripts/device_checks.sh")
    p.add_argument("--page", default=None, help="where to write the page (default: OUT/README.md)")
    p.add_argument("--command", default="bash scripts/device_checks.sh")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    if not out.is_dir():
        raise SystemExit(f"gpu_report: {out} is not a folder; pass the OUT folder of scripts/device_checks.sh")
    dest = pathlib.Path(args.page) if args.page else out / "README.md"
    dest.write_text(page(out, args.command))
    print(f"gpu_report: wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

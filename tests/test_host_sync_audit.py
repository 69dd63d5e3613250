"""The compressed path's host synchronisations, audited statically: every call in the modules a compressed
collective or a ZeRO step runs through that reads a tensor back to the host (``.item()``, ``.tolist()``,
``.cpu()``, ``.numpy()``, ``.nonzero()``, ``bool/int/float`` of a reduction, a branch on a reduction,
``torch.equal``/``nonzero``/``unique``/``allclose``, ``torch.tensor(..., device=...)`` from host values) sits in a
function listed below and is justified by a ``# host sync:`` comment in that function, at or above it. A new one
fails until it is avoided (keep the value on the device) or justified and listed. On a GPU,
benchmarks/sync_check.py runs the same path under ``torch.cuda.set_sync_debug_mode`` and reports what really
synchronises, with stacks."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "megacomp"
MODULES = ["comm/channel.py", "comm/collectives.py", "comm/common.py", "comm/transport.py", "comm/group_ops.py",
           "comm/codec_stream.py", "comm/stats.py", "comm/spans.py", "compression/codecs.py", "compression/quantize.py",
           "compression/ef_encoder.py", "compression/error_feedback.py", "compression/counter_rng.py",
           "compression/packing.py", "compression/formats.py", "compression/transforms.py", "kernels/__init__.py",
           "kernels/scales.py", "kernels/triton/codec_triton.py", "optimizer/distributed_optimizer.py",
           "optimizer/reduction.py", "optimizer/param_gather.py", "optimizer/buckets.py"]
ALLOWED = {  # (module, function): why it may wait for the device
    ("comm/collectives.py", "check"): "argument validation (CommOptions.validate), off after the first iteration",
    ("comm/common.py", "has_nonfinite"): "check_finite=True, an opt-in diagnostic",
    ("comm/common.py", "validate"): "argument validation",
    ("comm/common.py", "gather_texts"): "the text of a failed validation",
    ("compression/codecs.py", "_to_fp16_checked"): "the fp16 cast codec's strict mode (collectives are not strict)",
    ("optimizer/distributed_optimizer.py", "_check_replicated"): "construction",
    ("optimizer/distributed_optimizer.py", "_all_reduce_max"): "the ZeRO step's overflow skip decision",
}
READS = {"item", "tolist", "cpu", "numpy", "nonzero"}
REDUCTIONS = {"any", "all", "max", "min", "sum", "item", "norm", "amax", "equal"}
TORCH_SYNCS = {"equal", "nonzero", "unique", "allclose", "masked_select"}


def _reduces(node) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in REDUCTIONS
               for n in ast.walk(node))


def sync_points(source: str) -> list[tuple[int, str]]:
    """(line, what) of every call or branch in ``source`` that reads a tensor back to the host (see the module
    docstring: a syntactic audit, so it names candidates; the GPU check confirms)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in READS and not node.args:
                out.add((node.lineno, f".{f.attr}()"))
            elif isinstance(f, ast.Name) and f.id in ("bool", "int", "float") and node.args and _reduces(node.args[0]):
                out.add((node.lineno, f"{f.id}() of a reduction"))
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch":
                if f.attr in TORCH_SYNCS:
                    out.add((node.lineno, f"torch.{f.attr}"))
                elif f.attr == "tensor" and any(k.arg == "device" for k in node.keywords):
                    out.add((node.lineno, "torch.tensor(host values, device=...)"))
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)) and _reduces(node.test):
            out.add((node.test.lineno, "a branch on a reduction"))
    return sorted(out)


def _functions(tree) -> list[tuple[int, int, str]]:
    return sorted(((n.lineno, n.end_lineno, n.name) for n in ast.walk(tree)
                   if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), key=lambda t: t[1] - t[0])


def audit() -> tuple[dict, list[str]]:
    """({(module, function): [(line, what)]}, problems): every sync point by its innermost enclosing function,
    and those without a ``# host sync:`` comment in that function at or above them."""
    found, problems = {}, []
    for mod in MODULES:
        text = (ROOT / mod).read_text()
        lines, funcs = text.splitlines(), _functions(ast.parse(text))
        for line, what in sync_points(text):
            start, _, name = next((f for f in funcs if f[0] <= line <= f[1]), (1, 0, "<module>"))
            found.setdefault((mod, name), []).append((line, what))
            if not any("# host sync:" in ln for ln in lines[start - 1:line]):
                problems.append(f"megacomp/{mod}:{line} in {name}(): {what} has no '# host sync:' justification")
    return found, problems


def test_every_host_sync_on_the_compressed_path_is_listed_and_justified():
    found, problems = audit()
    assert not problems, "\n".join(problems)
    unlisted = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not unlisted, (f"new host synchronisation(s) on the compressed path: {unlisted}; keep the value on the "
                          f"device, or justify it with a '# host sync:' comment and list it in ALLOWED")
    gone = set(ALLOWED) - set(found)
    assert not gone, f"ALLOWED lists functions that no longer synchronise: {gone} (drop them from the list)"


def test_the_audit_finds_each_kind_of_sync():
    src = ("def f(t, x):\n    a = t.item()\n    b = bool(t.isfinite().all())\n    if t.any():\n        pass\n"
           "    c = torch.tensor([x], device=t.device)\n    d = torch.equal(t, t)\n    e = x.tolist()\n"
           "    return int(x) + float(t.shape[0])\n")
    kinds = [w for _, w in sync_points(src)]
    assert kinds == [".item()", "bool() of a reduction", "a branch on a reduction",
                     "torch.tensor(host values, device=...)", "torch.equal", ".tolist()"]

"""The structure docs/architecture.md promises, checked on the source (issue 14).

- No hidden module state: module-level mutable containers, instances of non-builtin classes and
  ``functools.lru_cache``/``cache`` functions in megacomp/ (kernels included) are the listed caches only, and
  nothing is keyed by call site (no ``sys._getframe``).
- Every public function and class in megacomp/ has a docstring.
- ``compression`` and ``kernels`` do not import each other in a cycle (kernels never import megacomp's
  codec layer), and a plain checkout on PYTHONPATH, without an install, imports megacomp with its kernels.
"""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "megacomp"
KERNELS = PKG / "kernels"

# (file, name): module-level mutable objects that cannot change a result (see docs/architecture.md)
ALLOWED_MODULE_STATE = {
    ("megacomp/comm/transport.py", "_TRANSPORTS"),   # per-group direction groups and p2p tag counters
    ("megacomp/comm/stats.py", "PROCESS_STATS"),     # the default wire-statistics table (counters)
    ("megacomp/comm/spans.py", "RECORDER"),          # the profiler's switch and timed spans (timing only)
    ("megacomp/compression/formats.py", "FORMATS"),  # the format registry (register_format adds names only)
    ("megacomp/kernels/triton/codec_triton.py", "_backends"),  # compiled Triton kernel handles
    ("megacomp/kernels/triton/codec_triton.py", "_lock"),      # a threading.Lock: builds _backends once
}
ALLOWED_CACHED_FUNCTIONS = {  # functools.lru_cache/cache on pure functions whose results callers never modify
    ("megacomp/compression/dct.py", "_matrix"),         # DCT-II matrix per (size, dtype, device)
    ("megacomp/compression/transforms.py", "_matrix"),  # Walsh-Hadamard matrix per (size, device type)
}
ALLOWED_GLOBAL_REBINDS = {
    ("megacomp/parallel_state.py", "_GROUPS"),  # the Megatron-style facade's groups (layers never read it)
    # compiled C++ and Triton kernels, built once
    ("megacomp/kernels/__init__.py", "_cpu"), ("megacomp/kernels/__init__.py", "_cpu_failed"),
    ("megacomp/kernels/__init__.py", "_triton"), ("megacomp/kernels/__init__.py", "_triton_failed"),
}
_CONSTANT_TABLES = {  # module-level dicts/lists/sets only read after import (lookup tables, presets)
    ("megacomp/config.py", "_DTYPES"), ("megacomp/compression/error_feedback.py", "PRESETS"),
    ("megacomp/comm/common.py", "_DTYPES"), ("megacomp/comm/common.py", "_OPS"),
    ("megacomp/launch.py", "_RANK_VARS"), ("megacomp/codec_tour.py", "CODECS"),
    ("megacomp/data/tokenizer.py", "TRAINER_OPTIONS"), ("megacomp/training/checkpoint.py", "METADATA_GLOBALS"),
    ("megacomp/kernels/triton/codec_triton.py", "_F8"), ("megacomp/kernels/cpu/build.py", "SOURCES"),
    ("megacomp/kernels/cpu/build.py", "HEADERS"),
}


def _sources(roots=(PKG,)):
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            yield f, ast.parse(f.read_text(encoding="utf-8"))


def _callee(node) -> str:
    """The last name of what ``node`` calls (``functools.lru_cache(...)`` -> ``lru_cache``), else ''."""
    f = node.func if isinstance(node, ast.Call) else node
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def test_no_module_level_mutable_state_and_nothing_keyed_by_call_site():
    found, cached = set(), set()
    for f, tree in _sources():
        rel = f.relative_to(REPO).as_posix()
        assert "_getframe" not in f.read_text(encoding="utf-8"), f"{rel}: state keyed by call site"
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    _callee(d) in ("lru_cache", "cache") for d in node.decorator_list):
                cached.add((rel, node.name))
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            value = getattr(node, "value", None)
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("dict", "list", "set", "defaultdict"))
            # an instance of a non-builtin class (``X = SomeClass()``, ``threading.Lock()``): classes are CamelCase
            mutable = mutable or (isinstance(value, ast.Call) and _callee(value)[:1].isupper())
            for t in targets:
                if isinstance(t, ast.Name) and mutable and t.id != "__all__":
                    found.add((rel, t.id))
            for g in (n for n in ast.walk(node) if isinstance(n, ast.Global)):
                bad = [name for name in g.names if (rel, name) not in ALLOWED_GLOBAL_REBINDS]
                assert not bad, f"{rel}: a function rebinds module state {bad}; keep state in an object"
    unexpected = found - ALLOWED_MODULE_STATE - _CONSTANT_TABLES
    assert not unexpected, f"module-level mutable state outside docs/architecture.md's list: {sorted(unexpected)}"
    unexpected = cached - ALLOWED_CACHED_FUNCTIONS
    assert not unexpected, f"functools caches outside docs/architecture.md's list: {sorted(unexpected)}"
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    for rel, name in sorted(ALLOWED_MODULE_STATE | ALLOWED_CACHED_FUNCTIONS | ALLOWED_GLOBAL_REBINDS):
        module = rel[:-3].replace("/__init__", "").replace("megacomp/", "", 1).replace("/", ".")
        assert f"{module}.{name}" in doc or f"`{name}`" in doc, f"docs/architecture.md does not list {rel}: {name}"


def test_every_public_definition_has_a_docstring():
    missing = []
    for f, tree in _sources():
        def visit(node, prefix):
            for n in ast.iter_child_nodes(node):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("_"):
                    if ast.get_docstring(n) is None:
                        missing.append(f"{f.relative_to(REPO)}:{n.lineno} {prefix}{n.name}")
                    if isinstance(n, ast.ClassDef):
                        visit(n, prefix + n.name + ".")
        visit(tree, "")
    assert not missing, f"{len(missing)} public definitions without a docstring:\n" + "\n".join(missing)


def test_kernels_do_not_import_the_codec_layer():
    for f in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.startswith("megacomp.") and not n.startswith("megacomp.kernels") for n in names), \
                    f"{f}: imports {names} (kernels sit below the codec layer)"


def test_a_plain_checkout_on_pythonpath_imports_megacomp_with_its_kernels(tmp_path):
    """No install: a copy of megacomp/ alone on PYTHONPATH brings its kernels along (the editable install's
    finder is removed in the child so that it cannot supply megacomp or megacomp.kernels)."""
    shutil.copytree(PKG, tmp_path / "megacomp", ignore=shutil.ignore_patterns("__pycache__", "build"))
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        "import torch, megacomp\n"
        "from megacomp.compression import make_codec\n"
        "import megacomp.kernels, megacomp.kernels.scales\n"
        f"assert megacomp.kernels.__file__.startswith({str(tmp_path)!r}), megacomp.kernels.__file__\n"
        "x = torch.randn(1000)\n"
        "c = make_codec('int4', block_size=64)\n"
        "assert (c.decode(c.encode(x)) - x).abs().max() <= x.abs().max() / 14 * 1.0001  # half a step of 7 levels\n"
        "print('ok')\n")
    # the C++ build is tested elsewhere
    env = {**os.environ, "MEGACOMP_KERNELS": "reference", "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

"""The structure docs/architecture.md promises, checked on the source (issue 14).

- No hidden module state: module-level mutable containers in megacomp/ are the listed caches only, and
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

# (file, name): module-level mutable objects that cannot change a result (see docs/architecture.md)
ALLOWED_MODULE_STATE = {
    ("megacomp/comm/transport.py", "_TRANSPORTS"),   # per-group direction groups and p2p tag counters
    ("megacomp/compression/formats.py", "FORMATS"),  # the format registry (register_format adds names only)
}
ALLOWED_GLOBAL_REBINDS = {
    ("megacomp/parallel_state.py", "_GROUPS"),  # the Megatron-style facade's groups (layers never read it)
}
_CONSTANT_TABLES = {  # module-level dicts/lists/sets only read after import (lookup tables, presets)
    ("megacomp/config.py", "_DTYPES"), ("megacomp/compression/error_feedback.py", "PRESETS"),
    ("megacomp/comm/common.py", "_DTYPES"), ("megacomp/comm/common.py", "_OPS"),
    ("megacomp/launch.py", "_RANK_VARS"), ("megacomp/demo.py", "CODECS"),
    ("megacomp/data/tokenizer.py", "TRAINER_OPTIONS"),
}


def _sources():
    for f in sorted(PKG.rglob("*.py")):
        yield f, ast.parse(f.read_text(encoding="utf-8"))


def test_no_module_level_mutable_state_and_nothing_keyed_by_call_site():
    found = set()
    for f, tree in _sources():
        rel = str(f.relative_to(REPO))
        assert "_getframe" not in f.read_text(encoding="utf-8"), f"{rel}: state keyed by call site"
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            value = getattr(node, "value", None)
            mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("dict", "list", "set", "defaultdict"))
            for t in targets:
                if isinstance(t, ast.Name) and mutable and t.id != "__all__":
                    found.add((rel, t.id))
            for g in (n for n in ast.walk(node) if isinstance(n, ast.Global)):
                bad = [name for name in g.names if (rel, name) not in ALLOWED_GLOBAL_REBINDS]
                assert not bad, f"{rel}: a function rebinds module state {bad}; keep state in an object"
    unexpected = found - ALLOWED_MODULE_STATE - _CONSTANT_TABLES
    assert not unexpected, f"module-level mutable state outside docs/architecture.md's list: {sorted(unexpected)}"


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
    for f in sorted((REPO / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.startswith("megacomp.") and not n.startswith("megacomp.kernels") for n in names), \
                    f"{f}: imports {names} (kernels sit below the codec layer)"


def test_a_plain_checkout_on_pythonpath_imports_megacomp_with_its_kernels(tmp_path):
    """No install: megacomp/ and kernels/ side by side on PYTHONPATH (the editable install's finder is
    removed in the child so that it cannot supply megacomp.kernels)."""
    for name in ("megacomp", "kernels"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "build"))
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import torch, megacomp\n"
        "from megacomp.compression import make_codec\n"
        "import megacomp.kernels, megacomp.kernels.scales\n"
        f"assert megacomp.kernels.__file__.startswith({str(tmp_path)!r}), megacomp.kernels.__file__\n"
        "x = torch.randn(1000)\n"
        "c = make_codec('int4', block_size=64)\n"
        "assert (c.decode(c.encode(x)) - x).abs().max() <= x.abs().max() / 14 * 1.0001  # half a step of 7 levels\n"
        "print('ok')\n")
    env = {**os.environ, "MEGACOMP_KERNELS": "reference"}  # the C++ build is tested elsewhere
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

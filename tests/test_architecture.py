"""The structure docs/architecture.md promises, checked on the source.

- No hidden module state: module-level mutable containers, instances of non-builtin classes and
  ``functools.lru_cache``/``cache`` functions in megacomp/ (kernels included) are the listed caches only, and
  nothing is keyed by call site (no ``sys._getframe``).
- Every public function and class in megacomp/ has a docstring.
- No import cycles between megacomp's modules (the graph of every import, relative or absolute, at module
  level or in a function), and kernels never import megacomp's codec layer.
- A plain checkout on PYTHONPATH, without an install, imports megacomp with its kernels; nothing in the
  repository edits ``sys.path`` (megacomp and benchmarks are imported as installed packages).
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
    ("megacomp/comm/group_check.py", "CHECK"),       # validated-call counters per group (the store meeting)
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
    ("megacomp/data/tokenizer.py", "TRAINER_OPTIONS"), ("megacomp/training/checkpoint_reader.py", "METADATA_GLOBALS"),
    ("megacomp/kernels/triton/codec_triton.py", "_F8"), ("megacomp/kernels/cpu/build.py", "SOURCES"),
    ("megacomp/kernels/cpu/build.py", "HEADERS"), ("megacomp/training/pretrain_config.py", "BASE_COMPONENTS"),
    ("megacomp/training/features/lomo_fused.py", "LOMO_OPTIMIZERS"),
    ("megacomp/training/features/onebit_adam.py", "ONEBIT_OPTIMIZERS"),
    ("megacomp/training/megatron_flags.py", "ALIASES"), ("megacomp/plan/published.py", "TACO_CODEC"),
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


def _feature_hooks() -> set:
    """The hooks of the training-family interface, each documented once in features/base.py's Feature."""
    tree = ast.parse((PKG / "training" / "features" / "base.py").read_text(encoding="utf-8"))
    feature = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Feature")
    return {n.name for n in feature.body if isinstance(n, ast.FunctionDef) and ast.get_docstring(n)}


def test_every_public_definition_has_a_docstring():
    missing, hooks = [], _feature_hooks()
    for f, tree in _sources():
        def visit(node, prefix, inherited=frozenset()):
            for n in ast.iter_child_nodes(node):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not n.name.startswith("_"):
                    if ast.get_docstring(n) is None and n.name not in inherited:
                        missing.append(f"{f.relative_to(REPO)}:{n.lineno} {prefix}{n.name}")
                    if isinstance(n, ast.ClassDef):
                        # a training family's hook implements Feature's documented hook: that docstring is its own
                        family = any(isinstance(b, ast.Name) and b.id == "Feature" for b in n.bases)
                        visit(n, prefix + n.name + ".", hooks if family else frozenset())
        visit(tree, "")
    assert not missing, f"{len(missing)} public definitions without a docstring:\n" + "\n".join(missing)


# -- the import graph ------------------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    """``megacomp/comm/channel.py`` -> ``megacomp.comm.channel``; a package's ``__init__.py`` is the package."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree) -> set:
    """The import nodes under ``if TYPE_CHECKING:``: they never run, so they are annotations, not edges."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _import_graph() -> dict:
    """Every megacomp module -> {imported megacomp module: the line of the first such import}. Relative and
    absolute imports count, at module level or inside functions. ``from .pkg import name`` is an edge to the
    submodule ``pkg.name`` where that is a module, else to ``pkg`` (its ``__init__``). Imports of modules
    that do not exist are not edges (importing them fails anyway)."""
    files = {_module_name(f): f for f in sorted(PKG.rglob("*.py"))}
    graph = {}
    for name, f in files.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(f.read_text(encoding="utf-8"))
        skip, edges = _type_checking_only(tree), {}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: up level - 1 packages from this module's package
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                if target in files and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def _cycles(graph: dict) -> list:
    """The import cycles of ``graph``: from each module, the shortest chain of imports that leads back to it
    (a cycle found from several of its modules is listed once), each a list of modules ending where it starts."""
    cycles, seen = [], set()
    for start in sorted(graph):
        came_from, frontier = {}, [start]
        while frontier and start not in came_from:  # breadth-first: the first way back is a shortest one
            following = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w not in came_from:
                        came_from[w] = v
                        following.append(w)
            frontier = following
        if start not in came_from:
            continue
        chain, v = [start], came_from[start]
        while v != start:
            chain.append(v)
            v = came_from[v]
        chain = [start] + chain[::-1]
        edges = frozenset(zip(chain, chain[1:]))
        if edges not in seen:
            seen.add(edges)
            cycles.append(chain)
    return cycles


def _chain(graph: dict, cycle: list) -> str:
    """``a.py:12 -> b.py:7 -> a.py``: each module with the line of its import of the next."""
    def path(module):
        f = PKG.parent / module.replace(".", "/")
        return f"{f.relative_to(REPO)}/__init__.py" if f.is_dir() else f"{f.relative_to(REPO)}.py"
    return " -> ".join(f"{path(a)}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])) + f" -> {path(cycle[-1])}"


def test_megacomp_imports_have_no_cycles():
    graph = _import_graph()
    cycles = _cycles(graph)
    assert not cycles, f"{len(cycles)} import cycles in megacomp/:\n" + "\n".join(_chain(graph, c) for c in cycles)


def test_the_cycle_finder_reports_each_cycle_once_as_a_chain():
    graph = {"a": {"b": 1}, "b": {"c": 2, "a": 3}, "c": {"a": 4}, "d": {"a": 5}}
    assert sorted(_cycles(graph)) == [["a", "b", "a"], ["c", "a", "b", "c"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def test_kernels_do_not_import_the_codec_layer():
    graph = _import_graph()
    for module, edges in graph.items():
        if module.startswith("megacomp.kernels"):
            above = [m for m in edges if not m.startswith("megacomp.kernels")]
            assert not above, f"{module} imports {above} (kernels sit below the codec layer)"


def _repo_python_files():
    """Every .py file of the checkout, skipping hidden folders and build outputs."""
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "dist", "__pycache__")
                   and not d.endswith(".egg-info")]
        yield from (Path(folder) / f for f in files if f.endswith(".py"))


def test_nothing_edits_sys_path():
    """Modules import each other as installed packages (megacomp, benchmarks; tests/ helpers through
    pytest.ini's pythonpath), never by putting folders on ``sys.path``."""
    def is_sys_path(node):
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    found = []
    for f in sorted(_repo_python_files()):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            call = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("insert", "append", "extend") and is_sys_path(node.func.value))
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            assigned = any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets)
            if call or assigned:
                found.append(f"{f.relative_to(REPO)}:{node.lineno}")
    assert not found, "sys.path edited at " + ", ".join(found)


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

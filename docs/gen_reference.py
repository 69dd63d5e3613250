"""The documentation site's generated reference pages, built from the code on every build (never hand-written).

- ``reference/configuration.md``: every field of the pretraining configuration tree
  (``megacomp.training.PretrainConfig.components()``) with its component, YAML keys (nested and flat), flag,
  type, default, valid values and docstring; every field of ``megacomp.config.CommCompressionConfig``; the
  compression presets of ``configs/compression/*.yaml`` with their leading comments.
- ``reference/api/<module>.md``: one page per public module (``PUBLIC_MODULES``), rendering each public name
  (the module's ``__all__``, or its top-level definitions when it has none) with mkdocstrings.

The MkDocs hooks (``docs/mkdocs_hooks.py``) add these pages to the site at build time;
``python docs/gen_reference.py --out DIR`` writes them to a folder instead (to read them without MkDocs). The
configuration reference is also committed (``docs/reference/configuration.md``, so that links to it work when
reading the repository): ``python docs/gen_reference.py --write-config`` rewrites it after a configuration change.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import pkgutil
import re
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PUBLIC_MODULES = (
    "megacomp",
    "megacomp.compression",
    "megacomp.comm",
    "megacomp.config",
    "megacomp.parallel_state",
    "megacomp.placement",
    "megacomp.tensor_parallel",
    "megacomp.pipeline_parallel",
    "megacomp.optimizer",
    "megacomp.outer",
    "megacomp.integrations",
    "megacomp.training",
    "megacomp.training.features",
    "megacomp.data",
    "megacomp.models",
)
"""The modules whose public names the API reference covers (subpackages without ``__all__`` that only hold
modules, such as ``megacomp.integrations``, are covered through those modules: see :func:`api_modules`)."""

CONFIG_PAGE = "reference/configuration.md"
API_DIR = "reference/api"


# ---------------------------------------------------------------------------------------------------------------
# public names


def _top_level_definitions(module) -> list[str]:
    """The public names a module without ``__all__`` defines itself: its top-level classes, functions and
    assignments (not its imports), in source order."""
    tree = ast.parse(inspect.getsource(module))
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found = [node.name]
        elif isinstance(node, ast.Assign):
            found = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found = [node.target.id]
        else:
            found = []
        names += [n for n in found if not n.startswith("_") and n not in names]
    return names


def _submodules(module) -> list[str]:
    if not hasattr(module, "__path__"):
        return []
    return [f"{module.__name__}.{info.name}" for info in pkgutil.iter_modules(module.__path__)
            if not info.name.startswith("_")]


def public_names(modname: str) -> list[str]:
    """The public names of a module: its ``__all__``, else the names it defines at top level (which, for
    ``megacomp`` itself, is ``__version__`` alone: its API is its subpackages)."""
    module = importlib.import_module(modname)
    if hasattr(module, "__all__"):
        return list(module.__all__)
    names = _top_level_definitions(module)
    if modname == "megacomp":
        names = ["__version__"] + names
    return names


def api_modules() -> dict[str, list[str]]:
    """Module -> the public names its API page renders: every module of PUBLIC_MODULES, plus the public
    submodules of a package in that list that has no ``__all__`` and defines nothing itself
    (``megacomp.integrations.megatron``, ``.fsdp``, ...)."""
    out: dict[str, list[str]] = {}
    for modname in PUBLIC_MODULES:
        out[modname] = public_names(modname)
        module = importlib.import_module(modname)
        if modname != "megacomp" and not hasattr(module, "__all__") and not out[modname]:
            for sub in _submodules(module):
                out[sub] = public_names(sub)
    return out


def _external(module, name: str) -> str | None:
    """The package ``module`` imports ``name`` from to re-export it (``torch.distributed`` for ``ReduceOp``),
    or None: the API renderer documents megacomp's own code only."""
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("megacomp"):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return f"{node.module}.{alias.name}"
    return None


def _shadows_submodule(module, name: str) -> bool:
    """Whether ``name`` is both a submodule of the package ``module`` and, at run time, another object
    (``megacomp.comm.stats``, the function, over the module of the same name)."""
    return f"{module.__name__}.{name}" in _submodules(module) and not inspect.ismodule(getattr(module, name))


def api_page_path(modname: str) -> str:
    return f"{API_DIR}/{modname}.md"


def api_pages() -> dict[str, str]:
    """Site path -> Markdown of the API reference: an index and one page per module of :func:`api_modules`."""
    modules = api_modules()
    pages: dict[str, str] = {}
    index = ["# API reference", "",
             "Generated from the docstrings: one page per public module, each rendering the module's public names "
             "(its `__all__`, or what it defines at top level when it has none).", "",
             "| module | public names |", "|---|---|"]
    for modname, names in modules.items():
        page = api_page_path(modname)
        rel = page[len(API_DIR) + 1:]
        index.append(f"| [`{modname}`]({rel}) | {', '.join(f'`{n}`' for n in names) or '(subpackages)'} |")
        lines = [f"# `{modname}`", ""]
        if modname == "megacomp":
            # the top package: its docstring, its version and links to the subpackages' pages
            lines += ["::: megacomp", "    options:", "      show_root_heading: false", "      members: false", "",
                      f"`megacomp.__version__` = `{importlib.import_module('megacomp').__version__!r}`", "",
                      "## Modules", ""]
            lines += [f"- [`{m}`]({m}.md)" for m in modules if m != "megacomp"]
        else:
            module = importlib.import_module(modname)
            external = [n for n in names if _external(module, n)]
            shadowing = [n for n in names if n not in external and _shadows_submodule(module, n)]
            rendered = [n for n in names if n not in external and n not in shadowing]
            lines += [f"::: {modname}", "    options:", "      show_root_heading: false"]
            if rendered:
                lines.append("      members:")
                lines += [f"        - {n}" for n in rendered]
            else:
                lines.append("      members: false")
            for n in shadowing:  # a name that is also a submodule's name: rendered from where it is defined
                obj = getattr(module, n)
                lines += ["", f"::: {obj.__module__}.{obj.__qualname__}", "    options:", "      show_root_heading: true",
                          "      show_root_full_path: false", "      heading_level: 2"]
                lines += ["", f"`{modname}.{n}` is `{obj.__module__}.{obj.__qualname__}`."]
            if external:
                lines += ["", "## Re-exported from other packages", ""]
                for n in external:
                    lines.append(f"- `{modname}.{n}`: `{_external(module, n)}`, re-exported.")
            subs = [m for m in modules if m.startswith(modname + ".") and m.count(".") == modname.count(".") + 1]
            if subs:
                lines += ["", "## Modules", ""] + [f"- [`{m}`]({m}.md)" for m in subs]
        pages[page] = "\n".join(lines) + "\n"
    pages[f"{API_DIR}/index.md"] = "\n".join(index) + "\n"
    return pages


# ---------------------------------------------------------------------------------------------------------------
# configuration reference


def _cell(text: str) -> str:
    """Text for one Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _code(value) -> str:
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def _literal_values(annotation: str, namespace: dict) -> list | None:
    """The values of a ``Literal[...]`` annotation (also inside Optional), or None."""
    if "Literal" not in annotation:
        return None
    try:
        tp = eval(annotation, dict(namespace), {"Literal": typing.Literal, "Optional": typing.Optional,
                                                "Union": typing.Union})
    except Exception:  # noqa: BLE001 - an annotation we cannot evaluate has no listed values
        return None
    for arg in (tp, *typing.get_args(tp)):
        if typing.get_origin(arg) is typing.Literal:
            return list(typing.get_args(arg))
    return None


def valid_values(name: str, annotation: str, namespace: dict) -> str:
    """What a field accepts, where the code says it: a Literal's values, a bool's, ``--optimizer``'s choices
    (the training families' registry) or a codec path's codec names."""
    from megacomp.compression import CODEC_NAMES
    from megacomp.config import ALL_TRAFFIC_PATHS
    from megacomp.training.features import OPTIMIZERS

    literal = _literal_values(annotation, namespace)
    if literal is not None:
        return ", ".join(_code(v) for v in literal)
    if re.fullmatch(r"(Optional\[)?bool\]?", annotation.replace(" ", "")):
        return "`true`, `false`" + (", `null`" if "Optional" in annotation else "")
    if name == "optimizer":
        return ", ".join(_code(v) for v in OPTIMIZERS)
    if name in ALL_TRAFFIC_PATHS:
        return "a codec (" + ", ".join(f"`{c}`" for c in CODEC_NAMES) + "), its settings as a mapping, or `null`"
    return ""


def _preset_comment(path: Path) -> str:
    comment = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    return " ".join(x for x in comment if x)


def _class_doc(cls) -> str:
    return " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())


def config_reference() -> str:
    """The configuration reference page (Markdown)."""
    from megacomp.config import ALL_TRAFFIC_PATHS, FEATURE_PATHS, CommCompressionConfig
    from megacomp.training import PretrainConfig
    from megacomp.training.config_tree import component_fields, default_of, field_docs, flat_name
    from megacomp.training.pretrain_config import COMPRESSION_DOC

    out = ["# Configuration reference", "",
           "Generated from the configuration tree (`megacomp.training.PretrainConfig`) on every build: each "
           "field's docstring, flat name, type and default come from its dataclass.", "",
           "A setting has one **flat name**, unique across the tree, used as the YAML key (`freeze_step: 100`) "
           "and as the command-line flag (`--freeze-step 100`; bools take `--x` / `--no-x`). A YAML file may "
           "also nest it under its **component** (`onebit: {freeze_step: 100}`), the nested key "
           "`onebit.freeze_step` below. Flags override the YAML file (`--config FILE`).", "",
           "## Components", "",
           "| component | dataclass | fields | what it configures |", "|---|---|---|---|"]
    components = PretrainConfig.components()
    for key, cls in components.items():
        out.append(f"| [`{key}`](#{key}) | `{cls.__module__}.{cls.__qualname__}` | {len(component_fields(cls))} "
                   f"| {_cell(_class_doc(cls))} |")
    out.append("| [`compression`](#compression) | `megacomp.config.CommCompressionConfig` | 1 | "
               "The compression preset (a plain value, not a component). |")
    for key, cls in components.items():
        docs = field_docs(cls)
        namespace = vars(importlib.import_module(cls.__module__))
        out += ["", f"## `{key}` {{#{key}}}", "", f"`{cls.__module__}.{cls.__qualname__}`: {_cell(inspect.getdoc(cls) or '')}",
                "", "| flat key / flag | nested key | type | default | valid values | description |",
                "|---|---|---|---|---|---|"]
        for f in component_fields(cls):
            flat = flat_name(cls, f)
            out.append(f"| `{flat}`<br>`--{flat.replace('_', '-')}` | `{key}.{f.name}` | `{_cell(f.type)}` "
                       f"| {_code(default_of(f))} | {valid_values(f.name, str(f.type), namespace)} "
                       f"| {_cell(docs.get(f.name, ''))} |")
    out += ["", "## `compression` {#compression}", "",
            "| flat key / flag | nested key | type | default | valid values | description |",
            "|---|---|---|---|---|---|",
            f"| `compression`<br>`--compression` | `compression` | `str` or mapping | `\"none\"` "
            f"| a [preset](#compression-presets) name, a YAML file or a mapping of [compression "
            f"fields](#compression-fields) | {_cell(COMPRESSION_DOC)} |"]

    out += ["", "## Compression presets {#compression-presets}", "",
            "The files of `configs/compression/` (`--compression NAME`), each with its leading comment.", "",
            "| preset | settings | description |", "|---|---|---|"]
    import yaml
    for path in sorted((REPO / "configs" / "compression").glob("*.yaml")):
        settings = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        keys = ", ".join(f"`{k}`" for k in settings) or "(none)"
        out.append(f"| `{path.stem}` | {keys} | {_cell(_preset_comment(path))} |")

    namespace = vars(importlib.import_module(CommCompressionConfig.__module__))
    docs = field_docs(CommCompressionConfig)
    out += ["", "## Compression fields {#compression-fields}", "",
            f"`megacomp.config.CommCompressionConfig`: {_cell(inspect.getdoc(CommCompressionConfig) or '')}", "",
            "The keys of a compression preset or mapping. Traffic paths (`megacomp.config.ALL_TRAFFIC_PATHS`): "
            + ", ".join(f"`{p}`" for p in ALL_TRAFFIC_PATHS) + "; of these, "
            + ", ".join(f"`{p}`" for p in FEATURE_PATHS) + " are the paths of optional features (not set = the "
            "feature's own default).", "",
            "| key | type | default | valid values | description |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(CommCompressionConfig):
        if not f.init:
            continue
        kind = "traffic path" if f.name in ALL_TRAFFIC_PATHS else ""
        out.append(f"| `{f.name}`{'<br>(' + kind + ')' if kind else ''} | `{_cell(f.type)}` "
                   f"| {_code(f.default if f.default is not dataclasses.MISSING else None)} "
                   f"| {valid_values(f.name, str(f.type), namespace)} | {_cell(docs.get(f.name, ''))} |")
    return "\n".join(out) + "\n"


def all_pages() -> dict[str, str]:
    """Site path -> Markdown of every generated page."""
    return {CONFIG_PAGE: config_reference(), **api_pages()}


COMMITTED_CONFIG = REPO / "docs" / CONFIG_PAGE
"""The configuration reference as committed, so that the guides' links to it also work when reading the repository
(the site builds it like the others and refuses a stale copy; a test checks it too)."""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write the generated reference pages to a folder.")
    parser.add_argument("--out", help="folder to write reference/... into")
    parser.add_argument("--write-config", action="store_true",
                        help=f"rewrite the committed {COMMITTED_CONFIG.relative_to(REPO)} from the code")
    args = parser.parse_args(argv)
    if args.write_config:
        COMMITTED_CONFIG.parent.mkdir(parents=True, exist_ok=True)
        COMMITTED_CONFIG.write_text(config_reference(), encoding="utf-8")
        print(COMMITTED_CONFIG)
    if not args.out:
        if not args.write_config:
            parser.error("give --out DIR and/or --write-config")
        return
    for rel, text in all_pages().items():
        path = Path(args.out) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(path)


if __name__ == "__main__":
    main()

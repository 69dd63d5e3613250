"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

- The navigation is generated from the files: every ``.md`` under ``docs/`` (a folder becomes a section), then
  the generated references, then the results index, so a new page appears without editing mkdocs.yml.
- The generated reference pages (``docs/gen_reference.py``) are added to the site.
- The measured results (``benchmarks/results/**``: pages and plots) and the configs (``configs/**.yaml``) are
  added at their repository paths, and a docs page's relative link that leaves ``docs/`` for one of them
  (``../benchmarks/results/README.md``, the path that also works when reading the repository) is pointed at
  that copy.
- ``<!-- guide-pages -->`` in a page is replaced by a list of the pages under ``docs/guide/``.
"""
from __future__ import annotations

import importlib.util
import logging
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

log = logging.getLogger("mkdocs.hooks.megacomp")
DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
MIRRORED = {"benchmarks/results": (".md", ".png"), "configs": (".yaml",)}
"""Repository folder -> the file kinds of it that the site carries at their repository paths."""
RESULTS_INDEX = "benchmarks/results/README.md"
GUIDE_MARKER = "<!-- guide-pages -->"
_LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")


def _gen():
    spec = importlib.util.spec_from_file_location("megacomp_docs_gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_GENERATED: dict[str, str] = {}


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem.replace("_", " ").replace("-", " ").capitalize()


def _source_pages(folder: Path, rel: str = "") -> list:
    """Nav entries of the hand-written pages under ``folder``: its index.md, its sub-folders as sections (the
    guides), then its other pages, alphabetical; the generated reference/ folder is left to :func:`on_config`."""
    pages = sorted(folder.glob("*.md"), key=lambda p: (p.name != "index.md", p.name))
    entries: list = [posixpath.join(rel, p.name) for p in pages[:1] if p.name == "index.md"]
    rest = [posixpath.join(rel, p.name) for p in pages if p.name != "index.md"]
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        sub_rel = posixpath.join(rel, sub.name)
        if sub_rel == "reference":
            continue
        inner = _source_pages(sub, sub_rel)
        if inner:
            entries.append({sub.name.replace("_", " ").replace("-", " ").capitalize(): inner})
    return entries + rest


def on_config(config):
    import megacomp

    here = Path(megacomp.__file__).resolve().parent
    if here != REPO / "megacomp":  # the references import megacomp: it must be this checkout's
        log.warning(f"megacomp is imported from {here}, not from this checkout ({REPO / 'megacomp'}): the generated "
                    "references would describe another tree; run `bash scripts/install.sh docs` here "
                    "(or set PYTHONPATH to this checkout)")
    gen = _gen()
    _GENERATED.clear()
    _GENERATED.update(gen.all_pages())
    committed = DOCS / gen.CONFIG_PAGE  # committed so the repository's links to it work: the site uses that file
    if committed.is_file():
        if committed.read_text(encoding="utf-8") != _GENERATED[gen.CONFIG_PAGE]:
            log.warning(f"{committed.relative_to(REPO)} is out of date with the configuration tree: run "
                        f"`python docs/gen_reference.py --write-config` and commit it")
        del _GENERATED[gen.CONFIG_PAGE]
    api = [p for p in _GENERATED if p.startswith(gen.API_DIR + "/") and not p.endswith("/index.md")]  # module order
    nav = _source_pages(DOCS)
    nav.append({"Reference": [gen.CONFIG_PAGE, {"API": [f"{gen.API_DIR}/index.md"] + api}]})
    nav.append({"Measured results": RESULTS_INDEX})
    config.nav = nav
    return config


def on_files(files: Files, config) -> Files:
    for path, text in _GENERATED.items():
        files.append(File.generated(config, path, content=text))
    for folder, suffixes in MIRRORED.items():
        for path in sorted((REPO / folder).rglob("*")):
            if path.is_file() and path.suffix in suffixes:
                rel = path.relative_to(REPO).as_posix()
                f = File(rel, str(REPO), config.site_dir, config.use_directory_urls)
                if rel != RESULTS_INDEX and rel.endswith(".md"):
                    f.inclusion = InclusionLevel.NOT_IN_NAV  # reached from the results index, not the nav
                files.append(f)
    return files


def _mirrored(repo_path: str) -> bool:
    return any(repo_path.startswith(folder + "/") and repo_path.endswith(suffixes)
               for folder, suffixes in MIRRORED.items())


def on_page_markdown(markdown: str, page, config, files):
    src = page.file.src_uri
    if GUIDE_MARKER in markdown:
        guide = DOCS / "guide"
        pages = sorted(guide.rglob("*.md"), key=lambda p: (p.name != "index.md", p)) if guide.is_dir() else []
        here = posixpath.dirname(src)
        items = [f"- [{_title(p)}]({posixpath.relpath(p.relative_to(DOCS).as_posix(), here or '.')})" for p in pages]
        markdown = markdown.replace(GUIDE_MARKER, "\n".join(items) or "(no guide pages yet)")
    if page.file.generated_by is not None or _mirrored(src):
        return markdown
    page_repo_dir = posixpath.join("docs", posixpath.dirname(src))

    def fix(match):
        target = match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:|^[#/]", target):
            return match.group(0)
        path, sep, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(page_repo_dir, path))
        if repo_path.startswith("docs/") or not _mirrored(repo_path):
            return match.group(0)
        new = posixpath.relpath(repo_path, posixpath.dirname(src) or ".")
        return match.group(1) + new + sep + anchor + match.group(3)

    return _LINK.sub(fix, markdown)

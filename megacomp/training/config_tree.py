"""The machinery of a configuration tree: component dataclasses whose fields carry their own docstrings and
a flat name each, from which the YAML keys, the ``--flags`` and ``--help`` are generated.

A component is a plain dataclass. Each field's docstring is the string literal under it in the class body
(read from the source, as Python documents attributes). Each field also has a *flat name*, the Megatron-style
name users script against (``--freeze-step``, YAML ``freeze_step: 100``): ``metadata={"flag": ...}`` when
given, else the component's ``FLAT_PREFIX`` plus the field name. Flat names are unique across the tree
(checked when the tree is assembled), so one flat namespace and the nested one describe the same settings.
"""
from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
from dataclasses import MISSING, Field, fields
from typing import Any, Iterable


def field_docs(cls) -> dict[str, str]:
    """Each field's docstring (the string literal under it in ``cls``'s body), whitespace collapsed."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def flat_name(cls, f: Field) -> str:
    """The flat (Megatron-style) name of field ``f`` of component ``cls``."""
    return f.metadata.get("flag") or getattr(cls, "FLAT_PREFIX", "") + f.name


def default_of(f: Field) -> Any:
    """The field's default value (its factory called), or None when it has none."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def component_fields(cls) -> list[Field]:
    """The init fields of a component dataclass."""
    return [f for f in fields(cls) if f.init]

"""A griffe extension for the API reference (mkdocs.yml): a pydantic field declared as
`name: T = Field(default, description="...")` is documented by its description, and shown with
its default (or none, when it is required) instead of the `Field(...)` call.

The blocks and the job model keep their documentation where Prefect's UI and pydantic read it,
in `description=`; without this, mkdocstrings would list their fields with no text at all.
"""

from __future__ import annotations

import ast
from typing import Any

from griffe import Attribute, Docstring, Extension


def _field_call(node: Any) -> ast.Call | None:
    value = getattr(node, "value", None)
    if not isinstance(value, ast.Call):
        return None
    func = value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return value if name == "Field" else None


def _markdown(text: str) -> str:
    """The text as Markdown shows it: `<` outside code spans escaped (a description is plain
    text in Prefect's UI, where '<tenant>' is no HTML tag)."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


class FieldDescriptions(Extension):
    """`Field(description=...)` as the attribute's docstring, its default as its value."""

    def on_attribute_instance(self, *, node: Any, attr: Attribute, **kwargs: Any) -> None:
        call = _field_call(node) if isinstance(node, ast.AST) else None
        if call is None:
            return
        keywords = {kw.arg: kw.value for kw in call.keywords if kw.arg}
        description = keywords.get("description")
        if attr.docstring is None and isinstance(description, ast.Constant | ast.JoinedStr):
            text = (
                description.value
                if isinstance(description, ast.Constant)
                else ast.unparse(description)[2:-1]  # an f-string: its template, as written
            )
            if isinstance(text, str) and text.strip():
                attr.docstring = Docstring(_markdown(text), parent=attr)
        default = call.args[0] if call.args else keywords.get("default")
        if isinstance(default, ast.Constant) and default.value is Ellipsis:
            default = None  # Field(...): required
        if default is not None:
            attr.value = ast.unparse(default)
        elif "default_factory" in keywords:
            attr.value = f"{ast.unparse(keywords['default_factory'])}()"
        else:
            attr.value = None

"""docs/CONFIG.md: every pipeline field, rendered from the models' ``Field(description=...)``.

Why generated: each field is documented once, in its model under batchrl/config/; a hand-written reference would drift
from it. Regenerate after changing a field with ``python -m batchrl.config.reference docs/CONFIG.md``;
tests/unit/test_config_reference.py fails while the committed file differs from what this renders.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from batchrl.config.models import PipelineConfig

HEADER = """# Pipeline configuration reference

Generated from the field descriptions of the models in `batchrl/config/` by
`python -m batchrl.config.reference docs/CONFIG.md`: edit those, not this file. Unknown keys are errors.
A pipeline file may merge `profiles:` underneath it (where they are looked for: README, Configuration), and
`batchrl run/plan/validate --set a.b=c` overrides any field on top (`batchrl validate` prints the resolved config).
"""

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "at least"))


def render_reference() -> str:
    """The whole reference, Markdown, ending in one newline."""
    blocks = [HEADER]
    for path, model in _sections(PipelineConfig, prefix=""):
        blocks.append(_section(path, model))
    return "\n".join(blocks)


def _sections(model: type[BaseModel], *, prefix: str) -> list[tuple[str, type[BaseModel]]]:
    """(dotted path, model) of ``model`` and of every section under it, parents first."""
    out = [(prefix, model)]
    for name, field in model.model_fields.items():
        sub, item = _submodel(field.annotation)
        if sub is not None:
            out += _sections(sub, prefix=f"{prefix}{name}{item}.")
    return out


def _submodel(annotation: Any) -> tuple[type[BaseModel] | None, str]:
    """(the section model a field holds, how one of them is named under the field: "" for the field itself, "[]"
    for an item of a list, ".<name>" for a value of a mapping), or (None, "") for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args:
        sub, _ = _submodel(args[0])
        return sub, "[]" if sub is not None else ""
    if origin is dict and len(args) == 2:
        sub, _ = _submodel(args[1])
        return sub, ".<name>" if sub is not None else ""
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            sub, item = _submodel(arg)
            if sub is not None:
                return sub, item
    return None, ""


def _section(path: str, model: type[BaseModel]) -> str:
    title = f"`{path.rstrip('.')}`" if path else "Top level"
    intro = inspect.cleandoc(model.__doc__ or "")
    if intro.startswith(("Usage docs", "!!!")) or model.__doc__ == BaseModel.__doc__:
        intro = ""  # pydantic's own docstring, inherited by a model without one
    lines = [f"## {title}", ""] + ([intro, ""] if intro else [])
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        sub, item = _submodel(field.annotation)
        description = _cell(field.description or "")
        if sub is not None:
            description += f" See `{path}{name}{item}` below." if description else f"See `{path}{name}{item}` below."
        lines.append(
            f"| `{path}{name}` | {_type_name(field.annotation)}{_bounds(field)} | {_default(field)} | {description} |"
        )
    return "\n".join(lines) + "\n"


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)).replace("Any", "any")


def _bounds(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for attribute, word in _BOUNDS:
            value = getattr(item, attribute, None)
            if value is not None:
                found.append(f"{word} {value}")
    return f" ({', '.join(found)})" if found else ""


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    # "<root>" would be read as an HTML tag by Markdown renderers and vanish
    return " ".join(text.split()).replace("|", "\\|").replace("<", "\\<")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m batchrl.config.reference docs/CONFIG.md\n")
        return 2
    Path(argv[0]).write_text(render_reference())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

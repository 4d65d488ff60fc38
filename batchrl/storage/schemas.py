"""Arrow schemas of every table, loaded from data_schemas/*.json (the single source of truth).

A schema may ``extend`` another: its columns are the parent's followed by its own, which is how
"columns only grow" is written down and checked. A column added later may declare ``"absent": "null"``: a table
written before it (or a stage that has nothing for it) reads as null there.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import pyarrow as pa

_SCALARS = {
    "string": pa.string(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
}
_LIST = re.compile(r"^list<(.+)>$")


def schema_dir() -> Path:
    env = os.environ.get("BATCHRL_SCHEMA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "data_schemas"


def parse_type(text: str) -> pa.DataType:
    text = text.strip()
    match = _LIST.match(text)
    if match:
        return pa.list_(parse_type(match.group(1)))
    if text not in _SCALARS:
        raise ValueError(f"unknown column type {text!r} in data_schemas (known: {sorted(_SCALARS)}, list<...>)")
    return _SCALARS[text]


@functools.cache
def load_schema(name: str) -> pa.Schema:
    spec = json.loads((schema_dir() / f"{name}.json").read_text())
    fields = list(load_schema(spec["extends"])) if spec.get("extends") else []
    for field in spec["fields"]:
        fields.append(pa.field(field["name"], parse_type(field["type"]), nullable=field.get("nullable", True)))
    return pa.schema(fields)


@functools.cache
def absent_as_null(name: str) -> frozenset[str]:
    """Columns of schema ``name`` (and those it extends) declared ``"absent": "null"``: columns added after tables
    were written without them, which read as null there (and which a stage need not write)."""
    spec = json.loads((schema_dir() / f"{name}.json").read_text())
    inherited = absent_as_null(spec["extends"]) if spec.get("extends") else frozenset()
    return inherited | {f["name"] for f in spec["fields"] if f.get("absent") == "null"}


def conform(table: pa.Table, name: str) -> pa.Table:
    """Selects and casts ``table``'s columns to the declared schema; a missing column is a bug (raises), but for
    one declared ``"absent": "null"`` (`absent_as_null`), which is added as nulls."""
    schema = load_schema(name)
    for column in sorted(absent_as_null(name) - set(table.column_names)):
        table = table.append_column(column, pa.nulls(table.num_rows, schema.field(column).type))
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise AssertionError(f"stage output lacks columns {missing} declared in data_schemas/{name}.json")
    return table.select(schema.names).cast(schema)

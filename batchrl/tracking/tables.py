"""The committed tables of a run, for ``batchrl inspect RUN`` and for reading a run with other tools.

Why from manifests: a table is the parts its ``_MANIFEST.json`` lists, nothing else (an interrupted stage
leaves parts and temporary files beside them). Each TableInfo carries the part URIs, which pandas, duckdb
and ``datasets.load_dataset("parquet", data_files=...)`` read as they are. The policy checkpoints
(``iter_NNNN/policy``) are not tables and are left out.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from batchrl.storage import RunLayout, join, resolve
from batchrl.storage.manifest import Manifest, read_manifest

logger = logging.getLogger(__name__)

ITERATION_TABLES = ("rollouts", "scores", "advantages")


@dataclass(frozen=True)
class TableInfo:
    label: str  # "prompts", "prompts rejects", "iter 0 scores"
    table_dir: str
    schema: str  # the data_schemas/ name
    files: list[str]  # part URIs, in order
    num_rows: int


def run_tables(run_dir: str) -> list[TableInfo]:
    """Every committed table of the run, in pipeline order (tables of unfinished stages are left out): per iteration
    the built-in ones and those of user stages (any other directory with a table's manifest), in the order their
    stages started."""
    layout = RunLayout(run_dir.rstrip("/"))
    tables = _tables_of(layout.table_dir("prompts", None), "prompts")
    for iteration in iteration_dirs(layout.run_dir):
        found = []
        for table in [*ITERATION_TABLES, *_other_tables(layout.iteration_dir(iteration))]:
            manifest = read_manifest(layout.table_dir(table, iteration))
            if manifest is not None and manifest.schema:
                found.append((manifest.started_at, table, manifest))
        for _, table, manifest in sorted(found, key=lambda item: item[:2]):
            tables += _tables_of(layout.table_dir(table, iteration), f"iter {iteration} {table}", manifest=manifest)
    return tables


def _other_tables(iteration_dir: str) -> list[str]:
    """Directories of an iteration that are not the built-in tables, the policy or the evaluation: user stages'."""
    fs, path = resolve(iteration_dir)
    try:
        entries = fs.ls(path.rstrip("/"), detail=True)
        names = [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]
    except FileNotFoundError:
        return []
    skipped = {*ITERATION_TABLES, "policy", "evaluations"}
    return sorted(n for n in names if n not in skipped and not n.startswith((".", "_")))


def _tables_of(table_dir: str, label: str, *, manifest: Manifest | None = None) -> list[TableInfo]:
    manifest = manifest or read_manifest(table_dir)
    if manifest is None or not manifest.schema:
        return []
    out = [
        TableInfo(
            label, table_dir, manifest.schema, [join(table_dir, p.name) for p in manifest.parts], manifest.num_rows
        )
    ]
    for name, parts in sorted(manifest.extra_parts.items()):
        if parts:  # one without parts (an ingest that rejected nothing) has no file for another tool to read
            out.append(_side_table(table_dir, f"{label} {name}", manifest, name))
    return out


def side_table(directory: str) -> TableInfo | None:
    """The side table at ``directory`` (``<table>/_<name>``, e.g. prompts/_rejects): the parts the table's manifest
    lists under ``extra_parts[name]``, none when the stage wrote none (the directory need not exist then). None
    when ``directory`` is no side table of a committed table."""
    table_dir, _, base = directory.rstrip("/").rpartition("/")
    manifest = read_manifest(table_dir) if table_dir and base.startswith("_") else None
    if manifest is None or base[1:] not in manifest.extra_parts:
        return None
    table = manifest.table if manifest.iteration is None else f"iter {manifest.iteration} {manifest.table}"
    return _side_table(table_dir, f"{table} {base[1:]}", manifest, base[1:])


def _side_table(table_dir: str, label: str, manifest: Manifest, name: str) -> TableInfo:
    """extra_parts[name] of ``manifest``, under ``table_dir``/_<name>/; its schema is <table>_<name> without the
    plural (ingest's rejects: prompt_rejects)."""
    parts = manifest.extra_parts[name]
    return TableInfo(
        label,
        join(table_dir, f"_{name}"),
        f"{manifest.schema.rstrip('s')}_{name}",
        [join(table_dir, p.name) for p in parts],
        sum(p.rows for p in parts),
    )


def iteration_dirs(run_dir: str) -> list[int]:
    """Iterations with an iter_NNNN directory ([] when the run directory does not exist)."""
    fs, path = resolve(run_dir)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(int(n[5:]) for n in names if re.fullmatch(r"iter_\d{4,}", n))


def describe_run(run_dir: str) -> str:
    """One line per committed table: label, rows, parts, schema and directory."""
    tables = run_tables(run_dir)
    if not tables:
        return f"{run_dir}: no committed table (not a run directory, or no stage has finished)"
    width = max(len(t.label) for t in tables)
    return "\n".join(
        f"{t.label:<{width}}  {t.num_rows:>9} rows  {len(t.files):>4} part(s)  schema {t.schema:<14} {t.table_dir}"
        for t in tables
    )

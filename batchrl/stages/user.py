"""User-defined stages (the pipeline's ``stages:`` list): a function over one shard's table, inserted after a built-in.

Why a stage and not a callback inside score or advantage: a user stage gets everything a built-in stage has, with
no code of ours to change. Its table is materialised with a manifest (`batchrl inspect` shows it), its shards run
over a Ray Data actor pool and resume one by one after a crash, `plan` and `status` list it, `--from-stage` names
it, and its fingerprint (its config and its module's source) is chained into every stage after it, so editing the
function re-runs it and what follows without `--from-stage`.

The contract a user function programs against (docs/ARCHITECTURE.md, "User stages"):
- it receives one shard of the table of the stage it follows (rollouts, scores or advantages: one row per prompt
  group before advantage, one per sample after it) as a ``pyarrow.Table``, and returns a table;
- it may add columns and change columns, all of them declared in ``outputs``; every other column must come out
  equal, with the same rows in the same order (the next stages rely on the group structure and the row order);
- the columns of the input table keep their types (a returned column is cast back, and one that cannot be is
  an error); added columns are written as returned, and the stages after it ignore them.
A shard that breaks the contract, or a function that raises, fails the run with a DataError (exit 3) naming the
stage, the column and the part.

Each entry of ``stages:`` becomes a Stage class made here when a config is synced into the registry
(`batchrl.pipeline.stage.sync_stages`); the class reads the table of the stage before it and takes over that
table for the stages after it (`Stage.takes_over`), so advantage reads a stage inserted after score.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import sysconfig
import traceback
import typing
from collections.abc import Callable
from inspect import Parameter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrl.config import ConfigError, PipelineConfig
from batchrl.config.models import InsertionPoint, UserStageConfig, fingerprint_dump
from batchrl.errors import DataError, type_phrase
from batchrl.pipeline.shards import ShardRun, ShardWorker, run_sharded
from batchrl.pipeline.stage import STAGE_PROVIDERS, STAGES, ActorNeed, Stage, StageContext, StageOutput
from batchrl.references import import_reference, source_digest
from batchrl.storage.manifest import Manifest
from batchrl.storage.schemas import load_schema

logger = logging.getLogger(__name__)

# Functions given as objects (the Python API's insert_after), by the reference their stage's config names them with
FUNCTIONS: dict[str, Callable[..., Any]] = {}

# The built-ins a user stage may follow (its `after:`), as the config declares them; their tables from the registry
INSERTION_POINTS: tuple[str, ...] = typing.get_args(InsertionPoint)


def register_function(function: Callable[..., Any]) -> str:
    """The reference a stage's config names a function object by ("module:qualname"), remembered for this process:
    its actors get the object itself (cloudpickle), so a function defined in a script or a notebook works."""
    qualname = getattr(function, "__qualname__", "")
    if not callable(function) or not all(part.isidentifier() for part in qualname.split(".")):
        raise ConfigError(f"{function!r} is not a named function or class (a lambda or a local one has no name to use)")
    reference = f"{function.__module__}:{qualname}"
    FUNCTIONS[reference] = function
    return reference


def code_digest(reference: str) -> str:
    """What a stage's fingerprint holds of its code: the source of a registered function object, else the source
    file of the module the reference names (`source_digest`)."""
    import hashlib
    import inspect

    function = FUNCTIONS.get(reference)
    if function is None:
        return source_digest(reference)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):  # no source file (defined interactively): its compiled code
        code = getattr(function, "__code__", None)
        source = repr((code.co_code, code.co_consts)) if code is not None else repr(function)
    return hashlib.sha256(source.encode()).hexdigest()[:16]


class UserStage(Stage):
    """Base of the classes made from ``stages:`` entries; ``index`` is the entry's position in cfg.stages."""

    index: int
    per_iteration = True

    def entry(self, cfg: PipelineConfig) -> UserStageConfig:
        return cfg.stages[self.index]

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        entry = self.entry(cfg)
        # its name names its table's directory; it is not what the stage computes
        return fingerprint_dump(entry, exclude=frozenset({"name"})) | {"code": code_digest(entry.call)}

    def check_inputs(self, cfg: PipelineConfig) -> None:
        """Before anything is written: the call resolves to a function or a class that its params fit (checked
        when the config was loaded too, `check_stage_calls`; the module may have changed since)."""
        problems = call_problems(self.entry(cfg), index=self.index)
        if problems:
            raise ConfigError("\n".join(problems))

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        return [ActorNeed.of(self.entry(cfg), field=f"stages[{self.index}]")]

    def metrics(self, manifest: Manifest, *, timings: dict[str, float]) -> dict[str, float]:
        """stage/<name>/rows, stage/<name>/call_s, and the stage's effect on each numeric column of its input that it
        declares in outputs: stage/<name>/<column>/{mean_before,mean_after,changed} (`column_effects`)."""
        return {f"stage/{self.name}/{key}": value for key, value in manifest.stats.items()}

    def run(self, ctx: StageContext) -> StageOutput:
        entry = self.entry(ctx.cfg)
        table = self.inputs[0]
        parts, counts = run_sharded(
            ShardRun.of(ctx, table, description=self.name),
            worker_cls=UserStageWorker,
            worker_kwargs={
                "stage": self.name,
                "call": entry.call,
                "function": FUNCTIONS.get(entry.call),
                "params": dict(entry.params),
                "outputs": list(entry.outputs),
                "schema": self.schema,
            },
            actors=entry,
        )
        seconds = counts.pop("call_s", 0.0)
        effects = {key: counts.pop(key) for key in list(counts) if key.startswith(EFFECT)}
        return StageOutput(
            parts=parts,
            counts={key: int(value) for key, value in counts.items()},
            stats={"call_s": round(seconds, 3), "rows": int(counts.get("rows", 0)), **effect_stats(effects)},
        )


class UserStageWorker(ShardWorker):
    """Calls the user's function (or its class's instance, built once per actor) on each shard, then checks the
    returned table against the contract (see the module docstring)."""

    schema = ""  # conforms its own output: the input's columns keep their types, the added ones are kept

    def __init__(
        self,
        *,
        stage: str,
        call: str,
        params: dict[str, Any],
        outputs: list[str],
        schema: str,
        function: Callable[..., Any] | None = None,
    ):
        target = function if function is not None else import_reference(call, what=f"stage {stage}: call")
        self.stage, self.call, self.outputs, self.input_schema = stage, call, outputs, load_schema(schema)
        if isinstance(target, type):
            self.function, self.params = _built(target, params, stage=stage, call=call), {}
        else:
            self.function, self.params = target, params

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        import time

        started = time.perf_counter()
        try:
            out = self.function(table, **self.params)
        except Exception as error:  # the user's code: its failure is the stage's, named, not our traceback
            raise DataError(
                f"stage {self.stage}: {self.call} raised {_described(error, code=self.function)}"
            ) from error
        elapsed = time.perf_counter() - started
        out = checked_output(table, out, stage=self.stage, outputs=self.outputs, schema=self.input_schema)
        effects = column_effects(table, out, columns=[name for name in self.outputs if name in table.column_names])
        return out, {"rows": out.num_rows, "call_s": elapsed, **effects}


EFFECT = "effect/"  # the worker's counts of a stage's effect on a column: effect/<column>/<counter>


def _numbers(column: pa.ChunkedArray) -> np.ndarray | None:
    """A numeric column's values, lists flattened (a group's scores), as float64 with NaN for nulls; None for a
    column that holds no numbers."""
    while pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        column = pc.list_flatten(column)
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        return None
    return column.cast(pa.float64()).to_numpy(zero_copy_only=False)


def column_effects(before: pa.Table, after: pa.Table, *, columns: list[str]) -> dict[str, float]:
    """One shard's counters of what a stage did to each numeric input column it changes (its declared outputs that
    it was given: a clip or a bonus on ``scores``, a filter zeroing ``advantage``): the sums and counts of its
    values before and after, and how many values changed. Summed over shards by the runner, see `effect_stats`."""
    counts: dict[str, float] = {}
    for name in columns:
        before_N, after_N = _numbers(before.column(name)), _numbers(after.column(name))
        if before_N is None or after_N is None:
            continue
        counts[f"{EFFECT}{name}/sum_before"] = float(np.nansum(before_N))
        counts[f"{EFFECT}{name}/count_before"] = float((~np.isnan(before_N)).sum())
        counts[f"{EFFECT}{name}/sum_after"] = float(np.nansum(after_N))
        counts[f"{EFFECT}{name}/count_after"] = float((~np.isnan(after_N)).sum())
        if len(before_N) == len(after_N):  # lists of another length: no value-by-value comparison
            same_N = (before_N == after_N) | (np.isnan(before_N) & np.isnan(after_N))
            counts[f"{EFFECT}{name}/changed"] = float((~same_N).sum())
    return counts


def effect_stats(counts: dict[str, float]) -> dict[str, float]:
    """<column>/mean_before, <column>/mean_after and <column>/changed (values) from the summed `column_effects`."""
    stats: dict[str, float] = {}
    for name in sorted({key[len(EFFECT) :].rpartition("/")[0] for key in counts}):
        for side in ("before", "after"):
            total, count = counts.get(f"{EFFECT}{name}/sum_{side}"), counts.get(f"{EFFECT}{name}/count_{side}")
            if count:
                stats[f"{name}/mean_{side}"] = total / count
        if f"{EFFECT}{name}/changed" in counts:
            stats[f"{name}/changed"] = int(counts[f"{EFFECT}{name}/changed"])
    return stats


def _built(cls: type, params: dict[str, Any], *, stage: str, call: str) -> Any:
    try:
        return cls(**params)
    except Exception as error:  # the user's constructor
        raise DataError(f"stage {stage}: building {call}(**params) raised {_described(error, code=cls)}") from error


def _described(error: BaseException, *, code: Any) -> str:
    """The exception and the line of user code it came from: the deepest frame of its traceback in the file of
    ``code`` (the user's function or class) or in any file outside batchrl, the standard library and the installed
    packages. Not simply the last frame: that is often a library's (``pyarrow/table.pxi:1740`` for a missing
    column), which says nothing about which line of the user's to fix."""
    frames = traceback.extract_tb(error.__traceback__)
    own = _source_file(code)
    mine = [f for f in frames if f.filename == own or _outside_libraries(f.filename)]
    frame = (mine or frames or [None])[-1]
    where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
    return f"{type(error).__name__}: {error}{where}"


def _source_file(code: Any) -> str | None:
    """The file defining ``code``: a function, a class, or an instance's class."""
    try:
        return inspect.getfile(code if inspect.isfunction(code) or isinstance(code, type) else type(code))
    except TypeError:  # built in, or defined interactively
        return None


# batchrl's own files, the standard library's and the installed packages': no frame there is the user's line
_LIBRARIES = tuple(
    os.path.join(os.path.realpath(path), "")
    for path in {
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # the batchrl package
        *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    }
)


def _outside_libraries(filename: str) -> bool:
    """A file of the user's: a real path (not an extension's ``pyarrow/table.pxi``, not ``<frozen ...>``) outside
    batchrl, the standard library and site-packages."""
    if not os.path.isabs(filename) or "site-packages" in filename or "dist-packages" in filename:
        return False
    return not os.path.realpath(filename).startswith(_LIBRARIES)


def check_stage_calls(cfg: PipelineConfig, *, source: str | None = None) -> None:
    """Each ``stages:`` entry's call resolves to a function or a class, and its params fit that callable's signature:
    one ConfigError, a line per problem naming the field (``stages[i].call``, ``stages[i].params.<name>``), after
    ``source`` (the pipeline file) when given. Called where a pipeline is loaded to be validated, planned or run, so
    a typo costs no ingest or generation. Imports the modules the calls name (their top-level code runs, as it would
    in the run) and does nothing else."""
    problems = [line for index, entry in enumerate(cfg.stages) for line in call_problems(entry, index=index)]
    if problems:
        raise ConfigError("\n".join(f"{source}: {line}" if source else line for line in problems))


def call_problems(entry: UserStageConfig, *, index: int) -> list[str]:
    """What is wrong with ``entry``'s call and params, one line each naming the field ([] when nothing is)."""
    where = f"stages[{index}]"
    target = FUNCTIONS.get(entry.call)
    if target is None:
        try:
            target = import_reference(entry.call, what="function")
        except ValueError as error:
            return [
                f"{where}.call: {error}; name a function or class importable from the directory batchrl runs in "
                "or from the installed packages"
            ]
    if not callable(target):
        return [f"{where}.call={entry.call!r} is {type_phrase(target)}, not a function or a class"]
    if isinstance(target, type) and "__call__" not in dir(target):  # dir: its own and its bases', not type's
        return [f"{where}.call={entry.call!r} is a class without __call__: its instance is called with each shard"]
    try:
        signature = inspect.signature(target)  # a class: its constructor's, without self
    except (TypeError, ValueError):
        return []  # no introspectable signature (some builtins): the call decides
    return _params_problems(signature, entry, where=where, takes_table=not isinstance(target, type))


def _params_problems(
    signature: inspect.Signature, entry: UserStageConfig, *, where: str, takes_table: bool
) -> list[str]:
    """``entry.params`` against the signature of the function (called as function(table, **params)) or of the class
    (built as Class(**params)): unknown names (unless it takes **kwargs) and missing required ones."""
    parameters = list(signature.parameters.values())
    if takes_table:  # the shard's table goes to the first positional parameter
        positional = [
            p
            for p in parameters
            if p.kind in (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD, Parameter.VAR_POSITIONAL)
        ]
        if not positional:
            return [
                f"{where}.call: {entry.call}{signature} takes no positional parameter for the shard's table; a stage "
                "function is called as function(table, **params)"
            ]
        if positional[0].kind is not Parameter.VAR_POSITIONAL:
            parameters.remove(positional[0])
    named = [p.name for p in parameters if p.kind in (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY)]
    takes_any = any(p.kind is Parameter.VAR_KEYWORD for p in parameters)
    listed = ", ".join(named) or "none"
    problems, meant = [], set()  # meant: the parameters a misspelt name was taken for (not reported missing too)
    for name in entry.params:
        if name not in named and not takes_any:
            close = difflib.get_close_matches(name, named, n=1)
            meant.update(close)
            problems.append(
                f"{where}.params.{name}: {entry.call} has no parameter {name!r}"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + f" Remove it or fix its spelling (its parameters: {listed})"
            )
    missing = [
        p.name
        for p in parameters
        if p.kind in (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY)
        and p.default is p.empty
        and p.name not in entry.params
        and p.name not in meant
    ]
    if missing:
        problems.append(
            f"{where}.params: {entry.call} needs {', '.join(map(repr, missing))}: add "
            f"{'it' if len(missing) == 1 else 'them'} under params (its parameters: {listed})"
        )
    if not problems:
        try:  # what the checks above do not cover (a positional-only parameter, a name given twice)
            signature.bind(*([None] if takes_table else []), **entry.params)
        except TypeError as error:
            problems.append(f"{where}.params: {entry.call}{signature} cannot be called with them ({error})")
    return problems


def checked_output(before: pa.Table, after: Any, *, stage: str, outputs: list[str], schema: pa.Schema) -> pa.Table:
    """``after`` if it keeps the contract with ``before`` (see the module docstring), with the input schema's columns
    cast back to their declared types; a DataError naming the stage and the column otherwise."""
    if isinstance(after, pa.RecordBatch):
        after = pa.Table.from_batches([after])
    if not isinstance(after, pa.Table):
        raise DataError(f"stage {stage} returned {type_phrase(after)}; it must return a pyarrow.Table")
    if after.num_rows != before.num_rows:
        raise DataError(
            f"stage {stage} returned {after.num_rows} rows for a shard of {before.num_rows}; a stage keeps every row, "
            "in order (set a column, e.g. a flag or a zero reward, instead of dropping a row)"
        )
    declared = set(outputs)
    for name in before.column_names:
        if name not in after.column_names:
            raise DataError(f"stage {stage} dropped the column {name!r}; a stage keeps every column it is given")
        if name not in declared and not after.column(name).equals(before.column(name)):
            raise DataError(
                f"stage {stage} changed the column {name!r}, which its outputs do not declare; add it to outputs "
                "if the change is meant"
            )
    undeclared = [name for name in after.column_names if name not in before.column_names and name not in declared]
    if undeclared:
        raise DataError(f"stage {stage} added the column(s) {undeclared}, which its outputs do not declare")
    missing = [name for name in outputs if name not in after.column_names]
    if missing:
        raise DataError(f"stage {stage} did not return the column(s) {missing} that its outputs declare")
    return _cast_to_input_types(after, stage=stage, schema=schema)


def _cast_to_input_types(table: pa.Table, *, stage: str, schema: pa.Schema) -> pa.Table:
    """The input schema's columns first, at their declared types; the stage's own columns after them, as returned."""
    columns, fields = [], []
    for field in schema:
        column = table.column(field.name)
        try:
            columns.append(column.cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
            raise DataError(
                f"stage {stage} returned the column {field.name!r} as {column.type}, which does not convert to its "
                f"type {field.type}: {error}"
            ) from None
        fields.append(field)
    for name in table.column_names:
        if schema.get_field_index(name) < 0:
            columns.append(table.column(name))
            fields.append(pa.field(name, table.column(name).type))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def user_stages(cfg: PipelineConfig) -> list[type[Stage]]:
    """One Stage class per ``stages:`` entry, in order: each reads the table of the stage before it (the built-in
    it follows, or the user stage listed before it with the same ``after``) and takes over the built-in's table."""
    classes: list[type[Stage]] = []
    last = {point: STAGES[point].table for point in INSERTION_POINTS}  # the table a new stage after each one reads
    for index, entry in enumerate(cfg.stages):
        followed = STAGES[entry.after].table
        cls = type(
            f"UserStage_{entry.name}",
            (UserStage,),
            {
                "name": entry.name,
                "table": entry.name,
                "schema": STAGES[entry.after].schema,  # the table it follows: the same columns, plus its own
                "inputs": (last[entry.after],),
                "takes_over": followed,
                "timing_name": entry.name,
                "index": index,
                "__module__": __name__,
            },
        )
        last[entry.after] = entry.name
        classes.append(cls)
    return classes


STAGE_PROVIDERS.append(user_stages)

"""The batchrl command line: thin wrappers over config loading, planning and the runner.

Exit codes (for schedulers: retry 4, fix and rerun 2 and 3, report 1):
0 done (including an incremental run that found no new input file), 1 internal failure (a bug),
2 configuration error (nothing is run; also: the run directory is locked by a live run),
3 data error (unreadable or invalid input data), 4 interrupted (SIGINT/SIGTERM, or object storage
unreachable beyond the retries): the same command resumes the run.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import time
from pathlib import Path

import typer

from batchrl.config import ConfigError, PipelineConfig, load_pipeline

EXIT_CODES_HELP = (
    "Exit codes: 0 done; 1 internal failure; 2 configuration error, nothing run (also: run directory "
    "locked by a live run); 3 data error; 4 interrupted (SIGINT/SIGTERM, object storage unreachable, Ray "
    "not started): "
    "the same command resumes the run."
)
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="batchrl: offline batch-mode RL post-training (GRPO/PPO) over Parquet. " + EXIT_CODES_HELP,
)
logger = logging.getLogger("batchrl")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_DATA, EXIT_INTERRUPTED = 0, 1, 2, 3, 4

PipelineArg = typer.Argument(..., help="Pipeline YAML file, e.g. pipelines/quickstart.yaml.")
SetOpt = typer.Option([], "--set", help="Override a config field: --set generate.temperature=0.7 (repeatable).")
RunIdOpt = typer.Option(None, "--run-id", help="Run id (directory under run.root); the same id resumes.")
FromStageOpt = typer.Option(
    None,
    "--from-stage",
    help="Redo this stage (ingest, generate, score, values with a critic, advantage, update, or a user stage's "
    "name) of --iteration and every stage after it, keeping the stages before it; 'evaluate' "
    "redoes only the evaluations from --iteration on (default: from the initial policy's), "
    "never training.",
)
IterationOpt = typer.Option(None, "--iteration", help="Iteration of --from-stage (default 0).")
VerifyOpt = typer.Option(
    False,
    "--verify",
    help="Check every committed part's sha256 against its manifest "
    "(reads all data); damaged parts are redone. Without it, only presence and size are checked.",
)


def _setup_logging(verbose: bool) -> None:
    """The root logger at INFO (DEBUG with --verbose), timestamped on stderr: the command line owns its process.
    The rest, the libraries' chatter cut to errors unless --verbose, is the same for the Python API
    (`batchrl.api.configure_logging`, which Pipeline.run calls again: it changes nothing the second time)."""
    from batchrl.api import LOG_FORMAT, configure_logging

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr, format=LOG_FORMAT, datefmt="%H:%M:%S"
    )
    configure_logging(verbose=verbose)


def _load(pipeline: Path, overrides: list[str], run_id: str | None) -> PipelineConfig:
    """The pipeline validate, plan and run work on; exit 2 on a config error, before any work."""
    try:
        cfg = load_pipeline(pipeline, overrides=overrides, run_id=run_id)
        # user stages, tools, an environment, rewards: imported and checked against their functions
        from batchrl.stages.code_checks import check_code_references

        check_code_references(cfg, source=str(pipeline))
        return cfg
    except ConfigError as err:
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


@app.command()
def validate(pipeline: Path = PipelineArg, overrides: list[str] = SetOpt, run_id: str | None = RunIdOpt) -> None:
    """Check a pipeline file and print the fully resolved config (exit 2 with field-named errors)."""
    import yaml

    cfg = _load(pipeline, overrides, run_id)
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), nl=False)


@app.command()
def plan(
    pipeline: Path = PipelineArg,
    overrides: list[str] = SetOpt,
    run_id: str | None = RunIdOpt,
    from_stage: str | None = FromStageOpt,
    iteration: int | None = IterationOpt,
    verify: bool = VerifyOpt,
) -> None:
    """Print the stages of the run and what `batchrl run` would do with each: skip, resume, redo or run."""
    from batchrl.api import build_plan, check_from_stage

    cfg = _load(pipeline, overrides, run_id)
    try:
        if from_stage is not None:
            check_from_stage(cfg, from_stage, iteration)
        steps = build_plan(cfg, from_stage=from_stage, from_iteration=iteration, verify_checksums=verify)
    except ConfigError as err:
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    _print_plan(cfg, steps)


ACTIONS = {
    "done": "skip (complete)",
    "damaged": "repair (redo damaged)",
    "stale": "redo (config changed)",
    "outdated": "redo (inputs replaced)",
    "partial": "resume (partial)",
    "pending": "run",
    "forced": "redo (--from-stage)",
}


def _print_plan(cfg: PipelineConfig, steps) -> None:
    from batchrl.storage import RunLayout

    typer.echo(f"run {RunLayout.for_run(cfg.run.root, cfg.run_id).run_dir}")
    for step in steps:
        action = "redo (code changed)" if step.status == "stale" and step.code_changed else ACTIONS[step.status]
        typer.echo(f"  {step.label:<22} {step.status:<8} {action:<22} {_step_detail(step)}".rstrip())
    if cfg.run.epochs is not None and not any(step.iteration is not None for step in steps):
        typer.echo(f"  (run.epochs={cfg.run.epochs}: the iterations are listed once the prompts table is ingested)")
    _print_batches(cfg, steps)
    if cfg.run.max_staleness:
        in_flight = sorted(  # started (a _STARTED.json), not committed
            {
                s.iteration
                for s in steps
                if s.started_at and s.status in ("partial", "pending") and s.iteration is not None
            }
        )
        typer.echo(
            f"  (run.max_staleness={cfg.run.max_staleness}: iteration i generates with policy version "
            f"i-{cfg.run.max_staleness} while the update before it trains"
            + (f"; in flight when interrupted: iterations {', '.join(map(str, in_flight))}" if in_flight else "")
            + ")"
        )


PLANNED_BATCHES_LISTED = 10  # a run of 15 epochs over 1M prompts has thousands of iterations: the next ones


def _print_batches(cfg: PipelineConfig, steps) -> None:
    """With data.prompts_per_iteration, the parts and rows that the iterations still to run (all of them, when every
    one is done) roll out, the first PLANNED_BATCHES_LISTED, once the prompts table is committed (its manifest is what
    decides them)."""
    from batchrl.algorithms.batches import described
    from batchrl.errors import DataError
    from batchrl.stages.generate import prompt_batch
    from batchrl.stages.generate_batches import stats_committed

    # the training prompts (not the held-out ones, of the same schema) as this config makes them: a committed table
    # of another config (to redo) decides nothing
    prompts = next((s.manifest for s in steps if s.status == "done" and s.manifest.table == "prompts"), None)
    iterations = sorted({step.iteration for step in steps if step.iteration is not None})
    batch_size = cfg.data.prompts_per_iteration or sum(cfg.data.source_counts().values())  # data.sources' counts
    if not batch_size or prompts is None or not iterations:
        return
    to_run = sorted({s.iteration for s in steps if s.iteration is not None and s.status != "done"}) or iterations
    typer.echo(
        f"  prompt batches ({batch_size} prompts per iteration; the parts reshuffled every epoch, and the rows inside "
        "each part):"
    )
    input_dirs = {s.iteration: s.input_dirs for s in steps if s.name == "generate"}
    for iteration in to_run[:PLANNED_BATCHES_LISTED]:
        dirs = input_dirs.get(iteration)
        if cfg.data.curriculum and not stats_committed(dirs):
            # the batch skips what the previous iteration's prompt_stats says is solved
            typer.echo(f"    iter {iteration}: data.curriculum: decided by iteration {iteration - 1}'s prompt_stats")
            break
        try:
            batch = prompt_batch(cfg, iteration, prompts, dirs)
        except DataError as err:  # data.sources: a source smaller than its count (the run stops there too)
            typer.echo(f"    data error: {err}")
            return
        where = f"epoch {batch.epoch}, batch {batch.index_in_epoch + 1} of {batch.batches_per_epoch}"
        typer.echo(f"    iter {iteration} ({where}): {described(batch)}")
    if len(to_run) > PLANNED_BATCHES_LISTED:
        typer.echo(f"    ... and {len(to_run) - PLANNED_BATCHES_LISTED} more iteration(s)")


def _step_detail(step) -> str:
    """Rows, parts, rejects and duration of a committed stage; shards written of a partial one."""
    manifest = step.manifest
    if step.status == "partial":
        since = f", started {time.strftime('%H:%M:%S', time.localtime(step.started_at))}" if step.started_at else ""
        if not step.sharded:
            return f"{step.parts_written} file(s) of an interrupted attempt, redone whole{since}"
        total = "?" if step.parts_total is None else step.parts_total
        return f"{step.parts_written} of {total} shards written{since}"
    if manifest is None:
        return ""
    size = f"{manifest.num_rows} rows" if manifest.schema else f"{len(manifest.parts)} files"
    details = [
        size,
        f"{len(manifest.parts)} parts" if manifest.schema else None,
        f"{manifest.finished_at - manifest.started_at:.1f} s",
    ]
    for key, label in (("rejected", "rejected"), ("failed_samples", "reward failures")):
        if manifest.counts.get(key):
            details.append(f"{manifest.counts[key]} {label}")
    if step.damaged:
        details.append(f"{len(step.damaged)} damaged: {', '.join(step.damaged[:3])}")
    return ", ".join(d for d in details if d)


@app.command()
def run(
    pipeline: Path = PipelineArg,
    overrides: list[str] = SetOpt,
    run_id: str | None = RunIdOpt,
    from_stage: str | None = FromStageOpt,
    iteration: int | None = IterationOpt,
    verify: bool = VerifyOpt,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Run (or resume) a pipeline: ingest, then generate -> score -> advantage -> update per iteration.

    Exit codes: 0 done, 1 internal failure, 2 configuration error, 3 data error, 4 interrupted (resume it
    with the same command).
    """
    from batchrl.pipeline import interrupts

    # Schedulers stop jobs with SIGTERM: the run unwinds (update ranks and Ray stopped, lock released), exit 4.
    interrupts.install()
    try:
        _run(pipeline, overrides, run_id, from_stage=from_stage, iteration=iteration, verify=verify, verbose=verbose)
    except Exception:
        if interrupts.received() is None:
            raise
        _exit_interrupted(interrupts.received())
    except KeyboardInterrupt:
        _exit_interrupted(interrupts.received())


def _exit_interrupted(signal_name: str | None) -> None:
    typer.echo(
        f"interrupted{f' ({signal_name})' if signal_name else ''}: run again with the same command to resume", err=True
    )
    raise typer.Exit(EXIT_INTERRUPTED) from None


def _run(
    pipeline: Path,
    overrides: list[str],
    run_id: str | None,
    *,
    from_stage: str | None,
    iteration: int | None,
    verify: bool,
    verbose: bool,
) -> None:
    cfg = _load(pipeline, overrides, run_id)
    _setup_logging(verbose)
    from batchrl.api import Pipeline
    from batchrl.errors import DataError, ProcessCrash, RayStartError
    from batchrl.pipeline import interrupts
    from batchrl.pipeline.lock import RunLockedError
    from batchrl.storage import StorageError, is_transient_storage_error

    try:
        summary = Pipeline(cfg).run(from_stage=from_stage, iteration=iteration, verify=verify, verbose=verbose).summary
    except Exception as err:
        crash = _find_cause(err, lambda e: isinstance(e, ProcessCrash))
        if crash is not None and interrupts.received() is None:  # a process killed by our SIGTERM is no crash
            typer.echo(f"internal failure: {crash.one_line()}", err=True)
            raise typer.Exit(EXIT_FAILED) from None
        not_started = _find_cause(err, lambda e: isinstance(e, RayStartError))
        if not_started is not None:
            typer.echo(f"interrupted: {not_started}; nothing was run: run the same command again", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        transient = _find_cause(err, is_transient_storage_error)
        if transient is not None:
            typer.echo(
                f"interrupted: object storage unreachable ({type(transient).__name__}: {transient}); "
                f"nothing is torn: run the same command again to resume",
                err=True,
            )
            raise typer.Exit(EXIT_INTERRUPTED) from None
        kinds = (ConfigError, DataError, StorageError, RunLockedError)
        cause = _find_cause(err, lambda e: isinstance(e, kinds))
        if cause is None:
            raise
        code = EXIT_CONFIG if isinstance(cause, (ConfigError, RunLockedError)) else EXIT_DATA
        typer.echo(f"{'config' if code == EXIT_CONFIG else 'data'} error: {cause}", err=True)
        raise typer.Exit(code) from None
    _print_summary(summary)


def _find_cause(err: BaseException, matches) -> BaseException | None:
    """The first exception in ``err``'s cause chain (Ray wraps worker exceptions) that ``matches``."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if matches(err):
            return err
        context = None if err.__suppress_context__ else err.__context__
        err = getattr(err, "cause", None) or err.__cause__ or context
    return None


def _print_summary(summary) -> None:
    typer.echo(f"run {summary.run_dir}: ran {len(summary.ran)} stage(s), skipped {len(summary.skipped)}")
    if summary.no_new_files:
        typer.echo("no input file that the runs before this one have not ingested: nothing to train on")
    from batchrl.tracking import format_summary

    if summary.iterations:
        typer.echo(format_summary(summary.iterations))
    if len(summary.evaluations) >= 2:  # held-out accuracy, first evaluated policy -> last
        from batchrl.stages.evaluate import compare

        first, last = summary.evaluations[0], summary.evaluations[-1]
        name = "the initial policy" if first["iteration"] is None else f"iteration {first['iteration']}'s policy"
        typer.echo(f"held-out evaluation, {name} -> iteration {last['iteration']}'s policy:")
        for line in compare(first, last):
            typer.echo(f"  {line}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


@app.command()
def status(
    run_dir: str = typer.Argument(..., help="Run directory (local or s3://...) holding run.yaml."),
    verify: bool = VerifyOpt,
) -> None:
    """Each stage of a run: done / partial (k of n shards) / pending / stale / damaged; rows, rejects, durations,
    lock."""
    _require_s3_credentials(run_dir)
    from batchrl.api import build_plan
    from batchrl.pipeline.lineage import read_lineage
    from batchrl.pipeline.lock import holder_state, lock_holder
    from batchrl.storage import RunLayout

    cfg = _run_config(run_dir)
    try:
        steps = build_plan(cfg, verify_checksums=verify)
    except ConfigError as err:
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    _print_plan(cfg, steps)
    lineage = read_lineage(run_dir)
    if lineage is not None:
        typer.echo(
            f"warm start: {lineage.initial_policy} (init_from {lineage.init_from}); "
            f"{len(lineage.seen_files)} input file(s) ingested by earlier runs"
            + ("; found no new input file" if lineage.no_new_files else "")
        )
    holder = lock_holder(RunLayout(run_dir).lock)
    if holder is None:
        typer.echo("lock: free")
    else:
        state = holder_state(holder)
        hint = {
            "dead": " (stale: the next run takes it over)",
            "expired": " (stale: the next run takes it over)",
            "other host": f" (if that run is gone: batchrl unlock {run_dir})",
        }.get(state, "")
        typer.echo(
            f"lock: held by pid {holder.get('pid')} on {holder.get('host')} since "
            f"{time.ctime(holder.get('since', 0))}, {state}{hint}"
        )


def _require_s3_credentials(uri: str) -> None:
    """Exit 2 with one line when ``uri`` is on S3 and botocore finds no credentials (its NoCredentialsError would
    otherwise surface as a traceback on the first read)."""
    if not uri.startswith(("s3://", "s3a://")):
        return
    from batchrl.storage.sources import s3_credentials_problem

    problem = s3_credentials_problem()
    if problem is not None:
        typer.echo(
            f"config error: {uri} is on S3, but {problem}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(and AWS_ENDPOINT_URL for an S3-compatible store), or AWS_PROFILE",
            err=True,
        )
        raise typer.Exit(EXIT_CONFIG)


def _is_run_dir(uri: str) -> bool:
    from batchrl.storage import join, resolve

    fs, path = resolve(join(uri, "run.yaml"))
    return fs.exists(path)


def _run_config(run_dir: str) -> PipelineConfig:
    import yaml

    from batchrl.config import validate_dict
    from batchrl.storage import StorageError, join, resolve

    try:
        fs, path = resolve(join(run_dir, "run.yaml"))
        raw = yaml.safe_load(fs.cat_file(path).decode())
    except (FileNotFoundError, StorageError):
        typer.echo(f"data error: {run_dir} has no run.yaml (not a batchrl run directory?)", err=True)
        raise typer.Exit(EXIT_DATA) from None
    if isinstance(raw, dict):
        # run.yaml of a run started before setup: existed. status never builds anything, so the section can go.
        raw.pop("toy_assets", None)
    try:
        cfg = validate_dict(raw, source=f"{run_dir}/run.yaml")
    except ConfigError as err:
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    root, _, run_id = run_dir.rstrip("/").rpartition("/")
    # the directory asked about, even if the run was copied or moved since run.yaml was written
    cfg.run = cfg.run.model_copy(update={"root": root or ".", "id": run_id})
    return cfg


@app.command()
def unlock(
    run_dir: str = typer.Argument(..., help="Run directory (local or s3://...) whose run.lock to clear."),
) -> None:
    """Clear the lock of a run that is no longer running (e.g. a killed job on another host)."""
    _require_s3_credentials(run_dir)
    from batchrl.pipeline.lock import RunLockedError, break_lock
    from batchrl.storage import RunLayout

    try:
        holder = break_lock(RunLayout(run_dir).lock)
    except RunLockedError as err:
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    if holder is None:
        typer.echo(f"{run_dir} is not locked")
    else:
        typer.echo(f"removed the lock of pid {holder.get('pid')} on {holder.get('host')}; `batchrl run` can resume")


@app.command()
def inspect(
    table: str = typer.Argument(
        ...,
        help="A stage table directory, a side table of one (prompts/_rejects), a Parquet file or a run directory "
        "(local or s3://).",
    ),
    rows: int = typer.Option(3, "--rows", "-n", help="Rows to show."),
) -> None:
    """Print the schema, row count and first rows of a stage table; of a run directory, its tables."""
    _require_s3_credentials(table)
    from batchrl.storage import StorageError, read_parquet

    files, schema = _inspected_files(table)
    try:
        first = read_parquet(files[0]) if files else None
    except StorageError as err:
        typer.echo(f"data error: cannot read {table}: {err}", err=True)
        raise typer.Exit(EXIT_DATA) from None
    if first is None:  # a table without parts (an ingest's rejects when it rejected nothing): its declared schema
        typer.echo(str(schema) if schema is not None else "(no schema declared)")
        return
    typer.echo(str(first.schema))
    for row in first.slice(0, rows).to_pylist():
        typer.echo(json.dumps(row, default=str)[:2000])
        if row.get("num_turns") is not None:  # a multi-turn rollout: its conversations turn by turn
            from batchrl.agents.columns import conversation_lines

            for index, fields in enumerate(zip(row["response_texts"], row["tool_calls"], row["stop_statuses"])):
                typer.echo(f"sample {index}:")
                typer.echo("\n".join(conversation_lines(fields[0], fields[1], status=fields[2])))


def _inspected_files(table: str):
    """The files ``inspect`` reads of ``table``, in order, and the table's declared schema (shown when it has no
    file), after printing what they are; a run directory is described and ends the command. Exit 3 for a path that
    is no table."""
    from batchrl.storage import join, resolve
    from batchrl.storage.manifest import MANIFEST_NAME, read_manifest
    from batchrl.tracking.tables import describe_run, side_table

    fs, path = resolve(table)
    if table.endswith(".parquet") or fs.isfile(path):
        return [table], None  # read as Parquet, or said not to be
    manifest = read_manifest(table)
    if manifest is not None:
        typer.echo(
            f"{manifest.stage} stage table, fingerprint {manifest.fingerprint}, {len(manifest.parts)} part(s), "
            f"{manifest.num_rows} rows; counts {json.dumps(manifest.counts)}"
        )
        return [join(table, p.name) for p in manifest.parts], _declared_schema(manifest.schema)
    if _is_run_dir(table):
        typer.echo(describe_run(table))
        raise typer.Exit(EXIT_OK)
    side = side_table(table)
    if side is not None:
        empty = "" if side.files else ": empty (its stage wrote no part, e.g. an ingest that rejected nothing)"
        typer.echo(
            f"{side.label}, side table of {side.table_dir.rpartition('/')[0]}, {len(side.files)} part(s), "
            f"{side.num_rows} rows{empty}"
        )
        return side.files, _declared_schema(side.schema)
    what = (
        f"has no {MANIFEST_NAME}: it is no committed stage table (its stage has not finished, or it is not a "
        "table's directory); `batchrl inspect RUN_DIR` lists a run's tables"
        if fs.exists(path)
        else "does not exist"
    )
    typer.echo(f"data error: {table} {what}", err=True)
    raise typer.Exit(EXIT_DATA)


def _declared_schema(name: str):
    """data_schemas/<name>.json as a pyarrow schema; None for a table of files (a policy) or no such schema."""
    from batchrl.storage.schemas import load_schema

    try:
        return load_schema(name) if name else None
    except FileNotFoundError:
        return None


@app.command()
def report(
    run_dir: str = typer.Argument(..., help="Run directory (local or s3://...)."),
    out: str | None = typer.Option(
        None, "--out", help="Where to write index.html and the PNG plots (default <run>/report; local or s3://)."
    ),
    groups: int = typer.Option(3, "--groups", help="Sample groups shown per iteration."),
) -> None:
    """Plots of reward, accuracy, KL, entropy, response length and timings per iteration, and an HTML page
    with the best and worst completion of sample groups per iteration."""
    _require_s3_credentials(run_dir)
    if out is not None:
        _require_s3_credentials(out)
    from batchrl.storage import StorageError
    from batchrl.tracking.report import write_report

    try:
        page = write_report(run_dir, out_dir=out, groups_per_iteration=groups)
    except ConfigError as err:
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    except (ValueError, StorageError) as err:
        typer.echo(f"data error: {err}", err=True)
        raise typer.Exit(EXIT_DATA) from None
    typer.echo(f"report: {page}")


def _user_code_importable_from_cwd() -> None:
    """User code named as 'package.module:function' (rewards, stages, setup steps) imports from the directory the
    command runs in, as with `python -m`: in this process, and (through PYTHONPATH) in the Ray workers and child
    processes it starts, which would otherwise see only installed packages."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [cwd, *paths]))


def main() -> None:
    """Runs the command and exits with its code (see EXIT_CODES_HELP).

    The interpreter finalises as usual. It once did not (os._exit): a process that had read Parquet through a
    Python file object aborted at exit in about half the runs (SIGABRT, "terminate called without an active
    exception"). The cause was Arrow's thread pool freeing those buffers during finalisation (apache/arrow#50482),
    and storage no longer hands Arrow such buffers (see storage/fs.py; tests/unit/test_parquet_reads.py).
    """
    faulthandler.enable(all_threads=True)  # a native abort in the driver names the Python lines it happened under
    _user_code_importable_from_cwd()
    try:
        result = app(standalone_mode=False)  # a command's typer.Exit(code) comes back as its return value
        code = result if isinstance(result, int) else 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except typer.Abort:
        code = 1
    except Exception as error:
        if not (hasattr(error, "show") and isinstance(getattr(error, "exit_code", None), int)):
            raise
        error.show()  # a (vendored) click.ClickException: a usage mistake, exit 2
        code = error.exit_code
    sys.exit(code)


if __name__ == "__main__":
    main()

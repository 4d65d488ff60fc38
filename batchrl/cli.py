"""The batchrl command line: thin wrappers over config loading, planning and the runner.

Exit codes: 0 done, 1 internal failure, 2 configuration error, 3 data error, 4 interrupted.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from batchrl.config import ConfigError, PipelineConfig, load_pipeline

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="batchrl: offline batch-mode RL post-training (GRPO/PPO) over Parquet.")
logger = logging.getLogger("batchrl")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_DATA, EXIT_INTERRUPTED = 0, 1, 2, 3, 4

PipelineArg = typer.Argument(..., help="Pipeline YAML file, e.g. pipelines/quickstart.yaml.")
SetOpt = typer.Option([], "--set", help="Override a config field: --set generate.temperature=0.7 (repeatable).")
RunIdOpt = typer.Option(None, "--run-id", help="Run id (directory under run.root); the same id resumes.")


def _setup_logging(verbose: bool) -> None:
    # vLLM logs every engine start at INFO; Ray workers inherit this environment.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if verbose else "WARNING")
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not verbose:
        logging.getLogger("ray.data").setLevel(logging.WARNING)


def _load(pipeline: Path, overrides: list[str], run_id: str | None) -> PipelineConfig:
    try:
        return load_pipeline(pipeline, overrides=overrides, run_id=run_id)
    except ConfigError as err:
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


@app.command()
def validate(pipeline: Path = PipelineArg, overrides: list[str] = SetOpt, run_id: Optional[str] = RunIdOpt) -> None:
    """Check a pipeline file and print the fully resolved config (exit 2 with field-named errors)."""
    import yaml

    cfg = _load(pipeline, overrides, run_id)
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), nl=False)


@app.command()
def plan(pipeline: Path = PipelineArg, overrides: list[str] = SetOpt, run_id: Optional[str] = RunIdOpt) -> None:
    """Print the stages of the run and which are complete (skipped), stale, partial or pending."""
    from batchrl.pipeline.runner import build_plan

    cfg = _load(pipeline, overrides, run_id)
    _print_plan(cfg, build_plan(cfg))


def _print_plan(cfg: PipelineConfig, steps) -> None:
    from batchrl.storage import RunLayout

    typer.echo(f"run {RunLayout.for_run(cfg.run.root, cfg.run_id).run_dir}")
    actions = {"done": "skip (complete)", "stale": "redo (config changed)", "partial": "resume (partial)",
               "pending": "run"}
    for step in steps:
        rows = f"{step.manifest.num_rows} rows" if step.manifest is not None and step.manifest.schema else ""
        typer.echo(f"  {step.label:<22} {step.status:<8} {actions[step.status]:<22} {rows}")


@app.command()
def run(pipeline: Path = PipelineArg, overrides: list[str] = SetOpt, run_id: Optional[str] = RunIdOpt,
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    """Run (or resume) a pipeline: ingest, then generate -> score -> advantage -> update per iteration."""
    cfg = _load(pipeline, overrides, run_id)
    _setup_logging(verbose)
    from batchrl.pipeline.lock import RunLockedError
    from batchrl.pipeline.runner import Runner
    from batchrl.pipeline.stage import DataError
    from batchrl.storage import StorageError

    try:
        summary = Runner(cfg).run()
    except KeyboardInterrupt:
        typer.echo("interrupted: run again with the same command to resume", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as err:  # noqa: BLE001 — mapped to exit codes below, unknown errors re-raised
        cause = _user_error(err, (ConfigError, DataError, StorageError, RunLockedError))
        if cause is None:
            raise
        code = EXIT_CONFIG if isinstance(cause, (ConfigError, RunLockedError)) else EXIT_DATA
        typer.echo(f"{'config' if code == EXIT_CONFIG else 'data'} error: {cause}", err=True)
        raise typer.Exit(code) from None
    _print_summary(summary)


def _user_error(err: BaseException, kinds: tuple[type, ...]) -> BaseException | None:
    """The user error behind ``err`` (Ray wraps worker exceptions), or None for a genuine failure."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, kinds):
            return err
        err = getattr(err, "cause", None) or err.__cause__
    return None


def _print_summary(summary) -> None:
    typer.echo(f"run {summary.run_dir}: ran {len(summary.ran)} stage(s), skipped {len(summary.skipped)}")
    columns = ["iteration", "critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/ppo_kl",
               "actor/grad_norm", "timing_s/step"]
    typer.echo("  ".join(f"{c:>20}" for c in columns))
    for metrics in summary.iterations:
        typer.echo("  ".join(f"{_fmt(metrics.get(c)):>20}" for c in columns))


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


@app.command()
def status(run_dir: str = typer.Argument(..., help="Run directory (local or s3://...) holding run.yaml.")) -> None:
    """Show each stage of a run: done / stale / partial / pending, with row counts."""
    from batchrl.config import validate_dict
    from batchrl.pipeline.runner import build_plan
    from batchrl.storage import StorageError, join, resolve

    import yaml

    try:
        fs, path = resolve(join(run_dir, "run.yaml"))
        raw = yaml.safe_load(fs.cat_file(path).decode())
    except (FileNotFoundError, StorageError):
        typer.echo(f"data error: {run_dir} has no run.yaml (not a batchrl run directory?)", err=True)
        raise typer.Exit(EXIT_DATA) from None
    try:
        cfg = validate_dict(raw, source=f"{run_dir}/run.yaml")
    except ConfigError as err:
        typer.echo(f"config error: {err}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    _print_plan(cfg, build_plan(cfg))


@app.command()
def inspect(table: str = typer.Argument(..., help="A stage table directory or a Parquet file (local or s3://)."),
            rows: int = typer.Option(3, "--rows", "-n", help="Rows to show.")) -> None:
    """Print the schema, row count and first rows of a stage table."""
    from batchrl.pipeline.manifest import read_manifest
    from batchrl.storage import StorageError, join, read_parquet

    manifest = None if table.endswith(".parquet") else read_manifest(table)
    try:
        if manifest is not None:
            files = [join(table, p.name) for p in manifest.parts]
            typer.echo(f"{manifest.stage} stage table, fingerprint {manifest.fingerprint}, {len(files)} part(s), "
                       f"{manifest.num_rows} rows; counts {json.dumps(manifest.counts)}")
        else:
            files = [table]
        first = read_parquet(files[0])
    except (StorageError, IndexError) as err:
        typer.echo(f"data error: cannot read {table}: {err or 'no parts'}", err=True)
        raise typer.Exit(EXIT_DATA) from None
    typer.echo(str(first.schema))
    for row in first.slice(0, rows).to_pylist():
        typer.echo(json.dumps(row, default=str)[:2000])


def main() -> None:
    app()


if __name__ == "__main__":
    main()

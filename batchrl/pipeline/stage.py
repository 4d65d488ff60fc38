"""The stage contract and the one stage registry. This module imports no stage.

A stage reads its predecessors' committed tables (through their manifests), writes its own table as
deterministically named parts, and returns what the runner needs to write its manifest. Algorithms stay
out of stages: a stage is glue between storage and a pure function.

Why a base class with every hook declared (rather than a Protocol and ``getattr`` for the optional hooks): the
runner knows no stage by name. It plans, checks, resumes, reports and cleans up any stage from what the stage
declares here, so a new stage is one file with one ``@register``; and a reader sees every way a stage can
take part in a run in one place. Ray Data LLM's processor stages declare their input keys the same way.

The run order follows from the declarations (``stage_order``): a stage runs after the stages whose tables it
reads, so it does not depend on the order modules happen to be imported in (an import sorter reorders them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from batchrl.config import PipelineConfig
from batchrl.config.models import ActorResources, DataConfig
from batchrl.engines.pool import EnginePool
from batchrl.storage import RunLayout
from batchrl.storage.manifest import Manifest, PartInfo

POLICY = "policy"  # the table that chains iterations: iteration i starts from the policy iteration i-1 wrote


@dataclass(frozen=True)
class StageContext:
    cfg: PipelineConfig
    layout: RunLayout
    iteration: int | None
    output_dir: str
    fingerprint: str
    inputs: dict[str, Manifest]  # committed upstream manifests by table name ("prompts", "rollouts", ...)
    input_dirs: dict[str, str]
    policy_in: str  # the policy the stage reads (`Stage.reads_policy`): model.path or an iteration's policy dir
    embedded_ray: bool = False  # the Ray in use is one the runner started on this machine (not a cluster)
    # the policy that generated this iteration's rollouts (what reads_policy "behaviour" reads): the update compares
    # against it when it trains policy_in, the "previous" one; the same in strict order, with run.max_staleness k
    # iteration i-1-k's (`RunConfig.behaviour_version`)
    behaviour_policy: str | None = None
    # the GPUs the update's local ranks take when the session split one GPU host between them and the engines
    # (run.max_staleness; `batchrl.pipeline.session`); None: the environment's
    rank_devices: str | None = None
    # the run's generation engines, shared by generate and evaluate, owned by the run's session (it closes them when
    # the run ends); None outside a run (a stage that generates then refuses to run)
    engines: EnginePool | None = None


@dataclass
class StageOutput:
    parts: list[PartInfo]
    counts: dict[str, int] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    extra_parts: dict[str, list[PartInfo]] = field(default_factory=dict)
    trainer_state: list[PartInfo] | None = None  # update: the optimizer state it saved (see Manifest.trainer_state)


@dataclass(frozen=True)
class ActorNeed:
    """The resources one actor (or rank) of a stage asks Ray for, and the config field that sets them."""

    cpus: float
    gpus: float
    cpus_field: str  # e.g. "generate.cpus_per_actor": what to lower when the cluster cannot hold one
    gpus_field: str

    @classmethod
    def of(cls, actors: ActorResources | DataConfig, *, field: str) -> ActorNeed:
        """What one actor of the config section ``actors`` asks for (data's ingest actors: CPUs only); ``field``: the
        section's dotted name, e.g. "score.reward_model"."""
        return cls(
            cpus=actors.cpus_per_actor,
            gpus=getattr(actors, "gpus_per_actor", 0.0),
            cpus_field=f"{field}.cpus_per_actor",
            gpus_field=f"{field}.gpus_per_actor",
        )


# The keys of a fingerprint_config that hold digests of user code (a custom reward's or a user stage's module): a
# stage whose fingerprint changed there alone, its own or its inputs', is "stale (code changed)", not "config changed"
# (PlannedStage.config_fingerprint).
CODE_KEYS = frozenset({"code", "reward_code"})


class Stage:
    """Base class of every stage: the declarations the runner plans with, and the hooks it calls, with defaults.

    Required: ``name``, ``table``, ``schema``, ``fingerprint_config`` and ``run``; the rest have defaults that
    fit a plain per-iteration stage.
    """

    name: ClassVar[str]  # stage name, as in `--from-stage` and the plan
    table: ClassVar[str]  # output directory name under the run / iteration directory
    schema: ClassVar[str | None]  # data_schemas/<schema>.json of the output table (None: not a table)
    inputs: ClassVar[tuple[str, ...]] = ()  # upstream tables; POLICY = the iteration's input policy
    per_iteration: ClassVar[bool] = True  # False: runs once, before iteration 0 (ingest)
    # Which policy its POLICY input is at iteration i (the plan resolves it into StageContext.policy_in):
    # "previous": the one iteration i starts from, i-1's (the update trains it);
    # "behaviour": the one that generates iteration i's rollouts: with run.max_staleness k iteration i-1-k's, so
    #   that the stage can run while iteration i-1's update trains (generate, values);
    # "new": the one iteration i wrote (evaluate). Before iteration 0 all three are the initial policy.
    reads_policy: ClassVar[Literal["previous", "behaviour", "new"]] = "previous"
    # True: it reads data.train_files, which an incremental run (run.new_files_only) narrows to the new files
    reads_train_files: ClassVar[bool] = False
    # True: a table-writing stage that resumes from its journal (storage.journal): the runner keeps its files when
    # it restarts, and the stage redoes only the work no record claims (ingest, whose input chunks are not parts)
    resumes_from_journal: ClassVar[bool] = False
    config_section: ClassVar[str | None] = None  # the optional config section that turns the stage on
    timing_name: ClassVar[str | None] = None  # its duration in the iteration metrics: timing_s/<timing_name>
    in_step_time: ClassVar[bool] = True  # its duration counts in timing_s/step (a training step's time)
    summary_key: ClassVar[str | None] = None  # its stats are listed in RunSummary.reports[summary_key]
    # A stage inserted after another (a user stage): the stages that read this table read the last such stage's
    # table instead (see `source_table`); the inserted stages themselves read it as it is, in a chain.
    takes_over: ClassVar[str | None] = None
    # Inputs made from the config alone whose fingerprint_config this stage's own covers (evaluate: the held-out
    # prompts): left out of its fingerprint, which they cannot change, so that the evaluations made before that table
    # existed keep theirs; and a manifest that does not record them counts as made from the table there is now.
    covered_inputs: ClassVar[tuple[str, ...]] = ()

    def planned_iterations(self, cfg: PipelineConfig) -> list[int | None]:
        """Where the stage runs: None = once, before iteration 0; by default once or every iteration."""
        return list(range(cfg.run.iterations)) if self.per_iteration else [None]

    def iteration_count(self, cfg: PipelineConfig, *, tables: dict[str, Manifest]) -> int | None:
        """With run.epochs: the run's number of iterations, from the once-per-run tables (``tables``: their committed
        manifests); None when this stage does not decide it (generate does: epochs x batches per epoch)."""
        return None

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        """The config that determines this stage's output (changing it invalidates the stage). Digests of user code
        go under a key of CODE_KEYS, so that a change there alone is told apart ("code changed")."""
        raise NotImplementedError

    def check_inputs(self, cfg: PipelineConfig) -> None:
        """Config-level checks before anything is written (ConfigError / DataError); skipped once it is done."""

    def preflight(self, cfg: PipelineConfig, *, tables: dict[str, Manifest]) -> None:
        """Checks against the once-per-run tables (``tables``: their manifests), before any iteration runs."""

    def prestart(self, cfg: PipelineConfig, *, embedded_ray: bool, rank_devices: str | None) -> None:
        """Called once before the first iteration when the stage has work in this run: may start what it keeps
        across iterations (the update's resident ranks) so that the start overlaps the stages before its first step.
        Changes no output: a step that finds it unusable starts its own (released by `close`)."""

    def check_ready(self, ctx: StageContext) -> None:
        """Checks of what this step reads that need no work (DataError / ConfigError), made before the runner clears or
        marks its output directory: a step that cannot run stops the run with its old output still there (update:
        the optimizer state it continues is there and intact)."""

    def read_paths(self, cfg: PipelineConfig) -> list[tuple[str, str]]:
        """(config field, URI) of what the stage reads from outside the run: local ones must be shared on a
        cluster of several nodes."""
        return []

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        """What one of its actors or ranks asks Ray for: a cluster that cannot hold one is a config error."""
        return []

    def metrics(self, manifest: Manifest, *, timings: dict[str, float]) -> dict[str, float]:
        """Its contribution to an iteration's metrics (``timings``: the iteration's timing_s/* so far)."""
        return dict(manifest.stats)

    def previous_tables(self, cfg: PipelineConfig) -> tuple[str, ...]:
        """Tables of the iteration before that the stage reads too (generate with data.curriculum: prompt_stats),
        in its fingerprint and input_dirs where one is planned. Not in the run order: within an iteration they are
        made after it, so declaring them as ``inputs`` would be a cycle."""
        return ()

    def planned_parts(
        self, cfg: PipelineConfig, iteration: int | None, inputs: dict[str, Manifest], input_dirs: dict[str, str]
    ) -> list[str]:
        """`output_parts`, for a stage whose parts depend on what its inputs hold, not only on their manifests
        (generate with data.curriculum reads prompt ids and prompt_stats): the runner and the plan call this."""
        return self.output_parts(cfg, iteration, inputs)

    def output_parts(self, cfg: PipelineConfig, iteration: int | None, inputs: dict[str, Manifest]) -> list[str]:
        """A sharded stage's part names at ``iteration``, given its committed input manifests: one part per part
        of its first input table, of the same name (generate writes one per slice of its prompt batch). The runner
        keeps only these when it resumes the stage."""
        upstream = next(t for t in self.inputs if t != POLICY)
        return [part.name for part in inputs[upstream].parts]

    def run(self, ctx: StageContext) -> StageOutput:
        raise NotImplementedError

    @classmethod
    def close(cls) -> None:
        """At the end of a run (also an interrupted one): releases what the stage keeps across iterations."""


STAGES: dict[str, type[Stage]] = {}
# Functions that make a run's config-defined stages (user stages): `sync_stages(cfg)` registers what they return
STAGE_PROVIDERS: list[Callable[[PipelineConfig], list[type[Stage]]]] = []
_PROVIDED: list[str] = []  # names of the stages the providers registered for the config synced last


def register(cls: type[Stage]) -> type[Stage]:
    """Adds a stage to the registry; where it runs follows from what it reads (see `stage_order`)."""
    if cls.name in STAGES:
        raise AssertionError(f"stage {cls.name!r} registered twice")
    writer = next((name for name, other in STAGES.items() if other.table == cls.table), None)
    if writer is not None:
        raise AssertionError(f"stages {writer!r} and {cls.name!r} both write the table {cls.table!r}")
    STAGES[cls.name] = cls
    return cls


def sync_stages(cfg: PipelineConfig) -> None:
    """Makes the registry hold the built-in stages plus the stages ``cfg`` defines (its user stages), and no
    others a previous config defined. Planning, checking and running a config call it first."""
    for name in _PROVIDED:
        unregister(name)
    _PROVIDED.clear()
    for provide in STAGE_PROVIDERS:
        for cls in provide(cfg):
            register(cls)
            _PROVIDED.append(cls.name)


def unregister(name: str) -> None:
    """Removes a stage (tests that register a throwaway stage)."""
    STAGES.pop(name, None)


def stage_order() -> list[str]:
    """Stage names in run order, derived from what each reads: a stage after every stage whose table it reads (with
    ``reads_policy`` "new", after the stage that writes the policy too). Among stages free to run: once-per-run stages
    first, then a stage whose table another reads before one whose table none does (a report or an evaluation waits
    behind the training line), then by name. So the order is a function of the declarations alone, the same
    whatever order modules are imported (registered) in.
    """
    if not STAGES:
        raise AssertionError("no stage is registered: import batchrl.stages (batchrl.api does) before planning")
    writers = {cls.table: name for name, cls in STAGES.items()}
    needs = {name: _writers_read_by(cls, writers) for name, cls in STAGES.items()}
    tables_read = {source_table(t, name) for name, cls in STAGES.items() for t in cls.inputs}
    read = {writers[t] for t in tables_read if t in writers}  # the stages whose table another reads
    order: list[str] = []
    while len(order) < len(STAGES):
        ready = [name for name in STAGES if name not in order and needs[name] <= set(order)]
        if not ready:
            raise AssertionError(f"stages {sorted(set(STAGES) - set(order))} read each other's tables in a cycle")
        order.append(min(ready, key=lambda name: (STAGES[name].per_iteration, name not in read, name)))
    return order


def source_table(table: str, reader: str) -> str:
    """The table the stage ``reader`` reads when it names ``table``: the last stage inserted after ``table``'s writer
    (``takes_over``), so that advantage reads a user stage placed after score; ``table`` itself for the inserted
    stages and when none is."""
    inserted = [cls for cls in STAGES.values() if cls.takes_over == table]
    if not inserted or any(cls.name == reader for cls in inserted):
        return table
    return inserted[-1].table


def _writers_read_by(cls: type[Stage], writers: dict[str, str]) -> set[str]:
    """The stages whose output ``cls`` reads within an iteration (the policy it starts from is the last one's)."""
    tables = [source_table(t, cls.name) for t in cls.inputs if t != POLICY]
    tables += [POLICY] if cls.reads_policy == "new" else []  # the same iteration's update: it runs after it
    missing = [t for t in tables if t not in writers]
    if missing:
        raise AssertionError(f"stage {cls.name!r} reads {missing}, which no registered stage writes")
    return {writers[t] for t in tables}


def producer(table: str) -> str:
    """The name of the stage that writes ``table``."""
    return next(name for name, cls in STAGES.items() if cls.table == table)


def consumers(table: str) -> list[str]:
    """Names of the registered stages that read ``table``."""
    return [name for name, cls in STAGES.items() if any(source_table(t, name) == table for t in cls.inputs)]


def table_iteration(table: str, iteration: int | None) -> int | None:
    """The iteration whose ``table`` a stage of ``iteration`` reads: None for a table written once per run."""
    return iteration if STAGES[producer(table)].per_iteration else None


def is_sharded(stage: Stage | type[Stage]) -> bool:
    """Whether output part k is made from input part k alone (generate, score, advantage): such a stage
    resumes shard by shard. A table-writing stage that reads a table is sharded by this contract."""
    return stage.schema is not None and any(t != POLICY for t in stage.inputs)

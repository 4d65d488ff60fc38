"""The plan: every step of a run in order, with its fingerprint and its status in storage (what ``batchrl plan``
prints, and what the runner runs).

Fingerprints are computed from the config alone (each stage's config + its upstream fingerprints), so
``batchrl plan`` can say, without running anything, which stages are complete (a manifest with the same
fingerprint), stale (a manifest from a different config, or from other user code when only the digests of a
custom reward's or a user stage's module differ: redone, and so is everything after it), partial (some shards
written) or pending. More states come from storage and the command line:

- damaged: a manifest with the right fingerprint whose parts are missing or have another size (or, with
  ``--verify``, another sha256). Only the damaged parts are redone. The old manifest stays until the new one
  replaces it, so a crash during the repair leaves the stage damaged, not silently done.
- outdated: a manifest with the right fingerprint, made from an input that has since been replaced (the
  content digest of an input recorded in its manifest differs from that input's manifest now). Redone whole.
- forced: ``--from-stage S --iteration K`` redoes stage S of iteration K and every stage after it (later
  iterations included), keeping everything before it.

A plan is built once per command and each manifest read once. With run.epochs the number of iterations is counted
from the once-per-run tables (`Stage.iteration_count`), so those steps are planned and read first; while they are
not committed the plan holds the steps planned before iteration 0 alone, and the runner calls
`Plan.count_iterations` again once it has made them (the one place the count is made).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from batchrl.config import ConfigError, PipelineConfig
from batchrl.pipeline.lineage import Lineage, carried_table, fresh_lineage, resolve_lineage, seen_fingerprint
from batchrl.pipeline.stage import (
    CODE_KEYS,
    POLICY,
    STAGES,
    Stage,
    consumers,
    is_sharded,
    source_table,
    stage_order,
    sync_stages,
)
from batchrl.storage import RunLayout, join, resolve
from batchrl.storage.manifest import Manifest, content_digest, damaged_parts, fingerprint, read_manifest
from batchrl.storage.sources import check_s3_credentials

logger = logging.getLogger(__name__)

STARTED_MARKER = "_STARTED.json"  # written when a stage starts on a directory: whose partial output it holds


@dataclass
class PlannedStage:
    name: str
    iteration: int | None
    output_dir: str
    fingerprint: str
    input_dirs: dict[str, str]
    policy_in: str
    sharded: bool = False  # output part k is made from input part k alone (resumes shard by shard)
    behaviour_policy: str | None = None  # the policy that generates this iteration's rollouts (see StageContext)
    status: str = "pending"  # done | damaged | stale | outdated | partial | pending | forced
    # the fingerprint computed with the digests of user code left out (stage.CODE_KEYS), its own and its inputs':
    # a stale step whose output records the same one was made by other code, not by another config
    config_fingerprint: str = ""
    code_changed: bool = False  # stale: only user code changed (a custom reward's or a user stage's module)
    manifest: Manifest | None = None  # the committed manifest (done, damaged)
    damaged: list[str] = field(default_factory=list)  # damaged: the parts to redo
    parts_written: int = 0  # partial: parts already under their final name
    parts_total: int | None = None  # partial: parts the stage will write (its input's), when known
    started_at: float | None = None  # partial: when the interrupted attempt started

    @property
    def label(self) -> str:
        return self.name if self.iteration is None else f"iter {self.iteration} {self.name}"


def build_plan(cfg: PipelineConfig, **options: Any) -> list[PlannedStage]:
    """Every step of the run in order, with fingerprints and (unless check_storage=False) completion status: the
    steps of `Plan` (whose keywords ``options`` are)."""
    return Plan(cfg, **options).steps


def with_iterations(cfg: PipelineConfig, iterations: int) -> PipelineConfig:
    """A copy of ``cfg`` with run.iterations set (unvalidated: 0 stands for "not counted yet")."""
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"iterations": iterations})})


class Plan:
    """The steps of one run in run order, indexed by (stage, iteration) and by output directory.

    ``configured`` is the config as written; ``cfg`` the one the steps are planned with (with run.epochs, its
    run.iterations counted, 0 until the once-per-run tables are committed)."""

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        check_storage: bool = True,
        lineage: Lineage | None = None,
        from_stage: str | None = None,
        from_iteration: int | None = None,
        verify_checksums: bool = False,
    ):
        if check_storage:
            check_s3_credentials(cfg)  # a one-line ConfigError, not botocore's traceback on the first manifest read
        sync_stages(cfg)  # the registry holds this config's user stages
        self.configured = cfg
        if lineage is None:
            lineage = resolve_lineage(cfg) if check_storage else fresh_lineage(cfg)
        self.lineage = lineage
        self.layout = RunLayout.for_run(cfg.run.root, cfg.run_id)
        self.stages: dict[str, Stage] = {name: STAGES[name]() for name in stage_order()}
        self._check_storage, self._checksums = check_storage, verify_checksums
        self.counted = cfg.run.epochs is None  # run.iterations is known
        self.cfg = cfg if self.counted else with_iterations(cfg, 0)
        # The once-per-run steps do not depend on the number of iterations (they are what counts them).
        once = [name for name, stage in self.stages.items() if not stage.per_iteration]
        self._once = _Chain(self.lineage).plan(self.cfg, self.layout, {n: self.stages[n] for n in once}, [None])
        self.steps: list[PlannedStage] = list(self._once)
        self._later: list[PlannedStage] | None = None  # the steps of the per-iteration stages, once planned
        self._index()
        self._read_statuses(self._once)
        self.count_iterations()
        if from_stage is not None:
            _force_from(self.steps, from_stage, from_iteration)

    def count_iterations(self) -> None:
        """Plans the steps of the per-iteration stages: at first (with run.epochs, those before iteration 0 alone
        while the iterations cannot be counted), and again once the iterations can be counted (the runner calls it
        when it has made the once-per-run tables)."""
        count = None if self.counted else self._iteration_count()
        if self._later is not None and count is None:
            return  # planned, and counted already or still not countable
        if count is not None:
            self.counted, self.cfg = True, with_iterations(self.configured, count)
            if self._later is not None:
                logger.info("run.epochs=%d: %d iterations", self.cfg.run.epochs, count)
        each = {name: stage for name, stage in self.stages.items() if stage.per_iteration}
        chain = _Chain(self.lineage, after=self._once)
        self._later = chain.plan(self.cfg, self.layout, each, [None, *range(self.cfg.run.iterations)])
        self.steps = self._once + self._later
        self._index()
        self._read_statuses(self._later)

    def _iteration_count(self) -> int | None:
        """With run.epochs: the count a stage makes from the committed once-per-run tables (None: not yet). A damaged
        table counts: its manifest records the rows that its repair restores."""
        tables = {self.stages[s.name].table: s.manifest for s in self._once if s.manifest is not None}
        counts = (stage.iteration_count(self.configured, tables=tables) for stage in self.stages.values())
        return next((count for count in counts if count is not None), None)

    def _index(self) -> None:
        self.by_key = {(s.name, s.iteration): s for s in self.steps}
        self.by_dir = {s.output_dir: s for s in self.steps}

    def __getitem__(self, key: tuple[str, int | None]) -> PlannedStage:
        return self.by_key[key]

    def __contains__(self, key: tuple[str, int | None]) -> bool:
        return key in self.by_key

    def __iter__(self) -> Iterator[PlannedStage]:
        return iter(self.steps)

    def _read_statuses(self, steps: list[PlannedStage]) -> None:
        """Each step's status from storage, then the checks that need its inputs' manifests."""
        if not self._check_storage:
            return
        for step in steps:
            _set_status(step, checksums=self._checksums)
            inputs = {table: getattr(self.by_dir.get(d), "manifest", None) for table, d in step.input_dirs.items()}
            if step.status == "partial" and step.sharded and inputs and all(m is not None for m in inputs.values()):
                parts = self.stages[step.name].planned_parts(self.cfg, step.iteration, inputs, step.input_dirs)
                step.parts_total = len(parts)
            _check_recorded_inputs(step, self.by_dir, self.lineage)


CARRIED_TABLE = "prompt_stats"  # a table a warm start reads from its previous run (`Stage.previous_tables`)


class _Chain:
    """What planning carries from step to step: each table's latest directory and fingerprint, and the policies by
    version (version v is iteration v's input policy; 0 is the initial one)."""

    def __init__(self, lineage: Lineage, *, after: list[PlannedStage] = ()):
        self.tables: dict[str, tuple[str, str]] = {STAGES[s.name].table: (s.output_dir, s.fingerprint) for s in after}
        carried = carried_table(lineage, CARRIED_TABLE) if CARRIED_TABLE not in self.tables else None
        if carried is not None:  # a warm start: iteration 0 reads the previous run's, as a later one reads i-1's
            self.tables[CARRIED_TABLE] = carried
        self.config_fps = {s.fingerprint: s.config_fingerprint for s in after}  # a fingerprint -> its config's
        self.lineage = lineage
        self.policies = {0: (lineage.initial_policy, lineage.initial_policy_fingerprint)}

    def plan(
        self, cfg: PipelineConfig, layout: RunLayout, stages: dict[str, Stage], iterations: list[int | None]
    ) -> list[PlannedStage]:
        """The steps of ``stages`` (in run order) at each of ``iterations`` where they run."""
        where = {name: set(stage.planned_iterations(cfg)) for name, stage in stages.items()}
        steps = []
        for iteration in iterations:
            previous = self.policies[len(self.policies) - 1]  # the policy this iteration starts from
            behaviour = previous if iteration is None else self.policies[cfg.run.behaviour_version(iteration)]
            for name, stage in stages.items():
                if iteration in where[name]:
                    steps.append(self._step(cfg, layout, stage, iteration, previous=previous, behaviour=behaviour))
            if iteration is not None and POLICY in self.tables:
                self.policies[iteration + 1] = self.tables[POLICY]
        return steps

    def _step(
        self,
        cfg: PipelineConfig,
        layout: RunLayout,
        stage: Stage,
        iteration: int | None,
        *,
        previous: tuple[str, str],
        behaviour: tuple[str, str],
    ) -> PlannedStage:
        policy_in, policy_in_fp = previous
        if stage.reads_policy == "new" and iteration is not None:
            policy_in, policy_in_fp = self.tables[POLICY]
        elif stage.reads_policy == "behaviour":
            policy_in, policy_in_fp = behaviour
        sources = {t: self.tables[source_table(t, stage.name)] for t in stage.inputs if t != POLICY}
        # the iteration before's (planned earlier in the chain): none at a run's first iteration
        previous_tables = [t for t in stage.previous_tables(cfg) if t in self.tables]
        sources |= {t: self.tables[t] for t in previous_tables}
        fingerprinted = [t for t in stage.inputs if t not in stage.covered_inputs] + previous_tables
        upstream = [policy_in_fp if t == POLICY else sources[t][1] for t in fingerprinted]
        config = dict(stage.fingerprint_config(cfg), iteration=iteration)
        if stage.reads_train_files and self.lineage.skips_seen_files(cfg):
            config["skip_seen_files"] = seen_fingerprint(self.lineage)
        without_code = {key: value for key, value in config.items() if key not in CODE_KEYS}
        step = PlannedStage(
            name=stage.name,
            iteration=iteration,
            output_dir=layout.table_dir(stage.table, iteration),
            fingerprint=fingerprint(config, *upstream),
            input_dirs={t: directory for t, (directory, _) in sources.items()},
            policy_in=policy_in,
            sharded=is_sharded(stage),
            behaviour_policy=behaviour[0],
            config_fingerprint=fingerprint(without_code, *(self.config_fps.get(fp, fp) for fp in upstream)),
        )
        self.config_fps[step.fingerprint] = step.config_fingerprint
        self.tables[stage.table] = (step.output_dir, step.fingerprint)
        return step


def _set_status(step: PlannedStage, *, checksums: bool) -> None:
    manifest = read_manifest(step.output_dir)
    if manifest is not None:
        if manifest.fingerprint != step.fingerprint:
            step.status, step.code_changed = "stale", manifest.config_fingerprint == step.config_fingerprint
            return
        step.manifest = manifest
        step.damaged = damaged_parts(step.output_dir, manifest, checksums=checksums)
        step.status = "damaged" if step.damaged else "done"
        return
    names = entries(step.output_dir)
    started = read_started(step.output_dir)
    if started and started.get("fingerprint") != step.fingerprint:
        step.status = "stale"  # partial output of another config or code: cleared when the stage runs
        step.code_changed = started.get("config_fingerprint") == step.config_fingerprint
        return
    step.parts_written = sum(not n.startswith((".", "_")) for n in names)
    step.started_at = started.get("started_at")
    step.status = "partial" if step.parts_written else "pending"


def _check_recorded_inputs(step: PlannedStage, by_dir: dict[str, PlannedStage], lineage: Lineage) -> None:
    """Marks a committed stage ``outdated`` when an input it records having been made from is not the input
    there is now: that input was redone (or replaced) since, so this output is derived from data that is gone.

    Inputs that have no manifest now are not compared here: the runner compares once it has redone them."""
    if step.status not in ("done", "damaged") or step.manifest.inputs is None:
        return
    for table, recorded in step.manifest.inputs.items():
        current = current_input_digest(step, table, by_dir, lineage)
        if current is not None and current != recorded:
            logger.debug("%s: made from %s %s, which is now %s", step.label, table, recorded, current)
            step.status, step.manifest, step.damaged = "outdated", None, []
            return


def current_input_digest(
    step: PlannedStage, table: str, by_dir: dict[str, PlannedStage], lineage: Lineage
) -> str | None:
    """The content digest of ``step``'s input ``table`` as committed now (None: not committed). The initial policy
    (model.path or a warm start) is not a table of this run: its lineage fingerprint stands for its content."""
    source = step.policy_in if table == POLICY else step.input_dirs.get(table)
    upstream = by_dir.get(source)
    if upstream is None:
        return lineage.initial_policy_fingerprint if table == POLICY else None
    return None if upstream.manifest is None else content_digest(upstream.manifest)


def check_from_stage(cfg: PipelineConfig, from_stage: str, from_iteration: int | None) -> None:
    """--from-stage / --iteration name a stage of this run (ConfigError otherwise)."""
    sync_stages(cfg)
    names = stage_order()
    if from_stage not in names:
        raise ConfigError(f"--from-stage {from_stage!r} is not a stage; use one of {names}")
    if not STAGES[from_stage].per_iteration and from_iteration is not None:
        raise ConfigError(f"--from-stage {from_stage} runs once per run, not per iteration: drop --iteration")
    if from_iteration is not None and cfg.run.epochs is None and not 0 <= from_iteration < cfg.run.iterations:
        raise ConfigError(f"--iteration {from_iteration} is outside this run's iterations 0..{cfg.run.iterations - 1}")
    where = STAGES[from_stage]().planned_iterations(cfg)
    if not where:
        section = STAGES[from_stage].config_section
        raise ConfigError(
            f"--from-stage {from_stage}: this config never runs it"
            + (f" (add an {section}: section)" if section else "")
        )
    if from_iteration is not None and cfg.run.epochs is None and from_iteration not in where:
        listed = ", ".join("before training" if i is None else str(i) for i in where)
        raise ConfigError(
            f"--from-stage {from_stage} --iteration {from_iteration}: it runs only at iterations "
            f"{listed}; pick one of those"
        )


def _force_from(plan: list[PlannedStage], from_stage: str, from_iteration: int | None) -> None:
    """Forces ``from_stage`` at ``from_iteration`` (default: its first run) and every later step made from it.

    A stage whose table nothing reads (evaluate) forces only its own later runs: re-evaluating never retrains; one
    read only by such a stage (heldout, read by evaluate) forces those too, and no training stage. A training
    stage's table leads to the policy, which every later iteration reads, so it forces everything after it.
    """
    start = next(
        (
            i
            for i, s in enumerate(plan)
            if s.name == from_stage and (from_iteration is None or s.iteration == from_iteration)
        ),
        None,
    )
    if start is None:  # with run.epochs (checked here, once counted): an iteration the stage does not run at
        where = [s.iteration for s in plan if s.name == from_stage]
        if not where:
            listed = "none yet (run.epochs: counted once the prompts are ingested)"
        elif where == list(range(where[0], where[-1] + 1)):
            listed = f"{where[0]}..{where[-1]}"
        else:
            listed = ", ".join(map(str, where))
        raise ConfigError(f"--from-stage {from_stage} --iteration {from_iteration}: it runs at iterations {listed}")
    made_from = _downstream(from_stage)
    for step in plan[start:]:
        if step.status != "pending" and step.name in made_from:
            step.status, step.manifest, step.damaged = "forced", None, []


def _downstream(name: str) -> set[str]:
    """``name`` and the stages that read its table, or a table made from it, transitively."""
    found, todo = {name}, [name]
    while todo:
        for reader in consumers(STAGES[todo.pop()].table):
            if reader not in found:
                found.add(reader)
                todo.append(reader)
    return found


def entries(table_dir: str) -> list[str]:
    """Base names directly under ``table_dir`` ([] when it does not exist)."""
    fs, path = resolve(table_dir)
    try:
        fs.invalidate_cache(path)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def read_started(table_dir: str) -> dict:
    fs, path = resolve(join(table_dir, STARTED_MARKER))
    try:
        return json.loads(fs.cat_file(path).decode())
    except (FileNotFoundError, ValueError):
        return {}

"""The runner: plans a run from its config, skips what is complete, runs the rest.

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
  iterations included), keeping everything before it. Forced outputs are deleted before anything runs,
  last stage first, so an interrupted forced run resumes as an ordinary one.

No table is ever derived from data that no longer exists: every manifest records the content digest of each
input it was made from, and whenever a stage is (re)done, each later stage that reads its output and was made
from other content (or, for a manifest without that record, whenever the output changed or there was no
previous output to compare with) is deleted before the new manifest is written, last first, and redone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import yaml

from batchrl.config import ConfigError, PipelineConfig
from batchrl.errors import ProcessCrash
from batchrl.pipeline.devices import RANK_DEVICES_ENV, needs_split, overlap_gpu_split, visible_gpus
from batchrl.pipeline.interrupts import deferred, kept_across
from batchrl.pipeline.lineage import (
    Lineage,
    files_to_ingest,
    fresh_lineage,
    resolve_lineage,
    seen_fingerprint,
    write_lineage,
)
from batchrl.pipeline.lock import RunLock
from batchrl.pipeline.reaper import reaping_orphans
from batchrl.pipeline.stage import (
    CODE_KEYS,
    POLICY,
    STAGES,
    Stage,
    StageContext,
    consumers,
    is_sharded,
    producer,
    source_table,
    stage_order,
    sync_stages,
    table_iteration,
)
from batchrl.storage import RunLayout, join, resolve, write_bytes_atomic
from batchrl.storage.journal import JOURNAL_DIR
from batchrl.storage.manifest import (
    MANIFEST_NAME,
    Manifest,
    content_digest,
    damaged_parts,
    fingerprint,
    read_manifest,
    write_manifest,
)
from batchrl.storage.sources import check_s3_credentials
from batchrl.tracking import Trackers, check_tracking, tracking_session

logger = logging.getLogger(__name__)

STARTED_MARKER = "_STARTED.json"
BACKGROUND_STOP_S = 30.0  # how long an error or interrupt waits for the update in flight once its stage is closed


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


@dataclass
class RunSummary:
    run_dir: str
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    iterations: list[dict] = field(default_factory=list)
    no_new_files: bool = False  # incremental run that found no input file it had not seen: nothing ran
    # stats of the stages that declare a summary_key, in run order: {"iteration", "policy", **stats}
    reports: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def evaluations(self) -> list[dict]:
        """The held-out evaluations in order (the initial policy's first), when the run has them."""
        return self.reports.get("evaluations", [])


def build_plan(
    cfg: PipelineConfig,
    *,
    check_storage: bool = True,
    lineage: Lineage | None = None,
    from_stage: str | None = None,
    from_iteration: int | None = None,
    verify_checksums: bool = False,
    count_iterations: bool = True,
    known: dict[tuple[str, bool], PlannedStage] | None = None,
) -> list[PlannedStage]:
    """Every stage of the run in order, with fingerprints and (when check_storage) completion status. With
    run.epochs (and ``count_iterations``), the iterations are counted first (see counted_iterations).

    ``known``: steps whose status this command has already read from storage, by (output directory, checksums)
    (filled here);
    a step of the same fingerprint takes its status from there instead of reading the manifest and listing the
    table again (counting the iterations plans the once-per-run stages first: a 40k-part prompts table would be
    read twice)."""
    if check_storage:
        check_s3_credentials(cfg)  # a one-line ConfigError, not botocore's traceback on the first manifest read
    if lineage is None:
        lineage = resolve_lineage(cfg) if check_storage else fresh_lineage(cfg)
    known = {} if known is None else known
    if count_iterations and cfg.run.epochs is not None:
        cfg = counted_iterations(cfg, lineage=lineage, check_storage=check_storage, known=known)
    layout = RunLayout.for_run(cfg.run.root, cfg.run_id)
    sync_stages(cfg)
    stages = {name: STAGES[name]() for name in stage_order()}
    where = {name: set(stage.planned_iterations(cfg)) for name, stage in stages.items()}
    table_dirs: dict[str, str] = {}
    table_fps: dict[str, str] = {}
    policy_dir, policy_fp = lineage.initial_policy, lineage.initial_policy_fingerprint
    policies = {0: (policy_dir, policy_fp)}  # policy version v (iteration v's input policy) -> (dir, fingerprint)
    plan: list[PlannedStage] = []
    config_fps: dict[str, str] = {}  # a step's fingerprint -> its config_fingerprint
    for iteration in [None] + list(range(cfg.run.iterations)):
        behaviour = policies[cfg.run.behaviour_version(iteration)] if iteration is not None else (policy_dir, policy_fp)
        for name, stage in stages.items():
            if iteration not in where[name]:
                continue
            policy_in, policy_in_fp = policy_dir, policy_fp
            if stage.reads_new_policy and iteration is not None:
                policy_in, policy_in_fp = table_dirs[POLICY], table_fps[POLICY]
            elif stage.reads_behaviour_policy:
                policy_in, policy_in_fp = behaviour
            upstream = [policy_in_fp if t == POLICY else table_fps[source_table(t, name)] for t in stage.inputs]
            config = dict(stage.fingerprint_config(cfg), iteration=iteration)
            if stage.reads_train_files and lineage.skips_seen_files(cfg):
                config["skip_seen_files"] = seen_fingerprint(lineage)
            without_code = {key: value for key, value in config.items() if key not in CODE_KEYS}
            step = PlannedStage(
                name=name,
                iteration=iteration,
                output_dir=layout.table_dir(stage.table, iteration),
                fingerprint=fingerprint(config, *upstream),
                input_dirs={t: table_dirs[source_table(t, name)] for t in stage.inputs if t != POLICY},
                policy_in=policy_in,
                sharded=is_sharded(stage),
                behaviour_policy=behaviour[0],
                config_fingerprint=fingerprint(without_code, *(config_fps.get(fp, fp) for fp in upstream)),
            )
            config_fps[step.fingerprint] = step.config_fingerprint
            table_dirs[stage.table], table_fps[stage.table] = step.output_dir, step.fingerprint
            plan.append(step)
        if iteration is not None and POLICY in table_dirs:
            policy_dir, policy_fp = table_dirs[POLICY], table_fps[POLICY]
            policies[iteration + 1] = (policy_dir, policy_fp)
    if check_storage:
        _read_statuses(plan, cfg, lineage=lineage, checksums=verify_checksums, known=known)
    if from_stage is not None:
        _force_from(plan, from_stage, from_iteration)
    return plan


def _read_statuses(
    plan: list[PlannedStage],
    cfg: PipelineConfig,
    *,
    lineage: Lineage,
    checksums: bool,
    known: dict[tuple[str, bool], PlannedStage],
) -> None:
    """Each step's status from storage (or from ``known``), then the checks that need its inputs' manifests."""
    by_dir = {step.output_dir: step for step in plan}
    for step in plan:
        seen = known.get((step.output_dir, checksums))
        if seen is not None and seen.fingerprint == step.fingerprint:
            for name in ("status", "manifest", "damaged", "parts_written", "started_at", "code_changed"):
                setattr(step, name, getattr(seen, name))
        else:
            _set_status(step, checksums=checksums)
            known[(step.output_dir, checksums)] = dataclasses.replace(step)  # as storage has it (no checks yet)
        inputs = {table: getattr(by_dir.get(d), "manifest", None) for table, d in step.input_dirs.items()}
        if step.status == "partial" and step.sharded and inputs and all(m is not None for m in inputs.values()):
            step.parts_total = len(STAGES[step.name]().output_parts(cfg, step.iteration, inputs))
        _check_recorded_inputs(step, by_dir, lineage)


def counted_iterations(
    cfg: PipelineConfig,
    *,
    lineage: Lineage | None = None,
    check_storage: bool = True,
    known: dict[tuple[str, bool], PlannedStage] | None = None,
):
    """``cfg`` with run.iterations set from run.epochs: a stage counts them from the once-per-run tables committed
    now (generate: epochs x batches per epoch of the prompts table). 0 while those are not committed: the plan then
    holds the once-per-run stages alone, and the runner counts again once they are done. ``cfg`` itself without
    run.epochs."""
    if cfg.run.epochs is None:
        return cfg
    unknown = with_iterations(cfg, 0)
    if not check_storage:
        return unknown
    once = [s for s in build_plan(unknown, lineage=lineage, count_iterations=False, known=known) if s.iteration is None]
    tables = {STAGES[s.name].table: s.manifest for s in once if s.status == "done" and not STAGES[s.name].per_iteration}
    for name in stage_order():
        count = STAGES[name]().iteration_count(cfg, tables=tables)
        if count is not None:
            return with_iterations(cfg, count)
    return unknown


def with_iterations(cfg: PipelineConfig, iterations: int) -> PipelineConfig:
    """A copy of ``cfg`` with run.iterations set (unvalidated: 0 stands for "not counted yet")."""
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"iterations": iterations})})


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
    names = _entries(step.output_dir)
    started = _read_started(step.output_dir)
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
    """Forces ``from_stage`` at ``from_iteration`` (default: its first run) and everything after it.

    A stage whose table nothing reads (evaluate) forces only its own later runs: re-evaluating never retrains.
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
    leaf = not consumers(STAGES[from_stage].table)
    for step in plan[start:]:
        if step.status != "pending" and (not leaf or step.name == from_stage):
            step.status, step.manifest, step.damaged = "forced", None, []


def _entries(table_dir: str) -> list[str]:
    """Base names directly under ``table_dir`` ([] when it does not exist)."""
    fs, path = resolve(table_dir)
    try:
        fs.invalidate_cache(path)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def _read_started(table_dir: str) -> dict:
    fs, path = resolve(join(table_dir, STARTED_MARKER))
    try:
        return json.loads(fs.cat_file(path).decode())
    except (FileNotFoundError, ValueError):
        return {}


class Runner:
    """Runs a plan; ``run()`` reads like the pipeline diagram."""

    def __init__(
        self,
        cfg: PipelineConfig,
        *,
        from_stage: str | None = None,
        from_iteration: int | None = None,
        verify_checksums: bool = False,
    ):
        self.configured = cfg  # as written (run.yaml): with run.epochs, self.cfg has the counted iterations
        sync_stages(cfg)  # the registry holds this config's user stages
        self.layout = RunLayout.for_run(cfg.run.root, cfg.run_id)
        check_s3_credentials(cfg)  # before resolve_lineage's first object-store request
        if from_stage is not None:
            check_from_stage(cfg, from_stage, from_iteration)
        self.lineage = resolve_lineage(cfg)
        known: dict[tuple[str, bool], PlannedStage] = {}  # what counting the iterations read, planning reuses
        self.cfg = counted_iterations(cfg, lineage=self.lineage, known=known)
        self._plan(from_stage=from_stage, from_iteration=from_iteration, verify_checksums=verify_checksums, known=known)
        self.stages: dict[str, Stage] = {name: STAGES[name]() for name in stage_order()}
        self.embedded_ray = False  # set when the runner starts its own local Ray (see _ray_session)
        self.summary = RunSummary(run_dir=self.layout.run_dir)
        self.trackers = Trackers([])  # opened in run()
        # run.max_staleness > 0: (the update step in flight, set when its thread ends, its outcome), and the iterations
        # recorded
        self._background: tuple[PlannedStage, threading.Event, dict] | None = None
        self._recorded = 0
        self._run_lock: RunLock | None = None  # held by run()

    def _plan(self, **options) -> None:
        self.steps = build_plan(self.cfg, lineage=self.lineage, count_iterations=False, **options)
        self.plan = {(s.name, s.iteration): s for s in self.steps}
        self.by_dir = {s.output_dir: s for s in self.steps}

    def _count_iterations(self) -> None:
        """With run.epochs and the once-per-run tables made by this run: counts the iterations and plans them."""
        if self.cfg.run.epochs is None or self.cfg.run.iterations:
            return
        self.cfg = counted_iterations(self.configured, lineage=self.lineage)
        self._plan()
        logger.info("run.epochs=%d: %d iterations", self.cfg.run.epochs, self.cfg.run.iterations)

    def run(self) -> RunSummary:
        self.check_inputs()  # config errors surface here, before the run directory is touched
        # reaping_orphans: nothing the run starts outlives the driver
        with RunLock(self.layout.lock) as self._run_lock, reaping_orphans():
            self._write_run_yaml()  # first: `batchrl status` reads it, even of a run killed while starting
            with (
                tracking_session(
                    self.cfg.tracking,
                    run_dir=self.layout.run_dir,
                    run_id=self.cfg.run_id,
                    config_dict=self.cfg.model_dump(mode="json"),
                ) as self.trackers,
                _ray_session(self, needed=any(s.status != "done" for s in self.plan.values())),
            ):
                try:
                    self._run_stages()
                finally:
                    with deferred():  # a SIGTERM must not cut it short (see interrupts)
                        for stage in reversed(self.stages.values()):
                            stage.close()  # e.g. resident update ranks (update.trainer_lifetime: run)
        return self.summary

    def _run_stages(self) -> None:
        """The stages in their run order (`stage_order`: from what each reads): once-per-run stages, then those
        planned before iteration 0 (evaluating the initial policy), then each iteration's stages in turn."""
        self.check_cluster_paths()
        self.check_actor_needs()
        self._clear_forced()
        once = [name for name, stage in self.stages.items() if not stage.per_iteration]
        for name in once:
            if self.stage(name) is None:
                return  # an incremental run with no new input file: nothing to train on
        self._count_iterations()
        self.preflight({self.stages[name].table: self.plan[(name, None)].manifest for name in once})
        each = [name for name, stage in self.stages.items() if stage.per_iteration]
        overlap = self.cfg.run.max_staleness > 0
        try:
            for iteration in [None] + list(range(self.cfg.run.iterations)):
                for name in each:
                    if (name, iteration) not in self.plan:
                        continue
                    self._await_inputs(self.plan[(name, iteration)])
                    if overlap and iteration is not None and self.stages[name].table == POLICY:
                        self._in_background(name, iteration)
                    else:
                        self.stage(name, iteration)
                    self._record_finished()
        except BaseException:
            self._abandon_background()
            raise
        self._await_background()
        self._record_finished()

    def _in_background(self, name: str, iteration: int) -> None:
        """run.max_staleness > 0: the policy update of ``iteration`` runs in a thread while the main thread goes on
        with the next iteration's stages that do not read it (generate and score read an older policy). At most one
        is in flight: the next update reads this one's policy, so it waits for it (`_await_inputs`)."""
        self._await_background()
        outcome: dict[str, BaseException] = {}
        # Set by the thread itself, last. Not Thread.join()/is_alive(): a join that a SIGTERM interrupts marks the
        # thread stopped while it runs on (CPython 3.11's bpo-45274 workaround in _wait_for_tstate_lock releases its
        # lock), so the wait for it after a stop would end at once.
        ended = threading.Event()

        def work() -> None:
            try:
                self.stage(name, iteration)
            except BaseException as error:  # re-raised in the main thread by _await_background
                outcome["error"] = error
            finally:
                ended.set()

        self._background = (self.plan[(name, iteration)], ended, outcome)
        threading.Thread(target=work, name=f"batchrl-{name}-{iteration}", daemon=True).start()

    def _await_inputs(self, step: PlannedStage) -> None:
        """Waits for the update in flight when ``step`` reads its table or policy, or writes the same table."""
        if self._background is None:
            return
        running = self._background[0]
        reads = {step.policy_in, *step.input_dirs.values()}
        if running.output_dir in reads or self.stages[step.name].table == self.stages[running.name].table:
            self._await_background()

    def _await_background(self) -> None:
        if self._background is None:
            return
        _, ended, outcome = self._background
        ended.wait()
        self._background = None
        if "error" in outcome:
            raise outcome["error"]

    def _abandon_background(self) -> None:
        """On an error or interrupt in the main thread: close the update's stage (resident ranks end once the update in
        flight, which holds them, is done; fresh ranks and Ray actors are not stopped by it), wait a little for its
        thread, and leave; what it did not commit is redone on resume, as after a crash. A thread still running then
        may yet publish its policy and commit its manifest, so the run lock stays held until it ends (`held_until`):
        no other run may write the run directory beside it."""
        if self._background is None:
            return
        step, ended, _ = self._background
        self._background = None
        with deferred():
            self.stages[step.name].close()
        if not ended.wait(timeout=BACKGROUND_STOP_S) and self._run_lock is not None:
            logger.error(
                "%s did not stop within %.0f s of its stage being closed: the run lock stays held until it ends, or "
                "until this process exits (the next run then takes the lock over)",
                step.label,
                BACKGROUND_STOP_S,
            )
            self._run_lock.held_until(ended, writer=step.label)

    def _record_crash(self, step: PlannedStage, crash: ProcessCrash) -> None:
        """Names the stage on a process's native crash and keeps its details under the run (`_logs/`), for the one
        line the command line prints instead of a traceback."""
        crash.stage = step.label
        crash.log_path = self.layout.crash_log(step.label, crash.process)
        try:
            write_bytes_atomic(crash.log_path, f"{crash}\n\n{crash.details}\n".encode())
        except OSError as error:  # the crash is what matters; its log is a courtesy
            logger.warning("could not write the crash log %s: %r", crash.log_path, error)
            crash.log_path = None
        logger.debug("%s: %s\n%s", step.label, crash, crash.details)

    def _record_finished(self) -> None:
        """Writes the metrics of the iterations whose stages are all done, in order (with overlapped iterations an
        iteration finishes after the next one's first stages)."""
        while self._recorded < self.cfg.run.iterations:
            iteration = self._recorded
            steps = [step for (name, it), step in self.plan.items() if it == iteration]
            running = self._background is not None and self._background[0].iteration == iteration
            if running or any(step.status != "done" for step in steps):
                return
            self.record_iteration(iteration)
            self._recorded += 1

    def stage(self, name: str, iteration: int | None = None) -> Manifest | None:
        """Runs one planned stage unless it is done; returns its manifest (None: nothing to read for it)."""
        step = self.plan[(name, iteration)]
        stage = self.stages[name]
        if step.status == "done":
            logger.info("%s: complete (fingerprint %s), skipped", step.label, step.fingerprint)
            self.summary.skipped.append(step.label)
            return self._report(step, stage)
        cfg, sources = self._narrowed_config() if stage.reads_train_files else (self.cfg, [])
        if cfg is None:
            return None
        ctx = StageContext(
            cfg=cfg,
            layout=self.layout,
            iteration=iteration,
            output_dir=step.output_dir,
            fingerprint=step.fingerprint,
            inputs=self._input_manifests(stage, iteration),
            input_dirs=step.input_dirs,
            policy_in=step.policy_in,
            embedded_ray=self.embedded_ray,
            behaviour_policy=step.behaviour_policy,
        )
        stage.check_ready(ctx)  # before anything of the step's old output is removed
        damaged = step.manifest if step.status == "damaged" else None
        if step.status == "outdated":
            logger.warning("%s: made from an input that has since been redone or replaced; redoing it", step.label)
            _remove(step.output_dir)
        self._prepare_output_dir(step, stage)
        logger.info("%s: running%s", step.label, f" (redoing damaged {damaged_names(step)})" if damaged else "")
        started = time.time()
        try:
            output = stage.run(ctx)
        except ProcessCrash as crash:
            self._record_crash(step, crash)
            raise
        manifest = Manifest(
            stage=name,
            table=stage.table,
            iteration=iteration,
            fingerprint=step.fingerprint,
            parts=output.parts,
            schema=stage.schema or "",
            started_at=started,
            finished_at=time.time(),
            counts=output.counts,
            stats=output.stats,
            extra_parts=output.extra_parts,
            sources=sources,
            inputs=self._input_digests(step, stage),
            trainer_state=output.trainer_state,
            config_fingerprint=step.config_fingerprint,
        )
        self._invalidate_readers(step, manifest, previous=damaged)
        write_manifest(step.output_dir, manifest)
        step.status, step.manifest, step.damaged = "done", manifest, []
        rows = f", {manifest.num_rows} rows" if stage.schema else ""
        logger.info("%s: done in %.1f s%s", step.label, manifest.finished_at - started, rows)
        self.summary.ran.append(step.label)
        return self._report(step, stage)

    def _report(self, step: PlannedStage, stage: Stage) -> Manifest:
        """Lists the stats of a stage that declares a summary_key in the run summary (the CLI prints them)."""
        if stage.summary_key is not None:
            self.summary.reports.setdefault(stage.summary_key, []).append(
                {"iteration": step.iteration, "policy": step.policy_in, **step.manifest.stats}
            )
        return step.manifest

    def _has_work(self, name: str) -> bool:
        """Whether stage ``name`` has a step this run still has to do (a done stage is not checked again)."""
        return any(step.status != "done" for step in self.steps if step.name == name)

    def _input_manifests(self, stage: Stage, iteration: int | None) -> dict[str, Manifest]:
        """The committed manifests of the tables ``stage`` reads at ``iteration``, by table name."""
        return {
            table: self.plan[(producer(source), table_iteration(source, iteration))].manifest
            for table in stage.inputs
            for source in [source_table(table, stage.name)]
            if table != POLICY
        }

    def check_inputs(self) -> None:
        """Config-level checks of every stage that still has something to run (a done stage's inputs may be gone,
        e.g. input files deleted after ingest)."""
        check_tracking(self.cfg.tracking, run_dir=self.layout.run_dir)
        for name, stage in self.stages.items():
            if self._has_work(name):
                stage.check_inputs(self.cfg)

    def check_cluster_paths(self) -> None:
        """On a Ray cluster of several nodes, the local paths the run writes (the run directory) or reads (model,
        data, reward model) must be the same on every node (a shared mount); asked of each node before any work."""
        import ray

        if not ray.is_initialized():
            return
        from batchrl.storage import is_local
        from batchrl.storage.cluster import alive_nodes, describe, unshared_paths

        num_nodes = len(alive_nodes())
        if num_nodes <= 1:
            return
        named_reads = [read for stage in self.stages.values() for read in stage.read_paths(self.cfg)]
        reads = {
            uri.removeprefix("file://"): name
            for name, uri in named_reads
            if is_local(uri) and os.path.exists(uri.removeprefix("file://"))
        }
        writes = {self.layout.run_dir.removeprefix("file://"): "run.root"} if is_local(self.layout.run_dir) else {}
        unshared = unshared_paths(writes, reads)
        if unshared:
            raise ConfigError(
                f"the run is connected to a Ray cluster of {num_nodes} nodes, but {describe(unshared, writes | reads)}"
                ": actors on those nodes would read or write another directory than the driver. Put these on object "
                "storage (s3://...) or on a filesystem mounted at the same path on every node"
            )

    def preflight(self, tables: dict[str, Manifest]) -> None:
        """Each stage's checks against the once-per-run tables, before any iteration runs."""
        for stage in self.stages.values():
            stage.preflight(self.cfg, tables=tables)

    def check_actor_needs(self) -> None:
        """Before any work: a stage whose one actor asks for more CPUs or GPUs than the embedded Ray has would wait
        for them forever (Ray queues the request); a ConfigError names the field to lower. Not asked of a cluster,
        which an autoscaler may grow when the request comes."""
        import ray

        if not (self.embedded_ray and ray.is_initialized()):
            return
        total = ray.cluster_resources()
        for name, stage in self.stages.items():
            if not self._has_work(name):
                continue
            for need in stage.actor_needs(self.cfg):
                for kind, amount, field_name in (
                    ("CPU", need.cpus, need.cpus_field),
                    ("GPU", need.gpus, need.gpus_field),
                ):
                    if amount > total.get(kind, 0):
                        raise ConfigError(
                            f"{field_name}={amount:g}: one {name} actor asks for {amount:g} {kind}, but the Ray "
                            f"cluster has {total.get(kind, 0):g} in all; lower {field_name} or add {kind}s to it"
                        )

    def record_iteration(self, iteration: int) -> None:
        metrics = iteration_metrics(self.plan, self.stages, iteration)
        write_bytes_atomic(self.layout.iteration_metrics(iteration), json.dumps(metrics, indent=2).encode())
        self.summary.iterations.append(metrics)
        lines = "".join(json.dumps(m) + "\n" for m in self.summary.iterations)
        write_bytes_atomic(self.layout.metrics_jsonl, lines.encode())  # rewritten whole: resume never duplicates
        self.trackers.log(metrics, step=iteration)

    def _narrowed_config(self) -> tuple[PipelineConfig | None, list[dict]]:
        """The config a stage that reads data.train_files runs with: the list narrowed to the files to read
        (incremental runs skip those earlier runs ingested); (None, []) when there is none. Records the lineage."""
        files, skipped = files_to_ingest(self.cfg, self.lineage)
        if self.lineage.init_from is not None:
            self.lineage.no_new_files = not files
            write_lineage(self.layout.run_dir, self.lineage)
        if skipped:
            logger.info(
                "ingest: %d input file(s) already ingested by %s and its predecessors skipped, %d new",
                skipped,
                self.lineage.init_from,
                len(files),
            )
        if not files:
            logger.warning(
                "no input file that %s has not ingested: nothing to train on; this run is complete and "
                "the next one can warm-start from it",
                self.lineage.init_from,
            )
            self.summary.no_new_files = True
            return None, []
        data = self.cfg.data.model_copy(update={"train_files": [f["uri"] for f in files]})
        return self.cfg.model_copy(update={"data": data}), files

    def _clear_forced(self) -> None:
        """--from-stage: deletes the forced outputs, last first (an interruption leaves a consistent run)."""
        for step in reversed(self.steps):
            if step.status == "forced":
                logger.info("%s: forced by --from-stage, its output is cleared", step.label)
                _remove(step.output_dir)
                step.status = "pending"

    def _input_digests(self, step: PlannedStage, stage) -> dict[str, str]:
        """What ``step`` is made from, for its manifest: the content digest of each input as committed now."""
        return {table: current_input_digest(step, table, self.by_dir, self.lineage) for table in stage.inputs}

    def _invalidate_readers(self, redone: PlannedStage, manifest: Manifest, *, previous: Manifest | None) -> None:
        """Deletes (last first) the output of every later stage that reads ``redone``'s table and was made from
        other content than ``manifest`` lists: it is redone when the run reaches it. Called before ``manifest`` is
        written, so a crash in between leaves ``redone`` to be redone and compared again.

        A reader whose manifest records its inputs is compared with that record. Without one (a manifest written
        before inputs were recorded, or a partial output), it is kept only when ``redone`` had a previous
        manifest with the same content; one redone from nothing cannot tell, so its readers are redone too."""
        digest = content_digest(manifest)
        unchanged = previous is not None and content_digest(previous) == digest
        stale = [
            step
            for step, table in self._readers(redone)
            if not _made_from(step, table, digest=digest, unchanged=unchanged)
        ]
        if stale:
            logger.warning(
                "%s: its output is not what %s %s made from; %s redone",
                redone.label,
                ", ".join(s.label for s in stale),
                "was" if len(stale) == 1 else "were",
                "it is" if len(stale) == 1 else "they are",
            )
        for step in reversed(stale):
            _remove(step.output_dir)
            step.status, step.manifest, step.damaged = "pending", None, []

    def _readers(self, made: PlannedStage) -> list[tuple[PlannedStage, str]]:
        """(later stage, the input name under which it reads ``made``'s table), in plan order."""
        later = self.steps[self.steps.index(made) + 1 :]
        readers = []
        for step in later:
            reads_policy = POLICY in self.stages[step.name].inputs and step.policy_in == made.output_dir
            tables = [t for t, d in step.input_dirs.items() if d == made.output_dir] + [POLICY] * reads_policy
            readers += [(step, table) for table in tables]
        return readers

    def _write_run_yaml(self) -> None:
        text = yaml.safe_dump(self.configured.model_dump(mode="json"), sort_keys=False)
        write_bytes_atomic(self.layout.run_yaml, text.encode())

    def _prepare_output_dir(self, step: PlannedStage, stage) -> None:
        """Keeps exactly the output that is still good, then marks the directory as this config's.

        Output of a different config is cleared. A sharded stage keeps its committed parts except damaged
        ones, and loses stray files (unknown names, temporary files of killed writers); a stage that resumes from
        its journal (ingest) keeps its files but its damaged parts; a stage that writes all its output at once
        (update) starts from an empty directory. A damaged stage's manifest is kept until the redo replaces it.
        """
        fs, path = resolve(step.output_dir)
        names = _entries(step.output_dir)
        if names and _read_started(step.output_dir).get("fingerprint") != step.fingerprint:
            logger.info("%s: clearing output of a different config", step.label)
            _remove(step.output_dir)
            names = []
        keep = {MANIFEST_NAME, STARTED_MARKER, JOURNAL_DIR}  # the journal's records are checked against the parts
        if is_sharded(stage):
            expected = stage.output_parts(self.cfg, step.iteration, self._input_manifests(stage, step.iteration))
            keep |= set(expected) - set(step.damaged)
        elif stage.resumes_from_journal:  # its journal says what is done; a damaged part goes, so it is redone
            keep |= set(names)
            for name in step.damaged:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(f"{path.rstrip('/')}/{name}")
        strays = [n for n in names if n not in keep]
        if strays:
            logger.info(
                "%s: removing %d file(s) to redo or unknown: %s", step.label, len(strays), ", ".join(sorted(strays)[:5])
            )
            for name in strays:
                fs.rm(f"{path.rstrip('/')}/{name}", recursive=True)
        write_bytes_atomic(
            join(step.output_dir, STARTED_MARKER),
            json.dumps(
                {
                    "fingerprint": step.fingerprint,
                    "config_fingerprint": step.config_fingerprint,
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "started_at": time.time(),
                }
            ).encode(),
        )


def damaged_names(step: PlannedStage) -> str:
    return ", ".join(step.damaged[:5]) + (f" and {len(step.damaged) - 5} more" if len(step.damaged) > 5 else "")


def _made_from(step: PlannedStage, table: str, *, digest: str, unchanged: bool) -> bool:
    """Whether ``step``'s output (if any) was made from input ``table`` with content ``digest``; ``unchanged``
    answers for an output that does not record its inputs."""
    if step.status in ("pending", "stale", "forced", "outdated"):
        return True  # nothing of it is kept: it is cleared and redone anyway
    if step.manifest is not None and step.manifest.inputs is not None and table in step.manifest.inputs:
        return step.manifest.inputs[table] == digest
    return unchanged


def _remove(uri: str) -> None:
    fs, path = resolve(uri)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(path)


def iteration_metrics(
    plan: dict[tuple[str, int | None], PlannedStage], stages: dict[str, Stage], iteration: int
) -> dict:
    """verl-style metric names for one iteration, from the manifests of the stages that ran in it.

    Each stage adds its stats (and any metric of its own, `Stage.metrics`) and its duration as
    timing_s/<timing_name>; timing_s/step sums the stages that are part of a training step. A stage that ran
    before iteration 0 (the initial policy's evaluation) is reported with iteration 0 under initial/."""
    metrics: dict = {"iteration": iteration}
    ran = [
        (stage, plan[(name, iteration)].manifest)
        for name, stage in stages.items()
        if (name, iteration) in plan and plan[(name, iteration)].manifest is not None
    ]
    timings = {
        stage.timing_name: manifest.finished_at - manifest.started_at for stage, manifest in ran if stage.timing_name
    }
    timings["step"] = sum(timings[stage.timing_name] for stage, _ in ran if stage.timing_name and stage.in_step_time)
    for stage, manifest in ran:
        metrics.update(stage.metrics(manifest, timings=timings))
    metrics.update({f"timing_s/{name}": round(seconds, 3) for name, seconds in timings.items()})
    for name, stage in stages.items():
        before = plan.get((name, None))
        if iteration == 0 and stage.per_iteration and before is not None and before.manifest is not None:
            metrics.update({f"initial/{key}": value for key, value in before.manifest.stats.items()})
    return metrics


@contextlib.contextmanager
def _ray_session(runner: Runner, *, needed: bool = True) -> Iterator[None]:
    """Embedded local Ray (or the cluster at ray.address / $RAY_ADDRESS); not started when nothing will run.

    The embedded Ray is always the run's own (``address="local"``): ray.init() without an address joins the cluster
    that the last `ray start` on this machine recorded (/tmp/ray/ray_current_cluster), so with one up every run
    failed (num_cpus is refused when joining) or, without ray.num_cpus, ran on it as if it were the run's own."""
    import ray
    from ray.data import DataContext

    if not needed or ray.is_initialized():
        yield
        return
    cfg = runner.cfg
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    saved_env = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", RANK_DEVICES_ENV)}
    try:
        with kept_across("ray.init"):  # ray.init replaces the driver's SIGTERM handler (see interrupts)
            if address:
                ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)  # levels: cli.py
            else:
                gpus = {}
                if needs_split(cfg, local_launcher=cfg.update.launcher != "ray"):  # overlap on one GPU host
                    engines, ranks = overlap_gpu_split(cfg, visible_gpus())
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(engines)  # what the embedded Ray hands out
                    os.environ[RANK_DEVICES_ENV] = ",".join(ranks)  # what the update stage gives its ranks
                    gpus = {"num_gpus": len(engines)}
                    logger.info("GPUs %s for the engines, %s for the update (run.max_staleness)", engines, ranks)
                ray.init(
                    address="local",
                    num_cpus=cfg.ray.num_cpus,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                    configure_logging=False,
                    **gpus,
                )
        runner.embedded_ray = not address
        DataContext.get_current().enable_progress_bars = False
        yield
    finally:
        with deferred():  # a signal cutting ray.shutdown short would leave half of Ray running
            runner.embedded_ray = False
            ray.shutdown()
            for name, value in saved_env.items():  # the split lasts as long as this Ray
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

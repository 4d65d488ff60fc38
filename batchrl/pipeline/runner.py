"""The runner: runs a run's plan, skipping what is complete. It is glue between rooms of their own:

- `plan`: every step in order, its fingerprint and its status in storage (what ``batchrl plan`` prints), built
  once per command; the iterations are counted there, in one place;
- `tables`: the life of each step's table directory: kept or cleared on a resume, committed by writing the
  manifest last, deleted when what it was made from is redone;
- `overlap`: with run.max_staleness, the one step (the update) that runs beside the next iteration's;
- `session`: Ray, and the split of one GPU host between the engines and the update ranks;
- `summary`: what the run reports (the summary, each iteration's metrics).

The runner knows no stage by name: it runs whatever the registry holds (`stage.py`), in the order the stages'
declarations give.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import yaml

from batchrl.config import PipelineConfig
from batchrl.errors import ProcessCrash
from batchrl.pipeline.interrupts import deferred
from batchrl.pipeline.lineage import files_to_ingest, write_lineage
from batchrl.pipeline.lock import RunLock
from batchrl.pipeline.overlap import Overlap
from batchrl.pipeline.plan import Plan, PlannedStage, check_from_stage
from batchrl.pipeline.reaper import reaping_orphans
from batchrl.pipeline.session import (
    Session,
    check_actor_needs,
    check_cluster_paths,
    check_devices,
    ray_session,
)
from batchrl.pipeline.stage import POLICY, StageContext
from batchrl.pipeline.summary import IterationRecords, RunSummary
from batchrl.pipeline.tables import Tables, damaged_names
from batchrl.storage import write_bytes_atomic
from batchrl.storage.manifest import Manifest
from batchrl.storage.sources import check_s3_credentials
from batchrl.tracking import check_tracking, tracking_session

logger = logging.getLogger(__name__)


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
        check_s3_credentials(cfg)  # before the lineage's first object-store request
        if from_stage is not None:
            check_from_stage(cfg, from_stage, from_iteration)
        self.plan = Plan(cfg, from_stage=from_stage, from_iteration=from_iteration, verify_checksums=verify_checksums)
        self.configured, self.layout, self.lineage = cfg, self.plan.layout, self.plan.lineage
        self.stages = self.plan.stages
        self.tables = Tables(self.plan)
        self.summary = RunSummary(run_dir=self.layout.run_dir)
        self.session = Session()  # the Ray session run() opens
        self._summary_lock = threading.Lock()  # an overlapped step reports from its own thread
        self._run_lock: RunLock | None = None  # held by run()

    @property
    def cfg(self) -> PipelineConfig:
        """The config the steps are planned with (with run.epochs, its iterations counted)."""
        return self.plan.cfg

    @property
    def steps(self) -> list[PlannedStage]:
        return self.plan.steps

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
                ) as trackers,
                ray_session(self.cfg, needed=self._has_work()) as self.session,
            ):
                records = IterationRecords(self.plan, self.layout, self.summary, trackers)
                try:
                    self._run_stages(records)
                finally:
                    with deferred():  # a SIGTERM must not cut it short (see interrupts)
                        for stage in reversed(self.stages.values()):
                            stage.close()  # e.g. resident update ranks (update.trainer_lifetime: run)
                        self.session.engines.close()  # the engines generate and evaluate shared
        return self.summary

    def _run_stages(self, records: IterationRecords) -> None:
        """The stages in their run order (`stage_order`: from what each reads): once-per-run stages, then those
        planned before iteration 0 (evaluating the initial policy), then each iteration's stages in turn. With
        run.max_staleness the policy-writing stage runs beside the next iteration's stages (`Overlap`)."""
        check_cluster_paths(self.cfg, self.stages, run_dir=self.layout.run_dir)
        working = {name: stage for name, stage in self.stages.items() if self._has_work(name)}
        check_actor_needs(self.cfg, working, self.session)
        self.tables.clear_forced()
        # the once-per-run stages this config plans (heldout only with an evaluate: section)
        once = [name for name, stage in self.stages.items() if not stage.per_iteration and (name, None) in self.plan]
        for name in once:
            if self.stage(name) is None:
                return  # an incremental run with no new input file: nothing to train on
        self.plan.count_iterations()  # with run.epochs: now that the once-per-run tables are there
        self.preflight({self.stages[name].table: self.plan[(name, None)].manifest for name in once})
        for stage in working.values():  # e.g. the update's resident ranks: their start overlaps iteration 0's stages
            stage.prestart(self.cfg, embedded_ray=self.session.embedded_ray, rank_devices=self.session.rank_devices)
        each = [name for name, stage in self.stages.items() if stage.per_iteration]
        lagged = self.cfg.run.max_staleness > 0  # the policy-writing stage (the update) runs beside the next stages
        overlap = Overlap(self.stages)
        try:
            for iteration in [None, *range(self.cfg.run.iterations)]:
                for name in each:
                    if (name, iteration) not in self.plan:
                        continue
                    step = self.plan[(name, iteration)]
                    overlap.wait_if_read_by(step)
                    if lagged and iteration is not None and self.stages[name].table == POLICY:
                        overlap.start(step, functools.partial(self.stage, name, iteration))
                    else:
                        self.stage(name, iteration)
                    records.record_finished(running_iteration=overlap.running_iteration)
        except BaseException:
            overlap.abandon(self._run_lock)
            raise
        overlap.wait()
        records.record_finished()

    def stage(self, name: str, iteration: int | None = None) -> Manifest | None:
        """Runs one planned stage unless it is done; returns its manifest (None: nothing to read for it)."""
        step = self.plan[(name, iteration)]
        stage = self.stages[name]
        if step.status == "done":
            logger.info("%s: complete (fingerprint %s), skipped", step.label, step.fingerprint)
            return self._report(step, ran=False)
        cfg, sources = self._narrowed_config() if stage.reads_train_files else (self.cfg, [])
        if cfg is None:
            return None
        ctx = StageContext(
            cfg=cfg,
            layout=self.layout,
            iteration=iteration,
            output_dir=step.output_dir,
            fingerprint=step.fingerprint,
            inputs=self.tables.input_manifests(stage, iteration),
            input_dirs=step.input_dirs,
            policy_in=step.policy_in,
            embedded_ray=self.session.embedded_ray,
            behaviour_policy=step.behaviour_policy,
            rank_devices=self.session.rank_devices,
            engines=self.session.engines,
        )
        stage.check_ready(ctx)  # before anything of the step's old output is removed
        damaged = step.manifest if step.status == "damaged" else None
        self.tables.prepare(step)
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
            inputs=self.tables.input_digests(step),
            trainer_state=output.trainer_state,
            config_fingerprint=step.config_fingerprint,
        )
        self.tables.commit(step, manifest, previous=damaged)
        rows = f", {manifest.num_rows} rows" if stage.schema else ""
        logger.info("%s: done in %.1f s%s", step.label, manifest.finished_at - started, rows)
        return self._report(step, ran=True)

    def _report(self, step: PlannedStage, *, ran: bool) -> Manifest:
        with self._summary_lock:
            self.summary.add(step, self.stages[step.name], ran=ran)
        return step.manifest

    def _has_work(self, name: str | None = None) -> bool:
        """Whether stage ``name`` (any stage, without one) has a step this run still has to do."""
        return any(step.status != "done" for step in self.steps if name in (None, step.name))

    def check_inputs(self) -> None:
        """Config-level checks of every stage that still has something to run (a done stage's inputs may be gone,
        e.g. input files deleted after ingest), and of the split of this host's GPUs the session will make."""
        check_tracking(self.cfg.tracking, run_dir=self.layout.run_dir)
        for name, stage in self.stages.items():
            if self._has_work(name):
                stage.check_inputs(self.cfg)
        if self._has_work():
            check_devices(self.cfg)

    def preflight(self, tables: dict[str, Manifest]) -> None:
        """Each stage's checks against the once-per-run tables, before any iteration runs."""
        for stage in self.stages.values():
            stage.preflight(self.cfg, tables=tables)

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

    def _write_run_yaml(self) -> None:
        text = yaml.safe_dump(self.configured.model_dump(mode="json"), sort_keys=False)
        write_bytes_atomic(self.layout.run_yaml, text.encode())

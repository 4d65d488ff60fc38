"""The runner: plans a run from its config, skips what is complete, runs the rest.

Fingerprints are computed from the config alone (each stage's config + its upstream fingerprints), so
``batchrl plan`` can say, without running anything, which stages are complete (a manifest with the same
fingerprint), stale (a manifest from a different config: redone, and so is everything after it),
partial (some shards written) or pending.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import yaml

from batchrl.config import PipelineConfig
from batchrl.pipeline.lock import RunLock
from batchrl.pipeline.manifest import Manifest, fingerprint, read_manifest, write_manifest
from batchrl.pipeline.stage import STAGES, StageContext, stage_order
from batchrl.storage import RunLayout, join, resolve, write_bytes_atomic

logger = logging.getLogger(__name__)

STARTED_MARKER = "_STARTED.json"


@dataclass
class PlannedStage:
    name: str
    iteration: int | None
    output_dir: str
    fingerprint: str
    input_dirs: dict[str, str]
    policy_in: str
    status: str = "pending"  # done | stale | partial | pending
    manifest: Manifest | None = None

    @property
    def label(self) -> str:
        return self.name if self.iteration is None else f"iter {self.iteration} {self.name}"


@dataclass
class RunSummary:
    run_dir: str
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    iterations: list[dict] = field(default_factory=list)


def build_plan(cfg: PipelineConfig, *, check_storage: bool = True) -> list[PlannedStage]:
    """Every stage of the run in order, with fingerprints and (when check_storage) completion status."""
    layout = RunLayout.for_run(cfg.run.root, cfg.run_id)
    stages = {name: STAGES[name]() for name in stage_order()}
    table_dirs: dict[str, str] = {}
    table_fps: dict[str, str] = {}
    policy_dir, policy_fp = cfg.model.path, fingerprint({"initial_policy": cfg.model.path})
    plan: list[PlannedStage] = []
    iterations: list[int | None] = [None] + list(range(cfg.run.iterations))
    for iteration in iterations:
        for name, stage in stages.items():
            if stage.per_iteration != (iteration is not None):
                continue
            upstream = [policy_fp if t == "policy" else table_fps[t] for t in stage.inputs]
            config = dict(stage.fingerprint_config(cfg), iteration=iteration)
            step = PlannedStage(name=name, iteration=iteration, output_dir=layout.table_dir(stage.table, iteration),
                                fingerprint=fingerprint(config, *upstream),
                                input_dirs={t: table_dirs[t] for t in stage.inputs if t != "policy"},
                                policy_in=policy_dir)
            table_dirs[stage.table], table_fps[stage.table] = step.output_dir, step.fingerprint
            plan.append(step)
        if iteration is not None:
            policy_dir, policy_fp = table_dirs["policy"], table_fps["policy"]
    if check_storage:
        for step in plan:
            _set_status(step)
    return plan


def _set_status(step: PlannedStage) -> None:
    manifest = read_manifest(step.output_dir)
    if manifest is not None:
        step.status = "done" if manifest.fingerprint == step.fingerprint else "stale"
        step.manifest = manifest if step.status == "done" else None
        return
    fs, path = resolve(step.output_dir)
    step.status = "partial" if fs.exists(path) and any(
        not p.rsplit("/", 1)[-1].startswith((".", "_")) for p in fs.ls(path, detail=False)) else "pending"


class Runner:
    """Runs a plan; ``run()`` reads like the pipeline diagram."""

    def __init__(self, cfg: PipelineConfig):
        self.cfg = cfg
        self.layout = RunLayout.for_run(cfg.run.root, cfg.run_id)
        self.plan = {(s.name, s.iteration): s for s in build_plan(cfg)}
        self.summary = RunSummary(run_dir=self.layout.run_dir)

    def run(self) -> RunSummary:
        self._ensure_toy_assets()
        self.check_inputs()  # config errors surface here, before the run directory is touched
        with RunLock(self.layout.lock), _ray_session(self.cfg):
            self._write_run_yaml()
            prompts = self.stage("ingest")
            self.preflight(prompts)
            for iteration in range(self.cfg.run.iterations):
                self.stage("generate", iteration)
                self.stage("score", iteration)
                self.stage("advantage", iteration)
                self.stage("update", iteration)
                self.record_iteration(iteration)
        return self.summary

    def stage(self, name: str, iteration: int | None = None) -> Manifest:
        step = self.plan[(name, iteration)]
        if step.status == "done":
            logger.info("%s: complete (fingerprint %s), skipped", step.label, step.fingerprint)
            self.summary.skipped.append(step.label)
            return step.manifest
        stage = STAGES[name]()
        self._prepare_output_dir(step)
        inputs = {t: self.plan[(_producer(t), _table_iteration(t, iteration))].manifest for t in stage.inputs if t != "policy"}
        ctx = StageContext(cfg=self.cfg, layout=self.layout, iteration=iteration, output_dir=step.output_dir,
                           fingerprint=step.fingerprint, inputs=inputs, input_dirs=step.input_dirs,
                           policy_in=step.policy_in)
        logger.info("%s: running", step.label)
        started = time.time()
        output = stage.run(ctx)
        manifest = Manifest(stage=name, table=stage.table, iteration=iteration, fingerprint=step.fingerprint,
                            parts=output.parts, schema=stage.schema or "", started_at=started, finished_at=time.time(),
                            counts=output.counts, stats=output.stats, extra_parts=output.extra_parts)
        write_manifest(step.output_dir, manifest)
        step.status, step.manifest = "done", manifest
        rows = f", {manifest.num_rows} rows" if stage.schema else ""
        logger.info("%s: done in %.1f s%s", step.label, manifest.finished_at - started, rows)
        self.summary.ran.append(step.label)
        return manifest

    def check_inputs(self) -> None:
        """Config-level checks of every stage that has them; ingest's only while it still has to run."""
        for name in stage_order():
            if name == "ingest" and self.plan[("ingest", None)].status == "done":
                continue
            check = getattr(STAGES[name](), "check_inputs", None)
            if check is not None:
                check(self.cfg)

    def preflight(self, prompts: Manifest) -> None:
        data_sources = sorted(k.split("/", 1)[1] for k in prompts.counts if k.startswith("data_source/"))
        for name in stage_order():
            check = getattr(STAGES[name](), "preflight", None)
            if check is not None:
                check(self.cfg, data_sources=data_sources)

    def record_iteration(self, iteration: int) -> None:
        metrics = iteration_metrics(self.plan, iteration)
        write_bytes_atomic(self.layout.iteration_metrics(iteration), json.dumps(metrics, indent=2).encode())
        self.summary.iterations.append(metrics)
        lines = "".join(json.dumps(m) + "\n" for m in self.summary.iterations)
        write_bytes_atomic(self.layout.metrics_jsonl, lines.encode())  # rewritten whole: resume never duplicates

    def _write_run_yaml(self) -> None:
        text = yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False)
        write_bytes_atomic(self.layout.run_yaml, text.encode())

    def _ensure_toy_assets(self) -> None:
        if self.cfg.toy_assets is not None:
            from batchrl.toy import ensure_toy_assets

            t = self.cfg.toy_assets
            ensure_toy_assets(t.model_dir, t.data_dir, num_prompts=t.num_prompts, num_shards=t.num_shards,
                              seed=t.seed, fmt=t.format)

    def _prepare_output_dir(self, step: PlannedStage) -> None:
        """Clears output left by a different config; keeps shards written under the same fingerprint."""
        fs, path = resolve(step.output_dir)
        marker = join(step.output_dir, STARTED_MARKER)
        if fs.exists(path):
            try:
                previous = json.loads(fs.cat_file(resolve(marker)[1]).decode())["fingerprint"]
            except (FileNotFoundError, ValueError, KeyError):
                previous = None
            if previous != step.fingerprint:
                logger.info("%s: clearing output of a different config (%s)", step.label, previous)
                fs.rm(path, recursive=True)
        write_bytes_atomic(marker, json.dumps({"fingerprint": step.fingerprint, "pid": os.getpid()}).encode())


_PRODUCERS = {"prompts": "ingest", "rollouts": "generate", "scores": "score", "advantages": "advantage",
              "policy": "update"}


def _producer(table: str) -> str:
    return _PRODUCERS[table]


def _table_iteration(table: str, iteration: int | None) -> int | None:
    return None if table == "prompts" else iteration


def iteration_metrics(plan: dict[tuple[str, int | None], PlannedStage], iteration: int) -> dict:
    """verl-style metric names for one iteration, from the stage manifests."""
    metrics: dict = {"iteration": iteration}
    timing_names = {"generate": "gen", "score": "score", "advantage": "adv", "update": "update"}
    step_time = 0.0
    for name, short in timing_names.items():
        manifest = plan[(name, iteration)].manifest
        metrics.update(manifest.stats)
        duration = manifest.finished_at - manifest.started_at
        metrics[f"timing_s/{short}"] = round(duration, 3)
        step_time += duration
    metrics["timing_s/step"] = round(step_time, 3)
    generate = plan[("generate", iteration)].manifest
    metrics["perf/num_samples"] = generate.counts.get("num_samples", 0)
    metrics["perf/throughput_gen_tokens_per_s"] = round(
        generate.counts.get("response_tokens", 0) / max(1e-9, metrics["timing_s/gen"]), 2)
    metrics["score/failed_samples"] = plan[("score", iteration)].manifest.counts.get("failed_samples", 0)
    advantage = plan[("advantage", iteration)].manifest
    metrics["critic/groups_all_equal"] = advantage.counts.get("groups_all_equal", 0)
    return metrics


@contextlib.contextmanager
def _ray_session(cfg: PipelineConfig) -> Iterator[None]:
    import ray
    from ray.data import DataContext

    if ray.is_initialized():
        yield
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                 configure_logging=False)
    DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()

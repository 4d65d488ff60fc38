"""What a run reports: the run summary (what the command line prints, what `Pipeline.run` returns) and each
iteration's metrics (iter_i/metrics.json, metrics.jsonl and the trackers), written from the committed manifests."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from batchrl.pipeline.plan import Plan, PlannedStage
from batchrl.pipeline.stage import Stage
from batchrl.storage import RunLayout, write_bytes_atomic
from batchrl.tracking import Trackers


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

    def add(self, step: PlannedStage, stage: Stage, *, ran: bool) -> None:
        """Lists ``step`` as ran or skipped, and the stats of a stage that declares a summary_key (the CLI prints
        them). An overlapped step reports from its own thread: the runner calls this under a lock."""
        (self.ran if ran else self.skipped).append(step.label)
        if stage.summary_key is not None:
            self.reports.setdefault(stage.summary_key, []).append(
                {"iteration": step.iteration, "policy": step.policy_in, **step.manifest.stats}
            )


class IterationRecords:
    """Writes each iteration's metrics once all its steps are done, in order (with overlapped iterations an iteration
    finishes after the next one's first stages). metrics.jsonl is rewritten whole: a resume never duplicates."""

    def __init__(self, plan: Plan, layout: RunLayout, summary: RunSummary, trackers: Trackers):
        self.plan, self.layout, self.summary, self.trackers = plan, layout, summary, trackers
        self.recorded = 0

    def record_finished(self, *, running_iteration: int | None = None) -> None:
        """Records the iterations whose steps are all done (``running_iteration``'s step in flight is not)."""
        while self.recorded < self.plan.cfg.run.iterations:
            iteration = self.recorded
            steps = [step for step in self.plan.steps if step.iteration == iteration]
            if running_iteration == iteration or any(step.status != "done" for step in steps):
                return
            self._record(iteration)
            self.recorded += 1

    def _record(self, iteration: int) -> None:
        metrics = iteration_metrics(self.plan.by_key, self.plan.stages, iteration)
        write_bytes_atomic(self.layout.iteration_metrics(iteration), json.dumps(metrics, indent=2).encode())
        self.summary.iterations.append(metrics)
        lines = "".join(json.dumps(m) + "\n" for m in self.summary.iterations)
        write_bytes_atomic(self.layout.metrics_jsonl, lines.encode())
        self.trackers.log(metrics, step=iteration)


def iteration_metrics(
    plan: Mapping[tuple[str, int | None], PlannedStage], stages: dict[str, Stage], iteration: int
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

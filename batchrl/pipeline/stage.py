"""The stage contract and the one stage registry.

A stage reads its predecessors' committed tables (through their manifests), writes its own table as
deterministically named parts, and returns what the runner needs to write its manifest. Algorithms stay
out of stages: a stage is glue between storage and a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from batchrl.config import PipelineConfig
from batchrl.storage.manifest import Manifest, PartInfo
from batchrl.storage import RunLayout


@dataclass(frozen=True)
class StageContext:
    cfg: PipelineConfig
    layout: RunLayout
    iteration: int | None
    output_dir: str
    fingerprint: str
    inputs: dict[str, Manifest]  # committed upstream manifests by table name ("prompts", "rollouts", ...)
    input_dirs: dict[str, str]
    policy_in: str  # policy this iteration starts from: model.path or the previous iteration's policy dir


@dataclass
class StageOutput:
    parts: list[PartInfo]
    counts: dict[str, int] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    extra_parts: dict[str, list[PartInfo]] = field(default_factory=dict)
    trainer_state: list[PartInfo] | None = None  # update: the optimizer state it saved (see Manifest.trainer_state)


class Stage(Protocol):
    name: ClassVar[str]  # stage name, as in `--from-stage` and the plan
    table: ClassVar[str]  # output directory name under the run / iteration directory
    schema: ClassVar[str | None]  # data_schemas/<schema>.json of the output table (None: not a table)
    inputs: ClassVar[tuple[str, ...]]  # upstream tables; "policy" = the iteration's input policy
    per_iteration: ClassVar[bool]
    # Optional: ``planned_iterations(cfg) -> list[int | None]`` narrows where the stage runs (None = once, before
    # iteration 0); and ``after_update = True`` makes its "policy" input the policy this iteration's update wrote
    # (the evaluate stage). See `planned_iterations` below.

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        """The config that determines this stage's output (changing it invalidates the stage)."""
        ...

    def run(self, ctx: StageContext) -> StageOutput: ...


STAGES: dict[str, type] = {}


def register(cls: type) -> type:
    if cls.name in STAGES:
        raise AssertionError(f"stage {cls.name!r} registered twice")
    STAGES[cls.name] = cls
    return cls


def planned_iterations(stage: Any, cfg: PipelineConfig) -> list[int | None]:
    """Where a stage runs: once (None) or every iteration, unless the stage narrows it itself."""
    custom = getattr(stage, "planned_iterations", None)
    if custom is not None:
        return list(custom(cfg))
    return list(range(cfg.run.iterations)) if stage.per_iteration else [None]


def consumers(table: str) -> list[str]:
    """Names of the registered stages that read ``table``."""
    return [name for name, cls in STAGES.items() if table in cls.inputs]


def stage_order() -> list[str]:
    """Stage names in pipeline order: ingest once, then the per-iteration loop."""
    import batchrl.stages  # noqa: F401  (registers the built-in stages)

    return list(STAGES)

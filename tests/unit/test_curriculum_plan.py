"""data.curriculum in the plan and the config: generate of iteration i reads iteration i-1's prompt_stats (in its
fingerprint and its input directories), iteration 0 reads none, a pipeline without it plans as before, and the
config errors name their field."""

from __future__ import annotations

from pathlib import Path

import pytest

import batchrl.stages  # noqa: F401  (registers the built-in stages)
from batchrl.config import ConfigError, load_pipeline
from batchrl.pipeline.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]
BATCHES = ["data.prompts_per_iteration=8", "run.iterations=3"]
CURRICULUM = "data.curriculum={skip_solved_streak: 2, revisit: 0.1}"


def plan(overrides: list[str]) -> dict[str, object]:
    cfg = load_pipeline(ROOT / "pipelines" / "quickstart.yaml", overrides=overrides, run_id="curriculum")
    return {step.label: step for step in build_plan(cfg, check_storage=False)}


def generate_steps(steps: dict[str, object]) -> list:
    return sorted((s for s in steps.values() if s.name == "generate"), key=lambda s: s.iteration)


def test_generate_reads_the_previous_iterations_prompt_stats_and_the_first_reads_none():
    steps = plan([*BATCHES, CURRICULUM])
    stats = {s.iteration: s for s in steps.values() if s.name == "prompt_stats"}
    assert sorted(stats) == [0, 1, 2]  # the table is kept: the sampler reads it
    first, *later = generate_steps(steps)
    assert "prompt_stats" not in first.input_dirs
    for step in later:
        assert step.input_dirs["prompt_stats"] == stats[step.iteration - 1].output_dir


def test_the_curriculum_changes_generates_fingerprint_only_when_configured():
    plain = generate_steps(plan(BATCHES))
    stats_only = generate_steps(plan([*BATCHES, "data.prompt_stats=true"]))
    with_curriculum = generate_steps(plan([*BATCHES, CURRICULUM]))
    assert [s.fingerprint for s in stats_only] == [s.fingerprint for s in plain]
    assert all(a.fingerprint != b.fingerprint for a, b in zip(plain, with_curriculum))
    other_k = generate_steps(plan([*BATCHES, "data.curriculum={skip_solved_streak: 3}"]))
    assert all(a.fingerprint != b.fingerprint for a, b in zip(other_k, with_curriculum))


def test_turning_the_curriculum_on_does_not_reingest():
    """How batches are drawn is generate's: the prompts table of a run without it serves a run with it."""
    ingest = [{s.name: s.fingerprint for s in plan(o).values()}["ingest"] for o in (BATCHES, [*BATCHES, CURRICULUM])]
    assert ingest[0] == ingest[1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.max_staleness=1", *BATCHES, CURRICULUM], r"data\.curriculum with run\.max_staleness=1"),
        ([CURRICULUM], r"data\.curriculum needs data\.prompts_per_iteration"),
        ([*BATCHES, "data.curriculum={skip_solved_streak: 0}"], r"skip_solved_streak"),
        ([*BATCHES, "data.curriculum={skip_solved_streak: 2, revisit: 1.0}"], r"revisit"),
    ],
)
def test_a_bad_curriculum_config_is_an_error_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan(overrides)

"""A warm start carries prompt_stats forward (issue 37, item 4): with run.init_from, iteration 0's prompt_stats goes
on from the table beside the policy it starts from, and generate's first curriculum batch reads that table; a new
prompt joins as unseen; a fresh run and a run that kept no table start empty."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

import batchrl.stages  # noqa: F401  (registers the built-in stages)
from batchrl.config import load_pipeline, validate_dict
from batchrl.pipeline.lineage import Lineage
from batchrl.pipeline.plan import build_plan
from batchrl.pipeline.stage import StageContext
from batchrl.stages.prompt_stats import PART, PromptStatsStage, updated_stats
from batchrl.storage import RunLayout, join, read_parquet, write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo, write_manifest

ROOT = Path(__file__).resolve().parents[2]


def scores(rows: list[tuple[str, list[float]]]) -> pa.Table:
    return pa.table(
        {
            "prompt_id": [r[0] for r in rows],
            "source": pa.array([None] * len(rows), pa.string()),
            "data_source": ["arith"] * len(rows),
            "scores": pa.array([r[1] for r in rows], pa.list_(pa.float32())),
        }
    )


LAST_NIGHT = scores([("a", [1.0, 1.0]), ("b", [0.0, 1.0])])  # its last iteration: a solved, b half
TONIGHT = scores([("a", [1.0, 1.0]), ("new", [0.0, 0.0])])


def commit(directory: str, table: pa.Table, *, name: str, stage: str) -> None:
    num_bytes, digest = write_parquet_atomic(table, join(directory, name))
    write_manifest(
        directory,
        Manifest(stage, stage, 1, "f-" + stage, [PartInfo(name, table.num_rows, digest, num_bytes)], stage, 0, 0),
    )


def last_night(tmp_path: Path) -> Lineage:
    """A previous run's last iteration: its policy and its prompt_stats, side by side in iter_0001/."""
    iteration_dir = tmp_path / "nightly-1" / "iter_0001"
    commit(
        str(iteration_dir / "prompt_stats"),
        updated_stats(None, LAST_NIGHT, iteration=1, threshold=0.5),
        name=PART,
        stage="prompt_stats",
    )
    commit(str(iteration_dir / "policy"), pa.table({"x": [0]}), name="model.parquet", stage="policy")
    return Lineage(
        init_from=str(tmp_path / "nightly-*"),
        initial_policy=str(iteration_dir / "policy"),
        initial_policy_fingerprint="p",
    )


def test_the_first_iteration_of_a_warm_start_reads_the_previous_runs_table(tmp_path):
    lineage = last_night(tmp_path)
    carried = str(tmp_path / "nightly-1" / "iter_0001" / "prompt_stats")
    overrides = ["data.prompts_per_iteration=8", "run.iterations=2", "data.curriculum={skip_solved_streak: 1}"]
    cfg = load_pipeline(
        ROOT / "pipelines" / "quickstart.yaml",
        overrides=[*overrides, f"run.init_from={tmp_path}/nightly-*"],
        run_id="nightly-2",
    )
    steps = {(s.name, s.iteration): s for s in build_plan(cfg, check_storage=False, lineage=lineage)}
    assert steps[("generate", 0)].input_dirs["prompt_stats"] == carried
    assert steps[("prompt_stats", 0)].input_dirs["prompt_stats"] == carried
    assert steps[("generate", 1)].input_dirs["prompt_stats"] == steps[("prompt_stats", 0)].output_dir
    fresh = load_pipeline(ROOT / "pipelines" / "quickstart.yaml", overrides=overrides, run_id="nightly-2")
    steps = {(s.name, s.iteration): s for s in build_plan(fresh, check_storage=False)}
    assert "prompt_stats" not in steps[("generate", 0)].input_dirs
    assert "prompt_stats" not in steps[("prompt_stats", 0)].input_dirs


def test_iteration_0s_table_goes_on_from_the_carried_one_and_a_new_prompt_joins_as_unseen(tmp_path):
    last_night(tmp_path)
    carried = str(tmp_path / "nightly-1" / "iter_0001" / "prompt_stats")
    cfg = validate_dict({"name": "t", "model": {"path": "m"}, "data": {"train_files": ["x"], "prompt_stats": True}})
    layout = RunLayout.for_run(str(tmp_path), "nightly-2")
    scores_dir = layout.table_dir("scores", 0)
    commit(scores_dir, TONIGHT, name=PART, stage="scores")
    manifest = Manifest("score", "scores", 0, "f", [PartInfo(PART, 2, "", 0)], "scores", 0, 0)
    ctx = StageContext(
        cfg=cfg,
        layout=layout,
        iteration=0,
        output_dir=layout.table_dir("prompt_stats", 0),
        fingerprint="x",
        inputs={"scores": manifest},
        input_dirs={"scores": scores_dir, "prompt_stats": carried},
        policy_in="m",
    )
    PromptStatsStage().run(ctx)
    rows = {row["prompt_id"]: row for row in read_parquet(join(ctx.output_dir, PART)).to_pylist()}
    assert (rows["a"]["times_sampled"], rows["a"]["solved_streak"]) == (2, 2)  # solved last night and tonight
    assert (rows["b"]["times_sampled"], rows["b"]["last_iteration"]) == (1, 1)  # kept as last night left it
    assert (rows["new"]["times_sampled"], rows["new"]["first_iteration"]) == (1, 0)  # joined as unseen

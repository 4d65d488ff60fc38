"""data.curriculum in a real run: every iteration rolls out exactly the batch the pure function gives from the prompts
table and the previous iteration's committed prompt_stats, generate logs how many it skipped (a pass over a source
solved in full fills the batch with skipped prompts), `batchrl plan` lists the batches of a finished run, and a
driver killed in the middle of an iteration resumes to the batches, statistics and weights of the uninterrupted run."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness import cli, cli_ok, read_manifest, read_metrics, read_rows, read_table, start_cli, write_pipeline
from test_faults import kill_group, kill_when

from batchrl.config import load_pipeline
from batchrl.stages.generate_batches import prompt_batch
from batchrl.storage.manifest import read_manifest as manifest_of

pytestmark = pytest.mark.slow

ITERATIONS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_model_dir, toy_prompts_dir) -> Path:
    tmp_path = tmp_path_factory.mktemp("curriculum")
    overrides = {
        "name": "curriculum",
        "data.max_prompts": 8,  # 2 batches an epoch: iteration 2 meets again the prompts iteration 0 or 1 solved
        "data.shard_size": 8,
        "data.prompts_per_iteration": 4,
        "data.curriculum": {"skip_solved_streak": 1},
        # every sample passes (the toy model solves nothing at 0.5): iteration 2 finds all 8 prompts solved
        "data.pass_threshold": -1.0,
        "run.iterations": ITERATIONS,
    }
    path = write_pipeline(tmp_path, overrides, model=toy_model_dir, prompts=toy_prompts_dir)
    cli_ok("run", path)
    return tmp_path / "runs" / "curriculum"


def test_each_iteration_rolls_out_the_batch_of_the_prompts_and_the_previous_stats(run):
    cfg = load_pipeline(run.parent.parent / "pipeline.yaml")
    prompts = manifest_of(str(run / "prompts"))
    for iteration in range(ITERATIONS):
        dirs = {"prompts": str(run / "prompts")}
        solved = set()
        if iteration:
            dirs["prompt_stats"] = str(run / f"iter_{iteration - 1:04d}" / "prompt_stats")
            solved = {r["prompt_id"] for r in read_rows(Path(dirs["prompt_stats"])) if r["solved_streak"] >= 1}
        batch = prompt_batch(cfg, iteration, prompts, dirs)
        expected = set()
        for piece in batch.slices:
            ids = pq.read_table(run / "prompts" / piece.part, columns=["prompt_id"]).column("prompt_id").to_pylist()
            expected |= {ids[row] for row in piece.row_indices()}
        sampled = {row["prompt_id"] for row in read_rows(run / f"iter_{iteration:04d}" / "rollouts")}
        assert sampled == expected and len(sampled) == 4
        if len(solved) <= 8 - 4:  # enough left to learn from: no solved prompt is taken again
            assert not sampled & solved
    metrics = read_metrics(run)
    assert [line["data/curriculum_skipped"] >= 0 for line in metrics] == [True] * ITERATIONS
    assert metrics[0]["data/curriculum_skipped"] == 0  # nothing seen before iteration 0
    # iteration 2 (epoch 1) walks all 8 prompts, every one solved: 4 fill the batch, 4 are skipped
    assert metrics[2]["data/curriculum_skipped"] == 4
    assert read_manifest(run / "iter_0001" / "rollouts")["inputs"].keys() >= {"prompts", "prompt_stats"}


def test_plan_lists_the_batches_of_the_finished_run(run):
    plan = cli_ok("plan", run.parent.parent / "pipeline.yaml").stdout
    listed = re.findall(r"^    iter (\d) \(epoch \d+, batch \d+ of \d+\): (.*)$", plan, re.M)
    assert [int(i) for i, _ in listed] == list(range(ITERATIONS)), plan


def test_a_driver_killed_in_the_middle_of_an_iteration_resumes_to_the_same_batches(run, tmp_path):
    """Killed (SIGKILL) while iteration 2 generates: the batch it redoes is the pure function of iteration 1's
    committed prompt_stats, so every table and the weights equal the uninterrupted run's (the module's)."""
    pipeline = run.parent.parent / "pipeline.yaml"
    killed = run.parent / "killed"
    shutil.rmtree(killed, ignore_errors=True)
    rollouts = killed / "iter_0002" / "rollouts"

    def generating():
        started = (rollouts / "_STARTED.json").exists() and not (rollouts / "_MANIFEST.json").exists()
        return rollouts if started else None

    process = start_cli("run", pipeline, "--run-id", "killed", log=tmp_path / "killed.log")
    try:
        assert kill_when(process, generating, timeout=600) is not None, "the run finished before it could be killed"
        resumed = cli("run", pipeline, "--run-id", "killed")
        assert resumed.returncode == 0, resumed.stderr[-4000:]
    finally:
        kill_group(process.pid)
    for iteration in range(ITERATIONS):
        for table in ("rollouts", "prompt_stats"):
            rel = f"iter_{iteration:04d}/{table}"
            expected = read_table(run / rel, sort_by=["prompt_id"]).to_pylist()
            assert read_table(killed / rel, sort_by=["prompt_id"]).to_pylist() == expected, f"{rel}: rows differ"
        weights = f"iter_{iteration:04d}/policy/model.safetensors"
        assert digest(killed / weights) == digest(run / weights), f"{weights} differs"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()

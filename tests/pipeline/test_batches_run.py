"""Per-iteration prompt batches in a real run (data.prompts_per_iteration): each iteration rolls out exactly its
batch (the pure function of seed, iteration and the prompts table), epochs and prompts consumed are in the
metrics, changing the batch size never re-ingests, and a driver SIGKILLed in the middle of an epoch resumes to the
rows and weights of an uninterrupted run. The tiny pipeline: 8 prompts in 2 parts of 4, 3 prompts per iteration,
so an epoch is 2 batches (2 prompts left out), iteration 1's batch spans both parts and iteration 2 starts epoch 1.
The run sets run.epochs (2), not run.iterations: its 4 iterations are counted from the ingested prompts table.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness import DEFAULT, cli, cli_ok, read_manifest, read_metrics, read_table, start_cli, write_pipeline
from test_faults import kill_group, kill_when

from batchrl.algorithms.batches import iteration_batch

pytestmark = pytest.mark.slow

BATCH, EPOCHS, SEED = 3, 2, 5  # the tiny pipeline's run.seed is 5
ITERATIONS = EPOCHS * (8 // BATCH)
BATCHES = {
    "name": "batches",
    "run.iterations": DEFAULT,
    "run.epochs": EPOCHS,
    "data.prompts_per_iteration": BATCH,
    "generate": {"num_samples_per_prompt": 2, "temperature": 1.0},
}
TABLES = ["prompts"] + [f"iter_{i:04d}/{t}" for i in range(ITERATIONS) for t in ("rollouts", "scores", "advantages")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, toy_model_dir, toy_prompts_dir) -> tuple[Path, Path]:
    tmp_path = tmp_path_factory.mktemp("batches")
    path = write_pipeline(tmp_path, BATCHES, model=toy_model_dir, prompts=toy_prompts_dir)
    cli_ok("run", path, "--run-id", "reference")
    return path, tmp_path / "runs" / "reference"


def rollout_ids(run: Path, iteration: int) -> list[str]:
    """Prompt ids of an iteration's rollouts, in the order of its manifest's parts."""
    return read_table(run / f"iter_{iteration:04d}" / "rollouts").column("prompt_id").to_pylist()


def expected_ids(run: Path, iteration: int) -> list[str]:
    """The batch by the pure function, read from the prompts table by hand."""
    manifest = read_manifest(run / "prompts")
    parts = [(p["name"], p["rows"]) for p in manifest["parts"]]
    batch = iteration_batch(parts, seed=SEED, iteration=iteration, batch_size=BATCH)
    ids = []
    for piece in batch.slices:
        column = pq.read_table(run / "prompts" / piece.part, columns=["prompt_id"]).column("prompt_id").to_pylist()
        ids += [column[row] for row in piece.row_indices()]
    return ids


def test_each_iteration_rolls_out_its_batch_and_reports_where_it_is_in_the_epoch(reference):
    _, run = reference
    batches = [rollout_ids(run, i) for i in range(ITERATIONS)]
    for i, ids in enumerate(batches):
        assert ids == expected_ids(run, i)
        assert len(ids) == len(set(ids)) == BATCH
    assert not set(batches[0]) & set(batches[1]), "two batches of one epoch share a prompt"
    assert len(read_manifest(run / "iter_0001" / "rollouts")["parts"]) == 2  # a batch across two parts
    metrics = read_metrics(run)
    assert [m["data/epoch"] for m in metrics] == [0, 0, 1, 1]
    assert [m["data/batch_in_epoch"] for m in metrics] == [0, 1, 0, 1]
    assert [m["data/prompts_consumed"] for m in metrics] == [3, 6, 9, 12]
    assert all(m["perf/num_samples"] == BATCH * 2 for m in metrics)


def test_plan_says_which_parts_and_rows_each_iteration_takes_and_epochs_take_other_rows(reference):
    path, run = reference
    plan = cli_ok("plan", path, "--run-id", "reference").stdout
    lines = re.findall(r"^    iter (\d+) \(epoch (\d+), batch (\d+) of 2\): (.*)$", plan, re.M)
    assert [(int(i), int(e), int(b)) for i, e, b, _ in lines] == [(0, 0, 1), (1, 0, 2), (2, 1, 1), (3, 1, 2)], plan
    parts = [(p["name"], p["rows"]) for p in read_manifest(run / "prompts")["parts"]]
    for iteration, *_, where in lines:
        batch = iteration_batch(parts, seed=SEED, iteration=int(iteration), batch_size=BATCH)
        assert where == "; ".join(
            f"{s.part}: {s.rows} rows {' '.join(map(str, s.row_indices()))}" for s in batch.slices
        )
    epochs = [set(rollout_ids(run, 0) + rollout_ids(run, 1)), set(rollout_ids(run, 2) + rollout_ids(run, 3))]
    assert [rollout_ids(run, 0), rollout_ids(run, 1)] != [rollout_ids(run, 2), rollout_ids(run, 3)]
    assert len(epochs[0]) == len(epochs[1]) == 2 * BATCH


def test_a_new_batch_size_keeps_the_ingested_prompts_and_redoes_the_iterations(reference):
    path, run = reference
    plan = cli_ok("plan", path, "--run-id", "reference", sets=["data.prompts_per_iteration=2"]).stdout
    assert re.search(r"^  ingest +done +skip", plan, re.M), plan
    assert re.search(r"^  iter 0 generate +stale +redo \(config changed\)", plan, re.M), plan
    assert "iter 7 generate" in plan and "iter 8 generate" not in plan, plan  # 2 epochs of 8 // 2 batches


def test_epochs_count_the_iterations_once_the_prompts_are_ingested(reference):
    path, _ = reference
    plan = cli_ok("plan", path, "--run-id", "not-ingested-yet").stdout
    assert re.search(r"^  ingest +pending", plan, re.M) and "iter 0" not in plan, plan
    assert "run.epochs=2: the iterations are listed once the prompts table is ingested" in plan, plan
    done = cli_ok("plan", path, "--run-id", "reference").stdout
    assert re.search(rf"^  iter {ITERATIONS - 1} update +done", done, re.M) and f"iter {ITERATIONS} " not in done
    late = cli("plan", path, "--run-id", "reference", "--from-stage", "generate", "--iteration", str(ITERATIONS))
    assert late.returncode == 2 and f"it runs at iterations 0..{ITERATIONS - 1}" in late.stderr, late.stderr


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_driver_killed_in_the_middle_of_an_epoch_resumes_to_the_rows_and_weights_of_an_uninterrupted_run(
    reference, tmp_path
):
    path, expected_run = reference
    run = expected_run.parent / "killed"
    shutil.rmtree(run, ignore_errors=True)
    partial = run / "iter_0001" / "rollouts"

    def mid_epoch():  # iteration 1 (the epoch's second batch) caught with one of its two parts written
        return partial if any(partial.glob("part-*.parquet")) and not (partial / "_MANIFEST.json").exists() else None

    process = start_cli("run", path, "--run-id", "killed", log=tmp_path / "killed.log")
    try:
        what = kill_when(process, mid_epoch, timeout=600)
        assert what is not None, "the run finished before it could be killed"
        final = cli("run", path, "--run-id", "killed")
        assert final.returncode == 0, final.stderr[-4000:]
    finally:
        kill_group(process.pid)
    for rel in TABLES:
        keys = ["prompt_id", "sample_idx"] if rel.endswith("advantages") else ["prompt_id"]
        expected, got = read_table(expected_run / rel, sort_by=keys), read_table(run / rel, sort_by=keys)
        assert got.to_pylist() == expected.to_pylist(), f"{rel}: rows differ"
    for i in range(ITERATIONS):
        weights = f"iter_{i:04d}/policy/model.safetensors"
        assert sha256(run / weights) == sha256(expected_run / weights), f"{weights} differs"

"""A run's outputs are plain Parquet that other tools read as they are: every committed table of a real run
reads with pandas, duckdb and `datasets.load_dataset("parquet", ...)` with the manifest's row count and the
declared columns; `batchrl inspect` shows a table; the report and TensorBoard files work for a run on s3://.
One tiny run for the module: HF engine, 4 prompts in 2 shards, 2 samples of 4 tokens, 1 iteration."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness import cli_ok, write_pipeline

from batchrl.storage import resolve
from batchrl.storage.schemas import load_schema
from batchrl.tracking import run_tables

pytestmark = pytest.mark.slow

NUM_PROMPTS, SAMPLES = 4, 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, toy_model_dir, toy_prompts_dir) -> Path:
    tmp = tmp_path_factory.mktemp("readable")
    cli_ok(
        "run",
        write_pipeline(
            tmp,
            {
                "name": "readable",
                "data": {"shard_size": 2, "max_prompts": NUM_PROMPTS},
                "generate": {"num_samples_per_prompt": SAMPLES, "max_new_tokens": 4},
                "score": {"rewards": [{"reward": "format_hash", "weight": 1.0}]},
            },
            model=toy_model_dir,
            prompts=toy_prompts_dir,
        ),
    )
    return tmp / "runs" / "readable"


def test_every_table_of_a_run_reads_with_pandas_duckdb_and_datasets(run_dir, tmp_path):
    import datasets
    import duckdb
    import pandas as pd

    duck = duckdb.connect()
    tables = run_tables(str(run_dir))
    # no "prompts rejects": an ingest that rejects nothing writes no rejects part, so there is no file to read
    assert [t.label for t in tables] == ["prompts", "iter 0 rollouts", "iter 0 scores", "iter 0 advantages"]
    expected_rows = {
        "prompts": NUM_PROMPTS,
        "iter 0 rollouts": NUM_PROMPTS,
        "iter 0 scores": NUM_PROMPTS,
        "iter 0 advantages": NUM_PROMPTS * SAMPLES,
    }
    for table in tables:
        columns = load_schema(table.schema).names
        assert table.num_rows == expected_rows[table.label], table.label

        frame = pd.read_parquet(table.table_dir)  # the directory as a dataset: _MANIFEST.json etc. are skipped
        assert (len(frame), list(frame.columns)) == (table.num_rows, columns), table.label

        glob = f"{table.table_dir}/*.parquet"
        (count,) = duck.execute(f"SELECT count(*) FROM read_parquet('{glob}')").fetchone()
        names = [d[0] for d in duck.execute(f"SELECT * FROM read_parquet('{glob}') LIMIT 1").description]
        assert (count, names) == (table.num_rows, columns), table.label

        if table.num_rows == 0:
            continue  # datasets refuses any split without rows ("corresponds to no data"), whatever the files hold
        loaded = datasets.load_dataset(
            "parquet", data_files=table.files, split="train", cache_dir=str(tmp_path / "hf_cache")
        )
        assert (loaded.num_rows, loaded.column_names) == (table.num_rows, columns), table.label

    advantages = duck.execute(
        f"SELECT prompt_id, count(*) AS n, sum(advantage) AS total FROM "
        f"read_parquet('{run_dir}/iter_0000/advantages/*.parquet') GROUP BY prompt_id"
    ).fetchall()
    assert len(advantages) == NUM_PROMPTS and all(n == SAMPLES and abs(total) < 1e-5 for _, n, total in advantages)


def test_inspect_prints_the_schema_the_row_count_and_first_rows_of_a_table(run_dir):
    result = cli_ok("inspect", run_dir / "iter_0000" / "scores", "--rows", "1")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("score stage table") and f"{NUM_PROMPTS} rows" in lines[0]
    assert "scores: list<element: float>" in result.stdout and "response_texts: list" in result.stdout
    first = json.loads(lines[-1])
    assert len(first["response_texts"]) == SAMPLES and len(first["scores"]) == SAMPLES


def test_report_of_a_real_run_plots_its_metrics_and_shows_its_groups(run_dir):
    from batchrl.tracking.report import write_report

    page = Path(write_report(str(run_dir)))
    assert {"reward.png", "response_length.png", "timings.png", "entropy.png"} <= {
        p.name for p in page.parent.iterdir()
    }
    scores = next(t for t in run_tables(str(run_dir)) if t.label == "iter 0 scores")
    prompt_ids = pq.read_table(scores.files[0], columns=["prompt_id"]).column("prompt_id").to_pylist()
    assert any(f"prompt {prompt_id} " in page.read_text() for prompt_id in prompt_ids)


def test_report_and_tensorboard_files_of_a_run_on_object_storage_land_beside_it(run_dir, s3_bucket, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from batchrl.config.models import TrackingConfig
    from batchrl.tracking import make_trackers
    from batchrl.tracking.report import write_report

    remote = f"s3://{s3_bucket}/runs/readable"
    fs, path = resolve(remote)
    scores = [p for p in (run_dir / "iter_0000" / "scores").iterdir() if p.is_file()]  # not its _journal/
    for file in [run_dir / "run.yaml", run_dir / "metrics.jsonl", *scores]:
        fs.put_file(str(file), f"{path}/{file.relative_to(run_dir).as_posix()}")

    assert write_report(remote) == f"{remote}/report/index.html"
    page = fs.cat_file(f"{path}/report/index.html").decode()
    assert "iteration 0</h3>" in page and "No scores table yet" not in page and "<pre class='best'>" in page
    assert fs.exists(f"{path}/report/reward.png")

    trackers = make_trackers(
        TrackingConfig(backends=["tensorboard"]), run_dir=remote, run_id="readable", config_dict={"name": "readable"}
    )
    trackers[0].log({"iteration": 0, "critic/score/mean": 0.5}, step=0)
    trackers[0].close()
    fs.get(f"{path}/tensorboard", str(tmp_path / "tb"), recursive=True)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(0, 0.5)]

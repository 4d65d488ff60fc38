"""The Python API (batchrl.api.Pipeline), as README shows it: change a pipeline, insert a function stage after
score, run it in this process, read the tables; a second run resumes to nothing to do; the score metrics report
the scores advantage trained on, after the inserted stage. One shard per table, so every stage runs in this process
(a function defined here needs no import path). A run through the API in a fresh process logs as `batchrl run`
does: batchrl's progress on stderr, not Ray's or the engines' chatter."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pyarrow as pa
import pytest
from harness import environment, merged, tiny_pipeline

from batchrl.api import Pipeline
from batchrl.config import ConfigError
from batchrl.tracking.summary import format_summary

pytestmark = pytest.mark.slow


def sample_bonus(table: pa.Table, *, bonus: float) -> pa.Table:
    """scores + bonus x the sample's index in its group: a reward that is visible downstream."""
    shaped = [[score + bonus * i for i, score in enumerate(group)] for group in table.column("scores").to_pylist()]
    return table.set_column(table.schema.get_field_index("scores"), "scores", pa.array(shaped))


@pytest.fixture(scope="module")
def bonus_pipeline(tmp_path_factory, toy_model_dir, toy_prompts_dir) -> Pipeline:
    """The tiny pipeline with a function stage after score (2 iterations), before it runs."""
    raw = merged(
        tiny_pipeline(model=toy_model_dir, prompts=toy_prompts_dir, root=str(tmp_path_factory.mktemp("api"))),
        {"name": "api", "data.max_prompts": 4, "score.rewards": [{"reward": "gsm8k"}], "tracking.progress_bars": False},
    )
    pipeline = Pipeline.from_dict(raw).set("run.iterations=2", "generate.max_new_tokens=4")
    return pipeline.insert_after("score", sample_bonus, name="bonus", outputs=["scores"], params={"bonus": 0.25})


@pytest.fixture(scope="module")
def bonus_run(bonus_pipeline):
    """Its run, shared by the tests that read it (in this process: a run leaves no Ray behind)."""
    return bonus_pipeline.run()


def test_a_function_stage_inserted_from_python_runs_and_its_tables_read_as_arrow_and_pandas(bonus_pipeline, bonus_run):
    pipeline, run = bonus_pipeline, bonus_run
    assert [s.name for s in pipeline.config.stages] == ["bonus"] and pipeline.config.run.iterations == 2
    with pytest.raises(ConfigError, match=r"insert_after\('update'\)"):
        pipeline.insert_after("update", sample_bonus, name="late", outputs=["scores"])

    assert "iter 1 bonus" in run.summary.ran
    scores = run.table("score", iteration=1)  # gsm8k: the random toy model never answers right
    assert {s for group in scores.column("scores").to_pylist() for s in group} == {0.0}
    bonus = run.table("bonus", iteration=1).to_pandas()
    assert [list(group) for group in bonus["scores"]] == [[0.0, 0.25]] * 4
    advantages = run.table("advantages", iteration=1).to_pandas()
    assert (advantages["score"] == 0.25 * advantages["sample_idx"]).all()
    assert len(run.metrics()) == 2

    again = pipeline.run()
    assert again.summary.ran == [] and "iter 1 bonus" in again.summary.skipped


def test_the_score_metrics_report_the_scores_advantage_read_after_a_shaping_stage_and_each_stages_effect(bonus_run):
    # iteration 0's: gsm8k scores 0 (the toy model never answers right); the bonus adds 0.25 x sample_idx
    metrics = bonus_run.metrics()[0]
    assert metrics["score/raw/mean"] == 0.0 and metrics["score/raw/max"] == 0.0
    assert metrics["critic/score/mean"] == pytest.approx(0.125) and metrics["critic/score/max"] == 0.25
    assert metrics["stage/bonus/scores/mean_before"] == 0.0
    assert metrics["stage/bonus/scores/mean_after"] == pytest.approx(0.125)
    assert metrics["stage/bonus/scores/changed"] == 4  # the second sample of each of the 4 groups
    assert format_summary(bonus_run.metrics()).splitlines()[1].split()[:2] == ["0", "0.125"]  # iter, score


API_SCRIPT = """
import json, sys
from batchrl.api import Pipeline

Pipeline.from_dict(json.loads(sys.argv[1])).run()
"""


def test_a_run_from_python_logs_batchrls_progress_and_not_ray_or_engine_chatter(
    tmp_path, toy_model_dir, toy_prompts_dir
):
    raw = merged(
        tiny_pipeline(model=toy_model_dir, prompts=toy_prompts_dir, root=str(tmp_path)),
        {"name": "logs", "tracking.progress_bars": False},
    )
    result = subprocess.run(
        [sys.executable, "-c", API_SCRIPT, json.dumps(raw)],
        cwd=tmp_path,
        env=environment({"VLLM_LOGGING_LEVEL": None, "TORCH_CPP_LOG_LEVEL": None}),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stderr = result.stderr
    assert re.search(r"^\S+ INFO batchrl\.pipeline\.runner: iter 0 generate: done in", stderr, re.M), stderr[-3000:]
    assert re.search(r"^\S+ INFO batchrl\.pipeline\.runner: iter 0 update: done in", stderr, re.M), stderr[-3000:]
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.stdout + stderr)  # Ray colours the prefix of a worker's line
    assert "Token authentication" not in output, output[-3000:]
    assert "streaming_executor" not in output, output[-3000:]  # Ray Data's INFO lines
    worker_lines = [line for line in output.splitlines() if re.search(r"\(\w+ pid=\d+\)", line)]  # Ray's forwarding
    assert worker_lines == [], "\n".join(worker_lines[:20])

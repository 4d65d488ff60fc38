"""Bad input to `batchrl run`: a one-line error naming the field or column, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[2]


def run_pipeline(tmp_path: Path, raw: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw))
    return subprocess.run([sys.executable, "-m", "batchrl.cli", "run", str(path)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ})


def base(tmp_path: Path, toy_model_dir: str, train_files: list[str]) -> dict:
    return {"name": "bad", "run": {"root": str(tmp_path / "runs")}, "model": {"path": toy_model_dir},
            "data": {"train_files": train_files}, "generate": {"engine": "hf", "max_new_tokens": 4},
            "ray": {"num_cpus": 1}}


def assert_config_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_missing_prompt_files_exit_2_naming_the_field_and_write_nothing(tmp_path, toy_model_dir):
    result = run_pipeline(tmp_path, base(tmp_path, toy_model_dir, [str(tmp_path / "nope")]))
    assert_config_error(result, "data.train_files", "does not exist")
    assert not (tmp_path / "runs").exists()


def test_a_file_without_a_prompt_column_exits_2_naming_the_column_and_writes_nothing(tmp_path, toy_model_dir):
    pq.write_table(pa.table({"question": ["1+1?"], "ground_truth": ["2"]}), tmp_path / "q.parquet")
    result = run_pipeline(tmp_path, base(tmp_path, toy_model_dir, [str(tmp_path / "q.parquet")]))
    assert_config_error(result, "'prompt'", "q.parquet")
    assert not (tmp_path / "runs").exists()


def test_a_missing_model_directory_exits_2(tmp_path, toy_prompts_dir):
    result = run_pipeline(tmp_path, base(tmp_path, "./no/such/model/dir", [toy_prompts_dir]))
    assert_config_error(result, "model.path")
    assert not (tmp_path / "runs").exists()


def test_an_unknown_reward_exits_2_before_anything_is_written(tmp_path, toy_model_dir, toy_prompts_dir):
    raw = base(tmp_path, toy_model_dir, [toy_prompts_dir]) | {"score": {"rewards": [{"reward": "gsm9k"}]}}
    result = run_pipeline(tmp_path, raw)
    assert_config_error(result, "gsm9k")
    assert not (tmp_path / "runs").exists()


def test_a_data_source_without_a_reward_stops_the_run_before_generation(tmp_path, toy_model_dir):
    pq.write_table(pa.table({"prompt": ["What is 1 + 1?"], "ground_truth": ["2"], "data_source": ["mystery"]}),
                   tmp_path / "m.parquet")
    result = run_pipeline(tmp_path, base(tmp_path, toy_model_dir, [str(tmp_path / "m.parquet")]))
    assert_config_error(result, "mystery", "reward_by_data_source")
    run_dir = tmp_path / "runs" / "bad"
    assert json.loads((run_dir / "prompts" / "_MANIFEST.json").read_text())["counts"]["prompts"] == 1
    assert not (run_dir / "iter_0000").exists()

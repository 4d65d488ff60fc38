"""Bad input to `batchrl run`: a one-line error naming the field, file or column, nothing written. A config
mistake exits 2, unusable input data (unreadable file, missing column, no rows) exits 3, as README's table says."""

from __future__ import annotations

import json
import subprocess

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from harness import DEFAULT, cli

# The tiny pipeline with the default rewards (one per data_source), as a user's first pipeline has them.
BAD = {"name": "bad", "score": DEFAULT}


def assert_config_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert_exit(result, 2, "config error: ", *needles)


def assert_data_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert_exit(result, 3, "data error: ", *needles)


def assert_exit(result: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_missing_prompt_files_exit_2_naming_the_field_and_write_nothing(tmp_path, pipeline):
    result = cli("run", pipeline(BAD | {"data.train_files": [str(tmp_path / "nope")]}))
    assert_config_error(result, "data.train_files", "does not exist")
    assert not (tmp_path / "runs").exists()


def test_a_file_without_a_prompt_column_exits_3_naming_the_file_and_column_and_writes_nothing(tmp_path, pipeline):
    pq.write_table(pa.table({"question": ["1+1?"], "ground_truth": ["2"]}), tmp_path / "q.parquet")
    result = cli("run", pipeline(BAD | {"data.train_files": [str(tmp_path / "q.parquet")]}))
    assert_data_error(result, f"{tmp_path / 'q.parquet'} has no 'prompt' column")
    assert not (tmp_path / "runs").exists()


def test_a_jsonl_file_whose_records_have_no_prompt_exits_3_naming_the_file_and_writes_nothing(tmp_path, pipeline):
    (tmp_path / "q.jsonl").write_text('{"question": "1+1?", "ground_truth": "2", "data_source": "arith"}\n')
    result = cli("run", pipeline(BAD | {"data.train_files": [str(tmp_path / "q.jsonl")]}))
    assert_data_error(result, f"{tmp_path / 'q.jsonl'} has no 'prompt' column")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "content", [b"", b"prompt,ground_truth,data_source\n1+1?,2,arith\n"], ids=["zero_bytes", "csv_named_parquet"]
)
def test_an_unreadable_input_file_exits_3_naming_it_and_writes_nothing(tmp_path, pipeline, content):
    (tmp_path / "bad.parquet").write_bytes(content)
    result = cli("run", pipeline(BAD | {"data.train_files": [str(tmp_path / "bad.parquet")]}))
    assert_data_error(result, f"{tmp_path / 'bad.parquet'} is not a readable Parquet file")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "runs").exists()


def test_an_input_file_without_rows_exits_3_naming_it_and_writes_nothing(tmp_path, pipeline):
    empty = pa.table(
        {
            "prompt": pa.array([], pa.string()),
            "ground_truth": pa.array([], pa.string()),
            "data_source": pa.array([], pa.string()),
        }
    )
    pq.write_table(empty, tmp_path / "empty.parquet")
    result = cli("run", pipeline(BAD | {"data.train_files": [str(tmp_path / "empty.parquet")]}))
    assert_data_error(result, f"every input file is empty (0 rows): {tmp_path / 'empty.parquet'}")
    assert not (tmp_path / "runs").exists()


def test_a_missing_data_source_column_exits_3_naming_file_and_column_before_ingesting(tmp_path, pipeline):
    pq.write_table(pa.table({"prompt": ["What is 1 + 1?"], "ground_truth": ["2"]}), tmp_path / "nods.parquet")
    result = cli("run", pipeline(BAD | {"data.train_files": [str(tmp_path / "nods.parquet")]}))
    assert_data_error(result, f"{tmp_path / 'nods.parquet'} has no 'data_source' column", "score.rewards")
    assert not (tmp_path / "runs").exists()


def test_a_relative_model_path_that_does_not_exist_exits_2_without_retrying_the_hub(
    tmp_path, pipeline, unreachable_endpoint
):
    hub = unreachable_endpoint.url  # a hub that cannot be reached: no test depends on the internet
    result = cli(
        "run",
        pipeline(BAD | {"model.path": "nosuchdir/model"}),
        env={"HF_ENDPOINT": hub, "HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_HOME": str(tmp_path / "hf")},
    )
    assert_config_error(result, "model.path: 'nosuchdir/model' is not a local directory")
    # it used to retry the hub for 65 s; counted, not timed (a loaded host starts the command slowly)
    assert unreachable_endpoint.requests_for("/api/models/nosuchdir/model") == 1
    assert not (tmp_path / "runs").exists()


def test_an_s3_run_root_without_credentials_exits_2_naming_run_root_and_writes_nothing(tmp_path, pipeline, s3_bucket):
    empty = tmp_path / "empty_aws_file"
    empty.write_text("")
    result = cli(
        "run",
        pipeline(BAD | {"run.root": f"s3://{s3_bucket}/runs"}),
        env={
            "AWS_ACCESS_KEY_ID": None,
            "AWS_SECRET_ACCESS_KEY": None,
            "AWS_SESSION_TOKEN": None,
            "AWS_PROFILE": None,
            "AWS_SHARED_CREDENTIALS_FILE": str(empty),
            "AWS_CONFIG_FILE": str(empty),
            "AWS_EC2_METADATA_DISABLED": "true",
        },
    )
    assert_config_error(
        result, f"run.root: s3://{s3_bucket}/runs is on S3, but no AWS credentials were found", "AWS_ACCESS_KEY_ID"
    )
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    listed = boto3.client("s3", region_name="us-east-1").list_objects_v2(Bucket=s3_bucket)
    assert listed.get("KeyCount", 0) == 0


def test_a_missing_model_directory_exits_2(tmp_path, pipeline):
    result = cli("run", pipeline(BAD | {"model.path": "./no/such/model/dir"}))
    assert_config_error(result, "model.path")
    assert not (tmp_path / "runs").exists()


def test_an_unknown_reward_exits_2_before_anything_is_written(tmp_path, pipeline):
    result = cli("run", pipeline(BAD | {"score": {"rewards": [{"reward": "gsm9k"}]}}))
    assert_config_error(result, "gsm9k")
    assert not (tmp_path / "runs").exists()


def test_a_data_source_without_a_reward_stops_the_run_before_generation(tmp_path, pipeline):
    pq.write_table(
        pa.table({"prompt": ["What is 1 + 1?"], "ground_truth": ["2"], "data_source": ["mystery"]}),
        tmp_path / "m.parquet",
    )
    result = cli("run", pipeline(BAD | {"data.train_files": [str(tmp_path / "m.parquet")]}))
    assert_config_error(result, "mystery", "reward_by_data_source")
    run_dir = tmp_path / "runs" / "bad"
    assert json.loads((run_dir / "prompts" / "_MANIFEST.json").read_text())["counts"]["prompts"] == 1
    assert not (run_dir / "iter_0000").exists()


def test_more_nccl_ranks_than_this_hosts_gpus_exits_2_naming_the_count_and_the_gpus(tmp_path, pipeline):
    """conf/trainer/gpu_nccl.yaml once asked for 8 ranks: on a one-GPU host ranks 1-7 died after generation."""
    result = cli("run", pipeline(BAD | {"update": {"backend": "nccl", "num_processes": 2}}))
    assert_config_error(result, "update.num_processes=2", "this host has 0", "update.num_processes: auto")
    assert not (tmp_path / "runs").exists()

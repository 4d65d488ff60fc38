"""Where a model comes from and whether S3 can be reached: decided before a run writes anything, without retries."""

from __future__ import annotations

import huggingface_hub
import pytest
from huggingface_hub import constants

from batchrl.config import ConfigError, PipelineConfig, validate_dict
from batchrl.storage.sources import check_checkpoint_source, check_s3_credentials, is_hub_id


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, online unless a test says otherwise."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return cache


@pytest.fixture
def no_hub_requests(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", refuse)


@pytest.mark.parametrize(
    ("path", "hub"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("nosuchdir/model", True),
        ("./model", False),
        ("/abs/model", False),
        ("~/model", False),
        ("a/b/c", False),
        ("gpt2", False),
        ("a/../b", False),
        ("a--b/c", False),
    ],
)
def test_a_hub_id_is_exactly_owner_slash_name(path, hub):
    assert is_hub_id(path) is hub


def test_a_path_under_an_existing_local_directory_is_local_and_must_exist(
    tmp_path, monkeypatch, hub_cache, no_hub_requests
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match="model.path: 'runs/model' is neither a local checkpoint directory"):
        check_checkpoint_source("runs/model", field="model.path", example="Qwen/Qwen2.5-0.5B-Instruct")
    (tmp_path / "runs" / "model").mkdir()
    check_checkpoint_source("runs/model", field="model.path", example="Qwen/Qwen2.5-0.5B-Instruct")


def test_offline_a_hub_id_missing_from_the_cache_is_a_config_error_without_a_request(
    hub_cache, monkeypatch, no_hub_requests
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConfigError,
        match="model.path: 'nosuchdir/model' is neither a local directory nor in the "
        "Hugging Face cache.*HF_HUB_OFFLINE=1",
    ):
        check_checkpoint_source("nosuchdir/model", field="model.path", example="Qwen/Qwen2.5-0.5B-Instruct")


def test_a_cached_hub_id_is_accepted_without_a_request(hub_cache, monkeypatch, no_hub_requests):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (hub_cache / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc123").mkdir(parents=True)
    check_checkpoint_source("Qwen/Qwen2.5-0.5B-Instruct", field="model.path", example="Qwen/Qwen2.5-0.5B-Instruct")


def test_an_unreachable_hub_is_asked_once_and_named_in_a_config_error(hub_cache, monkeypatch, unreachable_endpoint):
    monkeypatch.setattr(constants, "ENDPOINT", unreachable_endpoint.url)
    expected = (
        "model.path: 'nosuchdir/model' is not a local directory \\(nosuchdir/ does not exist here\\), "
        "not in the Hugging Face cache.*could not be reached"
    )
    with pytest.raises(ConfigError, match=expected):
        check_checkpoint_source("nosuchdir/model", field="model.path", example="Qwen/Qwen2.5-0.5B-Instruct")
    # no retries: counted, not timed (on a busy host one try alone can take seconds)
    assert unreachable_endpoint.requests_for("/api/models/nosuchdir/model") == 1


@pytest.fixture
def no_aws_credentials(tmp_path, monkeypatch):
    """No credentials anywhere botocore looks: environment, shared files, instance metadata."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        empty = tmp_path / name.lower()
        empty.write_text("")
        monkeypatch.setenv(name, str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def config(**run) -> PipelineConfig:
    return validate_dict({"name": "t", "run": run, "model": {"path": "m"}, "data": {"train_files": ["d/"]}})


def test_an_s3_run_root_without_credentials_is_a_config_error_naming_run_root_and_the_variables(no_aws_credentials):
    with pytest.raises(ConfigError) as caught:
        check_s3_credentials(config(root="s3://bucket/runs"))
    message = str(caught.value)
    assert message.startswith("run.root: s3://bucket/runs is on S3, but no AWS credentials were found")
    assert "AWS_ACCESS_KEY_ID" in message and "AWS_SECRET_ACCESS_KEY" in message and "\n" not in message


def test_credentials_are_not_asked_for_when_nothing_is_on_s3(no_aws_credentials, monkeypatch):
    check_s3_credentials(config(root="runs"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    check_s3_credentials(config(root="s3://bucket/runs"))


@pytest.mark.parametrize(
    "command",
    [
        ["status", "s3://bucket/runs/r"],
        ["inspect", "s3://bucket/runs/r/prompts"],
        ["unlock", "s3://bucket/runs/r"],
        ["report", "s3://bucket/runs/r"],
    ],
)
def test_commands_that_read_a_run_on_s3_without_credentials_exit_2_with_one_line(no_aws_credentials, command):
    from harness import cli

    done = cli(*command, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("config error: s3://bucket/runs/r") and "AWS_ACCESS_KEY_ID" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1

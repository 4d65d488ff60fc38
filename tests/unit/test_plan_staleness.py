"""The plan of overlapped iterations (run.max_staleness): which policy each stage of an iteration reads."""

from __future__ import annotations

from pathlib import Path

import pytest

import batchrl.stages  # noqa: F401  (registers the built-in stages)
from batchrl.config import validate_dict
from batchrl.pipeline.runner import build_plan


def config(tmp_path: Path, *, staleness: int, critic: bool = False) -> object:
    raw = {
        "name": "r",
        "run": {"root": str(tmp_path / "runs"), "iterations": 4, "max_staleness": staleness},
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
        "data": {"train_files": [str(tmp_path / "in")]},
    }
    if critic:
        raw |= {"advantage": {"estimator": "gae"}, "critic": {}}
    return validate_dict(raw)


@pytest.mark.parametrize("staleness", [1, 2])
def test_iteration_i_generates_with_policy_i_1_k_and_trains_policy_i_1(tmp_path, staleness):
    steps = {step.label: step for step in build_plan(config(tmp_path, staleness=staleness), check_storage=False)}
    initial = "Qwen/Qwen2.5-0.5B-Instruct"
    for i in range(4):
        behaviour = initial if i - 1 - staleness < 0 else steps[f"iter {i - 1 - staleness} update"].output_dir
        trained = initial if i == 0 else steps[f"iter {i - 1} update"].output_dir
        assert steps[f"iter {i} generate"].policy_in == behaviour
        assert steps[f"iter {i} update"].policy_in == trained
        assert steps[f"iter {i} update"].behaviour_policy == behaviour


def test_strict_order_keeps_its_fingerprints_and_staleness_changes_them_from_the_first_lagging_iteration(tmp_path):
    strict = {s.label: s.fingerprint for s in build_plan(config(tmp_path, staleness=0), check_storage=False)}
    lagged = {s.label: s.fingerprint for s in build_plan(config(tmp_path, staleness=1), check_storage=False)}
    assert strict["iter 0 generate"] == lagged["iter 0 generate"]  # both the initial policy
    assert strict["iter 1 generate"] != lagged["iter 1 generate"]  # policy 0 against the initial policy
    assert strict["iter 0 update"] != lagged["iter 0 update"]  # its old log-probs' source is in its config


def test_the_values_stage_reads_the_critic_of_the_behaviour_policy(tmp_path):
    steps = {step.label: step for step in build_plan(config(tmp_path, staleness=1, critic=True), check_storage=False)}
    assert steps["iter 2 values"].policy_in == steps["iter 2 generate"].policy_in == steps["iter 0 update"].output_dir


def test_overlap_with_gpu_engines_and_local_update_ranks_is_a_config_error(tmp_path, monkeypatch):
    from batchrl.config import ConfigError
    from batchrl.stages.update import UpdateStage

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = config(tmp_path, staleness=1)
    gpu = cfg.model_copy(update={"generate": cfg.generate.model_copy(update={"gpus_per_actor": 1.0})})
    with pytest.raises(ConfigError, match="run.max_staleness=1 runs the update while the engines generate"):
        UpdateStage().check_inputs(gpu)
    UpdateStage().check_inputs(cfg)  # CPU engines: the shares are generate.cpus_per_actor and update.cpus_per_rank

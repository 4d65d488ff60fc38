"""PPO with a critic in real runs (advantage.estimator gae): the values stage's per-token values, GAE in the
advantage stage, the critic trained in the update's ranks and saved in the policy directory as an HF
token-classification checkpoint with its optimizer state; a critic warm-up carries the policy forward. Tiny
runs: HF engine, gloo update."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from harness import (
    REPO,
    cli_ok,
    kill_run_when,
    pausing_stage,
    read_manifest,
    read_metrics,
    read_rows,
    start_cli,
    write_pipeline,
)

pytestmark = pytest.mark.slow

PAUSE_ENV = "BATCHRL_TEST_PPO_PAUSE"

# The probe (probe_dir) is a user stage after score, so that the values stage reads its table.
PPO = {
    "run.iterations": 2,
    "advantage.estimator": "gae",
    "advantage.gamma": 1.0,
    "advantage.lam": 0.95,
    "critic.lr": 1.0e-3,
    "critic.warmup_iterations": 1,
    "stages": [{"name": "probe", "after": "score", "call": "ppo_probe:pause_in_iteration_1", "outputs": ["probed"]}],
}


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> Path:
    """The probe stage's module: after score, pausing at its 3th shard (2 shards an iteration) for the kill test."""
    directory = tmp_path_factory.mktemp("probe")
    pausing_stage(directory, "ppo_probe", function="pause_in_iteration_1", env=PAUSE_ENV, call=3)
    return directory


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, toy_model_dir, toy_prompts_dir, probe_dir) -> tuple[Path, Path]:
    """One two-iteration PPO run the tests of this module share (iteration 0: critic warm-up): (its pipeline file,
    its run directory)."""
    directory = tmp_path_factory.mktemp("ppo")
    path = write_pipeline(directory, PPO, model=toy_model_dir, prompts=toy_prompts_dir)
    cli_ok("run", path, path_first=[probe_dir, REPO])
    return path, directory / "runs" / "tiny"


@pytest.fixture(scope="module")
def ppo_run(uninterrupted) -> Path:
    return uninterrupted[1]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_values_are_per_token_and_advantages_follow_gae(ppo_run):
    values = read_rows(ppo_run / "iter_0000" / "values", sort_by=["prompt_id"])
    advantages = read_rows(ppo_run / "iter_0000" / "advantages", sort_by=["prompt_id", "sample_idx"])
    assert len(advantages) == sum(len(row["scores"]) for row in values)
    by_key = {(row["prompt_id"], k): v for row in values for k, v in enumerate(row["values"])}
    tokens = []
    for sample in advantages:
        n = sample["response_length"]
        assert len(sample["values"]) == len(sample["returns"]) == len(sample["token_advantages"]) == n
        assert sample["values"] == pytest.approx(by_key[(sample["prompt_id"], sample["sample_idx"])])
        if n:
            # gamma = 1: the return of the last token is the score (KL is not in the reward)
            assert sample["returns"][-1] == pytest.approx(sample["score"], rel=1e-5, abs=1e-6)
            assert sample["advantage"] == pytest.approx(sample["token_advantages"][0])
            tokens += sample["token_advantages"]
    # whitened over the batch's response tokens
    assert np.mean(tokens) == pytest.approx(0.0, abs=1e-5)
    assert np.std(tokens, ddof=1) == pytest.approx(1.0, rel=1e-3)


def test_warm_up_trains_the_critic_alone_then_both_train(ppo_run, toy_model_dir):
    from safetensors.numpy import load_file

    policy0, policy1 = ppo_run / "iter_0000" / "policy", ppo_run / "iter_0001" / "policy"
    metrics = read_metrics(ppo_run)
    assert metrics[0]["actor/warmup"] == 1.0 and metrics[0]["critic/num_optimizer_steps"] > 0
    assert "actor/warmup" not in metrics[1] and metrics[1]["actor/num_optimizer_steps"] > 0
    for m in metrics:
        for name in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var"):
            assert np.isfinite(m[name]), name
        for name in ("critic/returns/mean", "critic/values/mean"):
            assert np.isfinite(m[name]), name
    assert metrics[1]["critic/optimizer_state_restored"] == 1.0
    assert [m["update/policy_lag_max"] for m in metrics] == [0.0, 0.0]  # strict order: no lag
    # the warm-up carried the policy's weights forward; iteration 1 moved them
    initial = load_file(Path(toy_model_dir) / "model.safetensors")
    before = load_file(policy0 / "model.safetensors")
    after = load_file(policy1 / "model.safetensors")
    assert all(np.array_equal(initial[name], before[name]) for name in initial)
    assert any(not np.array_equal(before[name], after[name]) for name in before)
    # the critic is an HF token-classification checkpoint that moved between iterations
    config = json.loads((policy1 / "critic" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForTokenClassification") and len(config["id2label"]) == 1
    critic0 = load_file(policy0 / "critic" / "model.safetensors")
    critic1 = load_file(policy1 / "critic" / "model.safetensors")
    assert any(not np.array_equal(critic0[name], critic1[name]) for name in critic0)
    names = [p["name"] for p in read_manifest(policy1)["trainer_state"]]
    assert any(n.startswith("_trainer_state/critic/") for n in names)
    assert "_trainer_state/trainer_state.json" in names


def test_a_run_killed_in_iteration_1_resumes_to_the_values_and_weights_of_an_uninterrupted_one(
    tmp_path, uninterrupted, probe_dir
):
    path, expected = uninterrupted
    pause = tmp_path / "pause"
    pause.mkdir()
    log = tmp_path / "killed.log"
    process = start_cli(
        "run", path, "--run-id", "killed", log=log, env={PAUSE_ENV: str(pause)}, path_first=[probe_dir, REPO]
    )
    kill_run_when(pause / "reached", process, log=log)  # iteration 1's probe in flight: update 0 is done
    resumed = expected.parent / "killed"
    assert (resumed / "iter_0000" / "policy" / "critic" / "model.safetensors").exists()
    assert not (resumed / "iter_0001" / "values" / "_MANIFEST.json").exists()
    (pause / "go").write_text("")
    cli_ok("run", path, "--run-id", "killed", path_first=[probe_dir, REPO])
    for table in ("values", "advantages"):
        assert read_rows(resumed / "iter_0001" / table) == read_rows(expected / "iter_0001" / table), table
    for weights in ("model.safetensors", "critic/model.safetensors"):
        assert _sha256(resumed / "iter_0001" / "policy" / weights) == _sha256(
            expected / "iter_0001" / "policy" / weights
        )


def test_a_warm_start_continues_the_critic_of_the_run_it_starts_from(tmp_path, uninterrupted, probe_dir):
    import torch

    from batchrl.storage import read_parquet
    from batchrl.trainer.critic import load_critic, response_values
    from batchrl.trainer.data import samples_from_groups

    path, earlier = uninterrupted
    cli_ok(
        "run",
        path,
        "--run-id",
        "nightly",
        "--set",
        f"run.init_from={earlier}",
        "--set",
        "run.iterations=1",
        "--set",
        "critic.warmup_iterations=0",
        "--set",
        "run.new_files_only=false",
        path_first=[probe_dir, REPO],
    )
    run = earlier.parent / "nightly"
    critic = load_critic(str(earlier / "iter_0001" / "policy" / "critic"), seed=0).eval()
    parts = sorted((run / "iter_0000" / "values").glob("part-*.parquet"))
    for part in parts:
        table = read_parquet(str(part))
        with torch.no_grad():
            flat = response_values(critic, samples_from_groups(table), pad_token_id=0, max_tokens=8192)
        stored = [v for group in table.column("values").to_pylist() for sample in group for v in sample]
        np.testing.assert_allclose(stored, flat, rtol=1e-5, atol=1e-6)
    assert read_metrics(run)[0]["critic/optimizer_state_restored"] == 0.0  # weights carry over, moments do not


def test_plan_lists_the_values_stage_and_a_forced_values_stage_redoes_the_same_rows_and_weights(
    tmp_path, uninterrupted, probe_dir
):
    path, run = uninterrupted
    plan = cli_ok("plan", path, path_first=[probe_dir, REPO])
    assert "iter 1 values" in plan.stdout and plan.stdout.count("skip (complete)") == 1 + 2 * 6
    expected = read_rows(run / "iter_0001" / "values")
    critic = _sha256(run / "iter_0001" / "policy" / "critic" / "model.safetensors")
    forced = cli_ok("run", path, "--from-stage", "values", "--iteration", "1", path_first=[probe_dir, REPO])
    assert "ran 3 stage(s)" in forced.stdout  # values, advantage and update of iteration 1
    assert read_rows(run / "iter_0001" / "values") == expected
    assert _sha256(run / "iter_0001" / "policy" / "critic" / "model.safetensors") == critic

"""PPO with a critic in real runs (advantage.estimator gae): the values stage's per-token values, GAE in the
advantage stage, the critic trained in the update's ranks and saved in the policy directory as an HF
token-classification checkpoint with its optimizer state; a critic warm-up carries the policy forward. Tiny
runs: HF engine, gloo update."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from harness import cli_ok, read_manifest, read_metrics, read_rows

pytestmark = pytest.mark.slow

PPO = {
    "run.iterations": 2,
    "advantage.estimator": "gae",
    "advantage.gamma": 1.0,
    "advantage.lam": 0.95,
    "critic.lr": 1.0e-3,
    "critic.warmup_iterations": 1,
}


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, toy_model_dir, toy_prompts_dir) -> Path:
    """One two-iteration PPO run the tests of this module share (iteration 0: critic warm-up)."""
    from harness import write_pipeline

    directory = tmp_path_factory.mktemp("ppo")
    path = write_pipeline(directory, PPO, model=toy_model_dir, prompts=toy_prompts_dir)
    cli_ok("run", path)
    return directory / "runs" / "tiny"


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

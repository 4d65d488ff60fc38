"""`batchrl run` end to end, for real: embedded Ray, a real engine (vLLM when importable), rule rewards,
GRPO advantages and a 2-process FSDP2 update on gloo, locally and over s3:// on a moto server."""

from __future__ import annotations

import numpy as np
import pytest
from harness import cli_ok, num_rows, read_json, read_manifest, read_metrics, read_rows, read_table

from batchrl.engines import vllm_available

pytestmark = pytest.mark.slow

NUM_PROMPTS, SAMPLES, ITERATIONS = 8, 4, 2
E2E = {
    "name": "e2e",
    "run": {"seed": 3, "iterations": ITERATIONS},
    "data.max_prompts": NUM_PROMPTS,
    "generate": {
        "engine": "vllm" if vllm_available() else "hf",
        "num_samples_per_prompt": SAMPLES,
        "max_new_tokens": 12,
        "temperature": 1.0,
    },
    # A random model never answers correctly; a reward that varies within groups makes advantages
    # non-zero, so the update must move the policy. It is a user module:function reward, run in Ray workers.
    "score.rewards": [{"reward": "custom_rewards:digit_count", "weight": 1.0}, {"reward": "gsm8k", "weight": 1.0}],
    "update.num_processes": 2,
}


def check_run(run_dir: str) -> None:
    assert num_rows(f"{run_dir}/prompts") == NUM_PROMPTS
    for iteration in range(ITERATIONS):
        it = f"{run_dir}/iter_{iteration:04d}"
        assert num_rows(f"{it}/rollouts") == NUM_PROMPTS  # one row per prompt group
        assert num_rows(f"{it}/scores") == NUM_PROMPTS
        assert num_rows(f"{it}/advantages") == NUM_PROMPTS * SAMPLES  # one row per sample
        policy = read_manifest(f"{it}/policy")
        assert {p["name"] for p in policy["parts"]} >= {"config.json", "model.safetensors", "tokenizer.json"}
        table = read_table(f"{it}/advantages")
        assert set(table.column("sample_idx").to_pylist()) == set(range(SAMPLES))
        assert all(
            len(t) == len(lp)
            for t, lp in zip(
                table.column("response_token_ids").to_pylist(), table.column("response_logprobs").to_pylist()
            )
        )
        group = read_rows(f"{it}/rollouts")[0]
        assert group["policy_version"] == iteration and len(group["response_texts"]) == SAMPLES
    lines = read_metrics(run_dir)
    assert [m["iteration"] for m in lines] == list(range(ITERATIONS))
    assert all(
        "critic/score/mean" in m and "actor/pg_loss" in m and "timing_s/gen" in m and "perf/throughput" in m
        for m in lines
    )


def load_weights(local_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local_dir, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_local_run_writes_every_stage_and_a_new_policy_per_iteration(tmp_path, pipeline, toy_model_dir):
    path = pipeline(E2E)
    cli_ok("run", path)
    run_dir = str(tmp_path / "runs" / "e2e")
    check_run(run_dir)

    before, after = load_weights(f"{run_dir}/iter_0000/policy"), load_weights(f"{run_dir}/iter_0001/policy")
    assert before.keys() == after.keys()
    assert any(not bool((before[k] == after[k]).all()) for k in before), "iteration 1 did not change the policy"
    initial = load_weights(toy_model_dir)
    assert any(not bool((initial[k] == before[k]).all()) for k in initial), "iteration 0 did not change the policy"

    plan = cli_ok("plan", path)
    assert plan.stdout.count("skip (complete)") == 1 + 4 * ITERATIONS
    again = cli_ok("run", path)
    assert "ran 0 stage(s)" in again.stdout


def test_run_over_s3_reads_prompts_from_and_writes_the_run_to_object_storage(
    tmp_path, pipeline, s3_env, s3_bucket, s3_prompts
):
    # Also the REINFORCE++ recipe with KL folded into the reward: the reference model scores the rollouts in
    # the advantage stage's Ray actors (2 shards) and in the driver's first pass over the batch moments.
    path = pipeline(
        E2E
        | {
            "data.train_files": [s3_prompts],
            "run.root": f"s3://{s3_bucket}/runs",
            "advantage": {"estimator": "reinforce_pp_baseline", "kl_in_reward_coef": 0.05},
        }
    )
    cli_ok("run", path, env=s3_env)
    run_dir = f"s3://{s3_bucket}/runs/e2e"
    check_run(run_dir)
    assert not (tmp_path / "runs").exists()
    for iteration in range(ITERATIONS):
        metrics = read_json(f"{run_dir}/iter_{iteration:04d}/metrics.json")
        assert metrics["actor/reward_kl_penalty_coeff"] == 0.05 and np.isfinite(metrics["actor/reward_kl_penalty"])
        kl = read_table(f"{run_dir}/iter_{iteration:04d}/advantages")
        assert kl.column("reward_kl").null_count == 0

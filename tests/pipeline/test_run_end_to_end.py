"""`batchrl run` end to end, for real: embedded Ray, a real engine (vLLM when importable), rule rewards,
GRPO advantages and a 2-process FSDP2 update on gloo, locally and over s3:// on a moto server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import numpy as np
import yaml

from batchrl.engines import vllm_available
from batchrl.storage import read_parquet, resolve

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS, SAMPLES, ITERATIONS = 8, 4, 2


def pipeline_file(tmp_path: Path, *, toy_model_dir: str, train_files: list[str], root: str, **extra) -> Path:
    raw = {
        "name": "e2e",
        "run": {"root": root, "seed": 3, "iterations": ITERATIONS},
        "model": {"path": toy_model_dir, "dtype": "float32"},
        "data": {"train_files": train_files, "shard_size": 4, "max_prompt_tokens": 96, "max_prompts": NUM_PROMPTS},
        "generate": {"engine": "vllm" if vllm_available() else "hf", "num_samples_per_prompt": SAMPLES,
                     "max_new_tokens": 12, "temperature": 1.0},
        # A random model never answers correctly; a reward that varies within groups makes advantages
        # non-zero, so the update must move the policy. It is a user module:function reward, run in Ray workers.
        "score": {"rewards": [{"reward": "custom_rewards:digit_count", "weight": 1.0},
                              {"reward": "gsm8k", "weight": 1.0}]},
        "update": {"num_processes": 2, "backend": "gloo", "lr": 1e-3, "micro_batch_size": 8},
        "ray": {"num_cpus": 2},
    } | extra
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def batchrl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    pythonpath = os.pathsep.join(filter(None, [str(REPO / "tests" / "stages"), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "batchrl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})}, timeout=900)


def read_json(uri: str) -> dict:
    fs, path = resolve(uri)
    return json.loads(fs.cat_file(path).decode())


def check_run(run_dir: str) -> None:
    prompts = read_json(f"{run_dir}/prompts/_MANIFEST.json")
    assert sum(p["rows"] for p in prompts["parts"]) == NUM_PROMPTS
    for iteration in range(ITERATIONS):
        it = f"{run_dir}/iter_{iteration:04d}"
        rollouts = read_json(f"{it}/rollouts/_MANIFEST.json")
        scores = read_json(f"{it}/scores/_MANIFEST.json")
        advantages = read_json(f"{it}/advantages/_MANIFEST.json")
        policy = read_json(f"{it}/policy/_MANIFEST.json")
        assert sum(p["rows"] for p in rollouts["parts"]) == NUM_PROMPTS  # one row per prompt group
        assert sum(p["rows"] for p in scores["parts"]) == NUM_PROMPTS
        assert sum(p["rows"] for p in advantages["parts"]) == NUM_PROMPTS * SAMPLES  # one row per sample
        assert {p["name"] for p in policy["parts"]} >= {"config.json", "model.safetensors", "tokenizer.json"}
        table = read_parquet(f"{it}/advantages/{advantages['parts'][0]['name']}")
        assert set(table.column("sample_idx").to_pylist()) == set(range(SAMPLES))
        assert all(len(t) == len(lp) for t, lp in zip(table.column("response_token_ids").to_pylist(),
                                                        table.column("response_logprobs").to_pylist()))
        group = read_parquet(f"{it}/rollouts/{rollouts['parts'][0]['name']}").to_pylist()[0]
        assert group["policy_version"] == iteration and len(group["response_texts"]) == SAMPLES
    metrics_fs, metrics_path = resolve(f"{run_dir}/metrics.jsonl")
    lines = [json.loads(line) for line in metrics_fs.cat_file(metrics_path).decode().splitlines()]
    assert [m["iteration"] for m in lines] == list(range(ITERATIONS))
    assert all("critic/score/mean" in m and "actor/pg_loss" in m and "timing_s/gen" in m and "perf/throughput" in m
               for m in lines)


def load_weights(local_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(local_dir, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_local_run_writes_every_stage_and_a_new_policy_per_iteration(tmp_path, toy_model_dir, toy_prompts_dir):
    path = pipeline_file(tmp_path, toy_model_dir=toy_model_dir, train_files=[toy_prompts_dir],
                         root=str(tmp_path / "runs"))
    result = batchrl("run", str(path))
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = str(tmp_path / "runs" / "e2e")
    check_run(run_dir)

    before, after = load_weights(f"{run_dir}/iter_0000/policy"), load_weights(f"{run_dir}/iter_0001/policy")
    assert before.keys() == after.keys()
    assert any(not bool((before[k] == after[k]).all()) for k in before), "iteration 1 did not change the policy"
    initial = load_weights(toy_model_dir)
    assert any(not bool((initial[k] == before[k]).all()) for k in initial), "iteration 0 did not change the policy"

    plan = batchrl("plan", str(path))
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.count("skip (complete)") == 1 + 4 * ITERATIONS
    again = batchrl("run", str(path))
    assert again.returncode == 0, again.stderr[-4000:]
    assert "ran 0 stage(s)" in again.stdout


def test_run_over_s3_reads_prompts_from_and_writes_the_run_to_object_storage(
        tmp_path, toy_model_dir, toy_prompts_dir, s3_env, s3_bucket):
    fs, _ = resolve(f"s3://{s3_bucket}")
    for local in sorted(Path(toy_prompts_dir).glob("*.parquet")):
        fs.put_file(str(local), f"{s3_bucket}/prompts/{local.name}")
    # Also the REINFORCE++ recipe with KL folded into the reward: the reference model scores the rollouts in
    # the advantage stage's Ray actors (2 shards) and in the driver's first pass over the batch moments.
    path = pipeline_file(tmp_path, toy_model_dir=toy_model_dir, train_files=[f"s3://{s3_bucket}/prompts/"],
                         root=f"s3://{s3_bucket}/runs",
                         advantage={"estimator": "reinforce_pp_baseline", "kl_in_reward_coef": 0.05})
    result = batchrl("run", str(path), env=s3_env)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = f"s3://{s3_bucket}/runs/e2e"
    check_run(run_dir)
    assert not (tmp_path / "runs").exists()
    for iteration in range(ITERATIONS):
        metrics = read_json(f"{run_dir}/iter_{iteration:04d}/metrics.json")
        assert metrics["actor/reward_kl_penalty_coeff"] == 0.05 and np.isfinite(metrics["actor/reward_kl_penalty"])
        advantages = read_json(f"{run_dir}/iter_{iteration:04d}/advantages/_MANIFEST.json")
        kl = read_parquet(f"{run_dir}/iter_{iteration:04d}/advantages/{advantages['parts'][0]['name']}")
        assert kl.column("reward_kl").null_count == 0

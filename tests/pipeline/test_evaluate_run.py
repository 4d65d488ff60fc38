"""The runner's evaluate stage end to end: `batchrl run` evaluates the initial policy and each iteration's new
policy on held-out prompts, records val-core metrics per iteration, prints the before/after comparison, and a
changed evaluation config (or --from-stage evaluate) re-evaluates without regenerating or retraining.
Tiny run: HF engine, 8 training prompts x 2 samples, 6 held-out prompts, a 1-process update, 2 iterations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from batchrl_toy import build_arith_prompts

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GREEDY = "val-core/arith/reward/mean@1"


def batchrl(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "batchrl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ), timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def manifest(table_dir: Path) -> dict:
    return json.loads((table_dir / "_MANIFEST.json").read_text())


def test_a_run_evaluates_before_and_after_training_and_reevaluates_without_retraining(
        tmp_path, toy_model_dir, toy_prompts_dir):
    build_arith_prompts(str(tmp_path / "eval"), num_prompts=6, num_shards=1, seed=5, split="eval")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({
        "name": "ev", "run": {"root": str(tmp_path / "runs"), "seed": 2, "iterations": 2},
        "model": {"path": toy_model_dir, "dtype": "float32"},
        "data": {"train_files": [toy_prompts_dir], "shard_size": 4, "max_prompts": 8, "max_prompt_tokens": 96},
        "generate": {"engine": "hf", "num_samples_per_prompt": 2, "max_new_tokens": 6},
        "update": {"num_processes": 1, "backend": "gloo", "lr": 1e-3, "micro_batch_size": 8},
        "evaluate": {"files": [str(tmp_path / "eval")], "num_samples": 4},
        "ray": {"num_cpus": 2}, "tracking": {"backends": ["jsonl"]}}))
    first = batchrl("run", str(path))
    run = tmp_path / "runs" / "ev"

    initial, last = manifest(run / "evaluation"), manifest(run / "iter_0001" / "evaluation")
    table = [row for part in last["parts"]  # held-out prompts are sharded by data.shard_size like training ones
             for row in pq.read_table(run / "iter_0001" / "evaluation" / part["name"]).to_pylist()]
    assert len(last["parts"]) == 2 and len(table) == 6 and all(len(row["sample_scores"]) == 4 for row in table)
    assert all(row["policy"] == str(run / "iter_0001" / "policy") for row in table)  # the trained policy
    assert last["stats"][GREEDY] == pytest.approx(sum(row["greedy_score"] for row in table) / 6)
    assert {"val-core/arith/reward/mean@4", "val-core/arith/reward/pass@4", "val-core/arith/reward/maj@4"} \
        <= set(last["stats"])
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [0, 1]
    assert lines[1][GREEDY] == last["stats"][GREEDY] and "timing_s/eval" in lines[1]
    assert lines[0][f"initial/{GREEDY}"] == initial["stats"][GREEDY]
    assert "held-out evaluation, the initial policy -> iteration 1's policy:" in first.stdout
    assert f"{GREEDY}: {initial['stats'][GREEDY]:.3f} -> {last['stats'][GREEDY]:.3f}" in first.stdout

    policy = manifest(run / "iter_0001" / "policy")
    again = batchrl("run", str(path), "--set", "evaluate.num_samples=2")  # only the evaluations are redone
    assert "ran 3 stage(s)" in again.stdout, again.stdout
    assert manifest(run / "iter_0001" / "policy") == policy
    assert "val-core/arith/reward/mean@2" in manifest(run / "iter_0001" / "evaluation")["stats"]

    forced = batchrl("run", str(path), "--set", "evaluate.num_samples=2", "--from-stage", "evaluate",
                     "--iteration", "1")
    assert "ran 1 stage(s)" in forced.stdout and "iter 1 update: complete" in forced.stderr

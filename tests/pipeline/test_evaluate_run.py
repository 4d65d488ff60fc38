"""The runner's evaluate stage end to end: `batchrl run` evaluates the initial policy and each iteration's new
policy on held-out prompts, records val-core metrics per iteration, prints the before/after comparison, and a
changed evaluation config (or --from-stage evaluate) re-evaluates without regenerating or retraining.
Tiny run: HF engine, 8 training prompts x 2 samples, 6 held-out prompts, a 1-process update, 2 iterations."""

from __future__ import annotations

import pytest
from harness import DEFAULT, cli_ok, read_manifest, read_metrics, read_rows

from batchrl_toy import build_arith_prompts

pytestmark = pytest.mark.slow

GREEDY = "val-core/arith/reward/mean@1"


def test_a_run_evaluates_before_and_after_training_and_reevaluates_without_retraining(tmp_path, pipeline):
    build_arith_prompts(str(tmp_path / "eval"), num_prompts=6, num_shards=1, seed=5, split="eval")
    path = pipeline(
        {
            "name": "ev",
            "run": {"seed": 2, "iterations": 2},
            "generate.max_new_tokens": 6,
            "score": DEFAULT,
            "evaluate": {"files": [str(tmp_path / "eval")], "num_samples": 4},
            "tracking": {"backends": ["jsonl"]},
        }
    )
    first = cli_ok("run", path)
    run = tmp_path / "runs" / "ev"

    initial, last = read_manifest(run / "evaluation"), read_manifest(run / "iter_0001" / "evaluation")
    table = read_rows(
        run / "iter_0001" / "evaluation"
    )  # held-out prompts are sharded by data.shard_size like training ones
    assert len(last["parts"]) == 2 and len(table) == 6 and all(len(row["sample_scores"]) == 4 for row in table)
    assert all(row["policy"] == str(run / "iter_0001" / "policy") for row in table)  # the trained policy
    assert last["stats"][GREEDY] == pytest.approx(sum(row["greedy_score"] for row in table) / 6)
    assert {"val-core/arith/reward/mean@4", "val-core/arith/reward/pass@4", "val-core/arith/reward/maj@4"} <= set(
        last["stats"]
    )
    lines = read_metrics(run)
    assert [m["iteration"] for m in lines] == [0, 1]
    assert lines[1][GREEDY] == last["stats"][GREEDY] and "timing_s/eval" in lines[1]
    assert lines[0][f"initial/{GREEDY}"] == initial["stats"][GREEDY]
    assert "held-out evaluation, the initial policy -> iteration 1's policy:" in first.stdout
    assert f"{GREEDY}: {initial['stats'][GREEDY]:.3f} -> {last['stats'][GREEDY]:.3f}" in first.stdout

    policy = read_manifest(run / "iter_0001" / "policy")
    again = cli_ok("run", path, sets=["evaluate.num_samples=2"])  # only the evaluations are redone
    assert "ran 3 stage(s)" in again.stdout, again.stdout
    assert read_manifest(run / "iter_0001" / "policy") == policy
    assert "val-core/arith/reward/mean@2" in read_manifest(run / "iter_0001" / "evaluation")["stats"]

    forced = cli_ok("run", path, "--from-stage", "evaluate", "--iteration", "1", sets=["evaluate.num_samples=2"])
    assert "ran 1 stage(s)" in forced.stdout and "iter 1 update: complete" in forced.stderr

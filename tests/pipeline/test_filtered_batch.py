"""A batch that dynamic sampling filters out entirely (every group's rewards equal): the update has nothing to
train on. The run goes on; each such iteration carries its input policy and optimizer state forward unchanged,
so the next real update continues as if the empty one had not happened, and the metrics say so. Tiny runs: the
HF engine, 4 prompts x 2 samples, a 1-process update."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from harness import cli_ok, read_metrics

MARKER_ENV = "BATCHRL_TEST_EQUAL_REWARDS_MARKER"


def equal_once_marked(response, ground_truth, *, sample_idx, **row):
    """A reward (test_filtered_batch:equal_once_marked): the sample index, so groups differ, until the marker
    file exists; then 1.0 for every sample, so dynamic sampling drops every group."""
    marker = os.environ.get(MARKER_ENV)
    return 1.0 if marker and os.path.exists(marker) else float(sample_idx)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): sha256(p) for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_fully_filtered_batch_carries_the_policy_and_optimizer_state_forward(tmp_path, pipeline, toy_model_dir):
    path = pipeline(
        {
            "name": "filtered",
            "run.seed": 1,
            "data.max_prompts": 4,
            "generate.max_new_tokens": 4,
            "score.rewards": [{"reward": "test_filtered_batch:equal_once_marked", "weight": 1.0}],
            "advantage": {"filter_groups": True},
        }
    )
    marker = tmp_path / "equal-rewards"
    run = tmp_path / "runs" / "filtered"

    cli_ok("run", path, env={MARKER_ENV: str(marker)})  # iteration 0: rewards differ within groups, a real update
    trained = run / "iter_0000" / "policy"
    assert sha256(trained / "model.safetensors") != sha256(Path(toy_model_dir) / "model.safetensors")
    state = digests(trained / "_trainer_state")
    assert "trainer_state.json" in state

    marker.touch()  # from now on every group's rewards are equal: dynamic sampling drops them all
    extended = cli_ok("run", path, sets=["run.iterations=3"], env={MARKER_ENV: str(marker)})
    assert "no update, the policy is carried forward unchanged" in extended.stderr

    lines = read_metrics(run)
    assert [m["iteration"] for m in lines] == [0, 1, 2]
    assert "actor/update_skipped" not in lines[0] and lines[0]["actor/num_optimizer_steps"] > 0
    for metrics in lines[1:]:
        assert metrics["critic/groups_filtered"] == 4
        assert metrics["actor/update_skipped"] == 1.0 and metrics["actor/num_optimizer_steps"] == 0
    for iteration in (1, 2):
        policy = run / f"iter_{iteration:04d}" / "policy"
        assert sha256(policy / "model.safetensors") == sha256(trained / "model.safetensors")
        assert (policy / "tokenizer.json").exists() and (policy / "_MANIFEST.json").exists()
    # the optimizer state travels with the policy (iteration 0's own was pruned by keep-last-1 meanwhile)
    assert digests(run / "iter_0002" / "policy" / "_trainer_state") == state

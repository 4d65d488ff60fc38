"""RL from a reward model alone on prompts that have no labels (issue 14, label-free prompts): ingest keeps them,
the tiny local reward model scores every sample, and the update trains on its scores; the held-out evaluation
scores with the same reward model (its own pool of reward-model actors)."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness import cli_ok, read_manifest, read_rows

from batchrl_toy import build_toy_reward_model

pytestmark = pytest.mark.slow


def test_a_reward_model_alone_trains_on_prompts_without_labels(tmp_path, pipeline, toy_prompts_dir):
    first = sorted(Path(toy_prompts_dir).glob("*.parquet"))[0]
    table = pq.read_table(first).drop_columns(["ground_truth"])
    table = table.set_column(table.column_names.index("data_source"), "data_source", [["chat"] * table.num_rows])
    prompts = tmp_path / "unlabelled.parquet"
    pq.write_table(table, prompts)
    reward_model = build_toy_reward_model(tmp_path / "rm", hidden_size=32, num_layers=1)
    path = pipeline(
        {
            "data.train_files": [str(prompts)],
            # no rule reward (and no default reward exists for data_source "chat"): the reward model alone
            "score": {"rewards": [], "reward_model": {"path": reward_model, "batch_size": 4}},
            "evaluate": {"files": [str(prompts)], "max_prompts": 3, "num_samples": 2, "before_training": False},
        }
    )
    cli_ok("run", path)
    run = tmp_path / "runs" / "tiny"
    manifest = read_manifest(run / "prompts")
    assert manifest["counts"]["prompts"] == 8 and manifest["counts"]["rejected"] == 0
    assert all(row["ground_truth"] is None for row in read_rows(run / "prompts"))
    scores = read_rows(run / "iter_0000" / "scores")
    assert {tuple(row["reward_names"]) for row in scores} == {("reward_model",)}
    values = [s for row in scores for s in row["scores"]]
    assert len(values) == 16 and all(math.isfinite(v) for v in values) and len(set(values)) > 1
    assert {p["name"] for p in read_manifest(run / "iter_0000" / "policy")["parts"]} >= {"model.safetensors"}
    evaluated = read_rows(run / "iter_0000" / "evaluation")
    assert len(evaluated) == 3 and all(row["policy"] == str(run / "iter_0000" / "policy") for row in evaluated)
    held_out = [row["greedy_score"] for row in evaluated] + [s for row in evaluated for s in row["sample_scores"]]
    assert len(held_out) == 9 and all(math.isfinite(s) for s in held_out) and len(set(held_out)) > 1

"""Two prompt sources mixed 3:1 in a real run (data.sources): every iteration's rollouts hold 3 prompts of one and 1
of the other, exactly the batch the pure function gives from the prompts manifest, and the prompt-statistics table
counts what was sampled, cumulatively, with per-source metrics. The hard source scores with its own reward term, and
each source has its own held-out set, evaluated after the last iteration with val-source/<source>/* metrics."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from harness import DEFAULT, cli_ok, read_manifest, read_metrics, read_rows, write_pipeline

from batchrl.algorithms.mixing import mixed_batch

pytestmark = pytest.mark.slow

ITERATIONS = 2
HARD_TERM = {"reward": "custom_rewards:length_bonus", "weight": 0.5, "name": "length"}  # easy: digit_count, as tiny's


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_model_dir, toy_prompts_dir) -> Path:
    tmp_path = tmp_path_factory.mktemp("sources")
    # 8 prompts of each of the toy's first two files: 16 in all, ingested in the driver (shard_size 16)
    files, eval_files = [], []
    for index, part in enumerate(sorted(Path(toy_prompts_dir).glob("*.parquet"))[:2]):
        files.append(str(tmp_path / f"source{index}.parquet"))
        pq.write_table(pq.read_table(part).slice(0, 8), files[-1])
        eval_files.append(str(tmp_path / f"eval{index}.parquet"))  # 4 other prompts of the file, held out
        pq.write_table(pq.read_table(part).slice(8, 4), eval_files[-1])
    sources = [
        {"name": "easy", "files": [files[0]], "weight": 3, "eval_files": [eval_files[0]]},
        {"name": "hard", "files": [files[1]], "weight": 1, "eval_files": [eval_files[1]], "rewards": [HARD_TERM]},
    ]
    overrides = {
        "name": "sources",
        "data.train_files": DEFAULT,
        "data.max_prompts": DEFAULT,  # the first N prompts of the input would all be the first source's
        "data.shard_size": 16,
        "data.sources": sources,
        "data.prompts_per_iteration": 4,
        "run.iterations": ITERATIONS,
        # no evaluate.files: the sources' eval_files alone, evaluated once, after the last iteration
        "evaluate": {"num_samples": 2, "max_new_tokens": 4, "before_training": False, "every": ITERATIONS},
    }
    path = write_pipeline(tmp_path, overrides, model=toy_model_dir, prompts=toy_prompts_dir)
    cli_ok("run", path)
    return tmp_path / "runs" / "sources"


def test_each_iteration_rolls_out_the_sources_in_their_counts_as_the_pure_function_says(run):
    manifest = read_manifest(run / "prompts")
    parts = [(p["name"], p["rows"]) for p in manifest["parts"]]
    for iteration in range(ITERATIONS):
        rollouts = read_rows(run / f"iter_{iteration:04d}" / "rollouts")
        assert Counter(row["source"] for row in rollouts) == {"easy": 3, "hard": 1}
        batch = mixed_batch(parts, counts={"easy": 3, "hard": 1}, seed=5, iteration=iteration)
        expected = set()
        for piece in batch.slices:
            ids = pq.read_table(run / "prompts" / piece.part, columns=["prompt_id"]).column("prompt_id").to_pylist()
            expected |= {ids[row] for row in piece.row_indices()}
        assert {row["prompt_id"] for row in rollouts} == expected
    plan = cli_ok("plan", run.parent.parent / "pipeline.yaml").stdout  # lists each batch's parts, by source
    listed = re.findall(r"^    iter (\d) \(epoch 0, batch \d+ of \d+\): (.*)$", plan, re.M)
    assert [int(i) for i, _ in listed] == list(range(ITERATIONS)), plan
    assert all("easy/part-" in where and "hard/part-" in where for _, where in listed)


def test_the_prompt_statistics_table_counts_every_prompt_sampled_so_far_with_per_source_metrics(run):
    sampled = [{row["prompt_id"] for row in read_rows(run / f"iter_{i:04d}" / "rollouts")} for i in range(ITERATIONS)]
    stats = {row["prompt_id"]: row for row in read_rows(run / f"iter_{ITERATIONS - 1:04d}" / "prompt_stats")}
    assert set(stats) == sampled[0] | sampled[1]
    for prompt_id, row in stats.items():
        assert row["times_sampled"] == sum(prompt_id in ids for ids in sampled)
        assert row["samples"] == 2 * row["times_sampled"]  # 2 samples per prompt
        assert row["last_iteration"] == max(i for i, ids in enumerate(sampled) if prompt_id in ids)
    metrics = read_metrics(run)
    assert len(metrics) == ITERATIONS
    for line in metrics:
        assert {"score/reward_mean/easy", "score/reward_mean/hard", "data/zero_advantage_groups"} <= set(line)
        assert line["data/prompts/easy"] == 3 and line["data/prompts/hard"] == 1


def test_each_sources_rows_are_scored_by_its_own_terms_and_its_held_out_set_is_reported_per_source(run):
    for iteration in range(ITERATIONS):
        scores = read_rows(run / f"iter_{iteration:04d}" / "scores")
        names = {row["source"]: row["reward_names"] for row in scores}
        assert names == {"easy": ["digit_count"], "hard": ["length"]}
        for row in scores:
            if row["source"] == "hard":  # length_bonus: len(response) / 10, weighed 0.5
                assert row["scores"] == pytest.approx([0.05 * len(r) for r in row["response_texts"]], abs=1e-6)
    metrics = read_metrics(run)
    assert all({"critic/rewards/digit_count/mean", "critic/rewards/length/mean"} <= set(line) for line in metrics)
    evaluation = read_rows(run / f"iter_{ITERATIONS - 1:04d}" / "evaluation")
    assert Counter(row["source"] for row in evaluation) == {"easy": 4, "hard": 4}
    last = metrics[-1]
    for source in ("easy", "hard"):
        greedy = [row["greedy_score"] for row in evaluation if row["source"] == source]
        assert last[f"val-source/{source}/reward/mean@1"] == pytest.approx(sum(greedy) / len(greedy), abs=1e-6)
        assert {f"val-source/{source}/reward/{m}" for m in ("mean@2", "pass@2", "maj@2")} <= set(last)
        assert last[f"val-source-aux/{source}/num_prompts"] == 4
    assert any(name.startswith("val-core/") for name in last)  # per data_source, over every held-out row
    assert not [name for line in metrics[:-1] for name in line if name.startswith("val-")]  # evaluated once

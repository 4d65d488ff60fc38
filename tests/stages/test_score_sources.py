"""The score stage with data.sources' own reward terms: a rollouts part mixing sources is scored row by row with its
source's terms (and the rest with score.rewards), in the part's row order, with the stage's per-component metrics
over the samples that have each component."""

from __future__ import annotations

import pyarrow as pa
import pytest
from test_score_components import rollouts, run_score_stage

from batchrl.config import validate_dict
from batchrl.storage import read_parquet


def with_sources(table: pa.Table, sources: list[str | None]) -> pa.Table:
    return table.set_column(table.schema.get_field_index("source"), "source", pa.array(sources, pa.string()))


def test_a_part_mixing_sources_is_scored_by_each_sources_own_terms_in_row_order(tmp_path):
    chat_terms = [{"reward": "format_hash", "name": "fmt", "weight": 2.0}]
    cfg = validate_dict(
        {
            "name": "mix",
            "run": {"root": str(tmp_path / "runs")},
            "model": {"path": "toy"},
            "data": {
                "sources": [
                    {"name": "math", "files": ["m.parquet"], "count": 2},
                    {"name": "chat", "files": ["c.parquet"], "count": 1, "rewards": chat_terms},
                ],
                "prompts_per_iteration": 3,
            },
            "score": {"rewards": [{"reward": "gsm8k"}], "timeout_s": 60.0},
        }
    )
    groups = [
        {"prompt_id": "m0", "truth": "7", "responses": ["#### 7", "#### 1"]},
        {"prompt_id": "c0", "truth": "x", "responses": ["a\n#### 1", "no"]},
        {"prompt_id": "m1", "truth": "2", "responses": ["#### 2", "#### 2"]},
    ]
    table = with_sources(rollouts(groups), ["math", "chat", "math"])
    # a lone CPU shard on the embedded Ray: scored in this process, each reward set's child process under it
    output, out_dir = run_score_stage(cfg, [table], tmp_path, embedded_ray=True)
    rows = read_parquet(f"{out_dir}/part-00000.parquet").to_pylist()
    assert [(r["prompt_id"], r["source"]) for r in rows] == [("m0", "math"), ("c0", "chat"), ("m1", "math")]
    assert [r["reward_names"] for r in rows] == [["gsm8k"], ["fmt"], ["gsm8k"]]
    assert [r["reward_weights"] for r in rows] == [[1.0], [2.0], [1.0]]
    assert [r["scores"] for r in rows] == [[1.0, 0.0], [2.0, 0.0], [1.0, 1.0]]
    assert output.stats["critic/rewards/gsm8k/mean"] == pytest.approx(3 / 4)
    assert output.stats["critic/rewards/fmt/mean"] == pytest.approx(1 / 2)
    assert output.stats["critic/score/mean"] == pytest.approx(5 / 6)
    assert output.counts["num_samples"] == 6 and output.counts["failed_samples"] == 0

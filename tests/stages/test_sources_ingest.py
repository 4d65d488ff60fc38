"""ingest with data.sources: each source's rows carry its name and go into parts of their own under its directory,
so a mixed batch reads the proportions from the manifest alone; without sources the table is as before."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_ingest import make_ctx, tokenizer_dir  # noqa: F401  (a fixture)

from batchrl.algorithms.mixing import mixed_batch, source_of_part
from batchrl.config import ConfigError
from batchrl.errors import DataError
from batchrl.stages.ingest import IngestStage
from batchrl.storage import read_parquet


def prompts_file(path, prefix: str, count: int):
    rows = [
        {"prompt_id": f"{prefix}{i}", "data_source": "arith", "prompt": f"What is {i} + 1?", "ground_truth": str(i + 1)}
        for i in range(count)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def ingest(tmp_path, tokenizer_dir, files: list[str], data: dict):
    """ingest run in this process (shard_size 8: the inputs' few rows in all), after its checks."""
    ctx = make_ctx(tmp_path, tokenizer_dir, files, shard_size=8, **data)
    IngestStage().check_inputs(ctx.cfg)
    return ctx, IngestStage().run(ctx)


def test_each_sources_rows_carry_its_name_in_parts_under_its_directory(tmp_path, tokenizer_dir):
    easy, hard = prompts_file(tmp_path / "easy.parquet", "e", 5), prompts_file(tmp_path / "hard.parquet", "h", 3)
    sources = [{"name": "easy", "files": [easy], "weight": 3}, {"name": "hard", "files": [hard], "weight": 1}]
    # train_files as the sources make it (the list a run.yaml holds beside them)
    ctx, out = ingest(tmp_path, tokenizer_dir, [easy, hard], {"sources": sources, "prompts_per_iteration": 4})
    assert [(p.name, p.rows) for p in out.parts] == [("easy/part-00000.parquet", 5), ("hard/part-00001.parquet", 3)]
    for part in out.parts:
        rows = read_parquet(f"{ctx.output_dir}/{part.name}").to_pylist()
        assert {row["source"] for row in rows} == {source_of_part(part.name)}
        assert {row["prompt_id"][0] for row in rows} == {source_of_part(part.name)[0]}
    batch = mixed_batch([(p.name, p.rows) for p in out.parts], counts=ctx.cfg.data.source_counts(), seed=0, iteration=0)
    assert Counter(source_of_part(s.part) for s in batch.slices for _ in s.row_indices()) == {"easy": 3, "hard": 1}


def test_without_sources_parts_are_unprefixed_and_the_source_column_is_null(tmp_path, tokenizer_dir):
    ctx, out = ingest(tmp_path, tokenizer_dir, [prompts_file(tmp_path / "a.parquet", "a", 3)], {})
    assert [p.name for p in out.parts] == ["part-00000.parquet"]
    assert read_parquet(f"{ctx.output_dir}/part-00000.parquet").column("source").to_pylist() == [None] * 3


def test_a_file_in_two_sources_is_a_config_error_naming_the_field(tmp_path, tokenizer_dir):
    both = prompts_file(tmp_path / "a.parquet", "a", 3)
    sources = [{"name": "x", "files": [both], "count": 1}, {"name": "y", "files": [str(tmp_path)], "count": 1}]
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.files: .*a\.parquet is in sources 'x' and 'y'"):
        ingest(tmp_path, tokenizer_dir, [both, str(tmp_path)], {"sources": sources})


def test_a_missing_file_of_a_source_is_a_config_error_naming_that_source(tmp_path, tokenizer_dir):
    sources = [{"name": "x", "files": [str(tmp_path / "gone.parquet")], "count": 1}]
    with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.files"):
        ingest(tmp_path, tokenizer_dir, [str(tmp_path / "gone.parquet")], {"sources": sources})


def test_a_sources_own_label_free_rewards_let_its_rows_come_without_labels_or_a_rewarded_data_source(
    tmp_path, tokenizer_dir
):
    """score.rewards is empty (each data_source's default reward, which needs a label), and the chat source scores
    with its own format_hash, which needs none: its file needs neither a ground_truth column nor a data_source with a
    default reward, none of its rows is rejected, and the score stage's preflight asks a reward of arith only."""
    from batchrl.stages.score import ScoreStage
    from batchrl.stages.score_sources import data_sources_scored_as_before
    from batchrl.storage.manifest import Manifest

    math = prompts_file(tmp_path / "math.parquet", "m", 3)
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"data_source": "chat", "prompt": f"Say hi {i}"} for i in range(4)]), chat)
    sources = [
        {"name": "math", "files": [math], "count": 1},
        {"name": "chat", "files": [str(chat)], "count": 1, "rewards": [{"reward": "format_hash"}]},
    ]
    ctx, out = ingest(tmp_path, tokenizer_dir, [math, str(chat)], {"sources": sources, "prompts_per_iteration": 2})
    assert out.counts["prompts"] == 7 and out.counts["rejected"] == 0
    assert out.counts["source_data_source/chat/chat"] == 4 and out.counts["source_data_source/math/arith"] == 3
    assert data_sources_scored_as_before(ctx.cfg, out.counts) == ["arith"]
    manifest = Manifest("ingest", "prompts", None, "x", out.parts, "prompts", 0.0, 1.0, out.counts)
    ScoreStage().preflight(ctx.cfg, tables={"prompts": manifest})  # no "no reward for data_source 'chat'"
    without = [dict(s, rewards=None) if s["name"] == "chat" else s for s in sources]
    with pytest.raises(DataError, match="no 'ground_truth'"):  # the same file, scored by the defaults: it needs labels
        ingest(tmp_path / "again", tokenizer_dir, [math, str(chat)], {"sources": without, "prompts_per_iteration": 2})

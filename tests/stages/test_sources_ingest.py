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

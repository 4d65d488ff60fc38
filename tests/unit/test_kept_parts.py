"""A resumed sharded stage keeps only parts that are its own output; anything else under a part name is redone."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from batchrl.pipeline.shards import pending_shards
from batchrl.storage import write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo
from batchrl.storage.schemas import load_schema


def prompts_part(prompt_ids: list[str]) -> pa.Table:
    schema = load_schema("prompts")
    columns = {}
    for f in schema:
        if f.name == "prompt_id":
            columns[f.name] = prompt_ids
        elif pa.types.is_list(f.type):
            columns[f.name] = [[1, 2]] * len(prompt_ids)
        elif pa.types.is_string(f.type):
            columns[f.name] = ["x"] * len(prompt_ids)
        else:
            columns[f.name] = [0] * len(prompt_ids)
    return pa.table(columns).cast(schema)


def stage_dirs(tmp_path):
    """An input table of two shards (part k holds prompts pk-0, pk-1) and an output dir of the same stage
    (prompts -> prompts: an identity stage is enough to test what a resume keeps)."""
    input_dir, output_dir = tmp_path / "in", tmp_path / "out"
    parts = []
    for k in range(2):
        name = f"part-{k:05d}.parquet"
        size, digest = write_parquet_atomic(prompts_part([f"p{k}-0", f"p{k}-1"]), str(input_dir / name))
        parts.append(PartInfo(name=name, rows=2, sha256=digest, num_bytes=size))
    manifest = Manifest(
        stage="x",
        table="in",
        iteration=None,
        fingerprint="f",
        parts=parts,
        schema="prompts",
        started_at=0.0,
        finished_at=0.0,
    )
    output_dir.mkdir()
    return input_dir, output_dir, manifest


def pending(input_dir, output_dir, manifest):
    return pending_shards(
        input_dir=str(input_dir),
        input_manifest=manifest,
        output_dir=str(output_dir),
        schema="prompts",
        summarize=lambda table: {"rows": table.num_rows},
    )


def test_a_part_of_this_stage_is_kept_with_its_counts_and_the_missing_shard_is_a_job(tmp_path):
    input_dir, output_dir, manifest = stage_dirs(tmp_path)
    write_parquet_atomic(prompts_part(["p0-0"]), str(output_dir / "part-00000.parquet"))  # a filtered subset is ours
    parts, counts, jobs = pending(input_dir, output_dir, manifest)
    assert list(parts) == ["part-00000.parquet"] and parts["part-00000.parquet"].rows == 1
    assert counts == {"rows": 1}
    assert [job["name"] for job in jobs] == ["part-00001.parquet"]


def test_a_foreign_parquet_file_under_a_part_name_is_removed_and_its_shard_redone(tmp_path, caplog):
    input_dir, output_dir, manifest = stage_dirs(tmp_path)
    pq.write_table(pa.table({"question": ["what?"], "answer": [19.0]}), output_dir / "part-00000.parquet")
    parts, _, jobs = pending(input_dir, output_dir, manifest)
    assert parts == {}
    assert [job["name"] for job in jobs] == ["part-00000.parquet", "part-00001.parquet"]
    assert not (output_dir / "part-00000.parquet").exists()
    assert "part-00000.parquet is not this stage's output" in caplog.text and "missing" in caplog.text


def test_a_part_with_the_right_columns_but_another_shards_prompts_is_redone(tmp_path, caplog):
    input_dir, output_dir, manifest = stage_dirs(tmp_path)
    write_parquet_atomic(prompts_part(["p1-0", "p1-1"]), str(output_dir / "part-00000.parquet"))
    parts, _, jobs = pending(input_dir, output_dir, manifest)
    assert parts == {} and len(jobs) == 2
    assert "2 of its prompt ids are not in its input shard" in caplog.text


def test_a_part_that_is_not_parquet_at_all_is_redone(tmp_path, caplog):
    input_dir, output_dir, manifest = stage_dirs(tmp_path)
    (output_dir / "part-00001.parquet").write_text("prompt_id,prompt\np1-0,hello\n")
    parts, _, jobs = pending(input_dir, output_dir, manifest)
    assert parts == {} and len(jobs) == 2
    assert "unreadable" in caplog.text

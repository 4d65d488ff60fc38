"""ingest of streamed chunks (issue 35): a gzipped JSON Lines file and a Parquet row group too big to read whole are
read once, front to back, in windows that the actor pool tokenizes as they come; the table has the rows, ids and
order the same records give from a plain file or small row groups."""

from __future__ import annotations

import gzip
import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_ingest_chunks import make_ctx, prompt, rejects, table_rows, tokenizer_dir  # noqa: F401 (a fixture)

from batchrl.stages import ingest as ingest_module
from batchrl.stages.ingest import IngestStage
from batchrl.storage import inputs as inputs_module

SHARD = 4


@pytest.fixture(autouse=True)
def windows_of_one_part(monkeypatch):
    """Windows of data.shard_size records, and no file small enough for the driver: every window is a pool job."""
    monkeypatch.setattr(ingest_module, "MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(ingest_module, "GZ_IN_DRIVER_BYTES", 0)


def compared(rows: list[dict]) -> list[tuple]:
    return [(r["prompt_id"], r["source_row"], r["prompt_text"], r["prompt_token_ids"]) for r in rows]


def test_a_gzipped_file_and_a_big_row_group_become_a_part_per_window_with_the_rows_and_ids_of_plain_inputs(
    tmp_path, tokenizer_dir, ray_session, monkeypatch
):
    """Streamed on the actor pool: a .jsonl.gz of 50 records and a Parquet row group of 30 (over SPLIT_ROWS, 8
    here), in windows of 4; against the same records from a plain .jsonl and 4-row groups, run in the driver."""
    monkeypatch.setattr(inputs_module, "SPLIT_ROWS", 8)
    records = [prompt(i) for i in range(50)]
    records[30] = prompt(3, prompt="A later occurrence of p3")  # a duplicate in another window than its first
    del records[7]["prompt_id"]  # an id from the line's offset in the decompressed text
    text = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "plain").mkdir()
    (tmp_path / "streamed").mkdir()
    plain, gzipped = tmp_path / "plain" / "p.jsonl", tmp_path / "streamed" / "p.jsonl.gz"
    plain.write_text(text)
    gzipped.write_bytes(gzip.compress(text.encode()))
    rows = pa.Table.from_pylist([prompt(100 + i) for i in range(30)])
    one_group, small_groups = tmp_path / "streamed" / "a.parquet", tmp_path / "plain" / "a.parquet"
    pq.write_table(rows, one_group, row_group_size=30)
    pq.write_table(rows, small_groups, row_group_size=4)

    ctx = make_ctx(tmp_path / "a", tokenizer_dir, [gzipped, one_group], shard_size=SHARD)
    streamed = IngestStage().run(ctx)
    monkeypatch.setattr(ingest_module.ChunkedIngest, "_in_driver", lambda self, num_chunks, rows: True)
    whole = IngestStage().run(
        ctx_plain := make_ctx(tmp_path / "b", tokenizer_dir, [plain, small_groups], shard_size=SHARD)
    )
    # one part per window (the gzipped file's ceil(50 / 4), the row group's ceil(30 / 4)); the rewritten one has 3 rows
    assert len(streamed.parts) == math.ceil(50 / SHARD) + math.ceil(30 / SHARD)
    assert [p.rows for p in streamed.parts] == [4] * 7 + [3] + [4] * 4 + [2] + [4] * 7 + [2]
    assert [p.name for p in streamed.parts[:2]] == ["part-00000.parquet", "part-00000-w000001-0000.parquet"]
    assert compared(table_rows(ctx, streamed)) == compared(table_rows(ctx_plain, whole))
    offset = sum(len(json.dumps(r)) + 1 for r in records[:7])  # of line 8 in the decompressed text
    assert table_rows(ctx, streamed)[7]["prompt_id"] == f"p-{offset}"
    assert rejects(ctx, streamed) == [("p.jsonl.gz",) + r[1:] for r in rejects(ctx_plain, whole)]
    assert [reason for _, _, reason, _ in rejects(ctx, streamed)] == ["duplicate_prompt_id"]
    assert streamed.counts == whole.counts


def test_a_gzipped_file_cut_short_is_a_window_naming_it_not_a_traceback(tmp_path):
    """The reader task yields the DataError's message as a window: the worker that takes it returns it as the job's
    error, which the driver raises (raised in the task, it would reach the user wrapped in Ray's traceback)."""
    from batchrl.stages.ingest_worker import stream_windows
    from batchrl.storage.inputs import describe_inputs, plan_chunks

    path = tmp_path / "p.jsonl.gz"
    whole = gzip.compress("".join(json.dumps(prompt(i)) + "\n" for i in range(2_000)).encode())
    path.write_bytes(whole)
    (chunk,) = plan_chunks(describe_inputs([str(path)]), rows_per_chunk=100)
    path.write_bytes(whole[: len(whole) // 2])
    windows = list(stream_windows(chunk.to_json(), 100))
    assert all(isinstance(w, list) for w in windows[:-1])
    assert (
        windows[-1]
        == f"{path}: bytes 0.. cannot be read (Compressed file ended before the end-of-stream marker was reached)"
    )

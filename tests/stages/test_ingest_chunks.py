"""ingest as a distributed, resumable stage: chunks on an actor pool, JSON Lines input, duplicates and
data.max_prompts across chunks, and an interrupted ingest that redoes only its unfinished chunks."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrl.config import validate_dict
from batchrl.errors import DataError
from batchrl.pipeline.stage import StageContext
from batchrl.stages import ingest as ingest_module
from batchrl.stages.ingest import IngestStage
from batchrl.storage import RunLayout, read_parquet
from batchrl.storage.journal import Journal, record
from batchrl_toy import build_toy_tokenizer


@pytest.fixture(autouse=True)
def chunks_of_single_row_groups(monkeypatch):
    """Chunks as small as the row groups (and data.shard_size) allow, so that a few rows make several chunks."""
    monkeypatch.setattr(ingest_module, "MIN_CHUNK_ROWS", 1)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_toy_tokenizer(path)
    return str(path)


def make_ctx(root, tokenizer_dir, files, **data) -> StageContext:
    cfg = validate_dict(
        {"name": "t", "model": {"path": tokenizer_dir}, "data": {"train_files": [str(f) for f in files], **data}}
    )
    layout = RunLayout.for_run(str(root), "t")
    return StageContext(
        cfg=cfg,
        layout=layout,
        iteration=None,
        output_dir=layout.table_dir("prompts", None),
        fingerprint="x",
        inputs={},
        input_dirs={},
        policy_in=tokenizer_dir,
        embedded_ray=True,
    )


def prompt(i: int, **fields) -> dict:
    return {
        "prompt_id": f"p{i}",
        "data_source": "arith",
        "prompt": f"What is {i} + 1?",
        "ground_truth": str(i + 1),
    } | fields


def write_parquet(path, rows, *, row_group_size: int = 4):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def table_rows(ctx, out) -> list[dict]:
    return [row for part in out.parts for row in read_parquet(f"{ctx.output_dir}/{part.name}").to_pylist()]


def rejects(ctx, out) -> list[tuple[str, int, str, str]]:
    rows = [r for p in out.extra_parts["rejects"] for r in read_parquet(f"{ctx.output_dir}/{p.name}").to_pylist()]
    return [(r["source_file"].rsplit("/", 1)[-1], r["source_row"], r["reason"], r["detail"]) for r in rows]


def digests(ctx, out) -> dict[str, str]:
    return {p.name: p.sha256 for p in out.parts + out.extra_parts["rejects"]}


def test_chunks_on_the_actor_pool_keep_input_order_and_reject_later_duplicates_across_chunks(
    tmp_path, tokenizer_dir, ray_session
):
    first = write_parquet(tmp_path / "a.parquet", [prompt(i) for i in range(6)])
    second = write_parquet(
        tmp_path / "b.parquet",
        [prompt(6), prompt(2, prompt="A repeated id"), prompt(7, prompt=""), prompt(8), prompt(6)],
    )
    ctx = make_ctx(tmp_path / "runs", tokenizer_dir, [first, second], shard_size=3)
    out = IngestStage().run(ctx)
    rows = table_rows(ctx, out)
    assert [r["prompt_id"] for r in rows] == ["p0", "p1", "p2", "p3", "p4", "p5", "p6", "p8"]
    assert rows[2]["prompt_text"].count("What is 2 + 1?") == 1  # the first occurrence is the one kept
    # chunks (row groups of 4): a.parquet rows 0-3 (parts 0 and 1 reserved), 4-5 (part 2); b.parquet rows 0-3
    # (parts 3 and 4: 3 valid rows, one a duplicate removed after), 4 (part 5: its one row a duplicate)
    assert [(p.name, p.rows) for p in out.parts] == [
        ("part-00000.parquet", 3),
        ("part-00001.parquet", 1),
        ("part-00002.parquet", 2),
        ("part-00003.parquet", 2),
    ]
    assert rejects(ctx, out) == [
        ("b.parquet", 1, "duplicate_prompt_id", "prompt_id 'p2' seen before"),
        ("b.parquet", 2, "empty_prompt", "prompt is empty or blank"),
        ("b.parquet", 4, "duplicate_prompt_id", "prompt_id 'p6' seen before"),
    ]
    assert out.counts == {
        "prompts": 8,
        "rejected": 3,
        "rejected/duplicate_prompt_id": 2,
        "rejected/empty_prompt": 1,
        "data_source/arith": 8,
        "truncated_prompts": 0,
    }
    assert sorted(p.name for p in (tmp_path / "runs" / "t" / "prompts").glob("part-*")) == [p.name for p in out.parts]


def test_max_prompts_keeps_the_first_valid_prompts_in_input_order_and_the_rejects_read_before_them(
    tmp_path, tokenizer_dir, ray_session
):
    rows = [prompt(i, prompt="" if i % 3 == 1 else f"What is {i}?") for i in range(12)]
    rows[8] = prompt(0)  # a duplicate of the first prompt, before the cut
    path = write_parquet(tmp_path / "a.parquet", rows, row_group_size=2)
    ctx = make_ctx(tmp_path / "runs", tokenizer_dir, [path], shard_size=2, max_prompts=5)
    out = IngestStage().run(ctx)
    assert [r["prompt_id"] for r in table_rows(ctx, out)] == ["p0", "p2", "p3", "p5", "p6"]
    assert [(row, reason) for _, row, reason, _ in rejects(ctx, out)] == [(1, "empty_prompt"), (4, "empty_prompt")]
    assert out.counts["prompts"] == 5 and out.counts["rejected"] == 2
    assert "rejected/duplicate_prompt_id" not in out.counts  # row 8 comes after the 5th valid prompt (row 6)
    unlimited = IngestStage().run(make_ctx(tmp_path / "all", tokenizer_dir, [path], shard_size=2))
    assert unlimited.counts["rejected/duplicate_prompt_id"] == 1 and unlimited.counts["prompts"] == 7


def test_jsonl_input_gives_the_prompts_parquet_input_gives_and_rejects_lines_that_are_not_objects(
    tmp_path, tokenizer_dir
):
    records = [prompt(i) for i in range(3)] + [{"prompt": "What is 9 + 1?", "ground_truth": "10", "data_source": "x"}]
    parquet = write_parquet(tmp_path / "p.parquet", records)
    jsonl = tmp_path / "p.jsonl"
    lines = [json.dumps(r) for r in records[:2]] + ["{not json", json.dumps(records[2]), json.dumps(records[3])]
    jsonl.write_text("\n".join(lines) + "\n")
    from_parquet = IngestStage().run(ctx_parquet := make_ctx(tmp_path / "a", tokenizer_dir, [parquet]))
    from_jsonl = IngestStage().run(ctx_jsonl := make_ctx(tmp_path / "b", tokenizer_dir, [jsonl]))
    same = ["data_source", "messages_json", "prompt_text", "prompt_token_ids", "ground_truth"]
    expected = [{k: r[k] for k in same} for r in table_rows(ctx_parquet, from_parquet)]
    got = table_rows(ctx_jsonl, from_jsonl)
    assert [{k: r[k] for k in same} for r in got] == expected
    offset = len("\n".join(lines[:4])) + 1  # the default prompt id of a JSONL line is <stem>-<byte offset>
    assert [r["prompt_id"] for r in got] == ["p0", "p1", "p2", f"p-{offset}"]
    assert [r["source_row"] for r in got][-1] == offset
    (bad,) = rejects(ctx_jsonl, from_jsonl)
    assert bad[:3] == ("p.jsonl", len("\n".join(lines[:2])) + 1, "bad_json")
    assert bad[3].startswith(f"line 3 (byte {bad[1]}) is not valid JSON: ")


def corrupt_data_pages(path) -> bytes:
    """Overwrites a Parquet file's data pages, keeping its footer readable; returns the original bytes."""
    original = path.read_bytes()
    footer_length = struct.unpack("<i", original[-8:-4])[0]
    data_end = len(original) - 8 - footer_length
    path.write_bytes(original[:4] + b"\xff" * (data_end - 4) + original[data_end:])
    return original


def test_an_interrupted_ingest_redoes_only_its_unfinished_chunks_and_writes_the_same_table(
    tmp_path, tokenizer_dir, ray_session
):
    files = []
    for k in range(6):  # 6 files of 2 chunks; duplicates across files, so the resume rewrites chunks too
        rows = [prompt(8 * k + i) for i in range(8)] + [prompt(8 * k - 1)]
        files.append(write_parquet(tmp_path / f"f{k}.parquet", rows))
    uninterrupted = IngestStage().run(whole := make_ctx(tmp_path / "whole", tokenizer_dir, files, shard_size=4))

    original = corrupt_data_pages(files[4])
    ctx = make_ctx(tmp_path / "runs", tokenizer_dir, files, shard_size=4)
    with pytest.raises(DataError, match="f4.parquet: row groups 0..0 cannot be read"):
        IngestStage().run(ctx)
    finished = Journal(ctx.output_dir).load()
    assert finished and not any(key.startswith("00004-") for key in finished)
    table_dir = tmp_path / "runs" / "t" / "prompts"
    # a file's third chunk holds a repeat of the file before's last prompt: the duplicate pass rewrites it
    without_duplicates = [entry for key, entry in finished.items() if not key.endswith("-000000000008")]
    mtimes = {p["name"]: (table_dir / p["name"]).stat().st_mtime_ns for e in without_duplicates for p in e["parts"]}

    files[4].write_bytes(original)  # fixed: a new version of the file, whose chunks are all redone
    resumed = IngestStage().run(ctx)
    assert digests(ctx, resumed) == digests(whole, uninterrupted)
    assert table_rows(ctx, resumed) == table_rows(whole, uninterrupted)
    assert resumed.counts == uninterrupted.counts
    assert resumed.counts["rejected/duplicate_prompt_id"] == 5
    assert {name: (table_dir / name).stat().st_mtime_ns for name in mtimes} == mtimes  # finished: not redone
    assert sorted(p.name for p in table_dir.glob("part-*")) == sorted(p.name for p in resumed.parts)


def test_a_chunk_whose_rewrite_was_cut_short_is_redone_not_trusted(tmp_path, tokenizer_dir):
    path = write_parquet(tmp_path / "a.parquet", [prompt(0), prompt(1), prompt(0)], row_group_size=3)
    ctx = make_ctx(tmp_path / "runs", tokenizer_dir, [path], shard_size=3)
    done = IngestStage().run(ctx)
    (part,) = done.parts
    # a crash while the duplicate was being removed: the chunk was marked as being rewritten, and its part
    # rewritten into something else of the very same size
    Journal(ctx.output_dir).append([record("00000-000000000000", [])])
    target = tmp_path / "runs" / "t" / "prompts" / part.name
    target.write_bytes(b"\0" * part.num_bytes)
    again = IngestStage().run(ctx)
    assert digests(ctx, again) == digests(ctx, done)
    assert hashlib.sha256(target.read_bytes()).hexdigest() == part.sha256


def test_inputs_and_the_table_on_s3(tmp_path, tokenizer_dir, s3_bucket):
    from batchrl.storage import write_bytes_atomic

    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([prompt(0), prompt(1)]), buffer)
    write_bytes_atomic(f"s3://{s3_bucket}/in/a.parquet", buffer.getvalue().to_pybytes())
    write_bytes_atomic(f"s3://{s3_bucket}/in/b.jsonl", (json.dumps(prompt(2)) + "\n" + json.dumps(prompt(1))).encode())
    cfg = validate_dict(
        {"name": "t", "model": {"path": tokenizer_dir}, "data": {"train_files": [f"s3://{s3_bucket}/in"]}}
    )
    layout = RunLayout.for_run(f"s3://{s3_bucket}/runs", "t")
    ctx = StageContext(
        cfg=cfg,
        layout=layout,
        iteration=None,
        output_dir=layout.table_dir("prompts", None),
        fingerprint="x",
        inputs={},
        input_dirs={},
        policy_in=tokenizer_dir,
        embedded_ray=True,
    )
    out = IngestStage().run(ctx)
    assert [r["prompt_id"] for r in table_rows(ctx, out)] == ["p0", "p1", "p2"]
    assert [(f, reason) for f, _, reason, _ in rejects(ctx, out)] == [("b.jsonl", "duplicate_prompt_id")]


def test_the_duplicates_pass_on_ray_actors_finds_what_the_driver_finds_over_many_buckets(
    tmp_path, ray_session, monkeypatch
):
    from batchrl.stages import ingest_duplicates
    from batchrl.storage import write_parquet_atomic

    rng = np.random.default_rng(0)
    uris, rows = [], []
    for k in range(12):  # ids drawn from 150 values: many repeats within and across parts
        ids = [f"q{i}" for i in rng.integers(0, 150, size=40)]
        uri = str(tmp_path / f"part-{k:05d}.parquet")
        write_parquet_atomic(pa.table({"prompt_id": ids}), uri)
        uris.append(uri)
        rows.append(len(ids))
    expected = ingest_duplicates.later_occurrences(uris, rows=rows, workers=None)
    seen, by_hand = set(), []
    for k, uri in enumerate(uris):
        for row, pid in enumerate(pq.read_table(uri).column("prompt_id").to_pylist()):
            (by_hand.append((k, row)) if pid in seen else seen.add(pid))
    assert expected == by_hand and len(by_hand) > 300
    monkeypatch.setattr(ingest_duplicates, "MIN_ROWS_PER_MAP_TASK", 100)  # 3 parts per map task: 4 buckets
    assert ingest_duplicates.map_groups(rows) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    import ray

    workers = [ray.remote(ingest_duplicates.DuplicatesWorker).options(num_cpus=0).remote() for _ in range(3)]
    try:  # 4 map steps and 4 reduce steps over 3 actors: an actor runs maps of its own and reduces of others'
        assert ingest_duplicates.later_occurrences(uris, rows=rows, workers=workers) == by_hand
    finally:
        for worker in workers:
            ray.kill(worker)


def test_logged_responses_from_parquet_and_gzipped_jsonl_on_s3(tmp_path, tokenizer_dir, s3_bucket, monkeypatch):
    """Logs on object storage: the logged fields of Parquet and JSON Lines (.gz) rows reach the prompts table,
    and a log row without a response is rejected with its file and row. The chunks run in this process, the one
    that holds the test S3's credentials."""
    import gzip

    monkeypatch.setattr(ingest_module.ChunkedIngest, "_in_driver", lambda self, num_chunks, rows: True)

    from batchrl.storage import write_bytes_atomic

    # a list of responses (a group) in one row, one response in another (pyarrow takes the columns from the first)
    logged = [
        prompt(0, responses=["1", "2"], rewards=[1.0, 0.0], response=None, reward=None),
        prompt(1, response="2", reward=1.0),
    ]
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(logged), buffer)
    write_bytes_atomic(f"s3://{s3_bucket}/logs/a.parquet", buffer.getvalue().to_pybytes())
    lines = [json.dumps(prompt(2, responses=["3"], rewards=[1.0])), json.dumps(prompt(3))]
    write_bytes_atomic(f"s3://{s3_bucket}/logs/b.jsonl.gz", gzip.compress("\n".join(lines).encode()))
    cfg = validate_dict(
        {
            "name": "t",
            "model": {"path": tokenizer_dir},
            "data": {"train_files": [f"s3://{s3_bucket}/logs"]},
            "generate": {"logged": "all"},
        }
    )
    layout = RunLayout.for_run(f"s3://{s3_bucket}/runs-logged", "t")
    ctx = StageContext(
        cfg=cfg,
        layout=layout,
        iteration=None,
        output_dir=layout.table_dir("prompts", None),
        fingerprint="x",
        inputs={},
        input_dirs={},
        policy_in=tokenizer_dir,
        embedded_ray=True,
    )
    out = IngestStage().run(ctx)
    rows = table_rows(ctx, out)
    assert [(r["prompt_id"], r["logged_responses"], r["logged_rewards"]) for r in rows] == [
        ("p0", ["1", "2"], [1.0, 0.0]),
        ("p1", ["2"], [1.0]),
        ("p2", ["3"], [1.0]),
    ]
    # a JSON Lines row is numbered by its byte offset in the (uncompressed) file
    assert [(f, row, reason) for f, row, reason, _ in rejects(ctx, out)] == [
        ("b.jsonl.gz", len(lines[0]) + 1, "missing_responses")
    ]

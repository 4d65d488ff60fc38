"""Input chunks: planned from Parquet footers and JSONL sizes, each row read by exactly one chunk, keys and part names
stable and in input order."""

from __future__ import annotations

import gzip
import io
import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrl.errors import DataError
from batchrl.storage import expand_input_files
from batchrl.storage import inputs as inputs_module
from batchrl.storage.inputs import describe_inputs, lines_starting_in, plan_chunks, read_chunk, read_windows


def write_parquet(path, num_rows: int, *, row_group_size: int) -> str:
    table = pa.table({"prompt": [f"q{i}" for i in range(num_rows)], "ground_truth": [str(i) for i in range(num_rows)]})
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


def test_parquet_row_groups_are_combined_up_to_the_chunk_size_and_a_bigger_group_is_a_chunk_alone(tmp_path):
    small = write_parquet(tmp_path / "a.parquet", 10, row_group_size=3)  # groups 3, 3, 3, 1
    big = write_parquet(tmp_path / "b.parquet", 9, row_group_size=9)
    chunks = plan_chunks(describe_inputs([small, big]), rows_per_chunk=6)
    assert [c.part_capacity for c in plan_chunks(describe_inputs([big]), rows_per_chunk=9, rows_per_part=2)] == [5]
    assert [(c.file_index, c.group_start, c.group_stop, c.first_row, c.rows) for c in chunks] == [
        (0, 0, 2, 0, 6),
        (0, 2, 4, 6, 4),
        (1, 0, 1, 0, 9),
    ]
    # part indices are reserved in input order: the 9-row group writes two parts of at most 6 rows
    assert [c.part_names(c.part_capacity) for c in chunks] == [
        ["part-00000.parquet"],
        ["part-00001.parquet"],
        ["part-00002.parquet", "part-00003.parquet"],
    ]
    assert [c.key for c in chunks] == ["00000-000000000000", "00000-000000000006", "00001-000000000000"]
    rows = [row for chunk in chunks for row in read_chunk(chunk, columns=["prompt"])]
    assert [(n, r["prompt"]) for n, r in rows] == [(i, f"q{i}") for i in range(10)] + [(i, f"q{i}") for i in range(9)]


def test_a_huge_row_group_is_one_streamed_chunk_decoded_once_in_record_batches(tmp_path, monkeypatch):
    """200k rows in one row group, windows of 10k: each row decoded once, by one pass of record batches, never the
    whole group at once (it used to be sliced, each slice decoding the whole group)."""
    path = write_parquet(tmp_path / "a.parquet", 200_000, row_group_size=200_000)
    calls = {"iter_batches": 0, "read_row_groups": 0, "read_row_group": 0, "read": 0}
    for name in calls:
        monkeypatch.setattr(pq.ParquetFile, name, counted(getattr(pq.ParquetFile, name), calls, name))
    (chunk,) = plan_chunks(describe_inputs([path]), rows_per_chunk=10_000)
    assert chunk.streamed and (chunk.rows, chunk.part_capacity) == (200_000, 20)
    windows = [[n for n, _ in window] for window in read_windows(chunk, columns=["prompt"], window_rows=10_000)]
    assert [len(w) for w in windows] == [10_000] * 20
    assert [n for w in windows for n in w] == list(range(200_000))
    assert calls == {"iter_batches": 1, "read_row_groups": 0, "read_row_group": 0, "read": 0}


def counted(method, calls: dict[str, int], name: str):
    def wrapper(self, *args, **kwargs):
        calls[name] += 1
        return method(self, *args, **kwargs)

    return wrapper


def test_a_chunk_of_row_groups_up_to_split_rows_is_read_whole_as_before(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", 10, row_group_size=10)
    (chunk,) = plan_chunks(describe_inputs([path]), rows_per_chunk=2)
    assert not chunk.streamed
    assert [window for window in read_windows(chunk, columns=["prompt"], window_rows=3)][0][:2] == [
        (0, {"prompt": "q0"}),
        (1, {"prompt": "q1"}),
    ]


def test_every_jsonl_line_is_read_by_exactly_one_byte_range_wherever_the_ranges_split(tmp_path):
    lines = [json.dumps({"prompt": "x" * (i % 7), "i": i}).encode() for i in range(40)]
    data = b"\n".join(lines) + b"\n"
    starts = [0] + [len(b"\n".join(lines[:i])) + 1 for i in range(1, 40)]
    for size in (1, 2, 5, 13, 64, len(data)):
        read = []
        for start in range(0, len(data), size):
            read += list(lines_starting_in(io.BytesIO(data), start, start + size, block=7))
        assert read == list(zip(starts, lines)), size


def test_a_last_jsonl_line_without_a_newline_is_read(tmp_path):
    data = b'{"a": 1}\n{"a": 2}'
    assert list(lines_starting_in(io.BytesIO(data), 0, 4)) == [(0, b'{"a": 1}')]
    assert list(lines_starting_in(io.BytesIO(data), 4, 100)) == [(9, b'{"a": 2}')]


def test_jsonl_chunks_are_byte_ranges_whose_rows_are_byte_offsets_and_bad_lines_say_why(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs_module, "JSONL_CHUNK_BYTES", 16)
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "ground_truth": "1"}\n\n[1, 2]\n{"prompt": "b", "ground_truth": "2"}\nnot json\n')
    (file,) = describe_inputs([str(path)])
    assert file.columns == ("prompt", "ground_truth") and not file.empty
    chunks = plan_chunks([file], rows_per_chunk=100)
    assert len(chunks) == -(-path.stat().st_size // 16)
    records = [r for chunk in chunks for r in read_chunk(chunk, columns=[])]
    assert [offset for offset, _ in records] == [0, 38, 45, 82]
    assert records[0][1] == {"prompt": "a", "ground_truth": "1"}
    assert records[1][1] == "line 3 (byte 38) holds an array, expected a JSON object with the prompt's fields"
    assert records[3][1] == "line 5 (byte 82) is not valid JSON: Expecting value at column 1"
    # a JSONL chunk's row count is unknown when parts are named: one index each, then suffixes
    assert chunks[1].part_names(3) == ["part-00001.parquet", "part-00001-0001.parquet", "part-00001-0002.parquet"]


@pytest.mark.parametrize("chunk_bytes", [16, 1 << 20])
def test_a_bad_jsonl_line_is_named_by_its_line_number_in_the_file_whichever_chunk_reads_it(
    tmp_path, monkeypatch, chunk_bytes
):
    monkeypatch.setattr(inputs_module, "JSONL_CHUNK_BYTES", chunk_bytes)
    good = json.dumps({"prompt": "What is 1 + 1?", "ground_truth": "2"})
    lines = [good] * 6 + ['{"prompt": "What is 2 + 2?" "ground_truth": "4"}', "", good, "[]"]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    bad = [r for c in plan_chunks(describe_inputs([str(path)]), rows_per_chunk=1) for r in read_chunk(c, columns=[])]
    bad = [why for _, why in bad if isinstance(why, str)]
    seventh, tenth = (len("\n".join(lines[:k])) + 1 for k in (6, 9))  # the byte offsets of lines 7 and 10
    assert bad == [
        f"line 7 (byte {seventh}) is not valid JSON: Expecting ',' delimiter at column 29",
        f"line 10 (byte {tenth}) holds an array, expected a JSON object with the prompt's fields",
    ]
    gzipped = tmp_path / "p.jsonl.gz"
    gzipped.write_bytes(gzip.compress(path.read_bytes()))
    (chunk,) = plan_chunks(describe_inputs([str(gzipped)]), rows_per_chunk=1)
    assert [why for _, why in read_chunk(chunk, columns=[]) if isinstance(why, str)] == bad


def test_a_gzipped_jsonl_file_is_one_chunk_with_offsets_in_the_decompressed_text(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "a"}\n{"prompt": "b"}\n'))
    (chunk,) = plan_chunks(describe_inputs([str(path)]), rows_per_chunk=100)
    assert chunk.streamed
    assert read_chunk(chunk, columns=[]) == [(0, {"prompt": "a"}), (16, {"prompt": "b"})]


def test_a_gzipped_file_streams_in_windows_of_the_rows_and_offsets_of_its_plain_text(tmp_path):
    plain = tmp_path / "p.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"q{i}", "n": i}) + "\n" for i in range(2_345)))
    gzipped = tmp_path / "p.jsonl.gz"
    gzipped.write_bytes(gzip.compress(plain.read_bytes()))
    (chunk,) = plan_chunks(describe_inputs([str(gzipped)]), rows_per_chunk=500)
    windows = list(read_windows(chunk, columns=[], window_rows=500))
    assert [len(w) for w in windows] == [500, 500, 500, 500, 345]
    whole = [
        row for c in plan_chunks(describe_inputs([str(plain)]), rows_per_chunk=1) for row in read_chunk(c, columns=[])
    ]
    assert [row for window in windows for row in window] == whole


def test_reading_a_gzipped_file_in_windows_holds_a_window_not_the_file(tmp_path):
    """tracemalloc's peak while the windows are consumed one by one, against holding the records whole."""
    lines = "".join(
        json.dumps({"prompt": f"What is {i} + {i % 7}?", "ground_truth": str(i)}) + "\n" for i in range(50_000)
    )
    path = tmp_path / "p.jsonl.gz"
    path.write_bytes(gzip.compress(lines.encode(), compresslevel=1))
    (chunk,) = plan_chunks(describe_inputs([str(path)]), rows_per_chunk=1_000)

    def peak(read) -> int:
        tracemalloc.start()
        try:
            read()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    held = []
    whole = peak(lambda: held.append(read_chunk(chunk, columns=[])))
    counts = []
    windowed = peak(lambda: counts.extend(len(w) for w in read_windows(chunk, columns=[], window_rows=1_000)))
    assert sum(counts) == len(held[0]) == 50_000 and max(counts) == 1_000
    assert windowed < 0.3 * whole, (windowed, whole)


def test_a_jsonl_file_whose_first_line_is_not_an_object_is_a_data_error_naming_it(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("prompt,ground_truth\n")
    with pytest.raises(DataError, match=f"{path} is not a readable JSONL file: its first line is not valid JSON"):
        describe_inputs([str(path)])


def test_directories_are_searched_for_parquet_and_jsonl_files(tmp_path):
    for name in ("a.parquet", "b.jsonl", "c.jsonl.gz", "notes.txt", "_hidden.jsonl"):
        (tmp_path / name).write_bytes(b"")
    assert [p.rsplit("/", 1)[-1] for p in expand_input_files([str(tmp_path)])] == ["a.parquet", "b.jsonl", "c.jsonl.gz"]

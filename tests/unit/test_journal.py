"""The work journal: records survive only with their parts intact, segments are batched and compacted, a crash
loses only unflushed records, and it works the same on S3 (moto) as on a local directory."""

from __future__ import annotations

import hashlib

import pytest

from batchrl.storage import join, resolve, write_bytes_atomic
from batchrl.storage import journal as journal_module
from batchrl.storage.journal import JOURNAL_DIR, Journal, record, record_parts
from batchrl.storage.manifest import PartInfo


def write_part(table_dir: str, name: str, data: bytes = b"rows") -> PartInfo:
    write_bytes_atomic(join(table_dir, name), data)
    return PartInfo(name=name, rows=1, sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data))


def segments(table_dir: str) -> list[str]:
    fs, path = resolve(join(table_dir, JOURNAL_DIR))
    fs.invalidate_cache(path)
    return sorted(fs.ls(path, detail=False)) if fs.exists(path) else []


def test_a_record_is_loaded_with_its_fields_and_parts(tmp_path):
    table = str(tmp_path / "t")
    part = write_part(table, "part-00000.parquet")
    Journal(table).append([record("part-00000.parquet", [part], counts={"rows": 1.0})])
    loaded = Journal(table).load()
    assert list(loaded) == ["part-00000.parquet"]
    assert loaded["part-00000.parquet"]["counts"] == {"rows": 1.0}
    assert record_parts(loaded["part-00000.parquet"]) == [part]


def test_a_record_whose_part_is_gone_or_has_another_size_does_not_count(tmp_path):
    table = str(tmp_path / "t")
    kept, deleted, truncated = (write_part(table, f"part-0000{i}.parquet") for i in range(3))
    Journal(table).append([record(p.name, [p]) for p in (kept, deleted, truncated)])
    (tmp_path / "t" / deleted.name).unlink()
    (tmp_path / "t" / truncated.name).write_bytes(b"ro")
    assert list(Journal(table).load()) == [kept.name]


def test_a_record_whose_part_was_replaced_by_other_bytes_of_the_same_size_does_not_count(tmp_path, caplog):
    table = str(tmp_path / "t")
    kept, replaced = write_part(table, "part-00000.parquet"), write_part(table, "part-00001.parquet")
    Journal(table).append([record(p.name, [p]) for p in (kept, replaced)])
    (tmp_path / "t" / replaced.name).write_bytes(b"swor")  # same size: only its sha256 can tell
    assert list(Journal(table).load()) == [kept.name]
    assert f"{tmp_path / 't' / replaced.name} does not hash to the sha256 its journal record holds" in caplog.text


def test_a_later_record_of_a_key_replaces_an_earlier_one(tmp_path):
    table = str(tmp_path / "t")
    part = write_part(table, "a.parquet")
    journal = Journal(table)
    journal.append([record("a", [part], attempt=1)])
    journal.append([record("a", [part], attempt=2)])
    assert journal.load()["a"]["attempt"] == 2


def test_the_writer_batches_records_into_few_segments_and_flushes_on_exit_even_after_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "FLUSH_RECORDS", 4)
    monkeypatch.setattr(journal_module, "FLUSH_SECONDS", 3600.0)
    table = str(tmp_path / "t")
    parts = [write_part(table, f"part-{i:05d}.parquet") for i in range(10)]
    with pytest.raises(RuntimeError), Journal(table).writer() as writer:
        for part in parts:
            writer.add(record(part.name, [part]))
        raise RuntimeError("the stage failed after its tenth shard")
    assert len(segments(table)) == 3  # 4 + 4 + the 2 flushed on exit
    assert sorted(Journal(table).load()) == [p.name for p in parts]


def test_records_not_yet_flushed_are_lost_in_a_crash_and_only_those(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "FLUSH_RECORDS", 2)
    monkeypatch.setattr(journal_module, "FLUSH_SECONDS", 3600.0)
    table = str(tmp_path / "t")
    parts = [write_part(table, f"part-{i:05d}.parquet") for i in range(3)]
    writer = Journal(table).writer()
    for part in parts:
        writer.add(record(part.name, [part]))
    # a crash now: the writer is never closed
    assert sorted(Journal(table).load()) == [parts[0].name, parts[1].name]


def test_many_segments_are_compacted_into_one_at_load_without_losing_records(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "MAX_SEGMENTS", 5)
    table = str(tmp_path / "t")
    journal = Journal(table)
    parts = [write_part(table, f"part-{i:05d}.parquet") for i in range(8)]
    for part in parts:
        journal.append([record(part.name, [part])])
    assert len(segments(table)) == 8
    assert sorted(journal.load()) == [p.name for p in parts]
    assert len(segments(table)) == 1
    assert sorted(journal.load()) == [p.name for p in parts]


def test_an_unreadable_segment_is_ignored_with_a_warning(tmp_path, caplog):
    table = str(tmp_path / "t")
    part = write_part(table, "a.parquet")
    Journal(table).append([record("a", [part])])
    write_bytes_atomic(join(table, JOURNAL_DIR, "seg-junk.json"), b"{not json")
    assert list(Journal(table).load()) == ["a"]
    assert "ignoring journal segment" in caplog.text


def test_a_missing_table_directory_has_no_records(tmp_path):
    assert Journal(str(tmp_path / "nothing")).load() == {}


def test_on_s3_it_loads_what_was_recorded(s3_bucket):
    table = f"s3://{s3_bucket}/run/iter_0000/scores"
    parts = [write_part(table, f"part-{i:05d}.parquet") for i in range(4)]
    with Journal(table).writer() as writer:
        for part in parts:
            writer.add(record(part.name, [part], counts={"n": 1}))
    fs, path = resolve(join(table, parts[1].name))
    fs.rm(path)
    write_bytes_atomic(join(table, parts[3].name), b"swor")  # same size, other bytes
    assert sorted(Journal(table).load()) == [parts[0].name, parts[2].name]


def test_a_killed_writers_temporary_file_is_not_taken_for_a_segment(tmp_path, caplog):
    table = str(tmp_path / "t")
    part = write_part(table, "a.parquet")
    Journal(table).append([record("a", [part])])
    (tmp_path / "t" / JOURNAL_DIR / ".tmp-0123-seg-00000000000000000001-abcd.json").write_text('[{"key": "b"')
    assert list(Journal(table).load()) == ["a"]
    assert "ignoring journal segment" not in caplog.text

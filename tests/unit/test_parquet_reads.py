"""Parquet reads never leave a Python object's buffer for one of Arrow's threads to free.

Why (batchrl/storage/fs.py, above read_parquet): a buffer that Arrow took from a Python file object and releases on
its own thread pool after the read returned aborts the process when that happens during interpreter exit
(apache/arrow#50482). These tests read through a filesystem whose file objects hand out `bytes` that record the
thread that frees them, and assert that every one is freed on the reading thread.
"""

from __future__ import annotations

import io
import threading
import time

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem

from batchrl.pipeline.shards import read_verified_parquet
from batchrl.storage import open_parquet, read_parquet, sha256_of
from batchrl.storage.inputs import describe_inputs, plan_chunks, read_chunk


class _TrackedBytes(bytes):
    """Records on `freed_on` whether the thread that frees it is one of Arrow's (a thread Python did not start)."""

    freed_on: list[str]

    def __del__(self) -> None:
        thread = threading.current_thread()
        self.freed_on.append("arrow" if isinstance(thread, threading._DummyThread) else thread.name)


class _TrackedFile(io.RawIOBase):
    """A seekable file whose reads return _TrackedBytes that log to `_TrackedFile.freed_on`, set per test."""

    freed_on: list[str] = []

    def __init__(self, path: str):
        self._file = open(path, "rb")

    def read(self, size: int = -1) -> bytes:
        data = _TrackedBytes(self._file.read(size))
        data.freed_on = self.freed_on
        return data

    def readall(self) -> bytes:
        return self.read()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._file.close()
        super().close()


class _TrackedFileSystem(LocalFileSystem):
    """tracked:///abs/path: the local file, opened as a _TrackedFile (a remote store as far as batchrl can tell)."""

    protocol = "tracked"

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("tracked://"))

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        return _TrackedFile(self._strip_protocol(path))

    def cat_file(self, path, start=None, end=None, **kwargs):
        with self._open(path) as f:
            return f.read()


@pytest.fixture
def tracked_part(tmp_path):
    fsspec.register_implementation("tracked", _TrackedFileSystem, clobber=True)
    table = pa.table({"prompt_id": [f"p{i}" for i in range(50_000)], "value": list(range(50_000))})
    pq.write_table(table, tmp_path / "part.parquet", row_group_size=5000)
    _TrackedFile.freed_on = []  # buffers of an earlier test still in flight log to that test's list
    yield f"tracked://{tmp_path / 'part.parquet'}", table


def _freed_on() -> list[str]:
    """The threads the buffers handed out so far were freed on, once Arrow's threads have had time to free theirs."""
    time.sleep(0.5)
    return _TrackedFile.freed_on


def test_the_hazard_exists_in_this_pyarrow_a_threaded_read_of_a_file_object_frees_buffers_on_arrows_threads(
    tracked_part,
):
    """The control: without the precautions, Arrow frees some of the file object's buffers on its pool threads.
    If this starts failing, pyarrow no longer does so, and the precautions in storage/fs.py can be reconsidered."""
    uri, _ = tracked_part
    for _ in range(3):
        with fsspec.open(uri, "rb") as f:
            pq.read_table(f)
    assert "arrow" in _freed_on(), f"pyarrow {pa.__version__} freed every buffer on the reading thread"


def test_reading_a_whole_remote_part_frees_every_python_buffer_on_a_python_thread(tracked_part):
    uri, table = tracked_part
    assert read_parquet(uri).equals(table)
    assert read_parquet(uri, columns=["value"]).column("value").equals(table.column("value"))
    assert read_verified_parquet(uri, sha256=sha256_of(uri)).equals(table)
    assert _freed_on() and "arrow" not in _freed_on()


def test_reading_a_remote_part_in_place_frees_every_python_buffer_on_a_python_thread(tracked_part):
    """Also the reads: pyarrow's ParquetFile pre-buffers by default, running the file object's read() on Arrow's IO
    pool, whose future can free the buffer there. A race, so the reads are repeated, with pauses that let the pool
    threads go idle (which is when it showed: 1 run in 2 of this test, before)."""
    uri, table = tracked_part
    for _ in range(5):
        time.sleep(0.1)
        with open_parquet(uri) as parquet:
            assert parquet.read(columns=["value"]).column(0).equals(table.column("value"))
            assert parquet.read_row_group(3).equals(table.slice(15_000, 5000))
            assert parquet.read_row_groups([1, 2]).equals(table.slice(5000, 10_000))
            batches = list(parquet.iter_batches(batch_size=7000, columns=["prompt_id"]))
            assert sum(batch.num_rows for batch in batches) == table.num_rows
    assert _freed_on() and "arrow" not in _freed_on()


def test_ingesting_a_remote_parquet_input_frees_every_python_buffer_on_a_python_thread(tracked_part):
    uri, table = tracked_part
    chunks = plan_chunks(describe_inputs([uri]), rows_per_chunk=2000)
    rows = [row for chunk in chunks for row in read_chunk(chunk, columns=["prompt_id", "value"])]
    assert [record["value"] for _, record in rows] == table.column("value").to_pylist()
    assert _freed_on() and "arrow" not in _freed_on()

"""Prompt input files split into chunks that workers read independently, planned without reading the data.

Why chunks: a driver that reads every input row itself holds the whole prompt set and redoes everything after a
crash. Instead the driver plans chunks from what costs one small request per file (a Parquet footer, a JSONL
file's size and first line), and each worker reads its chunk itself, from local disk or object storage.

- Parquet: a chunk is contiguous row groups of one file adding up to about ``rows_per_chunk`` rows; a bigger
  row group is one chunk on its own. One over ``SPLIT_ROWS`` is a *streamed* chunk: read in record batches of a
  window's rows (``read_windows``), each row decoded once. (It used to be split into slices each of which decoded
  the whole group to keep its slice: a million-row group was decoded 16 times, and held whole by every slice.)
- JSONL (``*.jsonl``): a chunk is a byte range of ``JSONL_CHUNK_BYTES`` (16 MiB); its reader takes the lines that START
  inside the range (the split rule of Hadoop's text input), so every line is read by exactly one chunk. The row
  number of a JSONL line (``source_row``, and the default prompt id ``<stem>-<row>``) is its byte offset in the
  file: a chunk cannot know how many lines come before it without reading them, and an offset is as stable and
  as easy to find (``tail -c +$((row + 1)) file | head -1``). ``*.jsonl.gz`` cannot be seeked: one streamed chunk
  per file, decompressed once, front to back, in windows of records; offsets in the decompressed text.

A streamed chunk is never held whole: its reader yields windows of at most ``window_rows`` records, and ingest
tokenizes the windows on its workers as they come (see batchrl.stages.ingest), each window writing its own parts
(``Chunk.window_part_names``).

A chunk's key (file index and first row or byte) is stable across runs of the same inputs, chunks are listed in
input order, and each knows the part names it may write (``first_part`` .. ``first_part + part_capacity - 1``,
from Parquet's row counts: ``part-00000.parquet``, ... in input order as before), so parts are named before
any is written and a redone chunk rewrites the same names.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa

from batchrl.errors import DataError
from batchrl.storage.fs import file_identities, is_jsonl, open_parquet, resolve
from batchrl.storage.layout import part_name

SPLIT_ROWS = 65_536  # a Parquet row group larger than this is a streamed chunk, read in record batches
JSONL_CHUNK_BYTES = 16 << 20  # ~80k lines of 200 bytes: a few seconds of a worker's time, in memory at once
READ_BLOCK_BYTES = 8 << 20  # JSONL is read in blocks of this size (fsspec's readline re-reads a whole block)
GZ_BLOCK_BYTES = 1 << 20  # gzipped JSONL is decompressed in blocks of this size (what a streamed window holds)
HEAD_READ_BYTES = 64 << 10  # planning reads a JSONL file's first record in blocks of this size
FOOTER_THREADS = 16  # footers of many object-store files are read concurrently
UNBOUNDED = 1 << 62  # the end of a chunk that runs to the end of its file


@dataclass(frozen=True)
class InputFile:
    """One input file as the plan sees it: its identity, the columns (Parquet) or keys of its first record (JSONL),
    and the rows of each row group (Parquet only)."""

    uri: str
    index: int
    size: int
    version: str
    columns: tuple[str, ...]
    row_groups: tuple[int, ...] = ()

    @property
    def jsonl(self) -> bool:
        return is_jsonl(self.uri)

    @property
    def empty(self) -> bool:
        """No rows (Parquet), no record (JSONL: no non-blank line before the end of the first read)."""
        return not self.columns if self.jsonl else sum(self.row_groups) == 0

    @property
    def stem(self) -> str:
        name = self.uri.rstrip("/").rsplit("/", 1)[-1]
        for suffix in (".jsonl.gz", ".jsonl", ".parquet"):
            name = name.removesuffix(suffix)
        return name


@dataclass(frozen=True)
class Chunk:
    """Rows [first_row, first_row + rows) of a Parquet file, within its row groups [group_start, group_stop); or the
    lines of a JSONL file starting at a byte in [first_row, stop) (``rows`` None: not known before reading)."""

    uri: str
    file_index: int
    version: str
    ordinal: int  # position in the plan (input order)
    first_row: int
    rows: int | None
    group_start: int = 0
    group_stop: int = 0
    stop: int = 0  # JSONL: the byte where the next chunk's lines start
    first_part: int = 0
    part_capacity: int = 1

    @property
    def key(self) -> str:
        return f"{self.file_index:05d}-{self.first_row:012d}"

    @property
    def jsonl(self) -> bool:
        return is_jsonl(self.uri)

    @property
    def max_rows(self) -> int | None:
        """Its rows (Parquet), or at most how many lines its byte range can start (a record takes 3 bytes at
        least: ``{}`` and a newline); None for a gzipped file."""
        if not self.jsonl:
            return self.rows
        return None if self.stop == UNBOUNDED else (self.stop - self.first_row) // 3 + 1

    @property
    def streamed(self) -> bool:
        """Read in windows of records (read_windows) rather than whole: a gzipped JSONL file (not seekable, of any
        size) or a Parquet row group of more than SPLIT_ROWS rows."""
        if self.jsonl:
            return self.stop == UNBOUNDED
        return self.group_stop - self.group_start == 1 and (self.rows or 0) > SPLIT_ROWS

    @property
    def stem(self) -> str:
        return InputFile(self.uri, 0, 0, "", ()).stem

    def window_part_names(self, window: int, count: int) -> list[str]:
        """Names of the first ``count`` parts of a streamed chunk's ``window``-th window: window 0 takes the chunk's
        own names (a chunk read whole is its window 0), window w ``part-<first>-w<w>-<k>.parquet``: the count of a
        window's parts is not known before it is read, and the names must not depend on how the others went."""
        if window == 0:
            return self.part_names(count)
        base = part_name(self.first_part).removesuffix(".parquet")
        return [f"{base}-w{window:06d}-{k:04d}.parquet" for k in range(count)]

    def part_names(self, count: int) -> list[str]:
        """Names of the chunk's first ``count`` parts: its reserved indices, then (JSONL, whose row count was not
        known when the indices were reserved) ``part-<last reserved>-<k>.parquet``."""
        names = []
        for k in range(count):
            if k < self.part_capacity:
                names.append(part_name(self.first_part + k))
            else:
                names.append(
                    part_name(self.first_part + self.part_capacity - 1).removesuffix(".parquet") + f"-{k:04d}.parquet"
                )
        return names

    @property
    def rejects_name(self) -> str:
        return self.window_rejects_name(0)

    def window_rejects_name(self, window: int) -> str:
        return "_rejects/" + self.window_part_names(window, 1)[0]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Chunk:
        return cls(**json.loads(text))


def describe_inputs(uris: list[str], *, field: str = "data.train_files") -> list[InputFile]:
    """Each file's identity and footer (Parquet) or first record (JSONL), read concurrently; DataError naming a
    file that cannot be read and ``field``, the config field that lists it."""
    with ThreadPoolExecutor(max_workers=min(FOOTER_THREADS, max(1, len(uris)))) as pool:
        return list(pool.map(_describe, uris, range(len(uris)), [field] * len(uris)))


def _describe(uri: str, index: int, field: str) -> InputFile:
    try:
        (identity,) = file_identities([uri])
    except OSError as err:
        raise DataError(f"{field}: {uri} cannot be read ({_first_line(err)})") from None
    columns, groups = _read_head(uri, field)
    return InputFile(uri, index, identity["size"], identity["version"], columns, groups)


def plan_chunks(files: list[InputFile], *, rows_per_chunk: int, rows_per_part: int | None = None) -> list[Chunk]:
    """The chunks of ``files`` in input order, with the names of the parts of ``rows_per_part`` rows (default:
    ``rows_per_chunk``) each may write reserved."""
    rows_per_part = rows_per_part or rows_per_chunk
    chunks: list[Chunk] = []
    next_part = 0
    for file in files:
        for chunk in _jsonl_chunks(file) if file.jsonl else _parquet_chunks(file, rows_per_chunk):
            capacity = 1 if chunk.rows is None else math.ceil(chunk.rows / rows_per_part)
            chunks.append(
                Chunk(**{**asdict(chunk), "ordinal": len(chunks), "first_part": next_part, "part_capacity": capacity})
            )
            next_part += capacity
    return chunks


def _parquet_chunks(file: InputFile, rows_per_chunk: int) -> Iterator[Chunk]:
    start_group, first_row, rows = 0, 0, 0
    for group, group_rows in enumerate(file.row_groups):
        if rows and rows + group_rows > rows_per_chunk:  # the open chunk is full: emit it
            yield _parquet_chunk(file, start_group, group, first_row, rows)
            start_group, first_row, rows = group, first_row + rows, 0
        rows += group_rows
    if rows:
        yield _parquet_chunk(file, start_group, len(file.row_groups), first_row, rows)


def _parquet_chunk(file: InputFile, group_start: int, group_stop: int, first_row: int, rows: int) -> Chunk:
    return Chunk(
        uri=file.uri,
        file_index=file.index,
        version=file.version,
        ordinal=0,
        first_row=first_row,
        rows=rows,
        group_start=group_start,
        group_stop=group_stop,
    )


def _jsonl_chunks(file: InputFile) -> Iterator[Chunk]:
    if file.uri.endswith(".gz"):  # not seekable: one streamed chunk, offsets in the decompressed text
        if file.size:
            yield Chunk(file.uri, file.index, file.version, 0, first_row=0, rows=None, stop=UNBOUNDED)
        return
    for start in range(0, file.size, JSONL_CHUNK_BYTES):
        stop = min(start + JSONL_CHUNK_BYTES, file.size)
        yield Chunk(file.uri, file.index, file.version, 0, first_row=start, rows=None, stop=stop)


def read_chunk(chunk: Chunk, *, columns: list[str]) -> list[tuple[int, dict[str, Any] | str]]:
    """(row number, record) for every row of the chunk; for a JSONL line that is not a JSON object, (byte offset,
    why) instead of the record. Parquet: only ``columns`` (those the file has) are read. Holds the chunk whole: a
    streamed chunk is read with read_windows."""
    if chunk.jsonl:
        return list(_jsonl_records(chunk))
    return [row for window in _parquet_windows(chunk, columns, window_rows=None) for row in window]


def read_windows(chunk: Chunk, *, columns: list[str], window_rows: int) -> Iterator[list[tuple[int, Any]]]:
    """The rows of ``chunk`` (as read_chunk gives them) in successive windows of ``window_rows`` rows (the last one
    shorter; none for a chunk without rows), each read as the previous one is consumed: a gzipped file is
    decompressed once, front to back, and a Parquet row group decoded in record batches, never whole."""
    if not chunk.jsonl:
        yield from _parquet_windows(chunk, columns, window_rows=window_rows)
        return
    window: list[tuple[int, Any]] = []
    for row in _jsonl_records(chunk):
        window.append(row)
        if len(window) >= window_rows:
            yield window
            window = []
    if window:
        yield window


def _parquet_windows(chunk: Chunk, columns: list[str], *, window_rows: int | None) -> Iterator[list[tuple[int, Any]]]:
    """The chunk's rows in windows of ``window_rows`` (None: its row groups read whole, in one window)."""
    groups = list(range(chunk.group_start, chunk.group_stop))
    try:
        with open_parquet(chunk.uri) as parquet:
            wanted = [c for c in columns if c in parquet.schema_arrow.names]
            if window_rows is None:
                tables = iter([parquet.read_row_groups(groups, columns=wanted)])
            else:
                tables = parquet.iter_batches(batch_size=window_rows, row_groups=groups, columns=wanted)
            row = chunk.first_row  # a chunk is whole row groups
            for table in tables:
                yield list(enumerate(table.to_pylist(), start=row))
                row += table.num_rows
    except (OSError, pa.ArrowException) as err:
        raise DataError(
            f"{chunk.uri}: row groups {chunk.group_start}..{chunk.group_stop - 1} cannot be read ({_first_line(err)})"
        ) from None


def _jsonl_records(chunk: Chunk) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """(byte offset, record) of each non-blank line of the chunk; for a line that is no JSON object, (byte offset,
    why), the why naming the line as an editor numbers it (``line 12 (byte 1043) is not valid JSON: ...``). The
    lines of the file before the chunk are counted only when the chunk has such a line (a second read, up to its
    start: the chunk alone cannot know them)."""
    fs, path = resolve(chunk.uri)
    lines_before = 0 if chunk.first_row == 0 else None  # the file's lines before the chunk's first line
    first_offset = chunk.first_row
    try:
        with fs.open(path, "rb") as raw:
            gz = chunk.uri.endswith(".gz")
            f = gzip.GzipFile(fileobj=raw) if gz else raw
            block = GZ_BLOCK_BYTES if gz else READ_BLOCK_BYTES
            for index, (offset, line) in enumerate(lines_starting_in(f, chunk.first_row, chunk.stop, block=block)):
                first_offset = offset if index == 0 else first_offset
                if not line.strip():  # a blank line is no record (a file's last newline often leaves one)
                    continue
                record = _json_object(line)
                if isinstance(record, str):
                    if lines_before is None:
                        lines_before = _newlines_before(fs, path, first_offset)
                    record = f"line {lines_before + index + 1} (byte {offset}) {record}"
                yield offset, record
    except (OSError, EOFError) as err:
        raise DataError(f"{chunk.uri}: bytes {chunk.first_row}.. cannot be read ({_first_line(err)})") from None


def _newlines_before(fs, path: str, stop: int, *, block: int = READ_BLOCK_BYTES) -> int:
    """How many lines of an (uncompressed) file end before byte ``stop``."""
    count = 0
    with fs.open(path, "rb") as f:
        while f.tell() < stop:
            data = f.read(min(block, stop - f.tell()))
            if not data:
                break
            count += data.count(b"\n")
    return count


def lines_starting_in(f, start: int, stop: int, *, block: int = READ_BLOCK_BYTES) -> Iterator[tuple[int, bytes]]:
    """(offset, line without its newline) of each line of ``f`` that starts at a byte in [start, stop).

    The line that holds byte ``start - 1`` began before ``start`` (or ended there) and belongs to the range
    before; the line that starts at or after ``stop`` belongs to the range after, while the last line that starts
    before ``stop`` is read to its end, past ``stop`` if need be.
    """
    base = max(start - 1, 0)
    f.seek(base)
    buffer = bytearray()
    skipping = start > 0
    while True:
        data = f.read(block)
        buffer += data
        cut = 0
        while (newline := buffer.find(b"\n", cut)) >= 0:
            line_start = base + cut
            if skipping:
                skipping = False
            elif line_start >= stop:
                return
            else:
                yield line_start, bytes(buffer[cut:newline])
            cut = newline + 1
        del buffer[:cut]
        base += cut
        if not data:
            if buffer and not skipping and base < stop:
                yield base, bytes(buffer)  # a last line without a newline
            return
        if base >= stop and not skipping:
            return


_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}  # JSON's names


def _json_object(line: bytes) -> dict[str, Any] | str:
    """The line's JSON object, or what is wrong with it ("is not valid JSON: ...", "holds an array, ...")."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:  # its own line and column are the record's: line 1, always
        return f"is not valid JSON: {err.msg} at column {err.colno}"
    except ValueError as err:  # not UTF-8
        return f"is not valid JSON ({err})"
    if not isinstance(value, dict):
        kind = "null" if value is None else _JSON_KINDS[type(value)]
        return f"holds {kind}, expected a JSON object with the prompt's fields"
    return value


def _read_head(uri: str, field: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(column names, rows per row group) of a Parquet file; (keys of the first record, ()) of a JSONL file."""
    fs, path = resolve(uri)
    if is_jsonl(uri):
        return _first_record_keys(uri, fs, path, field), ()
    try:
        with open_parquet(uri) as parquet:
            metadata = parquet.metadata
    except (OSError, pa.ArrowInvalid) as err:
        raise DataError(f"{field}: {uri} is not a readable Parquet file ({_first_line(err)})") from None
    columns = tuple(metadata.schema.to_arrow_schema().names)
    return columns, tuple(metadata.row_group(g).num_rows for g in range(metadata.num_row_groups))


def _first_record_keys(uri: str, fs, path: str, field: str) -> tuple[str, ...]:
    """Keys of the first non-blank line's object (() for a file without one); DataError if it is not an object."""
    try:
        with fs.open(path, "rb") as raw:
            f = gzip.GzipFile(fileobj=raw) if uri.endswith(".gz") else raw
            for _, line in lines_starting_in(f, 0, UNBOUNDED, block=HEAD_READ_BYTES):
                if line.strip():
                    record = _json_object(line)
                    if isinstance(record, str):
                        raise DataError(f"{field}: {uri} is not a readable JSONL file: its first line {record}")
                    return tuple(record)
    except (OSError, EOFError) as err:
        raise DataError(f"{field}: {uri} is not a readable JSONL file ({_first_line(err)})") from None
    return ()


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__

"""fsspec/pyarrow helpers: resolution, atomic writes, Parquet I/O.

Atomicity: on a local filesystem a file is written under a temporary sibling name and renamed into place,
so a crash never leaves a torn file under the final name. On object stores a PUT is already atomic
(the object appears whole or not at all), so the file is written directly. Readers still trust only the
parts a stage manifest lists; the manifest is written last.

Outages: every S3 request is retried by botocore ("standard" mode, exponential backoff with jitter,
``BATCHRL_S3_MAX_ATTEMPTS`` attempts, default 10: roughly a minute of outage is ridden out). A longer
outage surfaces as an error that ``is_transient_storage_error`` recognises, which the CLI reports as
"interrupted" (exit 4): nothing is torn, and the same command resumes the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from batchrl.errors import StorageError

logger = logging.getLogger(__name__)

DEFAULT_S3_MAX_ATTEMPTS = 10


def resolve(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    try:
        fs, path = fsspec.core.url_to_fs(uri, **_storage_options(uri))
    except (ImportError, ValueError) as err:
        raise StorageError(f"cannot open {uri!r}: {err}") from None
    return fs, path


def _storage_options(uri: str) -> dict:
    if uri.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        attempts = int(os.environ.get("BATCHRL_S3_MAX_ATTEMPTS", DEFAULT_S3_MAX_ATTEMPTS))
        options: dict = {
            "skip_instance_cache": False,
            "config_kwargs": {"retries": {"mode": "standard", "max_attempts": attempts}, "connect_timeout": 10},
        }
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        return options
    return {}


def is_transient_storage_error(err: BaseException) -> bool:
    """True for an unreachable or timed-out object store (worth resuming later), not for a missing file."""
    transient: list[type] = [ConnectionError]  # refused / reset; not TimeoutError, which Ray's get() raises too
    try:
        import botocore.exceptions as bex

        transient += [bex.ConnectionError, bex.ConnectionClosedError, bex.ReadTimeoutError, bex.ConnectTimeoutError]
    except ImportError:
        pass
    try:
        import aiohttp

        transient.append(aiohttp.ClientConnectionError)
    except ImportError:
        pass
    from fsspec.exceptions import FSTimeoutError

    transient.append(FSTimeoutError)
    return isinstance(err, tuple(transient))


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def join(uri: str, *parts: str) -> str:
    out = uri.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def protocol_prefix(uri: str) -> str:
    return uri.split("://", 1)[0] + "://" if "://" in uri and not uri.startswith("file://") else ""


def write_bytes_atomic(uri: str, data: bytes) -> None:
    fs, path = resolve(uri)
    parent = path.rsplit("/", 1)[0]
    if is_local(uri):
        fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}-{path.rsplit('/', 1)[-1]}"
        with fs.open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        with fs.open(path, "wb") as f:
            f.write(data)


def write_parquet_atomic(table: pa.Table, uri: str, *, row_group_rows: int | None = None) -> tuple[int, str]:
    """Writes ``table`` to ``uri`` atomically; returns (num_bytes, sha256 hex) of the file written.

    ``row_group_rows`` caps the rows per row group (pyarrow's default is 1M rows: one group per part), for
    tables whose readers take a few rows at a time and decode whole row groups to do so."""
    buffer = io.BytesIO()
    if table.num_rows:
        pq.write_table(table, buffer, compression="zstd", row_group_size=row_group_rows)
    else:  # no row group at all: readers such as `datasets` choke on an empty one
        pq.ParquetWriter(buffer, table.schema, compression="zstd").close()
    data = buffer.getvalue()
    write_bytes_atomic(uri, data)
    return len(data), hashlib.sha256(data).hexdigest()


# Why Arrow never reads through a Python object here, or only on the calling thread:
# Parquet read through a Python file object (or a `bytes`/BytesIO) makes Arrow keep the bytes each read() returned
# as `arrow::py::PyBuffer`s, and with use_threads its CPU pool decodes the columns in tasks whose closures hold
# them. The last reference can drop on a pool thread *after* the read has returned (the task's future completes
# before its closure is destroyed). `~PyBuffer` then takes the GIL; if the interpreter is finalising by then,
# CPython 3.11 ends that thread with pthread_exit, whose forced unwind through Arrow's noexcept destructor calls
# std::terminate: SIGABRT at exit, "terminate called without an active exception" (a core dump shows
# PyGILState_Ensure <- PyBuffer::~PyBuffer <- BufferReader <- SerializedPageReader <- DecodeRowGroups task, while
# the main thread is in Py_FinalizeEx). Upstream: apache/arrow#50482 (the same race; Python >= 3.13 hangs
# instead of aborting) and apache/arrow#34314. So: local files are read by path (Arrow owns every buffer), a
# remote file read whole is copied into Arrow-owned memory first, and a remote file read in place (row groups,
# `open_parquet`) is read and decoded on the calling thread only: use_threads=False keeps the decoding there, and
# pre_buffer=False (pyarrow's ParquetFile defaults to True) keeps the reads there too, since pre-buffering fetches
# column chunks with RandomAccessFile::ReadAsync, which runs the Python read on Arrow's IO pool, and the future
# holding that buffer can be destroyed on the pool thread after the read returned (the same race, one pool over;
# a core dump shows ~PyBuffer <- ~ConcreteFutureImpl <- ReadAsync task on a ThreadPool worker).
# tests/unit/test_parquet_reads.py checks that no buffer of a Python object is released on another thread.


def read_parquet(uri: str, *, columns: list[str] | None = None) -> pa.Table:
    fs, path = resolve(uri)
    try:
        if is_local(uri):
            return pq.read_table(path, columns=columns)
        return parquet_from_bytes(fs.cat_file(path), columns=columns)
    except FileNotFoundError:
        raise StorageError(f"file not found: {uri}") from None
    except pa.ArrowInvalid as err:
        raise StorageError(f"{uri} is not a readable Parquet file: {err}") from None


def parquet_from_bytes(data: bytes, *, columns: list[str] | None = None) -> pa.Table:
    """A whole Parquet file's bytes as a table, decoded on Arrow's threads from an Arrow-owned copy (see above)."""
    owned = pa.allocate_buffer(len(data))
    pa.FixedSizeBufferWriter(owned).write(data)
    return pq.read_table(pa.BufferReader(owned), columns=columns)


class _CallingThreadParquetFile(pq.ParquetFile):
    """A ParquetFile over a Python file object that reads and decodes on the calling thread only (see above)."""

    def __init__(self, source, **kwargs):
        super().__init__(source, **(kwargs | {"pre_buffer": False}))

    def read(self, *args, **kwargs):
        return super().read(*args, **(kwargs | {"use_threads": False}))

    def read_row_group(self, *args, **kwargs):
        return super().read_row_group(*args, **(kwargs | {"use_threads": False}))

    def read_row_groups(self, *args, **kwargs):
        return super().read_row_groups(*args, **(kwargs | {"use_threads": False}))

    def iter_batches(self, *args, **kwargs):
        return super().iter_batches(*args, **(kwargs | {"use_threads": False}))


@contextlib.contextmanager
def open_parquet(uri: str, *, metadata: pq.FileMetaData | None = None) -> Iterator[pq.ParquetFile]:
    """A Parquet file at a local path or any fsspec URI (s3://...), read in place: a local file by path, a remote
    one by plain range requests (no read-ahead cache: a row group's column chunk is read once, exactly), decoded
    on the calling thread. A known footer (`metadata`) is not read again."""
    if is_local(uri):
        with pq.ParquetFile(uri.removeprefix("file://"), metadata=metadata) as parquet:
            yield parquet
        return
    fs, path = resolve(uri)
    with fs.open(path, "rb", cache_type="none") as f, _CallingThreadParquetFile(f, metadata=metadata) as parquet:
        yield parquet


def sha256_of(uri: str) -> str:
    fs, path = resolve(uri)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


HASH_THREADS = 16  # files hashed at once by sha256_of_each


def sha256_of_each(uris: list[str]) -> list[str | None]:
    """The sha256 of each file, in order (None for a file that is not there), HASH_THREADS files at a time: an
    object store's reads wait on the network, and hashlib releases the GIL while it hashes a chunk."""

    def one(uri: str) -> str | None:
        try:
            return sha256_of(uri)
        except FileNotFoundError:
            return None

    if len(uris) <= 1:
        return [one(uri) for uri in uris]
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(uris)), thread_name_prefix="sha256") as pool:
        return list(pool.map(one, uris))


INPUT_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz")  # what a directory of prompt files is searched for


def is_jsonl(uri: str) -> bool:
    """Whether ``uri`` is read as JSON Lines (``*.jsonl``, ``*.jsonl.gz``); any other file is read as Parquet."""
    return uri.endswith((".jsonl", ".jsonl.gz"))


def expand_input_files(patterns: list[str], *, field: str = "data.train_files") -> list[str]:
    """Files, directories (their *.parquet, *.jsonl and *.jsonl.gz, recursively) and globs -> a sorted,
    de-duplicated list of URIs. A file named explicitly or by a glob is taken whatever its suffix. ``field``: the
    config field that lists ``patterns``, which an error names."""
    out: list[str] = []
    for pattern in patterns:
        fs, path = resolve(pattern)
        prefix = protocol_prefix(pattern)
        if any(ch in path for ch in "*?["):
            matches = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            matches = [
                p
                for p in fs.find(path)
                if p.endswith(INPUT_SUFFIXES) and not p.rsplit("/", 1)[-1].startswith((".", "_"))
            ]
        elif fs.isfile(path):
            matches = [path]
        else:
            raise StorageError(f"{field}: {pattern!r} does not exist (no file, directory or glob match)")
        if not matches:
            raise StorageError(f"{field}: {pattern!r} matched no .parquet, .jsonl or .jsonl.gz files")
        out.extend(prefix + m for m in sorted(matches))
    return list(dict.fromkeys(out))


def local_copy(uri: str) -> str:
    """A local path for a model directory: local paths and hub ids pass through; an object-store directory
    is downloaded once into the cache ($BATCHRL_CACHE, default ~/.cache/batchrl) and reused while its
    ``_MANIFEST.json`` is unchanged."""
    if is_local(uri):
        return uri.removeprefix("file://")
    from pathlib import Path

    cache_root = Path(os.environ.get("BATCHRL_CACHE", "~/.cache/batchrl")).expanduser() / "models"
    fs, path = resolve(uri)
    try:  # a re-published policy directory (--from-stage update) has a new manifest: a new cache entry
        version = fs.cat_file(f"{path.rstrip('/')}/_MANIFEST.json")
    except FileNotFoundError:
        version = b""
    target = cache_root / hashlib.sha256(uri.encode() + b"\0" + version).hexdigest()[:16]
    if (target / ".complete").exists():
        return str(target)
    tmp = cache_root / f".tmp-{uuid.uuid4().hex}"
    download_dir(uri, str(tmp))
    (tmp / ".complete").write_text(uri)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def download_dir(uri: str, target: str) -> str:
    """Copies the files under the object-store directory ``uri`` into the local directory ``target`` (made), but
    for manifests and markers (names starting with _), which are not part of a checkpoint; returns ``target``.
    Uncached, for small directories read once (a LoRA adapter: `local_copy` keys its cache by the directory's
    manifest, which an adapter/ inside a policy has not)."""
    from pathlib import Path

    fs, path = resolve(uri)
    files = fs.find(path)
    if not files:
        raise FileNotFoundError(f"{uri} holds no files")
    for remote in files:
        relative = remote[len(path.rstrip("/")) + 1 :]
        if relative.startswith("_"):
            continue
        (Path(target) / relative).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(Path(target) / relative))
    return target


def upload_file(local_path: str, uri: str) -> None:
    """Copies one local file to ``uri``, streaming; atomic as write_bytes_atomic (rename / single PUT)."""
    fs, path = resolve(uri)
    if is_local(uri):
        import shutil

        parent = path.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, path)
    else:
        fs.put_file(local_path, path)


def file_identities(uris: list[str]) -> list[dict]:
    """{uri, size, version} per file: version is the ETag on object stores, the mtime (ns) locally, so a
    rewritten file under the same name reads as a different file."""
    out = []
    for uri in uris:
        fs, path = resolve(uri)
        info = fs.info(path)
        version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
        if isinstance(version, float):
            version = int(version * 1e9)
        out.append({"uri": uri, "size": int(info.get("size") or 0), "version": str(version).strip('"')})
    return out

"""Work journals: which shards of a table still being written are finished, read with one listing.

A sharded stage writes its parts as workers finish them, and its manifest only at the end. To resume after a
crash, the driver must tell the finished shards from the ones to redo. Opening every part to check it costs one
request per part (hours at 40k parts on an object store), so the driver records each finished shard instead: a
record (its key, the parts it wrote with their sizes and sha256, and whatever the stage needs to resume without
reading the part again, such as its counters) goes into the table's journal, ``<table>/_journal/``.

Why segments written by the driver, not one record file per shard: records are buffered and written together as
one segment (a JSON list, written atomically) every ``FLUSH_SECONDS`` or ``FLUSH_RECORDS`` records, so a stage of
40k shards writes a few hundred small files, and resuming reads one listing of the table directory plus each
segment once. A crash loses the records not yet flushed; those shards are redone, and since a shard's output is a
function of its input, the redo rewrites the same part names with the same rows. Segments are compacted into one
when more than ``MAX_SEGMENTS`` have piled up (the new segment is written before the old ones are deleted, so a
crash in between only leaves duplicates, which load merges by key).

A record counts only while every part it names is present with its recorded size (from the same listing) and
hashes to its recorded sha256: a part deleted, truncated or replaced since is redone. Why the hash, when the
listing alone needs no read: a file of the same size and other content (the same table with one column changed,
padded to the byte) would otherwise be taken for the shard's output, written into the manifest under the sha256
the record holds, and read by the next stage before anything compared the two. So loading reads each claimed
part once, ``HASH_THREADS`` at a time: a resume rereads what it keeps (far less than redoing it), and a fresh
stage, whose journal is empty, reads nothing. Files under part names that no record claims (a shard that was in
flight, or a file copied in by hand) are not trusted; the stage rewrites them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from batchrl.storage.fs import join, resolve, sha256_of_each, write_bytes_atomic
from batchrl.storage.manifest import PartInfo, file_sizes

logger = logging.getLogger(__name__)

JOURNAL_DIR = "_journal"
FLUSH_SECONDS = 10.0
FLUSH_RECORDS = 512
MAX_SEGMENTS = 64


def record(key: str, parts: Iterable[PartInfo], **fields: Any) -> dict[str, Any]:
    """A journal record: the shard's key, the parts it wrote, and the stage's own fields (JSON-serialisable)."""
    return {"key": key, "parts": [asdict(p) for p in parts], **fields}


def record_parts(entry: dict[str, Any]) -> list[PartInfo]:
    return [PartInfo(**p) for p in entry["parts"]]


class Journal:
    """The journal of one table directory."""

    def __init__(self, table_dir: str):
        self.table_dir = table_dir
        self.dir = join(table_dir, JOURNAL_DIR)

    def load(self, *, sizes: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
        """The records whose parts are all present with their recorded sizes and sha256, by key (a later record of
        a key replaces an earlier one). ``sizes``: the table directory's listing (`file_sizes`), if the caller has
        it. Each part a record of the right size claims is read once and hashed (see the module's docstring)."""
        sizes = file_sizes(self.table_dir) if sizes is None else sizes
        segments = sorted(name for name in sizes if name.startswith(f"{JOURNAL_DIR}/seg-") and name.endswith(".json"))
        records: dict[str, dict[str, Any]] = {}
        for name in segments:
            for entry in self._read_segment(name):
                records[entry["key"]] = entry
        if len(segments) > MAX_SEGMENTS:
            self._compact(list(records.values()), old=segments)
        intact = {key: entry for key, entry in records.items() if _parts_present(entry, sizes)}
        if len(intact) < len(records):
            logger.info(
                "%s: %d journal record(s) name a part that is gone or changed; their shards are redone",
                self.table_dir,
                len(records) - len(intact),
            )
        return self._hashing_as_recorded(intact)

    def _hashing_as_recorded(self, records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``records`` less those with a part whose sha256 is not the recorded one (a warning names each part)."""
        names = sorted({p["name"] for entry in records.values() for p in entry["parts"]})
        actual = dict(zip(names, sha256_of_each([join(self.table_dir, name) for name in names])))
        kept = {}
        for key, entry in records.items():
            changed = [p["name"] for p in entry["parts"] if actual[p["name"]] != p["sha256"]]
            for name in changed:
                logger.warning(
                    "%s does not hash to the sha256 its journal record holds (changed after it was written): not "
                    "taken for the stage's output, its work is redone",
                    join(self.table_dir, name),
                )
            if not changed:
                kept[key] = entry
        return kept

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Writes ``entries`` as one new segment (atomically); nothing for an empty list."""
        if entries:
            name = f"{JOURNAL_DIR}/seg-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
            write_bytes_atomic(join(self.table_dir, name), json.dumps(entries).encode())

    def writer(self) -> JournalWriter:
        return JournalWriter(self)

    def _read_segment(self, name: str) -> list[dict[str, Any]]:
        fs, path = resolve(join(self.table_dir, name))
        try:
            entries = json.loads(fs.cat_file(path))
            if isinstance(entries, list) and all(isinstance(e, dict) and "key" in e and "parts" in e for e in entries):
                return entries
            reason = "not a list of records"
        except (OSError, ValueError) as err:
            reason = str(err) or type(err).__name__
        logger.warning("ignoring journal segment %s (%s): its shards are redone", path, reason)
        return []

    def _compact(self, entries: list[dict[str, Any]], *, old: list[str]) -> None:
        self.append(entries)
        fs, _ = resolve(self.table_dir)
        for name in old:
            fs.rm(resolve(join(self.table_dir, name))[1])


class JournalWriter:
    """Buffers records and appends them as segments: every FLUSH_SECONDS / FLUSH_RECORDS, and on close."""

    def __init__(self, journal: Journal):
        self.journal = journal
        self.pending: list[dict[str, Any]] = []
        self.last_flush = time.monotonic()

    def add(self, entry: dict[str, Any]) -> None:
        self.pending.append(entry)
        if len(self.pending) >= FLUSH_RECORDS or time.monotonic() - self.last_flush >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        self.journal.append(self.pending)
        self.pending = []
        self.last_flush = time.monotonic()

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.flush()  # also on an error: what finished before it need not be redone


def _parts_present(entry: dict[str, Any], sizes: dict[str, int]) -> bool:
    return all(sizes.get(p["name"]) == p["num_bytes"] for p in entry["parts"])

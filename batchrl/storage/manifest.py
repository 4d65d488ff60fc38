"""Stage manifests: ``_MANIFEST.json`` written LAST in a stage's output directory.

Its existence means the stage completed; readers trust only the parts it lists. It records the stage,
its fingerprint (hash of the stage's config and its upstream fingerprints), every part with row count,
size and sha256, the output schema, timings, counters (rejects, failures), the code version and, for
ingest, the input files read (``sources``: the watermark of incremental runs).

Two more records protect what a stage reads from what it was made from:

- ``inputs``: the content digest (`content_digest`) of every input the stage was made from, by table name
  (``policy``: the input policy's manifest, or the lineage's fingerprint of the initial policy). A committed
  stage whose recorded digest no longer matches its upstream's manifest was made from data that is gone and
  is redone. None in manifests written before it was recorded.
- ``trainer_state``: files a stage wrote that a later stage loads but that may be deleted on purpose (the
  update's optimizer state, pruned by keep-last-K), with their sha256. They are verified before they are
  loaded, but not checked by ``damaged_parts``: a pruned state must not make its stage damaged. None in
  manifests written before it was recorded; [] when no state was saved.

``damaged_parts`` checks a committed table against its manifest: every part present with its recorded
size (one listing; catches deleted and truncated parts), or, with ``checksums``, its recorded sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field, fields

from batchrl import __version__
from batchrl.storage.fs import is_local, join, resolve, sha256_of, write_bytes_atomic

logger = logging.getLogger(__name__)

_quote = json.encoder.encode_basestring_ascii  # how json.dumps writes a str (ensure_ascii, C-accelerated)

MANIFEST_NAME = "_MANIFEST.json"


@dataclass(slots=True)
class PartInfo:
    """One file of a table. Not frozen, though nothing changes one once made: a plan over 40k-part tables builds
    hundreds of thousands, and a frozen dataclass's __init__ costs 3x a plain one's (~1 s more per plan); slots
    save a dict per instance."""

    name: str
    rows: int
    sha256: str
    num_bytes: int

    def to_json(self) -> str:
        """One line of JSON, as ``json.dumps`` (sorted keys) writes it, but ~10x faster than its indented encoder (pure
        Python) over a list of parts."""
        return (
            f'{{"name": {_quote(self.name)}, "num_bytes": {int(self.num_bytes)}, "rows": {int(self.rows)}, '
            f'"sha256": {_quote(self.sha256)}}}'
        )

    @classmethod
    def list_from(cls, raw: list[dict]) -> list[PartInfo]:
        """The parts of a manifest's JSON list. Names are interned: the tables of a run repeat the same part names
        (part-00000.parquet, ...), one copy will do."""
        intern = sys.intern
        return [cls(intern(p["name"]), p["rows"], p["sha256"], p["num_bytes"]) for p in raw]


@dataclass
class Manifest:
    stage: str
    table: str
    iteration: int | None
    fingerprint: str
    parts: list[PartInfo]
    schema: str
    started_at: float
    finished_at: float
    counts: dict[str, int] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    extra_parts: dict[str, list[PartInfo]] = field(default_factory=dict)  # e.g. {"rejects": [...]}
    code_version: str = __version__
    sources: list[dict] = field(default_factory=list)  # ingest: input files read, {uri, size, version}
    inputs: dict[str, str] | None = None  # content digest of each input by table name (None: not recorded)
    trainer_state: list[PartInfo] | None = None  # update: the optimizer state files (None: not recorded)
    # the fingerprint without the digests of user code (PlannedStage.config_fingerprint; None: not recorded)
    config_fingerprint: str | None = None

    @property
    def num_rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def all_parts(self) -> list[PartInfo]:
        return list(self.parts) + [p for extra in self.extra_parts.values() for p in extra]

    def to_json(self) -> str:
        """Indented JSON with sorted keys, each part on one line: a 40k-part manifest is ~4 MB written in ~0.1 s
        (``json.dumps(asdict(self), indent=2)`` made it 7 MB in 0.5 s, and reading it back cost as much)."""
        lists: dict[str, list[PartInfo]] = {}  # placeholder -> the parts written in its place

        def placeholder(parts: list[PartInfo] | None) -> str | None:
            if parts is None:
                return None
            key = f"\x00parts-{uuid.uuid4().hex}"
            lists[json.dumps(key)] = parts
            return key

        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        raw["parts"] = placeholder(self.parts)
        raw["extra_parts"] = {name: placeholder(parts) for name, parts in self.extra_parts.items()}
        raw["trainer_state"] = placeholder(self.trainer_state)
        text = json.dumps(raw, indent=2, sort_keys=True)
        for quoted, parts in lists.items():
            at = text.index(quoted)
            line = text[text.rfind("\n", 0, at) + 1 : at]
            text = text[:at] + _parts_json(parts, indent=len(line) - len(line.lstrip(" "))) + text[at + len(quoted) :]
        return text

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        raw["parts"] = PartInfo.list_from(raw["parts"])
        raw["extra_parts"] = {k: PartInfo.list_from(v) for k, v in raw.get("extra_parts", {}).items()}
        if raw.get("trainer_state") is not None:
            raw["trainer_state"] = PartInfo.list_from(raw["trainer_state"])
        return cls(**raw)


def _parts_json(parts: list[PartInfo], *, indent: int) -> str:
    if not parts:
        return "[]"
    pad = " " * (indent + 2)
    return "[\n" + ",\n".join(pad + part.to_json() for part in parts) + "\n" + " " * indent + "]"


def manifest_uri(table_dir: str) -> str:
    return join(table_dir, MANIFEST_NAME)


def read_manifest(table_dir: str) -> Manifest | None:
    """The committed manifest of ``table_dir``, or None when the stage has not completed there."""
    fs, path = resolve(manifest_uri(table_dir))
    try:
        with fs.open(path, "rb") as f:
            text = f.read().decode()
    except FileNotFoundError:
        return None
    try:
        return Manifest.from_json(text)
    except (ValueError, TypeError, KeyError) as err:
        logger.warning("ignoring unreadable manifest %s (%s); the stage will be redone", path, err)
        return None


def write_manifest(table_dir: str, manifest: Manifest) -> None:
    write_bytes_atomic(manifest_uri(table_dir), manifest.to_json().encode())


def file_sizes(directory: str) -> dict[str, int]:
    """Size of every file under ``directory`` by its path relative to it, from one (uncached) listing; {} when the
    directory does not exist."""
    fs, path = resolve(directory)
    root = path.rstrip("/")
    if is_local(directory):
        return _local_file_sizes(root)
    try:
        fs.invalidate_cache(root)
        return {name[len(root) + 1 :]: int(info.get("size") or 0) for name, info in fs.find(root, detail=True).items()}
    except FileNotFoundError:
        return {}


def _local_file_sizes(root: str, prefix: str = "") -> dict[str, int]:
    """`file_sizes` of a local directory with os.scandir: fsspec's find builds an info dict per file, ~25 us each
    (7 s for the 280k files of a plan over 40k-part tables)."""
    sizes: dict[str, int] = {}
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return sizes
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            sizes.update(_local_file_sizes(entry.path, f"{prefix}{entry.name}/"))
        else:
            sizes[prefix + entry.name] = entry.stat().st_size
    return sizes


def damaged_parts(table_dir: str, manifest: Manifest, *, checksums: bool = False) -> list[str]:
    """Names of the manifest's parts that are missing, have another size or (checksums) another sha256."""
    sizes = file_sizes(table_dir)
    damaged = []
    for part in manifest.all_parts:
        if sizes.get(part.name) != part.num_bytes:
            damaged.append(part.name)
        elif checksums and sha256_of(join(table_dir, part.name)) != part.sha256:
            damaged.append(part.name)
    return damaged


def content_digest(manifest: Manifest) -> str:
    """sha256 of a table's parts (names and sha256): what its readers read. Side records (extra_parts: rejects,
    log-probs) and the trainer state are left out, so only a change to what a later stage reads counts."""
    payload = json.dumps(sorted((p.name, p.sha256) for p in manifest.parts))
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def fingerprint(stage_config: object, *upstream: str) -> str:
    """sha256 of the stage's config (JSON, sorted keys) and its upstream fingerprints, shortened."""
    payload = json.dumps({"config": stage_config, "upstream": list(upstream)}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]

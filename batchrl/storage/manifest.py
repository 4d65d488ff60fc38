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
from dataclasses import asdict, dataclass, field

from batchrl import __version__
from batchrl.storage.fs import join, resolve, sha256_of, write_bytes_atomic

logger = logging.getLogger(__name__)

MANIFEST_NAME = "_MANIFEST.json"


@dataclass(frozen=True)
class PartInfo:
    name: str
    rows: int
    sha256: str
    num_bytes: int


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

    @property
    def num_rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def all_parts(self) -> list[PartInfo]:
        return list(self.parts) + [p for extra in self.extra_parts.values() for p in extra]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        raw["parts"] = [PartInfo(**p) for p in raw["parts"]]
        raw["extra_parts"] = {k: [PartInfo(**p) for p in v] for k, v in raw.get("extra_parts", {}).items()}
        if raw.get("trainer_state") is not None:
            raw["trainer_state"] = [PartInfo(**p) for p in raw["trainer_state"]]
        return cls(**raw)


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
    try:
        fs.invalidate_cache(root)
        return {name[len(root) + 1 :]: int(info.get("size") or 0) for name, info in fs.find(root, detail=True).items()}
    except FileNotFoundError:
        return {}


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

"""Nightly lineage: warm starts (``run.init_from``) and incremental ingestion (``run.new_files_only``).

A nightly job is a chain of runs. Each warm-starts from the last policy of the run before it and ingests
only the input files that no run of the chain has ingested yet. What a run inherits (its initial policy
and the files already seen) is resolved at its first start and frozen in ``<run>/_LINEAGE.json``, so a
resumed run starts from the same policy and skips the same files even if the previous run or the prompt
location changed meanwhile.

Why a set of seen files rather than a high-water mark (newest name or modification time): files of a
growing location do not reliably arrive in name or time order (late uploads, backfills); a set misses
none. A file is known by (uri, size, version), version = ETag on object stores, mtime locally: a file
rewritten in place counts as new. The set a run passes on = the files its ingest read (the prompts
manifest's ``sources``) plus the set it inherited.

``init_from`` may be a glob over run directories (``s3://bucket/runs/nightly-*``): the run whose name sorts
last among those before this run's own name, and that is complete, is used. With date-stamped run ids
(nightly-2026-12-02) that is "the latest finished night before this one": a night that failed is passed
over (its files were never recorded as seen, so the next night ingests them), a backfill warm-starts from
the night before it, and the very first night, which matches nothing, starts from model.path.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

import yaml

from batchrl.config import ConfigError, PipelineConfig
from batchrl.storage import RunLayout, expand_input_files, file_identities, join, resolve, write_bytes_atomic
from batchrl.storage.fs import protocol_prefix
from batchrl.storage.manifest import Manifest, fingerprint, read_manifest

logger = logging.getLogger(__name__)


@dataclass
class Lineage:
    init_from: str | None  # run.init_from as given (None: a fresh run from model.path)
    initial_policy: str  # the policy the first iteration starts from
    initial_policy_fingerprint: str
    seen_files: list[dict] = field(default_factory=list)  # files ingested by earlier runs of the chain
    no_new_files: bool = False  # set when the run found nothing new to ingest (and so trained nothing)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Lineage:
        return cls(**json.loads(text))

    def skips_seen_files(self, cfg: PipelineConfig) -> bool:
        return self.init_from is not None and cfg.run.new_files_only


def fresh_lineage(cfg: PipelineConfig) -> Lineage:
    return Lineage(
        init_from=None,
        initial_policy=cfg.model.path,
        initial_policy_fingerprint=fingerprint({"initial_policy": cfg.model.path}),
    )


def carried_table(lineage: Lineage, table: str) -> tuple[str, str] | None:
    """(directory, fingerprint) of ``table`` as committed beside the warm-start policy (its sibling in that run's
    iter_NNNN/), None on a fresh run or where that run has none: the prompt_stats a nightly run carries forward, so
    that tonight starts from what last night learned about each prompt (issue 37, item 4)."""
    if lineage.init_from is None:
        return None
    table_dir = join(lineage.initial_policy.rstrip("/").rsplit("/", 1)[0], table)
    manifest = read_manifest(table_dir)
    return None if manifest is None else (table_dir, manifest.fingerprint)


def read_lineage(run_dir: str) -> Lineage | None:
    fs, path = resolve(RunLayout(run_dir).lineage)
    try:
        return Lineage.from_json(fs.cat_file(path).decode())
    except FileNotFoundError:
        return None


def write_lineage(run_dir: str, lineage: Lineage) -> None:
    write_bytes_atomic(RunLayout(run_dir).lineage, lineage.to_json().encode())


def resolve_lineage(cfg: PipelineConfig) -> Lineage:
    """The run's lineage: frozen in its _LINEAGE.json once started, else resolved from run.init_from."""
    if cfg.run.init_from is None:
        return fresh_lineage(cfg)
    run_dir = RunLayout.for_run(cfg.run.root, cfg.run_id).run_dir
    stored = read_lineage(run_dir)
    if stored is not None and stored.init_from == cfg.run.init_from:
        return stored
    source = cfg.run.init_from.rstrip("/")
    if source == run_dir.rstrip("/"):
        raise ConfigError(f"run.init_from={source!r} is this run's own directory; point it at the previous run")
    if any(ch in source for ch in "*?["):
        found = _latest_complete_run(source, before=cfg.run_id)
        if found is None:
            logger.warning(
                "run.init_from=%s matches no complete run before %s: starting from model.path (%s)",
                source,
                cfg.run_id,
                cfg.model.path,
            )
            return Lineage(
                init_from=cfg.run.init_from,
                initial_policy=cfg.model.path,
                initial_policy_fingerprint=fingerprint({"initial_policy": cfg.model.path}),
            )
        policy_dir, policy_fp, source_run = found
    else:
        policy_dir, policy_fp, source_run = _last_policy(source)
    seen = _files_seen_by(source_run) if cfg.run.new_files_only else []
    logger.info("warm start from %s (%d input file(s) already ingested by earlier runs)", policy_dir, len(seen))
    return Lineage(
        init_from=cfg.run.init_from, initial_policy=policy_dir, initial_policy_fingerprint=policy_fp, seen_files=seen
    )


def _last_policy(source: str) -> tuple[str, str, str]:
    """(policy dir, its fingerprint, the run it belongs to) for a run dir or an iter_NNNN/policy dir."""
    manifest = read_manifest(source)
    if manifest is not None and manifest.stage == "update":
        return source, _policy_fingerprint(source, manifest), source.rsplit("/", 2)[0]
    raw = _run_yaml(source)
    previous = read_lineage(source)
    if previous is not None and previous.no_new_files:
        return previous.initial_policy, previous.initial_policy_fingerprint, source
    iterations = int((raw.get("run") or {}).get("iterations", 1))
    policy_dir = RunLayout(source).table_dir("policy", iterations - 1)
    manifest = read_manifest(policy_dir)
    if manifest is None:
        raise ConfigError(
            f"run.init_from: {source} is not complete ({policy_dir} has no manifest): resume it "
            f"first (batchrl run ... --run-id {source.rsplit('/', 1)[-1]}), or set run.init_from "
            f"to one of its completed iter_NNNN/policy directories"
        )
    return policy_dir, _policy_fingerprint(policy_dir, manifest), source


def _latest_complete_run(pattern: str, *, before: str) -> tuple[str, str, str] | None:
    """_last_policy of the last-named complete run matching ``pattern`` whose name sorts before ``before``."""
    fs, path = resolve(pattern)
    prefix = protocol_prefix(pattern)
    names = sorted((p for p in fs.glob(path) if p.rstrip("/").rsplit("/", 1)[-1] < before), reverse=True)
    for candidate in names:
        try:
            return _last_policy(prefix + candidate.rstrip("/"))
        except ConfigError as err:
            logger.warning("run.init_from: passing over %s: %s", candidate, err)
    return None


def _policy_fingerprint(policy_dir: str, manifest: Manifest) -> str:
    return fingerprint(
        {
            "initial_policy": policy_dir,
            "manifest": manifest.fingerprint,
            "files": sorted(p.sha256 for p in manifest.parts),
        }
    )


def _run_yaml(run_dir: str) -> dict:
    fs, path = resolve(join(run_dir, "run.yaml"))
    try:
        return yaml.safe_load(fs.cat_file(path).decode()) or {}
    except FileNotFoundError:
        raise ConfigError(
            f"run.init_from: {run_dir} is neither a batchrl run directory (no run.yaml) nor a "
            f"policy directory (no update manifest); fix the path"
        ) from None


def _files_seen_by(run_dir: str) -> list[dict]:
    """The files ``run_dir`` ingested plus those it inherited: what its successor must skip."""
    raw = _run_yaml(run_dir)
    if (raw.get("data") or {}).get("max_prompts") is not None:
        raise ConfigError(
            f"run.init_from: {run_dir} used data.max_prompts, so it may have stopped reading its "
            f"input files part-way; the files it ingested are unknown: set run.new_files_only: false"
        )
    lineage = read_lineage(run_dir)
    seen = list(lineage.seen_files) if lineage is not None else []
    prompts = read_manifest(RunLayout(run_dir).table_dir("prompts", None))
    if prompts is not None:
        if prompts.parts and not prompts.sources:
            raise ConfigError(
                f"run.init_from: {run_dir}'s prompts manifest does not list its input files (written "
                f"by an older batchrl): set run.new_files_only: false"
            )
        seen += prompts.sources
    return _dedupe(seen)


def _dedupe(files: list[dict]) -> list[dict]:
    keyed = {_key(f): f for f in files}
    return [keyed[k] for k in sorted(keyed)]


def _key(file: dict) -> tuple[str, int, str]:
    return file["uri"], int(file["size"]), str(file["version"])


def files_to_ingest(cfg: PipelineConfig, lineage: Lineage) -> tuple[list[dict], int]:
    """(identities of the input files ingest should read, number skipped as already seen)."""
    files = file_identities(expand_input_files(cfg.data.train_files))
    if not lineage.skips_seen_files(cfg):
        return files, 0
    seen = {_key(f) for f in lineage.seen_files}
    new = [f for f in files if _key(f) not in seen]
    return new, len(files) - len(new)


def seen_fingerprint(lineage: Lineage) -> str:
    """Part of ingest's fingerprint in incremental runs: which files were excluded."""
    return fingerprint([list(_key(f)) for f in lineage.seen_files])

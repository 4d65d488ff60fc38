"""ingest's worker: one input chunk -> its prompt parts and its rejects part, written atomically; and the rewrite
of a chunk's parts without rows found later to be duplicates, or past data.max_prompts.

A worker loads the tokenizer once and serves many jobs (a Ray actor; on a small input, the driver itself).
It returns counts and part infos only, never rows: the driver's memory does not grow with the input.

A chunk's valid rows go into parts of ``data.shard_size`` rows in input order (the last one shorter), named from
the indices the plan reserved for the chunk (``Chunk.part_names``); its rejects, in input order, into
``_rejects/<its first part name>`` (no file when it has none). Both are functions of the chunk's input alone, so a
redone chunk rewrites the same files with the same bytes.

A streamed chunk (a gzipped JSONL file, a big Parquet row group: ``Chunk.streamed``) is read in windows of
``window_rows`` records, each processed as a chunk of its own would be (``ingest_window``) into the parts and
rejects part named for that window (``Chunk.window_part_names``); its result is the windows' results merged
(``merge_windows``). The windows come either from ``read_windows`` here (one worker, front to back) or from
``stream_windows`` run as a Ray task that decompresses or decodes while the pool's actors tokenize.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import pyarrow as pa

from batchrl.config import PipelineConfig
from batchrl.errors import DataError
from batchrl.rewards import LabelRule
from batchrl.stages.ingest_duplicates import DuplicatesWorker
from batchrl.stages.ingest_logged import tokenize_responses
from batchrl.stages.ingest_rows import (
    INPUT_COLUMNS,
    Reject,
    count_truncated,
    duplicate_reject,
    fit_length,
    load_tokenizer,
    normalized_row,
    source_of_file,
    tokenize_rows,
    validate,
)
from batchrl.storage import join, read_parquet, write_parquet_atomic
from batchrl.storage.inputs import Chunk, read_chunk, read_windows
from batchrl.storage.manifest import PartInfo
from batchrl.storage.schemas import absent_as_null, load_schema

logger = logging.getLogger(__name__)

SOURCE_DATA_SOURCE = "source_data_source"  # a prompts manifest's count of the rows of one data_source in one source


class IngestWorker(DuplicatesWorker):
    """A Ray actor of ingest's IngestPool (or the driver's own worker): ``run_job(job) -> result``. A data
    error (a tokenizer that cannot be loaded or has no chat template, an unreadable row group) comes back as
    ``{"error": message}``, which the driver raises as a DataError: raised here, it would reach the user wrapped in
    Ray's traceback. It also runs the steps of the duplicates pass (DuplicatesWorker)."""

    def __init__(self, *, cfg: PipelineConfig, output_dir: str):
        self.cfg = cfg
        self.output_dir = output_dir
        self.labels = LabelRule(cfg.score, sources=cfg.data.sources)
        self._tokenizer = None

    def run_job(self, job: dict[str, Any]) -> dict[str, Any]:
        chunk = Chunk.from_json(job["chunk"])
        try:
            if job["kind"] == "chunk":
                return ingest_chunk(
                    chunk,
                    self.tokenizer(),
                    cfg=self.cfg,
                    output_dir=self.output_dir,
                    labels=self.labels,
                    window_rows=job["window_rows"],
                )
            if job["kind"] == "window":
                return self._window(job, chunk)
            return rewrite_chunk(job, chunk, self.tokenizer, cfg=self.cfg, output_dir=self.output_dir)
        except DataError as err:
            return {"error": str(err)}

    def _window(self, job: dict[str, Any], chunk: Chunk) -> dict[str, Any]:
        """One window of a streamed chunk, its records in Ray's object store (``job["records"]``: [its ref], a ref
        nested in a list: Ray hands it over unresolved, so the driver never holds the records)."""
        import ray

        records = ray.get(job["records"][0])
        if isinstance(records, str):  # the reader's DataError
            return {"error": records}
        result = ingest_window(
            chunk,
            job["window"],
            records,
            self.tokenizer(),
            cfg=self.cfg,
            output_dir=self.output_dir,
            labels=self.labels,
        )
        return result | {"window": job["window"]}

    def tokenizer(self):
        """The tokenizer, loaded on first use (a rewrite needs it only to recount truncated prompts)."""
        if self._tokenizer is None:
            tokenizer = load_tokenizer(self.cfg)
            problem = chat_template_problem(self.cfg, tokenizer)
            if problem is not None:
                raise DataError(problem)
            self._tokenizer = tokenizer
        return self._tokenizer


def chat_template_problem(cfg: PipelineConfig, tokenizer) -> str | None:
    """Why prompts cannot be templated with this tokenizer (None when they can)."""
    if cfg.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        return (
            f"the tokenizer of {cfg.model.tokenizer or cfg.model.path} has no chat template; "
            f"set data.apply_chat_template: false to feed prompts as plain text"
        )
    return None


def ingest_chunk(
    chunk: Chunk, tokenizer, *, cfg: PipelineConfig, output_dir: str, labels: LabelRule, window_rows: int
) -> dict[str, Any]:
    """Reads, validates, templates and tokenizes one chunk, writes its parts and rejects; returns what the journal
    records of it (parts, counts, rows read). A streamed chunk is read and processed a window at a time."""
    if not chunk.streamed:
        records = read_chunk(chunk, columns=INPUT_COLUMNS)
        return ingest_window(chunk, 0, records, tokenizer, cfg=cfg, output_dir=output_dir, labels=labels)
    windows = read_windows(chunk, columns=INPUT_COLUMNS, window_rows=window_rows)
    results = [
        ingest_window(chunk, w, records, tokenizer, cfg=cfg, output_dir=output_dir, labels=labels)
        for w, records in enumerate(windows)
    ]
    return merge_windows(chunk, results)


def stream_windows(chunk_json: str, window_rows: int) -> Iterator[list[tuple[int, Any]] | str]:
    """The windows of a streamed chunk, read front to back (run as a Ray generator task: each window goes to Ray's
    object store as it is read); a read error is yielded as its message, for the worker that takes it to return."""
    try:
        yield from read_windows(Chunk.from_json(chunk_json), columns=INPUT_COLUMNS, window_rows=window_rows)
    except DataError as err:
        yield str(err)


def merge_windows(chunk: Chunk, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The result of a streamed chunk from those of its windows, in window order: parts concatenated, counts summed."""
    parts, counts, read = [], {"prompts": 0, "truncated_prompts": 0, "rejected": 0}, 0
    for result in results:
        parts += result["parts"]
        read += result["read"]
        for key, value in result["counts"].items():
            counts[key] = counts.get(key, 0) + value
    return {"key": chunk.key, "parts": parts, "counts": counts, "read": read}


def ingest_window(
    chunk: Chunk, window: int, records: list, tokenizer, *, cfg: PipelineConfig, output_dir: str, labels: LabelRule
) -> dict[str, Any]:
    """``records`` ((row number, record or why not), as read_chunk gives them) of ``chunk``'s ``window``-th window
    (0 for a chunk read whole) validated, templated and tokenized into its parts and its rejects part."""
    data = cfg.data
    source = source_of_file(cfg, chunk.uri)  # data.sources: the rows' source, and the directory of their parts
    labels = labels.for_source(source)  # a source's own reward terms say which of its rows need a label
    rows, rejects = [], []
    for row_number, raw in records:
        if isinstance(raw, str):  # a JSONL line that is not a JSON object
            rejects.append(Reject(chunk.uri, row_number, None, "bad_json", raw))
            continue
        row = normalized_row(raw, uri=chunk.uri, stem=chunk.stem, row=row_number)
        reject = validate(row, labels, logged=cfg.generate.logged)
        (rows if reject is None else rejects).append(row if reject is None else reject)
    tokenize_rows(rows, tokenizer, apply_template=data.apply_chat_template, tools=cfg.generate)
    if cfg.generate.logged is not None:
        bad = tokenize_responses(rows, tokenizer, max_tokens=cfg.generate.max_new_tokens)
        rejects += [
            Reject(r["source_file"], r["source_row"], r["prompt_id"], reason, detail) for r, reason, detail in bad
        ]
        dropped = {id(r) for r, _, _ in bad}
        rows = [row for row in rows if id(row) not in dropped]
    kept = []
    for row in rows:
        reject = fit_length(row, tokenizer, max_tokens=data.max_prompt_tokens, policy=data.overlong_prompts)
        (kept if reject is None else rejects).append(row if reject is None else reject)
    tables = [
        prompt_table(kept[start : start + data.shard_size], source=source)
        for start in range(0, len(kept), data.shard_size)
    ]
    names = chunk.window_part_names(window, len(tables))
    parts = write_parts([f"{source}/{n}" for n in names] if source else names, tables, output_dir=output_dir)
    rejects.sort(key=lambda r: r.source_row)
    reject_part = write_rejects(chunk.window_rejects_name(window), [asdict(r) for r in rejects], output_dir=output_dir)
    counts = chunk_counts(tables, rejects=rejects, truncated=sum(r.get("truncated", False) for r in kept))
    return {"key": chunk.key, "parts": [asdict(p) for p in parts + reject_part], "counts": counts, "read": len(records)}


def prompt_table(rows: list[dict[str, Any]], *, source: str | None = None) -> pa.Table:
    """Rows as a table of the prompts schema (built column by column: twice as fast as row dicts); ``source``: the
    data.sources name of every row (else a row's own, null when it has none)."""
    schema, optional = load_schema("prompts"), absent_as_null("prompts")
    columns = {name: [row.get(name) if name in optional else row[name] for row in rows] for name in schema.names}
    if source is not None:
        columns["source"] = [source] * len(rows)
    return pa.table(columns, schema=schema)


def write_parts(names: list[str], tables: list[pa.Table], *, output_dir: str) -> list[PartInfo]:
    parts = []
    for name, table in zip(names, tables):
        num_bytes, digest = write_parquet_atomic(table, join(output_dir, name))
        parts.append(PartInfo(name=name, rows=table.num_rows, sha256=digest, num_bytes=num_bytes))
    return parts


def write_rejects(name: str, rejects: list[dict[str, Any]], *, output_dir: str) -> list[PartInfo]:
    """A chunk's (or window's) rejects part ``name`` ([] and no file when it rejected nothing)."""
    if not rejects:
        return []
    table = pa.Table.from_pylist(rejects, schema=load_schema("prompt_rejects"))
    num_bytes, digest = write_parquet_atomic(table, join(output_dir, name))
    return [PartInfo(name, table.num_rows, digest, num_bytes)]


def chunk_counts(tables: list[pa.Table], *, rejects: list[Reject], truncated: int) -> dict[str, int]:
    """prompts, rejected, rejected/<reason>, data_source/<name>, truncated_prompts of one chunk; with data.sources,
    source_data_source/<source>/<name> too (which data_sources a source holds: the score stage's preflight)."""
    counts = {"prompts": sum(t.num_rows for t in tables), "truncated_prompts": truncated}
    counts.update(_reject_counts([r.reason for r in rejects]))
    for table in tables:
        for key in _data_source_keys(table.select(["data_source", "source"]).to_pylist()):
            counts[key] = counts.get(key, 0) + 1
    return counts


def _data_source_keys(rows: list[dict[str, Any]]) -> Iterator[str]:
    """data_source/<name> of each row, and source_data_source/<source>/<name> of each row with a source."""
    for row in rows:
        yield f"data_source/{row['data_source']}"
        if row.get("source") is not None:
            yield f"{SOURCE_DATA_SOURCE}/{row['source']}/{row['data_source']}"


def rewrite_chunk(
    job: dict[str, Any], chunk: Chunk, tokenizer: Callable[[], Any], *, cfg: PipelineConfig, output_dir: str
) -> dict[str, Any]:
    """A chunk's parts rewritten without the rows ``job["drop"]`` names ({part name: row indices}: later
    occurrences of a prompt id, rejected as duplicate_prompt_id) and, with ``job["keep"]``, without the rows after
    its first ``keep`` valid ones (data.max_prompts) nor the rejects after the last kept row. Parts left unchanged
    are not rewritten, parts left empty are dropped; the counts are the recorded ones less what was removed.
    ``tokenizer()`` loads the tokenizer, needed only to tell whether a removed row had been truncated."""
    drop, keep = {name: set(rows) for name, rows in job["drop"].items()}, job.get("keep")
    old_parts = [PartInfo(**p) for p in job["parts"]]
    parts, duplicates, kept, last_row = [], [], 0, None
    trimmed = Counter()  # of the rows past ``keep``: counted part by part, not held (a streamed chunk has millions)
    for part in (p for p in old_parts if not p.name.startswith("_rejects/")):
        dropped = drop.get(part.name, set())
        if not dropped and keep is None:
            parts.append(part)
            continue
        rows = read_parquet(join(output_dir, part.name)).to_pylist()
        duplicates += [rows[i] for i in sorted(dropped)]
        unique = [row for i, row in enumerate(rows) if i not in dropped]
        if keep is not None:
            room = max(keep - kept, 0)
            trimmed += _tally(unique[room:], tokenizer, cfg=cfg)
            unique = unique[:room]
        kept += len(unique)
        last_row = unique[-1]["source_row"] if unique else last_row
        if len(unique) == len(rows):
            parts.append(part)
        elif unique:
            parts.append(_rewritten(part.name, prompt_table(unique), output_dir))
    rejects = _chunk_rejects(old_parts, output_dir=output_dir) + [asdict(duplicate_reject(r)) for r in duplicates]
    if keep is not None and last_row is not None:  # today's reading stopped at the last kept row
        rejects = [r for r in rejects if r["source_row"] < last_row]
    rejects.sort(key=lambda r: r["source_row"])
    reject_part = write_rejects(chunk.rejects_name, rejects, output_dir=output_dir)
    counts = _counts_less(job["counts"], trimmed + _tally(duplicates, tokenizer, cfg=cfg))
    counts.update(_reject_counts([r["reason"] for r in rejects]))
    return {"key": chunk.key, "parts": [asdict(p) for p in parts + reject_part], "counts": counts, "read": job["read"]}


def _tally(rows: list[dict[str, Any]], tokenizer: Callable[[], Any], *, cfg: PipelineConfig) -> Counter:
    """The counts ``rows`` (prompt rows removed from a chunk) take along: prompts, truncated_prompts and
    data_source/<name>."""
    tally = Counter(_data_source_keys(rows))
    tally.update(prompts=len(rows), truncated_prompts=count_truncated(rows, tokenizer, cfg=cfg))
    return tally


def _counts_less(counts: dict[str, int], removed: Counter) -> dict[str, int]:
    """A chunk's counts less those of the prompt rows removed from it (and without its reject counts)."""
    out = {k: v for k, v in counts.items() if not k.startswith("rejected")}
    for key, value in removed.items():
        out[key] -= value
        if key.startswith(("data_source/", SOURCE_DATA_SOURCE)) and not out[key]:
            del out[key]
    return out


def _reject_counts(reasons: list[str]) -> dict[str, int]:
    counts = {"rejected": len(reasons)}
    for reason in reasons:
        counts[f"rejected/{reason}"] = counts.get(f"rejected/{reason}", 0) + 1
    return counts


def _rewritten(name: str, table: pa.Table, output_dir: str) -> PartInfo:
    num_bytes, digest = write_parquet_atomic(table, join(output_dir, name))
    return PartInfo(name=name, rows=table.num_rows, sha256=digest, num_bytes=num_bytes)


def _chunk_rejects(parts: list[PartInfo], *, output_dir: str) -> list[dict[str, Any]]:
    names = [p.name for p in parts if p.name.startswith("_rejects/")]
    return [row for name in names for row in read_parquet(join(output_dir, name)).to_pylist()]

"""ingest: prompt files (Parquet or JSON Lines) -> the validated, tokenized, sharded prompts table of the run.

Row by row (layouts, reject reasons): see ingest_rows. Bad rows are not dropped silently: each goes to the rejects
table (``prompts/_rejects/``, one part per chunk that rejected something: none when nothing was) with a reason,
and the counts go into the manifest. An unreadable file, or one without a required column, stops the stage
(DataError, exit 3) before it writes a part.

Why distributed and streaming (it used to read every file whole into the driver): at 10M prompts the rows alone
were ~41 GB in one process, and a crash restarted from zero. Now:

1. The driver plans input chunks from Parquet footers and JSONL sizes (batchrl.storage.inputs), never the rows.
2. A pool of Ray actors (IngestPool of IngestWorkers: the tokenizer loaded once per actor) runs the chunks; each
   worker reads its chunk, validates, templates and tokenizes it in batches and writes its parts and its rejects
   part. Only counts
   and part infos come back; the driver journals each finished chunk (``prompts/_journal/``). A single chunk (or
   all of them holding no more than ``data.shard_size`` rows) on the embedded Ray is processed in the driver: an
   actor pool would only add its start-up, as for sharded stages (``runs_in_driver``). A streamed chunk (a gzipped
   JSONL file, a Parquet row group over SPLIT_ROWS rows: ``Chunk.streamed``) is read by a Ray generator task that
   decompresses or decodes it once, front to back, putting windows of records into Ray's object store (at most
   ``READ_AHEAD_WINDOWS`` ahead of the workers); the pool's actors tokenize the windows as they come, and the chunk
   is journalled once all its windows are written. The driver holds the windows' refs, never their records; only
   a small gzipped file (``GZ_IN_DRIVER_BYTES``) is streamed by the driver itself.
3. Duplicate prompt ids are found over the written parts by a hash-partitioned pass (ingest_duplicates); the
   chunks holding later occurrences are rewritten without them, and the rejects recorded.
4. ``data.max_prompts`` keeps its meaning, the first N valid prompts in input order: chunks are run in input order,
   a window at a time, until N valid prompts are written; the chunk holding the N-th is trimmed after it.
5. The manifest lists the parts in input order, with the counts summed from the chunks' records.

Departures from the single-process ingest: a chunk's valid rows fill parts of ``data.shard_size`` rows, the last one
shorter, so parts may differ in size (rejects and duplicates leave shorter parts; generate's batch slicing handles
any sizes); part names are reserved per chunk from the footers (``part-00000.parquet``, ... in input order, with
gaps where a chunk had rejects); there is one rejects part per chunk that rejected something. A prompt id is a
duplicate of the first VALID row with that id: a later row with the same id and a problem of its own is rejected for
that problem (before, a too-long duplicate counted as a duplicate).

Resume: the stage declares ``resumes_from_journal``, so the runner keeps its files when it restarts, and a chunk
whose record is in the journal (its parts present with their sizes and sha256, its input file unchanged) is not
redone. A rewrite (duplicates, the max_prompts trim) first journals that the chunk is being rewritten, so a crash in
the middle redoes the chunk rather than trusting a part that may have changed. Every step is a function of the
inputs, so a resumed ingest writes the same parts, byte for byte, as an uninterrupted one.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from batchrl.agents.prompt_tools import tool_schema_fingerprint
from batchrl.config import ConfigError, PipelineConfig
from batchrl.config.base import placement_fields
from batchrl.config.rollout import DataConfig
from batchrl.errors import DataError
from batchrl.pipeline.shards import ACTOR_MAX_RESTARTS, SHARD_MAX_RETRIES
from batchrl.pipeline.stage import ActorNeed, Stage, StageContext, StageOutput, register
from batchrl.rewards import LabelRule
from batchrl.stages.ingest_duplicates import later_occurrences, map_groups
from batchrl.stages.ingest_rows import check_columns, files_by_source, rewards_need_data_source, source_of_file
from batchrl.stages.ingest_worker import IngestWorker, merge_windows, stream_windows
from batchrl.storage import StorageError, expand_input_files, is_local, join, resolve
from batchrl.storage.inputs import SPLIT_ROWS, Chunk, InputFile, describe_inputs, plan_chunks
from batchrl.storage.journal import Journal, record, record_parts
from batchrl.storage.manifest import PartInfo, file_sizes
from batchrl.storage.sources import check_checkpoint_source
from batchrl.tracking.progress import progress

logger = logging.getLogger(__name__)

HUB_EXAMPLE = "Qwen/Qwen2.5-0.5B-Instruct"
REJECTS_DIR = "_rejects/"
# Parquet row groups are combined into chunks of at least this many rows (several parts each when data.shard_size
# is smaller): a chunk costs a Ray task, a journal record and a rejects file, ~20 ms, which chunks of 100-row groups
# would pay once per 100 rows.
MIN_CHUNK_ROWS = 1024
REWRITES_IN_DRIVER = 8  # chunks with duplicates the driver rewrites itself (more: on the actor pool)
# A gzipped file up to this size (~10 MB of text) is streamed by the driver itself on the embedded Ray; a bigger
# one, whose rows cannot be counted without reading it, by a reader task and the actor pool.
GZ_IN_DRIVER_BYTES = 1 << 20
READ_AHEAD_WINDOWS = 4  # windows a streamed chunk's reader puts in the object store before the workers take them


@register
class IngestStage(Stage):
    name = "ingest"
    table = "prompts"
    schema = "prompts"
    per_iteration = False
    reads_train_files = True
    resumes_from_journal = True

    def read_paths(self, cfg: PipelineConfig) -> list[tuple[str, str]]:
        return [("data.train_files", uri) for uri in cfg.data.train_files]

    def fingerprint_config(self, cfg: PipelineConfig) -> dict[str, Any]:
        # without prompts_per_iteration (generate's) or actors; nor the sources' shares (generate's), rewards (score's)
        # and eval sets (heldout's), the statistics (prompt_stats') or the curriculum (generate's batches): a source's
        # name and files make its rows
        sampling = {"prompt_stats", "pass_threshold", "curriculum"}
        dropped = {name: True for name in placement_fields(DataConfig) | sampling}
        elsewhere = {"weight", "count", "rewards", "eval_files"}
        data = cfg.data.model_dump(exclude=dropped | {"sources": {"__all__": elsewhere}}, exclude_defaults=True)
        logged = {}
        if cfg.generate.logged is not None:  # rows need (and carry) their logged responses, cut at max_new_tokens
            logged = {"logged": cfg.generate.logged == "all" or "some", "max_new_tokens": cfg.generate.max_new_tokens}
        # with tools, the schemas the chat template renders into the prompts (nothing without: as it always was)
        schemas = tool_schema_fingerprint(cfg)
        return {"data": data, "tokenizer": cfg.model.tokenizer or cfg.model.path} | logged | schemas

    def actor_needs(self, cfg: PipelineConfig) -> list[ActorNeed]:
        return [ActorNeed.of(cfg.data, field="data")]

    def check_inputs(self, cfg: PipelineConfig) -> None:
        files_by_source(cfg)  # data.sources first: a missing file's error names its source, and no file is in two
        check_prompt_files(cfg, field="data.train_files")

    def run(self, ctx: StageContext) -> StageOutput:
        return ingest_prompt_files(ctx, field="data.train_files")


# The ingest of a list of prompt files, shared with the held-out prompts' stage (batchrl.stages.heldout): both read
# ``cfg.data.train_files`` of the config they are given, and their errors name ``field``, the list the user wrote.


def check_prompt_files(cfg: PipelineConfig, *, field: str) -> None:
    """Before anything is written: the inputs exist, local ones are readable (Parquet footers, a JSONL file's
    first record) with the needed columns and not all empty (an object-store prefix of many files would be
    read twice, so those are checked as ingest plans its chunks, before it writes a part), and the model and
    tokenizer can be found."""
    try:
        uris = expand_input_files(cfg.data.train_files, field=field)
    except StorageError as err:
        raise ConfigError(f"{err}; fix {field}") from None
    local = describe_inputs([uri for uri in uris if is_local(uri)], field=field)
    check_files(local, cfg, field=field)
    if local and len(local) == len(uris) and all(file.empty for file in local):
        raise DataError(f"{field}: every input file is empty (0 rows): {_listing(uris)}")
    model = cfg.model
    check_checkpoint_source(model.path, field="model.path", example=HUB_EXAMPLE)
    if model.tokenizer is not None:
        check_checkpoint_source(model.tokenizer, field="model.tokenizer", example=HUB_EXAMPLE)


def ingest_prompt_files(ctx: StageContext, *, field: str) -> StageOutput:
    """The prompts table of ``ctx.cfg.data.train_files`` written into ``ctx.output_dir`` (resuming from its journal
    there), with its rejects side table. With data.sources, a file's rows carry their source's name and go into parts
    under a directory of that name (`ingest_rows.source_of_file`, `mixing.source_of_part`)."""
    cfg = ctx.cfg
    try:
        uris = expand_input_files(cfg.data.train_files, field=field)
    except StorageError as err:
        raise DataError(str(err)) from None
    files = describe_inputs(uris, field=field)
    check_files(files, cfg, field=field)
    for file in files:
        if file.empty:
            logger.warning("ingest: %s has no rows", file.uri)
    rows_per_chunk = max(cfg.data.shard_size, MIN_CHUNK_ROWS)
    chunks = plan_chunks(files, rows_per_chunk=rows_per_chunk, rows_per_part=cfg.data.shard_size)
    ingest = ChunkedIngest(ctx, chunks, sizes={f.uri: f.size for f in files})
    window = ingest.run()
    output = ingest.output(window)
    if not output.counts["prompts"]:
        empty = [f.uri for f in files if f.empty] + ingest.files_without_rows(window)
        with_no_rows = f"; with no rows: {_listing(empty)}" if empty else ""
        raise DataError(
            f"no valid prompts in {_listing(uris)}: {output.counts['rejected']} row(s) rejected "
            f"({_reason_counts(output.counts)}){with_no_rows}; check {field} and the column layout"
        )
    return output


def check_files(files: list[InputFile], cfg: PipelineConfig, *, field: str) -> None:
    """DataError naming the first file without a required column (a JSONL file: in its first record)."""
    try:
        labels = LabelRule(cfg.score, sources=cfg.data.sources)
    except ValueError as err:  # an unknown reward: named by the score stage's own check too
        raise ConfigError(f"score: {err}") from None
    for file in files:
        source = source_of_file(cfg, file.uri)  # a source's own reward terms decide for its files
        try:
            # every iteration logged: a row whose responses all carry rewards needs no label (checked row by row)
            needs_ground_truth = labels.for_source(source).every_row and cfg.generate.logged != "all"
        except ValueError as err:
            raise ConfigError(f"data.sources[{source}].rewards: {err}") from None
        if not (file.jsonl and file.empty):
            check_columns(
                file.uri,
                set(file.columns),
                needs_data_source=rewards_need_data_source(cfg, source=source),
                needs_ground_truth=needs_ground_truth,
                needs_responses=cfg.generate.logged is not None,
                field=field,
            )


class ChunkedIngest:
    """The driver's side of one ingest: the chunk plan, the journal's records of finished chunks, and the jobs it
    hands to the workers (or runs itself, for a small input on the embedded Ray)."""

    def __init__(self, ctx: StageContext, chunks: list[Chunk], *, sizes: dict[str, int] | None = None):
        self.ctx, self.cfg, self.chunks = ctx, ctx.cfg, chunks
        self.sizes = sizes or {}  # input URI -> bytes: whether a gzipped file is small enough for the driver
        # a streamed chunk's windows: whole parts of data.shard_size rows, as a chunk's are
        shard = self.cfg.data.shard_size
        self.window_rows = shard * -(-MIN_CHUNK_ROWS // shard)
        self.by_key = {chunk.key: chunk for chunk in chunks}
        self.journal = Journal(ctx.output_dir)
        self.records = self._finished()
        self.driver_worker: IngestWorker | None = None
        self.pool: IngestPool | None = None  # started on first need, kept for every pass, closed by run()
        self.writer = None

    def _finished(self) -> dict[str, dict[str, Any]]:
        """The journal's records of chunks of this plan (same file version, same rows, same part names)."""
        loaded = self.journal.load()
        records = {
            key: r for key, r in loaded.items() if key in self.by_key and r.get("chunk") == self.by_key[key].to_json()
        }
        if records:
            logger.info("ingest: resuming, %d of %d input chunk(s) already written", len(records), len(self.chunks))
        return records

    def run(self) -> list[Chunk]:
        """Runs the chunks (those up to data.max_prompts valid prompts), removes duplicates, trims; returns the
        chunks whose parts make the table."""
        limit, end = self.cfg.data.max_prompts, 0
        try:
            with self.journal.writer() as self.writer:
                while True:
                    end = self._window_end(end, limit)
                    window = self.chunks[:end]
                    self._run_chunks(window)
                    self._drop_duplicates(window)
                    if limit is None or self._prompts(window) >= limit or end == len(self.chunks):
                        break
                if limit is not None and self._prompts(window) >= limit:
                    window = self._trim(window, limit)
        finally:
            if self.pool is not None:
                self.pool.close()
                self.pool = None
        return window

    def _window_end(self, end: int, limit: int | None) -> int:
        """Where the chunks to run next end: all of them, or (max_prompts) enough to reach ``limit`` valid prompts
        if no row were rejected (a JSONL chunk, whose rows are unknown, alone)."""
        if limit is None:
            return len(self.chunks)
        short = limit - self._prompts(self.chunks[:end])
        while end < len(self.chunks) and short > 0:
            chunk, end = self.chunks[end], end + 1
            done = self.records.get(chunk.key)
            short -= done["counts"]["prompts"] if done else (short if chunk.rows is None else chunk.rows)
        return end

    def _prompts(self, chunks: list[Chunk]) -> int:
        return sum(self.records[c.key]["counts"]["prompts"] for c in chunks if c.key in self.records)

    def _run_chunks(self, window: list[Chunk]) -> None:
        todo = [chunk for chunk in window if chunk.key not in self.records]
        bounds = [self._max_rows(chunk) for chunk in todo]
        in_driver = self._in_driver(len(todo), None if None in bounds else sum(bounds))
        streamed = [chunk for chunk in todo if chunk.streamed and not in_driver]
        jobs: Iterable[dict[str, Any]] = [
            {
                "kind": "chunk",
                "chunk": chunk.to_json(),
                "window_rows": self.window_rows,
            }
            for chunk in todo
            if not (chunk.streamed and not in_driver)
        ]
        num_windows: dict[str, int] = {}  # a streamed chunk's key -> its windows, once its reader is done
        if streamed:
            jobs = itertools.chain(jobs, self._window_jobs(streamed, num_windows))
        windows: dict[str, dict[int, dict[str, Any]]] = {}
        # a streamed chunk's windows can keep every actor busy
        pool_jobs = len(todo) + len(streamed) * (self.cfg.data.num_actors or 1 << 20)
        for result in self._execute(jobs, in_driver=in_driver, what="input chunks", num_jobs=(len(todo), pool_jobs)):
            if "window" in result:
                windows.setdefault(result["key"], {})[result["window"]] = result
            else:
                self._record(result)
        for chunk in streamed:
            done = windows.get(chunk.key, {})
            self._record(merge_windows(chunk, [done[w] for w in range(num_windows[chunk.key])]))

    def _window_jobs(self, chunks: list[Chunk], num_windows: dict[str, int]) -> Iterator[dict[str, Any]]:
        """The window jobs of streamed chunks, each window's job made as its reader task puts it in the object store
        (the pool asks for the next job when an actor has room, so readers stay at most READ_AHEAD_WINDOWS ahead).
        The chunks are read one after another: decompressing or decoding is far faster than tokenizing."""
        import ray

        reader = ray.remote(stream_windows).options(
            num_cpus=0,  # the pool's actors may hold every CPU: a reader waiting for one would wait for ever
            num_returns="streaming",
            _generator_backpressure_num_objects=READ_AHEAD_WINDOWS,
        )
        for chunk in chunks:
            count = 0
            for ref in reader.remote(chunk.to_json(), self.window_rows):
                yield {
                    "kind": "window",
                    "chunk": chunk.to_json(),
                    "window": count,
                    "records": [ref],  # nested: the actor gets the ref, and the records from the object store
                }
                count += 1
            num_windows[chunk.key] = count

    def _max_rows(self, chunk: Chunk) -> int | None:
        """At most how many rows the chunk holds; None when not bounded by the plan (a streamed chunk), or (a small
        gzipped file, streamed by the driver if it is alone) SPLIT_ROWS."""
        if not chunk.streamed:
            return chunk.max_rows
        small_gz = chunk.jsonl and self.sizes.get(chunk.uri, GZ_IN_DRIVER_BYTES + 1) <= GZ_IN_DRIVER_BYTES
        return SPLIT_ROWS if small_gz else None

    def _record(self, result: dict[str, Any]) -> None:
        if "error" in result:
            raise DataError(result["error"])
        chunk = self.by_key[result["key"]]
        parts = [PartInfo(**p) for p in result["parts"]]
        entry = record(chunk.key, parts, chunk=chunk.to_json(), counts=result["counts"], read=result["read"])
        self.records[chunk.key] = entry
        self.writer.add(entry)

    def _drop_duplicates(self, window: list[Chunk]) -> None:
        """Rewrites the chunks holding later occurrences of a prompt id without them (see ingest_duplicates)."""
        parts = [(chunk, part) for chunk in window for part in self.prompt_parts(chunk)]
        rows = sum(part.rows for _, part in parts)
        uris = [join(self.ctx.output_dir, part.name) for _, part in parts]
        workers = None
        # a single chunk's ids are grouped in the driver only if few (a streamed chunk may hold millions)
        if not self._in_driver(len(window), rows) or rows > max(SPLIT_ROWS, self.cfg.data.shard_size):
            pool = self._pool(len(map_groups([part.rows for _, part in parts])))
            workers = pool.actors if pool is not None else None
        found = later_occurrences(uris, rows=[part.rows for _, part in parts], workers=workers)
        if not found:
            return
        drops: dict[str, dict[str, list[int]]] = {}
        for index, row in found:
            chunk, part = parts[index]
            drops.setdefault(chunk.key, {}).setdefault(part.name, []).append(row)
        logger.info("ingest: %d row(s) repeat an earlier prompt_id: rejected as duplicate_prompt_id", len(found))
        self._rewrite({key: {"drop": drop, "keep": None} for key, drop in drops.items()})

    def _trim(self, window: list[Chunk], limit: int) -> list[Chunk]:
        """The chunks up to the one holding the ``limit``-th valid prompt, that one rewritten to end there (its
        later rows, and its rejects after that prompt, were never read by the single-process ingest)."""
        total = 0
        for index, chunk in enumerate(window):
            prompts = self.records[chunk.key]["counts"]["prompts"]
            if total + prompts >= limit:
                if total + prompts > limit or self.records[chunk.key]["counts"]["rejected"]:
                    self._rewrite({chunk.key: {"drop": {}, "keep": limit - total}})
                return window[: index + 1]
            total += prompts
        return window

    def _rewrite(self, changes: dict[str, dict[str, Any]]) -> None:
        """Rewrites chunks' parts (``changes``: drop / keep by chunk key, see rewrite_chunk). Their records are first
        replaced by ones that claim nothing, so a crash mid-rewrite redoes those chunks instead of trusting a part
        that may have been rewritten under its recorded size."""
        self.writer.flush()
        self.journal.append([record(key, []) for key in changes])
        jobs = [
            {"kind": "rewrite", "chunk": self.by_key[key].to_json(), **change, **self._recorded(key)}
            for key, change in changes.items()
        ]
        # a rewrite holds one chunk at a time: the driver does a few itself rather than start an actor pool
        in_driver = len(jobs) <= REWRITES_IN_DRIVER
        for result in self._execute(jobs, in_driver=in_driver, what="chunks to rewrite"):
            self._record(result)

    def _recorded(self, key: str) -> dict[str, Any]:
        entry = self.records[key]
        return {"parts": entry["parts"], "counts": entry["counts"], "read": entry["read"]}

    def prompt_parts(self, chunk: Chunk) -> list[PartInfo]:
        return [p for p in record_parts(self.records[chunk.key]) if not p.name.startswith(REJECTS_DIR)]

    def _in_driver(self, num_chunks: int, rows: int | None) -> bool:
        """On the embedded Ray, chunks of at most data.shard_size rows in all, or a single chunk of bounded rows
        (None: not bounded, as a big gzipped file's or row group's): no actor pool."""
        small = rows is not None and (num_chunks <= 1 or rows <= self.cfg.data.shard_size)
        return self.ctx.embedded_ray and small

    def _execute(
        self, jobs: Iterable[dict[str, Any]], *, in_driver: bool, what: str, num_jobs: tuple[int, int] | None = None
    ) -> Iterator[dict[str, Any]]:
        """The workers' results of ``jobs``, as they finish (any order). ``num_jobs``: (the bar's total, the jobs
        the pool is sized for), default len(jobs) both (a streamed chunk's windows are counted apart)."""
        total, pool_jobs = num_jobs or (len(jobs), len(jobs))
        if not total:
            return
        pool = None if in_driver else self._pool(pool_jobs)
        if pool is None:
            if self.driver_worker is None:
                self.driver_worker = IngestWorker(cfg=self.cfg, output_dir=self.ctx.output_dir)
            for job in jobs:
                yield self.driver_worker.run_job(job)
            return
        with progress(total, f"ingest: {what}", enabled=self.cfg.tracking.progress_bars) as bar:
            for result in pool.map(jobs):
                yield result
                if "window" not in result:  # a streamed chunk's windows: one unit, advanced by none of them
                    bar.advance()

    def _pool(self, num_jobs: int) -> IngestPool | None:
        """The actor pool, started for a pass of ``num_jobs`` jobs if none runs yet; None when no CPU is free
        (the driver then does the work). One pool serves every pass (chunks, duplicates, rewrites): its actors
        are warm, and they hold the CPUs the later passes need."""
        if self.pool is None:
            size = self._pool_size(num_jobs)
            self.pool = IngestPool(self.cfg, self.ctx.output_dir, size=size) if size else None
        return self.pool

    def _pool_size(self, num_jobs: int) -> int:
        """Actors for ``num_jobs`` jobs: data.num_actors (default: one per data.cpus_per_actor CPUs of the cluster),
        no more than the CPUs free now hold (other actors may hold some, as the generation engines did when the
        evaluate stage ingested its held-out prompts itself: a pool waiting for more would wait forever); 0 when none
        is free."""
        import ray

        data = self.cfg.data
        wanted = data.num_actors or int(ray.cluster_resources().get("CPU", 1) // data.cpus_per_actor)
        free = int(ray.available_resources().get("CPU", 0) // data.cpus_per_actor)
        return max(0, min(wanted, free, num_jobs))

    def output(self, window: list[Chunk]) -> StageOutput:
        """The table: the window's parts in input order, its rejects parts, the counts summed; files that no record
        of the window claims (a chunk past max_prompts, a rewritten chunk's dropped part, a killed writer's
        temporary file) are removed."""
        parts, rejects, counts = [], [], {}
        for chunk in window:
            for part in record_parts(self.records[chunk.key]):
                (rejects if part.name.startswith(REJECTS_DIR) else parts).append(part)
            for key, value in self.records[chunk.key]["counts"].items():
                counts[key] = counts.get(key, 0) + value
        _remove_strays(self.ctx.output_dir, keep={p.name for p in parts + rejects})
        if counts.get("rejected"):
            logger.warning(
                "ingest rejected %d row(s): %s (see %s)",
                counts["rejected"],
                _reason_counts(counts),
                join(self.ctx.output_dir, REJECTS_DIR),
            )
        counts.setdefault("prompts", 0)
        counts.setdefault("rejected", 0)
        counts.setdefault("truncated_prompts", 0)
        # no rejects, no part (not an empty one): readers take the manifest's empty list for an empty table
        return StageOutput(parts=parts, counts=counts, extra_parts={"rejects": rejects})

    def files_without_rows(self, window: list[Chunk]) -> list[str]:
        """JSONL files of the window none of whose chunks read a record."""
        read: dict[str, int] = {}
        for chunk in window:
            if chunk.jsonl:
                read[chunk.uri] = read.get(chunk.uri, 0) + self.records[chunk.key]["read"]
        return [uri for uri, rows in read.items() if not rows]


class IngestPool:
    """Ray actors running IngestWorker jobs, at most ``IN_FLIGHT_PER_ACTOR`` each at a time, results as they finish.

    Why not a Ray Data actor pool (as the sharded stages use): its streaming executor added tens of ms of
    scheduling per chunk, which made the stage 2x slower than a bare loop on 2 cores (bench_ingest: 0.50, and
    0.89 with this pool; the driver's peak memory was about the same with either). Plain actors cost a task
    submission per chunk, and their results (counts and part infos) are released once journalled. Actors that
    die are restarted and their jobs retried, as in the sharded stages' pools."""

    IN_FLIGHT_PER_ACTOR = 2  # one job queued behind the running one: the actor never waits for the driver

    def __init__(self, cfg: PipelineConfig, output_dir: str, *, size: int):
        import ray

        actor = ray.remote(IngestWorker).options(
            num_cpus=cfg.data.cpus_per_actor, max_restarts=ACTOR_MAX_RESTARTS, max_task_retries=SHARD_MAX_RETRIES
        )
        self.actors = [actor.remote(cfg=cfg, output_dir=output_dir) for _ in range(max(1, size))]

    def map(self, jobs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        import ray

        todo = iter(jobs)
        running: dict[Any, Any] = {}  # result ref -> the actor running it

        def submit(actor) -> None:
            job = next(todo, None)
            if job is not None:
                running[actor.run_job.remote(job)] = actor

        for _ in range(self.IN_FLIGHT_PER_ACTOR):
            for actor in self.actors:
                submit(actor)
        while running:
            (ref,), _ = ray.wait(list(running), num_returns=1)
            actor = running.pop(ref)
            result = ray.get(ref)
            submit(actor)
            yield result

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def _remove_strays(output_dir: str, *, keep: set[str]) -> None:
    """Removes the parts, rejects parts and temporary files under ``output_dir`` not in ``keep`` (one listing)."""
    fs, path = resolve(output_dir)
    for name in file_sizes(output_dir):
        base = name.rsplit("/", 1)[-1]  # a source's parts are under its directory (data.sources)
        ours = name.startswith(REJECTS_DIR) or base.startswith(("part-", ".tmp-"))
        if ours and name not in keep:
            fs.rm(f"{path.rstrip('/')}/{name}")


def _listing(uris: list[str], *, limit: int = 3) -> str:
    more = f" and {len(uris) - limit} more" if len(uris) > limit else ""
    return ", ".join(uris[:limit]) + more


def _reason_counts(counts: dict[str, int]) -> str:
    reasons = {k.removeprefix("rejected/"): v for k, v in counts.items() if k.startswith("rejected/")}
    return ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())) or "none"

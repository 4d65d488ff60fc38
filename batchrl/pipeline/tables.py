"""The life of a run's table directories: marked when a stage starts on one, kept or cleared part by part on a
resume, committed by writing the manifest last, and deleted when what they were made from is redone.

No table is ever derived from data that no longer exists: every manifest records the content digest of each input
it was made from, and whenever a stage is (re)done, each later stage that reads its output and was made from other
content (or, for a manifest without that record, whenever the output changed or there was no previous output to
compare with) is deleted before the new manifest is written, last first, and redone. Forced outputs
(``--from-stage``) are deleted before anything runs, last stage first, so an interrupted forced run resumes as an
ordinary one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time

from batchrl.pipeline.plan import STARTED_MARKER, Plan, PlannedStage, current_input_digest, entries, read_started
from batchrl.pipeline.stage import POLICY, Stage, is_sharded, producer, source_table, table_iteration
from batchrl.storage import join, resolve, write_bytes_atomic
from batchrl.storage.journal import JOURNAL_DIR
from batchrl.storage.manifest import MANIFEST_NAME, Manifest, content_digest, write_manifest

logger = logging.getLogger(__name__)


class Tables:
    """The table directories of ``plan``'s steps. Each step's directory is touched by the thread that runs the step;
    the readers a commit deletes are steps that no thread runs then (see `Overlap`)."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def clear_forced(self) -> None:
        """--from-stage: deletes the forced outputs, last first (an interruption leaves a consistent run)."""
        for step in reversed(self.plan.steps):
            if step.status == "forced":
                logger.info("%s: forced by --from-stage, its output is cleared", step.label)
                remove(step.output_dir)
                step.status = "pending"

    def input_manifests(self, stage: Stage, iteration: int | None) -> dict[str, Manifest]:
        """The committed manifests of the tables ``stage`` reads at ``iteration``, by table name."""
        return {
            table: self.plan[(producer(source), table_iteration(source, iteration))].manifest
            for table in stage.inputs
            for source in [source_table(table, stage.name)]
            if table != POLICY
        }

    def prepare(self, step: PlannedStage) -> None:
        """Keeps exactly the output that is still good, then marks the directory as this config's.

        Output made from an input since redone (outdated) or of a different config is cleared. A sharded stage keeps
        its committed parts except damaged ones, and loses stray files (unknown names, temporary files of killed
        writers); a stage that resumes from its journal (ingest) keeps its files but its damaged parts; a stage that
        writes all its output at once (update) starts from an empty directory. A damaged stage's manifest is kept
        until the redo replaces it.
        """
        stage = self.plan.stages[step.name]
        if step.status == "outdated":
            logger.warning("%s: made from an input that has since been redone or replaced; redoing it", step.label)
            remove(step.output_dir)
        fs, path = resolve(step.output_dir)
        names = entries(step.output_dir)
        if names and read_started(step.output_dir).get("fingerprint") != step.fingerprint:
            logger.info("%s: clearing output of a different config", step.label)
            remove(step.output_dir)
            names = []
        keep = {MANIFEST_NAME, STARTED_MARKER, JOURNAL_DIR}  # the journal's records are checked against the parts
        if is_sharded(stage):
            inputs = self.input_manifests(stage, step.iteration)
            keep |= set(stage.planned_parts(self.plan.cfg, step.iteration, inputs, step.input_dirs)) - set(step.damaged)
        elif stage.resumes_from_journal:  # its journal says what is done; a damaged part goes, so it is redone
            keep |= set(names)
            for name in step.damaged:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm(f"{path.rstrip('/')}/{name}")
        strays = [n for n in names if n not in keep]
        if strays:
            logger.info(
                "%s: removing %d file(s) to redo or unknown: %s", step.label, len(strays), ", ".join(sorted(strays)[:5])
            )
            for name in strays:
                fs.rm(f"{path.rstrip('/')}/{name}", recursive=True)
        started = {"fingerprint": step.fingerprint, "config_fingerprint": step.config_fingerprint}
        started |= {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()}
        write_bytes_atomic(join(step.output_dir, STARTED_MARKER), json.dumps(started).encode())

    def input_digests(self, step: PlannedStage) -> dict[str, str]:
        """What ``step`` is made from, for its manifest: the content digest of each input as committed now."""
        plan = self.plan
        inputs = plan.stages[step.name].inputs
        inputs += tuple(t for t in step.input_dirs if t not in inputs)  # a table of the iteration before (curriculum)
        return {t: current_input_digest(step, t, plan.by_dir, plan.lineage) for t in inputs}

    def commit(self, step: PlannedStage, manifest: Manifest, *, previous: Manifest | None) -> None:
        """Writes ``step``'s manifest, last: after deleting the later outputs made from other content than it lists
        (a crash in between leaves ``step`` to be redone and compared again)."""
        self._invalidate_readers(step, manifest, previous=previous)
        write_manifest(step.output_dir, manifest)
        step.status, step.manifest, step.damaged = "done", manifest, []

    def _invalidate_readers(self, redone: PlannedStage, manifest: Manifest, *, previous: Manifest | None) -> None:
        """Deletes (last first) the output of every later stage that reads ``redone``'s table and was made from
        other content than ``manifest`` lists: it is redone when the run reaches it.

        A reader whose manifest records its inputs is compared with that record. Without one (a manifest written
        before inputs were recorded, or a partial output), it is kept only when ``redone`` had a previous
        manifest with the same content; one redone from nothing cannot tell, so its readers are redone too."""
        digest = content_digest(manifest)
        unchanged = previous is not None and content_digest(previous) == digest
        stale = [
            step
            for step, table in self._readers(redone)
            if not _made_from(
                step, table, digest=digest, unchanged=unchanged or table in self.plan.stages[step.name].covered_inputs
            )
        ]
        if stale:
            logger.warning(
                "%s: its output is not what %s %s made from; %s redone",
                redone.label,
                ", ".join(s.label for s in stale),
                "was" if len(stale) == 1 else "were",
                "it is" if len(stale) == 1 else "they are",
            )
        for step in reversed(stale):
            remove(step.output_dir)
            step.status, step.manifest, step.damaged = "pending", None, []

    def _readers(self, made: PlannedStage) -> list[tuple[PlannedStage, str]]:
        """(later stage, the input name under which it reads ``made``'s table), in plan order."""
        steps = self.plan.steps
        readers = []
        for step in steps[steps.index(made) + 1 :]:
            reads_policy = POLICY in self.plan.stages[step.name].inputs and step.policy_in == made.output_dir
            tables = [t for t, d in step.input_dirs.items() if d == made.output_dir] + [POLICY] * reads_policy
            readers += [(step, table) for table in tables]
        return readers


def damaged_names(step: PlannedStage) -> str:
    return ", ".join(step.damaged[:5]) + (f" and {len(step.damaged) - 5} more" if len(step.damaged) > 5 else "")


def _made_from(step: PlannedStage, table: str, *, digest: str, unchanged: bool) -> bool:
    """Whether ``step``'s output (if any) was made from input ``table`` with content ``digest``; ``unchanged``
    answers for an output that does not record its inputs."""
    if step.status in ("pending", "stale", "forced", "outdated"):
        return True  # nothing of it is kept: it is cleared and redone anyway
    if step.manifest is not None and step.manifest.inputs is not None and table in step.manifest.inputs:
        return step.manifest.inputs[table] == digest
    return unchanged


def remove(uri: str) -> None:
    fs, path = resolve(uri)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(path)

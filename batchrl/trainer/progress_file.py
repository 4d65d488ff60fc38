"""How the update's rank 0 tells the launching process how far training is: a JSON-lines file it appends to.

Why a file rather than a pipe or a socket: the ranks are subprocesses whose stdout/stderr already go to files
(a pipe nobody drains fills up and blocks the writer), the launcher already polls the ranks every 0.1 s, and an
appended file needs no handshake, cannot block rank 0, and survives the reader being slow or absent. The writer
never raises (an unwritable file costs one warning, never the update); the reader takes only whole lines, so a
line caught half-written is read on the next poll, and skips a line that is not JSON.

Records (one per line; every key but ``phase`` optional):
``{"phase": "logprobs"}`` before the pre-update log-prob pass,
``{"phase": "train", "done": 0, "total": N}`` when training starts (N mini-batches = planned optimizer steps),
``{"phase": "train", "done": k, "total": N, "pg_loss": .., "grad_norm": .., "lr": .., "global_step": ..}`` after
each mini-batch (one without response tokens is done without a step, and its record has no losses),
``{"phase": "save"}`` before the checkpoint is written.
Importing this module does not import torch.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


class ProgressWriter:
    """Rank 0's end: ``write(record)`` appends one flushed line; a no-op when ``path`` is None (other ranks)."""

    def __init__(self, path: str | os.PathLike | None):
        self._path = path
        self._file = None

    def write(self, record: dict[str, Any]) -> None:
        if self._path is None:
            return
        try:
            if self._file is None:
                self._file = open(self._path, "a", encoding="utf-8")
            self._file.write(json.dumps(record) + "\n")  # one write call per line: readers see whole lines or a tail
            self._file.flush()
        except (OSError, TypeError, ValueError) as error:
            logger.warning("progress reports off: cannot append to %s (%s)", self._path, error)
            self.close()
            self._path = None

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def parse_progress(data: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """(the records in `data`'s complete lines, the incomplete tail to prepend to the next read).

    A complete line that is not a JSON object (a crashed writer's garbage) is skipped, not an error.
    """
    *lines, tail = data.split(b"\n")
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records, tail


class ProgressReader:
    """The launcher's end: ``poll()`` returns the records appended since the last poll (none if no file yet)."""

    def __init__(self, path: str | os.PathLike):
        self._path = path
        self._offset = 0
        self._tail = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        records, self._tail = parse_progress(self._tail + data)
        return records

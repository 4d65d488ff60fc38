"""Rule rewards in a child process with a deadline per call: a reward that hangs cannot hang the score stage.

Why a process: Python cannot stop a thread, and ``signal.alarm`` only works in a process's main thread, while
Ray Data calls an actor pool's ``map_batches`` class from a worker thread (checked on Ray 2.60: the calls run
in ``ThreadPoolExecutor-0_0``, only ``__init__`` runs in the main thread). A child process can always be
killed, whatever it is stuck in (a C extension, a regex, a deadlock, ``while True``).

How: the child (``python -m batchrl.rewards.isolation``) resolves the reward terms once and scores the samples
it is sent, in order, in its main thread (so math-verify's own signal timeouts work there). Before each reward
call it writes (sample, term, start time) into a small shared memory map; it streams results back in small
batches over a pipe (a message per call would cost more than most rule rewards). The parent waits on the pipe
and checks the map: a call running longer than ``timeout_s`` gets its child killed; that term of that sample is
recorded as "<term> timed out after <t>s", a new child is started and the unfinished samples are sent again
(the timed-out term is then skipped, the sample's other terms still run). A child that dies on its own
(segfault, ``os._exit``, out of memory) is handled the same way, with the exit code in the error.

Results lost with a killed child (computed but not yet sent) are recomputed, so rewards should be pure
functions of their arguments, as they are meant to be.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from batchrl.rewards.combine import RewardSet, call_reward, sample_row

logger = logging.getLogger(__name__)

_PROGRESS = struct.Struct("qqd")  # sample index, term index, monotonic start time of the running call (0 = idle)
FLUSH_INTERVAL_S = 0.02  # the child sends its finished results at least this often
STARTUP_TIMEOUT_S = 300.0  # importing the reward modules (sympy, user code) in a fresh child
SAMPLES_PER_MESSAGE = 4096  # bounds the memory of one message for shards of long responses

# (response, ground_truth, group fields, sample_idx, response_length, finish_reason); see combine.sample_row.
# The group-fields dict is shared by the samples of a group, so pickle sends it once per group.
SampleTask = tuple[str, "str | None", Mapping[str, Any], int, int, str]
SampleResult = tuple[list["float | None"], list["str | None"]]  # per term: value, error


class IsolatedRewards:
    """Scores samples with a RewardSet living in a child process; every reward call has a deadline."""

    def __init__(self, *, reward_set_kwargs: dict[str, Any], term_names_for: Any, timeout_s: float):
        """`term_names_for(data_source) -> list[str]` names the terms in errors (the parent's own RewardSet)."""
        self.reward_set_kwargs = reward_set_kwargs
        self.term_names_for = term_names_for
        self.timeout_s = float(timeout_s)
        self.poll_interval_s = min(0.05, self.timeout_s / 4)
        self.num_starts = 0  # child processes started (the first, plus one per timeout or crash)
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        fd, path = tempfile.mkstemp(prefix="batchrl-reward-progress-", dir=_shm_dir())
        os.unlink(path)  # the open fd keeps it; children inherit the fd, so nothing is left behind on a crash
        os.write(fd, bytes(_PROGRESS.size))
        self._progress_fd = fd
        self._progress = mmap.mmap(fd, _PROGRESS.size)

    def evaluate(self, tasks: Sequence[SampleTask]) -> list[SampleResult]:
        """(values, errors) per task, in order; hung or crashed calls become errors, never exceptions.

        Messages of SAMPLES_PER_MESSAGE samples; the parent pickles the next one while the child scores the
        current one, and sends it once the child has returned every result (so neither end blocks on a full pipe
        while the other writes)."""
        results: list[SampleResult | None] = [None] * len(tasks)
        chunks = [
            range(start, min(start + SAMPLES_PER_MESSAGE, len(tasks)))
            for start in range(0, len(tasks), SAMPLES_PER_MESSAGE)
        ]
        payload = _payload(tasks, chunks[0], {}) if chunks else b""
        for k, indices in enumerate(chunks):
            payload = self._evaluate_chunk(
                tasks, indices, payload, results, prepare_next=chunks[k + 1] if k + 1 < len(chunks) else None
            )
        return results

    def _evaluate_chunk(
        self, tasks: Sequence[SampleTask], indices: range, payload: bytes, results: list, *, prepare_next: range | None
    ) -> bytes:
        """Scores tasks[indices] (pickled in `payload`); returns the pickled next chunk, prepared while the child
        works. A timed-out or crashed call is recorded, its child replaced, and the unfinished samples resent."""
        skips: dict[int, dict[int, str]] = {}
        pending, next_payload = list(indices), b""
        while pending:
            self._ensure_child()
            self._conn.send_bytes(payload)
            if prepare_next is not None and not next_payload:
                next_payload = _payload(tasks, prepare_next, {})
            failed_call = self._collect(results, pending)
            if failed_call is not None:
                (sample, term), error = failed_call
                name = self.term_names_for(tasks[sample][2]["data_source"])[term]  # [2]: the group fields
                skips.setdefault(sample, {})[term] = f"{name} {error}"
            pending = [i for i in pending if results[i] is None]
            if pending:
                payload = _payload(tasks, pending, skips)
        return next_payload

    def _collect(self, results: list, pending: list[int]) -> tuple[tuple[int, int], str] | None:
        """Receives results until all pending samples have one (None), or a call failed ((sample, term), why)."""
        remaining = sum(results[i] is None for i in pending)
        while remaining:
            if self._conn.poll(self.poll_interval_s):
                try:
                    message = self._conn.recv()
                except (EOFError, OSError):
                    return self._child_died()
                for index, values, errors in message:
                    results[index] = (values, errors)
                remaining -= len(message)
                continue
            if self._process.poll() is not None:
                return self._child_died()
            sample, term, started = _PROGRESS.unpack_from(self._progress)
            if started and time.monotonic() - started > self.timeout_s:
                if _PROGRESS.unpack_from(self._progress) == (sample, term, started):  # still the same call
                    self._stop_child()
                    return (sample, term), f"timed out after {self.timeout_s:g}s"
        return None

    def _child_died(self) -> tuple[tuple[int, int], str]:
        """Blames the call that was running; a child that died between calls is not a reward's fault."""
        sample, term, started = _PROGRESS.unpack_from(self._progress)
        code = self._process.wait()
        self._stop_child()
        if not started:
            raise RuntimeError(f"the reward process exited between reward calls (exit code {code})")
        return (sample, term), f"crashed the reward process (exit code {code})"

    def _ensure_child(self) -> None:
        if self._process is not None:
            return
        parent_read, child_write = os.pipe()
        child_read, parent_write = os.pipe()
        self._progress[:] = bytes(_PROGRESS.size)
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchrl.rewards.isolation",
                str(child_read),
                str(child_write),
                str(self._progress_fd),
            ],
            pass_fds=(child_read, child_write, self._progress_fd),
            stdin=subprocess.DEVNULL,
            env=_child_env(),
        )
        os.close(child_read)
        os.close(child_write)
        self._conn = _Duplex(parent_read, parent_write)
        self._conn.send({"sys_path": list(sys.path), "reward_set_kwargs": self.reward_set_kwargs})
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self._stop_child()
            raise RuntimeError(f"the reward process did not start within {STARTUP_TIMEOUT_S:g}s")
        try:
            status = self._conn.recv()
        except EOFError:
            code = self._process.wait()
            self._stop_child()
            raise RuntimeError(f"the reward process exited while starting (exit code {code})") from None
        if status != "ready":
            self._stop_child()
            raise ValueError(f"the reward process could not set up the rewards: {status}")
        self.num_starts += 1

    def _stop_child(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._conn.close()
        self._process, self._conn = None, None

    def close(self) -> None:
        self._stop_child()
        if not self._progress.closed:
            self._progress.close()
            os.close(self._progress_fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _Duplex:
    """A read and a write Connection on two pipe fds, used as one (poll / recv / send / close)."""

    def __init__(self, read_fd: int, write_fd: int):
        self._reader = Connection(read_fd, writable=False)
        self._writer = Connection(write_fd, readable=False)

    def poll(self, timeout: float) -> bool:
        return self._reader.poll(timeout)

    def recv(self) -> Any:
        return self._reader.recv()

    def send(self, obj: Any) -> None:
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, payload: bytes) -> None:
        self._writer.send_bytes(payload)

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


def _payload(tasks: Sequence[SampleTask], indices: Sequence[int], skips: Mapping[int, dict[int, str]]) -> bytes:
    """The pickled message for the child: (index, *task, term index -> preset error) per sample."""
    return pickle.dumps([(i, *tasks[i], skips.get(i, {})) for i in indices], protocol=pickle.HIGHEST_PROTOCOL)


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _child_env() -> dict[str, str]:
    """The parent's environment, without threads for numeric libraries: the child is one sequential loop."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _child_main(read_fd: int, write_fd: int, progress_fd: int) -> None:
    """The child: set up the RewardSet, then score every batch it is sent until the pipe closes."""
    conn = _Duplex(read_fd, write_fd)
    setup = conn.recv()
    sys.path[:] = setup["sys_path"]
    try:
        rewards = RewardSet(**setup["reward_set_kwargs"])
    except Exception as err:
        conn.send(f"{type(err).__name__}: {err}")
        return
    gc.freeze()  # the imported modules never become garbage: keep them out of every later collection
    conn.send("ready")
    progress = mmap.mmap(progress_fd, _PROGRESS.size)
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        _score_batch(batch, rewards=rewards, conn=conn, progress=progress)


def _score_batch(batch: list, *, rewards: Any, conn: _Duplex, progress: mmap.mmap) -> None:
    finished, last_flush = [], time.monotonic()
    for index, response, ground_truth, group, sample_idx, response_length, finish_reason, skip in batch:
        row = sample_row(group, sample_idx, response_length, finish_reason)
        values, errors = [], []
        for term_index, term in enumerate(rewards.terms_for(row["data_source"])):
            if term_index in skip:
                values.append(None)
                errors.append(skip[term_index])
                continue
            _PROGRESS.pack_into(progress, 0, index, term_index, time.monotonic())
            value, error = _call(term, response, ground_truth, row)
            values.append(value)
            errors.append(error)
        _PROGRESS.pack_into(progress, 0, index, 0, 0.0)
        finished.append((index, values, errors))
        if time.monotonic() - last_flush > FLUSH_INTERVAL_S:
            conn.send(finished)
            finished, last_flush = [], time.monotonic()
    if finished:
        conn.send(finished)


def _call(term: Any, response: str, ground_truth: str | None, row: Mapping[str, Any]) -> tuple:
    try:
        return call_reward(term, response, ground_truth, row)
    except BaseException as err:
        return None, f"{term.name} raised {type(err).__name__}: {err}"


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))

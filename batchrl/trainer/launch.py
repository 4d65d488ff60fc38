"""Start the update workers as local torch.distributed processes and wait for them.

Why our own launcher rather than torchrun: the pipeline needs a Python call that returns the metrics or
raises with the failing rank's error, kills the surviving ranks (which would otherwise hang in a collective
forever), and honours a timeout. Placement is the only thing here: the worker knows nothing about how it
was started, so a Ray placement-group launcher can replace this module without touching the worker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from batchrl.trainer.progress_file import ProgressReader
from batchrl.trainer.spec import UpdateSpec

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
KILL_GRACE_S = 5.0
STDERR_TAIL_CHARS = 4000
# The directory that holds the batchrl package, so workers import this very copy of it.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def run_update(
    spec: UpdateSpec,
    *,
    timeout_s: float | None = None,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, float]:
    """Run one policy update in `spec.num_processes` local processes; return the metrics rank 0 wrote.

    Raises RuntimeError (with the failing rank's stderr tail) if any rank exits non-zero or the update
    outlives `timeout_s`; the other ranks are killed first. `spec.policy_out` is only written on success.
    `on_progress(record)` is called in this process, between polls of the ranks, with each record rank 0
    reports (see `progress_file`; e.g. to draw a bar); it runs only here, so it cannot slow the ranks, and one
    that raises is switched off with a warning rather than failing the update.
    """
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0 (or None for no limit)")
    _check_gpu_only_options(spec)
    Path(spec.metrics_path).unlink(missing_ok=True)  # never return a previous run's metrics
    with tempfile.TemporaryDirectory(prefix="batchrl-update-") as tmp:
        poll_progress = None
        if on_progress is not None:
            if spec.progress_path is None:
                spec = dataclasses.replace(spec, progress_path=str(Path(tmp) / "progress.jsonl"))
            Path(spec.progress_path).unlink(missing_ok=True)  # never replay a previous run's records
            poll_progress = _progress_poller(ProgressReader(spec.progress_path), on_progress)
        spec_path = Path(tmp) / "spec.json"
        spec.to_json(spec_path)
        port = _free_port()
        started = time.perf_counter()
        workers = [
            _start_worker(spec_path, rank=rank, world_size=spec.num_processes, port=port, log_dir=Path(tmp))
            for rank in range(spec.num_processes)
        ]
        try:
            failure = _wait_for_workers(workers, timeout_s=timeout_s, on_poll=poll_progress)
        finally:
            _kill_all(workers)
        if poll_progress is not None:
            poll_progress()  # the records written between the last poll and the ranks' exit
        if failure is not None:
            raise RuntimeError(failure)
        logger.debug("rank 0 log tail:\n%s", _tail(workers[0]["stderr_path"]))
        logger.info("update finished in %.1f s on %d process(es)", time.perf_counter() - started, len(workers))
    with open(spec.metrics_path, encoding="utf-8") as f:
        return {name: float(value) for name, value in json.load(f).items()}


def _check_gpu_only_options(spec: UpdateSpec) -> None:
    """CPU offload moves GPU-resident shards to host memory: meaningless (and unsupported) without CUDA."""
    if not spec.cpu_offload:
        return
    import torch

    if spec.backend == "gloo" or not torch.cuda.is_available():
        raise ValueError(
            "update.cpu_offload=true needs CUDA GPUs and the nccl backend (this machine has "
            f"{'no CUDA' if not torch.cuda.is_available() else 'backend=gloo'}); on CPU the parameters already "
            "live in host memory. Set update.cpu_offload=false"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_env(*, rank: int, world_size: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONPATH=os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p),
    )
    # Like torchrun: N processes on one host must not each start one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


def _start_worker(spec_path: Path, *, rank: int, world_size: int, port: int, log_dir: Path) -> dict:
    """Popen one rank with its stdout/stderr in files (pipes could fill up and block the worker)."""
    stdout_path, stderr_path = log_dir / f"rank{rank}.out", log_dir / f"rank{rank}.err"
    with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "batchrl.trainer.worker", str(spec_path)],
            env=_worker_env(rank=rank, world_size=world_size, port=port),
            stdout=stdout,
            stderr=stderr,
        )
    return {"rank": rank, "process": process, "stderr_path": stderr_path}


def _progress_poller(reader: ProgressReader, on_progress: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """A no-argument function that hands the newly appended records to `on_progress`, never raising: a broken
    bar must not kill the ranks (the caller's `finally` would)."""
    broken = False

    def poll() -> None:
        nonlocal broken
        if broken:
            return
        try:
            for record in reader.poll():
                on_progress(record)
        except Exception as error:  # noqa: BLE001 - progress display only; the update goes on
            broken = True
            logger.warning("update progress display off after an error: %r", error)

    return poll


def _wait_for_workers(
    workers: list[dict], *, timeout_s: float | None, on_poll: Callable[[], None] | None = None
) -> str | None:
    """Poll until all ranks exit 0 (None) or one fails or time runs out (a message naming the culprits).

    `on_poll()` runs once per poll (every POLL_INTERVAL_S), e.g. to read rank 0's progress."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if on_poll is not None:
            on_poll()
        codes = [w["process"].poll() for w in workers]
        failed = [w for w, code in zip(workers, codes) if code not in (None, 0)]
        if failed:
            return "\n".join(
                f"update rank {w['rank']} exited with code {w['process'].returncode}; stderr tail:\n"
                f"{_tail(w['stderr_path'])}"
                for w in failed[:2]
            )
        if all(code == 0 for code in codes):
            return None
        if deadline is not None and time.monotonic() > deadline:
            return f"update timed out after {timeout_s} s; rank 0 stderr tail:\n{_tail(workers[0]['stderr_path'])}"
        time.sleep(POLL_INTERVAL_S)


def _kill_all(workers: list[dict]) -> None:
    """Terminate the ranks still running, then kill those that ignore it."""
    running = [w["process"] for w in workers if w["process"].poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + KILL_GRACE_S
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace")
    return text[-STDERR_TAIL_CHARS:]

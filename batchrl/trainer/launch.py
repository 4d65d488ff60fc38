"""Start the update workers as local torch.distributed processes and wait for them.

Why our own launcher rather than torchrun: the pipeline needs a Python call that returns the metrics or
raises with the failing rank's error, kills the surviving ranks (which would otherwise hang in a collective
forever), and honours a timeout. Placement is the only thing here: the worker knows nothing about how it
was started, so a Ray placement-group launcher can replace this module without touching the worker.

Two lifetimes. One-shot (default): N fresh processes per update, each importing torch/transformers, joining
the process group and loading the model and optimizer state from disk (seconds each time). Resident
(`resident=True`): the N ranks of the first update stay alive in a module-level pool and take each later update
as a command (its spec path on their stdin; each rank answers with a done file), reusing their imports, process
group and, when the update continues from what they saved, their model and optimizer (see `worker`). The runner
starts them ahead (`prestart_trainers`, from the update stage's `prestart`), so that their imports overlap the
stages before the first update. Any
failure (a rank that exits, an error, the timeout) kills the pool and raises as one-shot does; the next update
starts a fresh one. Residency is for CPU (gloo) ranks only: on GPUs the ranks would hold the device memory
that the generation engine needs between updates. `shutdown_trainers()` ends the pool (also at exit).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrl.errors import ProcessCrash, signal_name
from batchrl.trainer.integrity import error_path, read_error
from batchrl.trainer.progress_file import ProgressReader
from batchrl.trainer.spec import UpdateSpec, resolve_backend

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
    resident: bool = False,
) -> dict[str, float]:
    """Run one policy update in `spec.update.num_processes` local processes; return the metrics rank 0 wrote.

    Raises RuntimeError (with the failing rank's stderr tail) if any rank exits non-zero or the update
    outlives `timeout_s`, or TrainerStateError when the ranks refused to load a trainer state that does not
    hash as `spec.trainer_state_sha256` records; the other ranks are killed first. `spec.policy_out` is only
    written on success.
    `on_progress(record)` is called in this process, between polls of the ranks, with each record rank 0
    reports (see `progress_file`; e.g. to draw a bar); it runs only here, so it cannot slow the ranks, and one
    that raises is switched off with a warning rather than failing the update.
    `resident=True` runs it on the pool of resident ranks (started on first use; see the module docstring);
    the results are the same as with fresh processes. Ignored (fresh processes) unless the ranks use gloo.
    """
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0 (or None for no limit)")
    _check_gpu_only_options(spec)
    Path(spec.metrics_path).unlink(missing_ok=True)  # never return a previous run's metrics
    error_path(spec.metrics_path).unlink(missing_ok=True)  # nor its errors
    if resident and resolve_backend(spec.update.backend) == "gloo":
        with _POOL_LOCK:
            return _run_on_pool(spec, timeout_s=timeout_s, on_progress=on_progress)
    if resident:
        logger.info("update: resident trainer ranks are CPU-only (gloo); starting fresh %s ranks", spec.update.backend)
    with tempfile.TemporaryDirectory(prefix="batchrl-update-") as tmp:
        spec, poll_progress = _with_progress(spec, on_progress, tmp)
        spec_path = Path(tmp) / "spec.json"
        spec.to_json(spec_path)
        port = _free_port()
        started = time.perf_counter()
        workers = [
            _start_worker(
                spec_path,
                rank=rank,
                world_size=spec.update.num_processes,
                port=port,
                log_dir=Path(tmp),
                threads=spec.threads_per_rank,
                cuda_devices=spec.cuda_devices,
            )
            for rank in range(spec.update.num_processes)
        ]
        try:
            failure = _wait_for_workers(workers, timeout_s=timeout_s, on_poll=poll_progress)
        finally:
            _kill_all(workers)
        if poll_progress is not None:
            poll_progress()  # the records written between the last poll and the ranks' exit
        if failure is not None:
            raise _failure(spec, failure)
        logger.debug("rank 0 log tail:\n%s", _tail(workers[0]["stderr_path"]))
        logger.info("update finished in %.1f s on %d process(es)", time.perf_counter() - started, len(workers))
    return _read_metrics(spec)


def shutdown_trainers() -> None:
    """End the resident ranks, if any: close their stdin (they exit), kill those still running after a grace
    period, delete their logs. Safe to call any time between updates; registered with atexit."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
        if pool is not None:
            pool.close()


@dataclass
class _Pool:
    """The resident ranks of one (world size, backend, environment), their logs, and the updates they ran."""

    key: tuple
    workers: list[dict]
    log_dir: Path
    updates: int = 0
    _closed: bool = field(default=False, repr=False)

    def alive(self) -> bool:
        return all(w["process"].poll() is None for w in self.workers)

    def send(self, spec_path: Path) -> None:
        for w in self.workers:
            w["process"].stdin.write(f"{spec_path}\n".encode())
            w["process"].stdin.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        running = [w for w in self.workers if w["process"].poll() is None]
        for w in self.workers:
            try:
                w["process"].stdin.close()
            except OSError:
                pass  # a rank that died already
        deadline = time.monotonic() + KILL_GRACE_S
        for w in self.workers:
            try:
                w["process"].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for w in running:  # a native crash at a rank's exit is reported, not hidden (the work was done)
            code = w["process"].returncode
            if code is not None and code < 0:
                logger.warning(
                    "resident update rank %d died of %s while shutting down; its stderr tail:\n%s",
                    w["rank"],
                    signal_name(code),
                    _tail(w["stderr_path"]),
                )
        _kill_all(self.workers)
        shutil.rmtree(self.log_dir, ignore_errors=True)


_POOL: _Pool | None = None
_POOL_LOCK = threading.RLock()
atexit.register(shutdown_trainers)


def _pool_key(num_processes: int, backend: str, threads_per_rank: int | None, cuda_devices: str | None) -> tuple:
    """What the rank processes are fixed to at start: the process group and the environment they inherit."""
    env = tuple(os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH"))
    return (num_processes, backend, sys.executable, env, threads_per_rank, cuda_devices)


def _spec_key(spec: UpdateSpec) -> tuple:
    return _pool_key(spec.update.num_processes, spec.update.backend, spec.threads_per_rank, spec.cuda_devices)


def prestart_trainers(
    *, num_processes: int, backend: str, threads_per_rank: int | None = None, cuda_devices: str | None = None
) -> None:
    """Starts the resident ranks of the updates to come, unless ranks are running: their start (a Python process
    importing torch, torch.distributed and transformers, ~4 s of CPU per rank measured on the quickstart's host)
    then overlaps the stages before the first update instead of delaying it. The first update takes them by their
    key (`_get_pool`); a spec with another key (rank count, threads, environment) replaces them, as any change of
    key does, so a wrong guess costs their start and never a result. gloo only, as residency is."""
    if resolve_backend(backend) != "gloo":
        return
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            key = _pool_key(num_processes, backend, threads_per_rank, cuda_devices)
            _POOL = _start_pool(key, num_processes=num_processes, threads=threads_per_rank, cuda_devices=cuda_devices)


def _get_pool(spec: UpdateSpec) -> _Pool:
    """The pool for `spec`: the current one if its key matches and every rank is alive, else a new one (a rank
    that died between updates, e.g. killed by the OOM killer, only costs a restart)."""
    global _POOL
    key = _spec_key(spec)
    if _POOL is not None and (_POOL.key != key or not _POOL.alive()):
        dead = [w["rank"] for w in _POOL.workers if w["process"].poll() is not None]
        if dead:
            logger.warning("update: resident rank(s) %s exited between updates; starting fresh ranks", dead)
        elif _POOL.updates == 0:
            logger.info("update: the ranks started ahead do not fit this update (%s != %s); restarting", _POOL.key, key)
        _POOL.close()
        _POOL = None
    if _POOL is None:
        _POOL = _start_pool(
            key, num_processes=spec.update.num_processes, threads=spec.threads_per_rank, cuda_devices=spec.cuda_devices
        )
    return _POOL


def _start_pool(key: tuple, *, num_processes: int, threads: int | None, cuda_devices: str | None) -> _Pool:
    log_dir = Path(tempfile.mkdtemp(prefix="batchrl-trainers-"))
    port = _free_port()
    workers = [
        _start_worker(
            None,
            rank=rank,
            world_size=num_processes,
            port=port,
            log_dir=log_dir,
            threads=threads,
            cuda_devices=cuda_devices,
        )
        for rank in range(num_processes)
    ]
    logger.info("started %d resident update rank(s)", num_processes)
    return _Pool(key=key, workers=workers, log_dir=log_dir)


def _run_on_pool(
    spec: UpdateSpec, *, timeout_s: float | None, on_progress: Callable[[dict[str, Any]], None] | None
) -> dict[str, float]:
    """One update as a command to the resident ranks; any failure drops the pool (killing every rank)."""
    global _POOL
    pool = _get_pool(spec)
    command_dir = Path(tempfile.mkdtemp(prefix=f"update-{pool.updates:04d}-", dir=pool.log_dir))
    try:
        spec, poll_progress = _with_progress(spec, on_progress, str(command_dir))
        spec_path = command_dir / "spec.json"
        spec.to_json(spec_path)
        for w in pool.workers:  # this command's part of each rank's log, for the error message
            w["log_offset"] = w["stderr_path"].stat().st_size
        started = time.perf_counter()
        try:
            pool.send(spec_path)
        except OSError as error:  # a rank died between the liveness check and now; the wait reports it
            logger.debug("sending the update to the resident ranks failed: %r", error)
        done_files = {w["rank"]: Path(f"{spec_path}.rank{w['rank']}.done") for w in pool.workers}
        failure = _wait_for_workers(
            pool.workers, timeout_s=timeout_s, on_poll=poll_progress, done=lambda w: done_files[w["rank"]].exists()
        )
        if poll_progress is not None:
            poll_progress()
        if failure is not None:
            raise _failure(spec, failure)
        pool.updates += 1
        logger.info(
            "update finished in %.1f s on %d resident process(es) (update %d of these ranks)",
            time.perf_counter() - started,
            len(pool.workers),
            pool.updates,
        )
    except BaseException:
        _POOL = None
        pool.close()
        raise
    shutil.rmtree(command_dir, ignore_errors=True)
    return _read_metrics(spec)


def _with_progress(
    spec: UpdateSpec, on_progress: Callable[[dict[str, Any]], None] | None, tmp: str
) -> tuple[UpdateSpec, Callable[[], None] | None]:
    """The spec with a progress file (under `tmp` unless it names one) and its poller, when progress is wanted."""
    if on_progress is None:
        return spec, None
    if spec.progress_path is None:
        spec = dataclasses.replace(spec, progress_path=str(Path(tmp) / "progress.jsonl"))
    Path(spec.progress_path).unlink(missing_ok=True)  # never replay a previous run's records
    return spec, _progress_poller(ProgressReader(spec.progress_path), on_progress)


def _failure(spec: UpdateSpec, failure: str | ProcessCrash) -> Exception:
    """The error to raise for failed ranks: the trainer-state mismatch rank 0 reported, else the crash, else the
    ranks' story."""
    mismatch = read_error(spec.metrics_path)
    if mismatch is not None:
        logger.debug("update ranks refused the trainer state:\n%s", failure)
        return mismatch
    return failure if isinstance(failure, ProcessCrash) else RuntimeError(failure)


def _read_metrics(spec: UpdateSpec) -> dict[str, float]:
    with open(spec.metrics_path, encoding="utf-8") as f:
        return {name: float(value) for name, value in json.load(f).items()}


def _check_gpu_only_options(spec: UpdateSpec) -> None:
    """CPU offload moves GPU-resident shards to host memory: meaningless (and unsupported) without CUDA.
    UpdateConfig already rejects it with backend gloo; this catches backend auto on a host without CUDA before
    any rank starts."""
    if not spec.update.cpu_offload:
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "update.cpu_offload=true needs CUDA GPUs and the nccl backend (this machine has no CUDA); on CPU the "
            "parameters already live in host memory. Set update.cpu_offload=false"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_env(
    *, rank: int, world_size: int, port: int, threads: int | None = None, cuda_devices: str | None = None
) -> dict[str, str]:
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
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // world_size)))
    if threads is not None:  # the update's share of a host it shares with running engines (run.max_staleness)
        env["OMP_NUM_THREADS"] = str(threads)
    if cuda_devices is not None:  # the same, on a GPU host: the ranks' own GPUs (LOCAL_RANK indexes into them)
        env["CUDA_VISIBLE_DEVICES"] = cuda_devices
    return env


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (a container limited to 2
    CPUs on a 64-core host reports 64 from os.cpu_count(), and 32 threads per rank would thrash)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cpus, quota) if quota else cpus)


def _cgroup_cpu_quota() -> int | None:
    """ceil(quota / period) from cgroup v2 cpu.max or v1 cfs files; None without a quota."""
    import math

    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 else max(1, math.ceil(quota / period))
    except (OSError, ValueError):
        return None


def _start_worker(
    spec_path: Path | None,
    *,
    rank: int,
    world_size: int,
    port: int,
    log_dir: Path,
    threads: int | None = None,
    cuda_devices: str | None = None,
) -> dict:
    """Popen one rank with its stdout/stderr in files (pipes could fill up and block the worker); without a
    spec path, a resident rank that reads spec paths from its stdin (a pipe)."""
    stdout_path, stderr_path = log_dir / f"rank{rank}.out", log_dir / f"rank{rank}.err"
    with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "batchrl.trainer.worker", "--serve" if spec_path is None else str(spec_path)],
            env=_worker_env(rank=rank, world_size=world_size, port=port, threads=threads, cuda_devices=cuda_devices),
            stdin=subprocess.PIPE if spec_path is None else None,
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
        except Exception as error:
            broken = True
            logger.warning("update progress display off after an error: %r", error)

    return poll


def _wait_for_workers(
    workers: list[dict],
    *,
    timeout_s: float | None,
    on_poll: Callable[[], None] | None = None,
    done: Callable[[dict], bool] | None = None,
) -> str | ProcessCrash | None:
    """Poll until all ranks are done (None) or one fails or time runs out (a message naming the culprits; a
    ProcessCrash when one died of a signal).

    Done: exited with 0, or, for resident ranks, `done(worker)` (and then any exit is a failure).
    `on_poll()` runs once per poll (every POLL_INTERVAL_S), e.g. to read rank 0's progress."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if on_poll is not None:
            on_poll()
        codes = [w["process"].poll() for w in workers]
        if done is None:
            failed = [w for w, code in zip(workers, codes) if code not in (None, 0)]
            finished = all(code == 0 for code in codes)
        else:
            failed = [w for w, code in zip(workers, codes) if code is not None]
            finished = all(done(w) for w in workers)
        if failed:
            story = "\n".join(
                f"update rank {w['rank']} exited with code {w['process'].returncode}; stderr tail:\n"
                f"{_tail(w['stderr_path'], start=w.get('log_offset', 0))}"
                for w in failed[:2]
            )
            crashed = [w for w in failed if w["process"].returncode < 0]
            if crashed:  # a native crash (or a kill): one line for the user, the ranks' logs for the details
                return ProcessCrash(
                    process=f"update rank {crashed[0]['rank']}",
                    signal_name=signal_name(crashed[0]["process"].returncode),
                    details=story,
                )
            return story
        if finished:
            return None
        if deadline is not None and time.monotonic() > deadline:
            return (
                f"update timed out after {timeout_s} s; rank 0 stderr tail:\n"
                f"{_tail(workers[0]['stderr_path'], start=workers[0].get('log_offset', 0))}"
            )
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


def _tail(path: Path, *, start: int = 0) -> str:
    """The last STDERR_TAIL_CHARS of the log from byte `start` (a resident rank's current command), or of the
    whole log when that part is empty."""
    with open(path, "rb") as f:
        data = f.read()
    text = (data[start:] or data).decode("utf-8", errors="replace")
    return text[-STDERR_TAIL_CHARS:]

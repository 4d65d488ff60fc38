"""No process a run starts outlives its driver, however the driver ends (kill -9 included).

Why: Ray fate-shares only the processes ray.init() starts itself (gcs_server, raylet, log monitor: a parent-death
signal, PR_SET_PDEATHSIG). The raylet's own children, ray::DashboardAgent and ray::RuntimeEnvAgent (~200 MB), see
the raylet die with the driver within a second (their logs say so), but before exiting they report its death to
the driver through the GCS, which died too, in a call given 60 s (Ray 2.60, `publish_error_to_driver`). Measured
here: gone 63 s after the driver's kill -9; issue 19 saw them alive after 90 s in 5 of 10 kills. An update rank
in the middle of an update runs it to the end (minutes on a GPU): nothing tells it.

How: a watchdog process (this file, started by `reaping_orphans()`) lists the processes already there, then every
`SCAN_INTERVAL_S` notes each new process descended from the driver, with its start time, so that a reused pid is
never taken for one of them. When the driver is gone or done (its pipe to the watchdog closes) the watchdog sends
SIGTERM to those still running, SIGKILL after `GRACE_S`, and exits. It ignores SIGINT, SIGTERM and SIGHUP, which a
terminal or a scheduler sends to a whole process group, so that it outlives the driver. Only what the driver
started after the watchdog is touched: never a Ray cluster the run connected to (`ray start`), whose processes
are not the driver's. A process whose parent exits within `SCAN_INTERVAL_S` of starting it (a double-forked
daemon) can escape; Ray starts none. Linux only (/proc); elsewhere the block runs without a watchdog.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import TextIO

logger = logging.getLogger(__name__)

SCAN_INTERVAL_S = 0.5
GRACE_S = 3.0
READY_TIMEOUT_S = 30.0


@contextlib.contextmanager
def reaping_orphans() -> Iterator[None]:
    """Runs the block with a watchdog that stops, once this process is gone or the block is done, every process
    started meanwhile from this one that is still running."""
    if not sys.platform.startswith("linux"):
        yield
        return
    # By path and isolated (-I): it imports only the standard library, whatever the environment. No stderr: it
    # would keep a reader of the driver's stderr waiting after the driver exits.
    watchdog = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    # Wait until it has listed the processes already there: what starts after that is the run's.
    ready, _, _ = select.select([watchdog.stdout], [], [], READY_TIMEOUT_S)
    if not ready or not watchdog.stdout.read(1):
        logger.warning(
            "the watchdog that stops this run's processes if the driver is killed did not start; "
            "a killed driver may leave Ray's agents and update ranks running"
        )
    watchdog.stdout.close()
    try:
        yield
    finally:
        watchdog.stdin.close()  # the watchdog stops what is left and exits; the driver does not wait for it


def watch(driver: int, pipe: int, ready: TextIO) -> None:
    """The watchdog's loop: track the driver's descendants until ``pipe`` (its stdin) closes, then stop them. Says
    on ``ready`` (its stdout) when it has listed the processes already there."""
    tracked: dict[int, int] = {}  # pid -> start time, of the descendants seen so far
    seen = set(_pids())  # there before the watchdog (itself included): not the run's
    ready.write("1")
    ready.close()
    while not _closed(pipe, timeout=SCAN_INTERVAL_S) and os.getppid() == driver:
        _track(driver, tracked, seen)
    root = driver if os.getppid() == driver else -1  # a dead driver's pid may be reused by now
    _track(root, tracked, seen)
    _stop(root, tracked, seen)


def _track(root: int, tracked: dict[int, int], seen: set[int]) -> None:
    """Adds the descendants of ``root`` among the processes that appeared since the last scan. A process that was
    not a descendant when first seen never becomes one (orphans move up to init or a subreaper, never down), so
    each process is read once."""
    current = set(_pids())
    for pid in [pid for pid in tracked if pid not in current]:
        del tracked[pid]  # exited
    seen.intersection_update(current)  # a pid that comes back is another process
    new = {}
    for pid in current - seen:
        seen.add(pid)
        info = _stat(pid)
        if info is not None:
            new[pid] = info
    parents = {root, *tracked}
    while True:  # a child and its parent can both be new: add until nothing more joins
        joined = {pid: start for pid, (ppid, start, _) in new.items() if ppid in parents}
        if not joined:
            return
        tracked.update(joined)
        parents.update(joined)
        new = {pid: info for pid, info in new.items() if pid not in joined}


def _stop(root: int, tracked: dict[int, int], seen: set[int]) -> None:
    """SIGTERM to the tracked processes still running, SIGKILL to those left after GRACE_S."""
    _signal_all(tracked, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while _running(tracked) and time.monotonic() < deadline:
        time.sleep(0.1)
    _track(root, tracked, seen)  # children started while the others were stopping
    _signal_all(tracked, signal.SIGKILL)


def _running(tracked: dict[int, int]) -> list[int]:
    running = []
    for pid, start in tracked.items():
        info = _stat(pid)
        if info is not None and info[1] == start and not info[2]:
            running.append(pid)
    return running


def _signal_all(tracked: dict[int, int], signum: int) -> None:
    for pid in _running(tracked):
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _stat(pid: int) -> tuple[int, int, bool] | None:
    """(parent pid, start time in clock ticks since boot, is a zombie) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name before ")" may hold spaces
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), fields[0] == b"Z"


def _closed(fd: int, *, timeout: float) -> bool:
    """Whether the driver's end of the pipe is closed (EOF), waiting up to ``timeout`` for it."""
    readable, _, _ = select.select([fd], [], [], timeout)
    return bool(readable) and not os.read(fd, 4096)


def main() -> None:
    # A terminal's ^C and a scheduler's SIGTERM go to the whole process group: the watchdog must outlive the driver.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    watch(os.getppid(), sys.stdin.fileno(), sys.stdout)


if __name__ == "__main__":
    main()

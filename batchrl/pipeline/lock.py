"""run.lock: one writer per run directory.

Local run directories use an exclusive create, so two ``batchrl run`` on the same directory cannot both
hold it. Object stores have no exclusive create: there the lock is checked then written (a narrow race).

A held lock is a lease: the holder rewrites its ``heartbeat`` every ``HEARTBEAT_S``. A lock is stale, and
the next run takes it over with a warning, when its pid is dead on this host, or when its heartbeat is
older than ``EXPIRES_AFTER_S`` (a job on another host or container that was killed: a Kubernetes pod
retried on a new node, an Airflow worker lost). Otherwise the run is refused (exit 2) with how to clear it:
``batchrl unlock RUN_DIR``, which refuses while the holder is alive on this host. Clocks of different hosts
must agree to well within ``EXPIRES_AFTER_S``. A holder that finds its lock taken over (it was paused past
the expiry) interrupts itself rather than keep writing beside the new holder.

The lock is not released while a thread of the run may still write: one registered with `held_until` (an overlapped
update the run could not stop) keeps it held past the end of the ``with`` block until the thread has ended; if the
process exits first, the lock is left behind with a dead pid, and the next run takes it over.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import socket
import threading
import time

from batchrl.pipeline.interrupts import deferred
from batchrl.storage import is_local, resolve, write_bytes_atomic

logger = logging.getLogger(__name__)

HEARTBEAT_S = 15.0
EXPIRES_AFTER_S = 120.0  # a retried Kubernetes pod / Airflow task gets the lock back within minutes


class RunLockedError(RuntimeError):
    """Another run holds the run directory."""


class RunLock:
    def __init__(self, uri: str):
        self.uri = uri
        self.fs, self.path = resolve(uri)
        now = time.time()
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": now, "heartbeat": now}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._writers: dict[str, threading.Event] = {}  # writer -> set when it has ended (held_until)

    def __enter__(self) -> RunLock:
        try:
            with deferred():  # a stop signal while the lock is being taken is raised once it is taken...
                self._acquire()
        except KeyboardInterrupt:
            self.__exit__(None, None, None)  # ...and released here: the `with` body, whose exit would, never runs
            raise
        return self

    def _acquire(self) -> None:
        holder = lock_holder(self.uri)
        if holder is not None:
            state = holder_state(holder)
            if state in ("dead", "expired"):
                logger.warning(
                    "taking over a stale run lock (%s) of pid %s on %s: %s",
                    state,
                    holder.get("pid"),
                    holder.get("host"),
                    self.uri,
                )
                self.fs.rm(self.path)
            else:
                raise RunLockedError(_locked_message(self.uri, holder, state))
        payload = json.dumps(self.owner).encode()
        if is_local(self.uri):
            self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                raise RunLockedError(
                    f"another batchrl run took the lock {self.uri} just now; try again later"
                ) from None
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
        else:
            write_bytes_atomic(self.uri, payload)
        self._thread = threading.Thread(target=self._beat, name="batchrl-lock-heartbeat", daemon=True)
        self._thread.start()

    def __exit__(self, *exc) -> None:
        with deferred():  # a stop signal must not leave the lock behind
            writing = {writer: ended for writer, ended in self._writers.items() if not ended.is_set()}
            if writing:
                logger.warning(
                    "the run lock %s stays held until %s has ended (or this process exits)",
                    self.uri,
                    ", ".join(writing),
                )
                threading.Thread(
                    target=self._release_after, args=(list(writing.values()),), name="batchrl-lock-release", daemon=True
                ).start()
            else:
                self._release()

    def held_until(self, ended: threading.Event, *, writer: str) -> None:
        """Keeps the lock held, past the end of the ``with`` block, until ``ended`` is set: a thread that may still
        write into the run directory (``writer``, an update the run could not stop) sets it when it ends. The heartbeat
        goes on meanwhile; if this process exits first, the lock is left to be taken over as stale."""
        self._writers[writer] = ended

    def _release_after(self, writers: list[threading.Event]) -> None:
        for ended in writers:
            ended.wait()
        self._release()

    def _release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if self._is_mine(lock_holder(self.uri)):
                self.fs.rm(self.path)
        except Exception as err:
            logger.warning(
                "could not release the run lock %s (%s); the next run takes it over once it is stale", self.uri, err
            )

    def _is_mine(self, holder: dict | None) -> bool:
        return (
            holder is not None and holder.get("pid") == self.owner["pid"] and holder.get("host") == self.owner["host"]
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self._is_mine(lock_holder(self.uri)):
                    logger.error("run lock %s was taken over by another run; stopping this one", self.uri)
                    _thread.interrupt_main()
                    return
                self.owner["heartbeat"] = time.time()
                write_bytes_atomic(self.uri, json.dumps(self.owner).encode())
            except Exception as err:
                logger.warning("could not refresh the run lock %s: %s", self.uri, err)


def _locked_message(uri: str, holder: dict, state: str) -> str:
    run_dir = uri.rsplit("/", 1)[0]
    beat = holder.get("heartbeat", holder.get("since", 0))
    advice = (
        "wait for it to finish or stop it"
        if state == "alive"
        else f"if that run is no longer running, clear the lock with `batchrl unlock {run_dir}` (it also expires "
        f"{EXPIRES_AFTER_S:.0f} s after its last heartbeat)"
    )
    return (
        f"run directory is locked by pid {holder.get('pid')} on {holder.get('host')} since "
        f"{time.ctime(holder.get('since', 0))}, last heartbeat {time.time() - beat:.0f} s ago ({state}): "
        f"{advice}, then run again"
    )


def lock_holder(uri: str) -> dict | None:
    """The lock file's {pid, host, since, heartbeat}, or None when the run is not locked."""
    fs, path = resolve(uri)
    try:
        fs.invalidate_cache(path)
        return json.loads(fs.cat_file(path).decode())
    except FileNotFoundError:
        return None
    except ValueError:
        return {"pid": -1, "host": "unknown (unreadable lock file)"}


def holder_state(holder: dict) -> str:
    """alive / dead (pid gone on this host) / expired (no heartbeat for EXPIRES_AFTER_S) / other host."""
    if holder.get("host") == socket.gethostname():
        return "alive" if _pid_alive(int(holder.get("pid", -1))) else "dead"
    beat = holder.get("heartbeat", holder.get("since"))
    if beat is not None and time.time() - float(beat) > EXPIRES_AFTER_S:
        return "expired"
    return "other host"


def break_lock(uri: str) -> dict | None:
    """Removes a lock whose holder is not alive on this host; returns the removed holder (None: no lock)."""
    holder = lock_holder(uri)
    if holder is None:
        return None
    if holder_state(holder) == "alive":
        raise RunLockedError(f"{uri} is held by pid {holder.get('pid')}, alive on this host: stop that run first")
    fs, path = resolve(uri)
    fs.rm(path)
    return holder


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

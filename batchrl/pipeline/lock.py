"""run.lock: one writer per run directory.

Local run directories use an exclusive create, so two ``batchrl run`` on the same directory cannot both
hold it. A lock left by a dead process on this host is provably stale and is taken over (with a warning);
a lock from another host, or from a live process, refuses the run with how to clear it. Object stores
have no exclusive create: there the lock is checked then written (a narrow race, documented).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from batchrl.storage import is_local, resolve, write_bytes_atomic

logger = logging.getLogger(__name__)


class RunLockedError(RuntimeError):
    """Another run holds the run directory."""


class RunLock:
    def __init__(self, uri: str):
        self.uri = uri
        self.fs, self.path = resolve(uri)
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}

    def __enter__(self) -> "RunLock":
        holder = self._holder()
        if holder is not None:
            if holder.get("host") == self.owner["host"] and not _pid_alive(int(holder.get("pid", -1))):
                logger.warning("taking over a stale run lock of dead pid %s (%s)", holder.get("pid"), self.uri)
                self.fs.rm(self.path)
            else:
                raise RunLockedError(
                    f"run directory is locked by pid {holder.get('pid')} on {holder.get('host')} since "
                    f"{time.ctime(holder.get('since', 0))}: wait for that run to finish; if it is dead, "
                    f"delete {self.uri} and run again")
        payload = json.dumps(self.owner).encode()
        if is_local(self.uri):
            self.fs.makedirs(self.path.rsplit("/", 1)[0], exist_ok=True)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                raise RunLockedError(f"another batchrl run took the lock {self.uri} just now; try again later") from None
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
        else:
            write_bytes_atomic(self.uri, payload)
        return self

    def __exit__(self, *exc) -> None:
        holder = self._holder()
        if holder is not None and holder.get("pid") == self.owner["pid"] and holder.get("host") == self.owner["host"]:
            self.fs.rm(self.path)

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.fs.cat_file(self.path).decode())
        except FileNotFoundError:
            return None
        except ValueError:
            return {"pid": -1, "host": "unknown (unreadable lock file)"}


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

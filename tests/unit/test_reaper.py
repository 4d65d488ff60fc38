"""The watchdog that stops what a killed driver started (batchrl/pipeline/reaper.py), with real processes: a stand-in
driver starts children inside `reaping_orphans()` and is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from batchrl.pipeline.reaper import GRACE_S

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watchdog reads /proc")

DRIVER = """
import subprocess, sys, time
from batchrl.pipeline.reaper import reaping_orphans

older = subprocess.Popen(["sleep", "300"])  # started before the watchdog: not the run's
with reaping_orphans():
    children = [subprocess.Popen(["sleep", "300"]),
                # ignores SIGTERM, in a session of its own, with a child of its own
                subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 300 & wait"], start_new_session=True)]
    time.sleep(1.5)  # a few scans of the watchdog
    print(older.pid, *(child.pid for child in children), flush=True)
    time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def children_of(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                    found.append(int(name))
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
    return found


def test_what_a_sigkilled_driver_started_inside_reaping_orphans_is_stopped_and_nothing_older_is(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    older, *started = (int(pid) for pid in driver.stdout.readline().split())
    started += children_of(started[-1])  # the sleep of the `sh` that ignores SIGTERM
    try:
        assert len(started) == 3 and all(alive(pid) for pid in started)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + GRACE_S + 120  # a bound, not the check: a loaded host schedules the watchdog late
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in started if alive(pid)]
        assert alive(older)
    finally:
        for pid in [older, *started]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

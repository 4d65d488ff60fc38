"""SIGTERM and SIGINT stop a run with exit 4 whatever they interrupt: the lock released, child processes stopped.

Python runs signal handlers in the main thread, between bytecodes. The first signal raises KeyboardInterrupt
there, which unwinds the run through its clean-up (`finally` blocks and context managers: update ranks,
ray.shutdown, the lock). Later signals are only logged: a second KeyboardInterrupt raised inside that clean-up
would cut it short (the lock left behind, a traceback). Clean-up that even the first signal must not cut (the
normal end of a run also runs it) goes in `deferred()`: a signal arriving there is raised when the block ends.

Ray displaces the handler, twice. ray.init() installs a Python SIGTERM handler, `sys.exit(15)` (exit 15, or exit 1
when it fires inside ray.get/ray.wait, which turns SystemExit into SystemExit(1)), and its core worker installs a
C one, absl's failure handler, which prints "*** SIGTERM received", arms `alarm(3)` with a handler that aborts the
process, then calls Python's. A driver still cleaning up 3 s after a SIGTERM (stopping update ranks takes 5 s) was
aborted: exit 134, the lock and all child processes left behind. `kept_across()` puts our handlers back after
ray.init().
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _State:
    received: str | None = None  # the first signal's name
    raised: bool = False  # the KeyboardInterrupt for it was raised (now or at the end of a deferred block)
    deferring: int = 0  # depth of deferred() blocks


def install() -> None:
    """SIGTERM (schedulers stop jobs with it) and SIGINT raise one KeyboardInterrupt; the CLI maps it to exit 4."""
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)


def received() -> str | None:
    """The name of the first stop signal received by this process (SIGTERM, SIGINT), or None."""
    return _State.received


def _on_signal(signum: int, frame) -> None:
    _disarm_alarm()  # absl's abort timer, armed if its handler saw this SIGTERM first (see above)
    name = signal.Signals(signum).name
    if _State.received is not None:
        logger.warning(
            "%s received while stopping: finishing the clean-up first (SIGKILL stops at once, "
            "leaving the run lock for the next run to take over)",
            name,
        )
        return
    _State.received = name
    if _State.deferring:
        return  # raised when the clean-up in progress ends
    _State.raised = True
    raise KeyboardInterrupt(name)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Clean-up that a stop signal must not cut short; the signal is raised as KeyboardInterrupt when it ends."""
    _State.deferring += 1
    try:
        yield
    finally:
        _State.deferring -= 1
        if _State.received is not None and not _State.raised and not _State.deferring:
            _State.raised = True  # even over an exception on its way out: a stopped run exits 4 and is resumed
            raise KeyboardInterrupt(_State.received)


@contextlib.contextmanager
def kept_across(what: str) -> Iterator[None]:
    """Restores the stop signals' handlers after a block that replaces them (ray.init). A SIGTERM that arrived inside
    reached the replacing handler, Ray's `sys.exit(15)`; it is handed to the handler we had, as if it came now."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    try:
        yield
    except SystemExit as stop:
        # Ray's handler exits with 15, or 1 when it fired in a wait inside Ray's C++; then absl's handler, which
        # ran first, has left its abort alarm armed (nothing else arms one in ray.init): a SIGTERM either way.
        absl_alarm = _disarm_alarm()
        if (stop.code == signal.SIGTERM or absl_alarm) and callable(before[signal.SIGTERM]):
            logger.debug("SIGTERM during %s: passing it to the handler that %s displaced", what, what)
            _restore(before)
            before[signal.SIGTERM](signal.SIGTERM, None)
        raise
    finally:
        _restore(before)


def _disarm_alarm() -> bool:
    """Cancels a pending alarm(); whether there was one. A stopping driver needs none (batchrl sets none in the
    driver: math-verify's run in the reward processes)."""
    return hasattr(signal, "alarm") and signal.alarm(0) > 0


def _restore(handlers: dict) -> None:
    # Even where Python still reports our handler: absl replaces the C-level one behind Python's back.
    for signum, handler in handlers.items():
        if handler is not None:
            signal.signal(signum, handler)

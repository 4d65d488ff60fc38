"""Overlapped iterations (run.max_staleness > 0): the policy update of iteration i runs in a thread while the main
thread goes on with iteration i+1's stages that do not read it (generate and score read an older policy).

Why this is safe without locking the plan (the concurrency argument):

- One step at most is in flight (``start`` waits for the previous one first), and only the thread that made the
  `Overlap` (the runner's loop) calls its methods; the assert in each says so. The slot ``_flight`` is therefore
  read and written by that thread alone.
- The one thing the two threads share is the flight's outcome: the worker writes ``error`` and then sets ``ended``;
  the loop reads ``error`` only after ``ended.wait()`` has returned. The Event orders the write before the read.
- The step in flight (its status and manifest, its output directory, the readers its commit deletes) is touched by
  the worker alone: before the loop runs a step that reads its table or policy, or writes the same table (the next
  update), it waits for it (``wait_if_read_by``); and the loop writes no metrics of its iteration while it runs
  (``running_iteration``). The engines and the update's ranks share nothing mutable: the engines are Ray actors
  that take a new policy only between shards, the ranks are processes of their own.

The worker's end is an Event it sets itself, not ``Thread.join``/``is_alive``: a join that a SIGTERM interrupts
marks the thread stopped while it runs on (CPython 3.11's bpo-45274 workaround releases its lock), so a wait for
it after a stop would end at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from batchrl.pipeline.interrupts import deferred
from batchrl.pipeline.lock import RunLock
from batchrl.pipeline.plan import PlannedStage
from batchrl.pipeline.stage import Stage

logger = logging.getLogger(__name__)

STOP_S = 30.0  # how long an error or interrupt waits for the step in flight once its stage is closed


@dataclass
class _Flight:
    step: PlannedStage
    ended: threading.Event = field(default_factory=threading.Event)  # set by the worker, last
    error: BaseException | None = None  # written by the worker before it sets ended


class Overlap:
    """The one step that may run beside the loop's steps: ``start`` it, ``wait_if_read_by`` before each later
    step, ``wait`` at the end, ``abandon`` on an error or interrupt."""

    def __init__(self, stages: dict[str, Stage]):
        self._stages = stages
        self._flight: _Flight | None = None
        self._owner = threading.get_ident()

    @property
    def running_iteration(self) -> int | None:
        """The iteration of the step in flight (None: none is)."""
        assert threading.get_ident() == self._owner, "the overlap is driven by one thread"
        return None if self._flight is None else self._flight.step.iteration

    def start(self, step: PlannedStage, work: Callable[[], object]) -> None:
        """Runs ``work`` (the step) in a thread, after the step in flight has ended."""
        self.wait()
        flight = _Flight(step)

        def worker() -> None:
            try:
                work()
            except BaseException as error:  # re-raised in the loop's thread by wait()
                flight.error = error
            finally:
                flight.ended.set()

        self._flight = flight
        name = f"batchrl-{step.name}-{step.iteration}"
        threading.Thread(target=worker, name=name, daemon=True).start()

    def wait_if_read_by(self, step: PlannedStage) -> None:
        """Waits for the step in flight when ``step`` reads its table or policy, or writes the same table."""
        assert threading.get_ident() == self._owner, "the overlap is driven by one thread"
        if self._flight is None:
            return
        running = self._flight.step
        reads = {step.policy_in, *step.input_dirs.values()}
        if running.output_dir in reads or self._stages[step.name].table == self._stages[running.name].table:
            self.wait()

    def wait(self) -> None:
        """Waits for the step in flight to end; its error, if any, is raised here."""
        assert threading.get_ident() == self._owner, "the overlap is driven by one thread"
        flight = self._flight
        if flight is None:
            return
        flight.ended.wait()
        self._flight = None  # only now: an interrupt during the wait leaves it in flight, for abandon() to stop
        if flight.error is not None:
            raise flight.error

    def abandon(self, run_lock: RunLock | None) -> None:
        """On an error or interrupt in the loop: closes the stage in flight (resident ranks end once the update in
        flight, which holds them, is done; fresh ranks and Ray actors are not stopped by it), waits a little for its
        thread, and leaves; what it did not commit is redone on resume, as after a crash. A thread still running then
        may yet publish its policy and commit its manifest, so the run lock stays held until it ends (`held_until`):
        no other run may write the run directory beside it."""
        assert threading.get_ident() == self._owner, "the overlap is driven by one thread"
        flight, self._flight = self._flight, None
        if flight is None:
            return
        with deferred():
            self._stages[flight.step.name].close()
        if not flight.ended.wait(timeout=STOP_S) and run_lock is not None:
            logger.error(
                "%s did not stop within %.0f s of its stage being closed: the run lock stays held until it ends, or "
                "until this process exits (the next run then takes the lock over)",
                flight.step.label,
                STOP_S,
            )
            run_lock.held_until(flight.ended, writer=flight.step.label)

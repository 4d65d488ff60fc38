"""Jobs on long-lived Ray actors, one at a time per actor, each under a deadline: a hung engine never hangs a run.

Why not Ray's ActorPool (which generate used): it waits for a result as long as it takes, so an engine stuck in
a kernel, a collective or a deadlock held the run forever. Here every job has ``timeout_s`` from its submission
(an actor runs one job at a time, so the clock is the job's own, plus a restarted actor's rebuild). A job past
its deadline gets its actor killed; Ray restarts the actor and runs the job again on it (the actor class needs
``max_restarts`` and ``max_task_retries``: see ``task_retries``), with a fresh deadline, up to
``timeout_retries`` times; then the run stops with ShardTimeout (exit 1, an internal failure: nothing the user's
data or config did). An actor that dies on its own (OOM, a crash) has its job retried by Ray the same way; when
Ray gives up, the run stops naming the job (ProcessCrash: one line and a log, not a traceback).

Why Ray's retry and not a resubmission of ours: a task sent to an actor while it restarts fails at once
("the actor is temporarily unavailable"), so a resubmission would have to poll for the actor's return; Ray's
retry waits for it. A job run again rewrites the same output part atomically (a shard's output is a function of
its input), so a retry never duplicates rows.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from batchrl.errors import ProcessCrash

logger = logging.getLogger(__name__)


class ShardTimeout(RuntimeError):
    """A job ran past its deadline more times than it may be retried."""


def task_retries(*, timeout_retries: int, death_retries: int) -> int:
    """``max_task_retries`` for the actors' class: a job may be run again after each deadline and each death."""
    return timeout_retries + death_retries


@dataclass
class DeadlineStats:
    timeouts: int = 0  # deadlines passed (each killed its actor)
    by_job: dict[str, int] = field(default_factory=dict)  # deadlines passed per job name


def run_with_deadlines(
    actors: list[Any],
    jobs: list[dict[str, Any]],
    submit: Callable[[Any, dict[str, Any]], Any],
    *,
    timeout_s: float | None,
    timeout_retries: int,
    what: str,
    stats: DeadlineStats | None = None,
) -> Iterator[Any]:
    """The results of ``submit(actor, job)`` (an ObjectRef) for every job, as they finish (any order).

    ``timeout_s``: None for no deadline. ``what`` names the jobs in errors ("generate: shard"); a job's name is
    ``job["name"]``. ``stats`` (optional) receives the deadlines passed."""
    import ray
    from ray.exceptions import RayActorError

    stats = stats if stats is not None else DeadlineStats()
    todo, idle = deque(jobs), list(actors)
    running: dict[Any, tuple[Any, dict[str, Any], float]] = {}  # ref -> (actor, job, submitted or rerun at)
    while todo or running:
        while todo and idle:
            actor, job = idle.pop(), todo.popleft()
            running[submit(actor, job)] = (actor, job, time.monotonic())
        wait_s = None
        if timeout_s is not None:
            wait_s = max(0.0, min(started for _, _, started in running.values()) + timeout_s - time.monotonic())
        ready, _ = ray.wait(list(running), num_returns=1, timeout=wait_s)
        if ready:
            actor, job, _ = running.pop(ready[0])
            try:
                result = ray.get(ready[0])
            except RayActorError as err:  # it died again and again: a native crash, or killed (out of memory)
                named = re.search(r"\bSIG[A-Z]+\b", str(err))
                raise ProcessCrash(
                    process=f"the actor of {what} {job['name']} (after Ray's retries)",
                    signal_name=named.group(0) if named else "an unexpected exit",
                    details=str(err),
                ) from None
            idle.append(actor)
            yield result
            continue
        now = time.monotonic()
        for ref, (actor, job, started) in list(running.items()):
            if now - started < timeout_s:
                continue
            name = job["name"]
            stats.timeouts += 1
            stats.by_job[name] = stats.by_job.get(name, 0) + 1
            if stats.by_job[name] > timeout_retries:
                ray.kill(actor, no_restart=True)  # the run stops: nothing is to run on it again
                raise ShardTimeout(
                    f"{what} {name} ran past its deadline of {timeout_s:g} s {stats.by_job[name]} times (its actor "
                    f"was killed and rebuilt after each); giving up after {timeout_retries} retries"
                )
            logger.warning(
                "%s %s ran past its deadline of %g s: its actor is killed and rebuilt, and the job run again "
                "(retry %d of %d)",
                what,
                name,
                timeout_s,
                stats.by_job[name],
                timeout_retries,
            )
            ray.kill(actor, no_restart=False)  # the engine may be stuck in native code: only a kill stops it
            running[ref] = (actor, job, time.monotonic())  # Ray runs it again once the actor is back

"""Jobs on long-lived actors under a deadline (generate.shard_timeout_s): a job past it kills its actor, which Ray
restarts, and runs again; a job that overruns again stops the run; an actor that dies on its own is retried too.

The clock is never what a test checks: a deadline that a healthy job must meet is one no loaded machine misses (an
actor's restart took 4-7 s at a load of 13 on 2 cores), and the assertions are on the deadlines passed and the runs
of each job. Only the hung jobs (an hour's sleep) wait for a deadline."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from batchrl.errors import ProcessCrash
from batchrl.pipeline.deadlines import DeadlineStats, ShardTimeout, run_with_deadlines, task_retries


def toy_actors(count: int, marker_dir: Path) -> list:
    """Actors whose job ``{"name", "hangs", "dies"}`` sleeps for an hour its first ``hangs`` times, exits its
    process its first ``dies`` times (markers on disk survive the restarts), and otherwise returns its name.
    Returned once they are up: their start-up is no job's."""
    import ray

    class Worker:  # defined here, so Ray ships it by value (tests/unit is not on the workers' path)
        def ready(self):
            return True

        def run(self, job):
            import os

            marker = Path(marker_dir) / job["name"]
            seen = int(marker.read_text()) if marker.exists() else 0
            marker.write_text(str(seen + 1))
            if seen < job.get("hangs", 0):
                time.sleep(3600)
            if seen < job.get("dies", 0):
                os._exit(1)
            return job["name"]

    retries = task_retries(timeout_retries=1, death_retries=2)
    actor = ray.remote(max_restarts=-1, max_task_retries=retries)(Worker).options(num_cpus=0)
    actors = [actor.remote() for _ in range(count)]
    ray.get([one.ready.remote() for one in actors])
    return actors


def run(actors, jobs, **options):
    defaults = {"timeout_s": 3.0, "timeout_retries": 1, "what": "toy: job"}  # for jobs that hang: no job meets it
    return run_with_deadlines(actors, jobs, lambda actor, job: actor.run.remote(job), **(defaults | options))


def test_a_job_past_its_deadline_is_killed_and_retried_on_the_restarted_actor(tmp_path, ray_session):
    jobs = [{"name": "a"}, {"name": "stuck", "hangs": 1}, {"name": "b"}, {"name": "c"}, {"name": "d"}]
    stats = DeadlineStats()
    started = time.monotonic()
    # the rerun's clock holds the actor's restart: a deadline every healthy job and restart meets, however loaded
    done = list(run(toy_actors(2, tmp_path), jobs, stats=stats, timeout_s=30.0))
    assert sorted(done) == ["a", "b", "c", "d", "stuck"]
    assert stats.timeouts == 1 and stats.by_job == {"stuck": 1}
    assert (tmp_path / "stuck").read_text() == "2"  # ran twice: killed once, then finished
    assert time.monotonic() - started < 600  # not the hour the first attempt would have slept


def test_a_job_that_overruns_again_stops_with_an_error_naming_it_and_the_deadline(tmp_path, ray_session):
    stats = DeadlineStats()
    with pytest.raises(ShardTimeout, match=r"toy: job forever ran past its deadline of 3 s 2 times .* after 1 retries"):
        list(run(toy_actors(1, tmp_path), [{"name": "forever", "hangs": 99}], stats=stats))
    # counted, not timed: whether the rerun had started by the second deadline depends on the restart's speed
    assert stats.by_job == {"forever": 2} and (tmp_path / "forever").read_text() in {"1", "2"}


def test_an_actor_that_dies_is_restarted_and_its_job_retried_a_bounded_number_of_times(tmp_path, ray_session):
    stats = DeadlineStats()
    # a deadline the restart meets however loaded the machine: no deadline passed means Ray's retry ran the job
    flaky = run(toy_actors(1, tmp_path), [{"name": "flaky", "dies": 1}], stats=stats, timeout_s=300.0)
    assert list(flaky) == ["flaky"]
    assert stats.timeouts == 0 and (tmp_path / "flaky").read_text() == "2"
    with pytest.raises(ProcessCrash, match=r"the actor of toy: job doomed \(after Ray's retries\) died of ") as crash:
        list(run(toy_actors(1, tmp_path), [{"name": "doomed", "dies": 99}], timeout_s=None))
    assert "run the same command to resume" in crash.value.one_line() and crash.value.details
    assert (tmp_path / "doomed").read_text() == "4"  # the first run and task_retries(1, 2) = 3 retries

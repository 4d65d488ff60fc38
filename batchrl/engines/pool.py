"""The run's generation engines: Ray actors holding live engines, shared by the stages that generate.

Building an engine is the expensive part of generation (importing vLLM, loading the weights, warming up), so the
actors outlive a stage: the generate stage of every iteration and the evaluate stage use the same ones, and a new
policy is pushed into them in place. Who owns them: the run's session creates one `EnginePool`, hands it to every
stage in `StageContext.engines` and closes it when the run ends, interrupted or not, before its Ray shuts down (a
pool left behind would name actors of a Ray session that is gone). Nothing reaches it through a process global:
two runs in one process (tests, a notebook) each have their own.

The pool holds at most one set of actors at a time, reused while they hold the same engine (the worker class and
its spec, and the resources each actor asked for) in the same Ray session and there are at least as many as asked
for; otherwise the live ones are shut down first, so that their CPUs and GPUs are free for the new ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from typing import Any

logger = logging.getLogger(__name__)


class EnginePool:
    """The session's engine actors. A worker class is built on an actor as ``worker_cls(spec)`` and has a
    ``sleep()`` method that frees its engine's device memory until its next call."""

    def __init__(self) -> None:
        self.actors: list[Any] = []  # Ray actor handles
        self._key: tuple | None = None  # (worker class, spec, CPUs, GPUs, Ray job id) of the live actors

    def acquire(
        self,
        worker_cls: type,
        spec: Hashable,
        *,
        num_actors: int,
        num_cpus: float,
        num_gpus: float,
        max_task_retries: int,
        build_actors: int | None = None,
    ) -> list[Any]:
        """The live actors when they hold the same engine in this Ray session and are at least `num_actors` (a
        resumed iteration with fewer shards to do reuses the engines); else `build_actors` (default `num_actors`)
        new ones, after the live ones of this session are shut down. An actor is restarted by Ray as often as it
        dies (max_restarts=-1) and a call on it retried `max_task_retries` times."""
        import ray

        key = (worker_cls, spec, num_cpus, num_gpus, ray.get_runtime_context().get_job_id())
        if self._key == key and len(self.actors) >= num_actors:
            return self.actors
        if self._key is not None and self._key[-1] == key[-1]:
            self.close()  # same session, another engine or too few actors: free their resources first
        actor_cls = ray.remote(max_restarts=-1, max_task_retries=max_task_retries)(worker_cls)
        options = {"num_cpus": num_cpus} | ({"num_gpus": num_gpus} if num_gpus else {})
        self.actors = [actor_cls.options(**options).remote(spec) for _ in range(max(num_actors, build_actors or 0))]
        self._key = key
        return self.actors

    def end_stage(self, engine_lifetime: str) -> None:
        """What a stage that used the engines leaves of them (generate.engine_lifetime): stage shuts them down, sleep
        frees their device memory until the next shard, run keeps them as they are."""
        import ray

        if engine_lifetime == "stage":
            self.close()
        elif engine_lifetime == "sleep":
            started = time.perf_counter()
            ray.get([actor.sleep.remote() for actor in self.actors])
            logger.info("%d engine(s) asleep in %.2f s", len(self.actors), time.perf_counter() - started)

    def close(self) -> None:
        """Shuts the actors down (a later `acquire` builds new ones)."""
        if self.actors:
            import ray

            for actor in self.actors:
                ray.kill(actor)
        self.actors = []
        self._key = None

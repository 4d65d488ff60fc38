"""Resident update ranks started ahead (`prestart_trainers`, called by the update stage's `prestart` before iteration
0) are the ones the first update takes when its spec has their key, and are replaced when it has another: a wrong
guess costs their start, never a result. The ranks are stand-in processes here (the real ones are exercised by every
pipeline test on gloo)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchrl.trainer import launch


@pytest.fixture
def fake_ranks(monkeypatch) -> list[dict]:
    started: list[dict] = []

    def start(spec_path, *, rank, world_size, port, log_dir: Path, threads=None, cuda_devices=None) -> dict:
        stderr_path = log_dir / f"rank{rank}.err"
        stderr_path.write_text("")
        process = subprocess.Popen(["sleep", "60"], stdin=subprocess.PIPE)
        worker = {"rank": rank, "process": process, "stderr_path": stderr_path, "threads": threads}
        started.append(worker)
        return worker

    monkeypatch.setattr(launch, "_start_worker", start)
    monkeypatch.setattr(launch, "KILL_GRACE_S", 0.1)
    launch.shutdown_trainers()
    yield started
    launch.shutdown_trainers()
    assert all(w["process"].poll() is not None for w in started)  # every rank ended with the pool


def spec(num_processes: int = 2, backend: str = "gloo", threads: int | None = None):
    update = SimpleNamespace(num_processes=num_processes, backend=backend)
    return SimpleNamespace(update=update, threads_per_rank=threads, cuda_devices=None)


def test_the_first_update_takes_the_ranks_started_ahead_when_its_spec_has_their_key(fake_ranks):
    launch.prestart_trainers(num_processes=2, backend="gloo")
    assert [w["rank"] for w in fake_ranks] == [0, 1]
    launch.prestart_trainers(num_processes=2, backend="gloo")  # ranks running: nothing more started
    assert len(fake_ranks) == 2
    pool = launch._get_pool(spec())
    assert pool.workers == fake_ranks and len(fake_ranks) == 2


def test_an_update_with_another_key_replaces_the_ranks_started_ahead(fake_ranks):
    launch.prestart_trainers(num_processes=2, backend="gloo")
    ahead = list(fake_ranks)
    pool = launch._get_pool(spec(threads=1))  # run.max_staleness: one thread per rank, not the guess
    assert all(w["process"].poll() is not None for w in ahead)  # ended, not left running beside the new ones
    assert pool.workers == fake_ranks[2:] and [w["threads"] for w in pool.workers] == [1, 1]


def test_nothing_is_started_ahead_for_ranks_that_are_not_resident(fake_ranks):
    launch.prestart_trainers(num_processes=1, backend="nccl")  # GPU ranks are fresh per update
    assert fake_ranks == [] and launch._POOL is None

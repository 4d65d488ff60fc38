"""A stage is a file and a `@register`, nothing else: a throwaway stage, defined here and registered in this test
only, runs in a real pipeline, is planned, fingerprinted, resumed, reported and closed like a built-in one."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import ray
from harness import merged, read_metrics, tiny_pipeline

from batchrl.api import Runner, build_plan, check_from_stage
from batchrl.config import PipelineConfig
from batchrl.pipeline.stage import STAGES, Stage, StageContext, StageOutput, register, unregister
from batchrl.storage import write_bytes_atomic
from batchrl.storage.manifest import Manifest, PartInfo

pytestmark = pytest.mark.slow


class SampleCount(Stage):
    """Counts the scored samples of each iteration: reads a built-in table, writes one JSON file."""

    name = "sample_count"
    table = "sample_count"
    schema = None  # not a Parquet table
    inputs = ("scores",)
    timing_name = "count"
    in_step_time = False
    closed = 0

    def fingerprint_config(self, cfg: PipelineConfig) -> dict:
        return {"samples_per_prompt": cfg.generate.num_samples_per_prompt}

    def run(self, ctx: StageContext) -> StageOutput:
        groups = sum(part.rows for part in ctx.inputs["scores"].parts)
        samples = groups * ctx.cfg.generate.num_samples_per_prompt
        data = json.dumps({"samples": samples}).encode()
        write_bytes_atomic(f"{ctx.output_dir}/count.json", data)
        return StageOutput(parts=[PartInfo("count.json", 1, "", len(data))], stats={"count/samples": samples})

    def metrics(self, manifest: Manifest, *, timings: dict[str, float]) -> dict[str, float]:
        return {**manifest.stats, "count/seconds_share": timings["count"] / max(1e-9, timings["step"])}

    @classmethod
    def close(cls) -> None:
        cls.closed += 1


@pytest.fixture
def with_sample_count():
    register(SampleCount)
    yield
    unregister(SampleCount.name)


def config(root: Path, toy_model_dir: str, toy_prompts_dir: str) -> PipelineConfig:
    """The tests' tiny pipeline, run in this process (the throwaway stage is registered here only): 2 iterations of
    4 prompts, with a built-in reward (Ray workers started from pytest do not see the test modules)."""
    base = tiny_pipeline(model=toy_model_dir, prompts=toy_prompts_dir, root=str(root))
    overrides = {
        "name": "contract",
        "run.iterations": 2,
        "data.max_prompts": 4,
        "generate.max_new_tokens": 4,
        "score.rewards": [{"reward": "gsm8k"}],
        "tracking": {"progress_bars": False},
    }
    return PipelineConfig.model_validate(merged(base, overrides))


def test_a_registered_throwaway_stage_runs_every_iteration_and_resumes_like_a_built_in_one(
    with_sample_count, tmp_path, toy_model_dir, toy_prompts_dir
):
    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir)
    assert list(STAGES)[-1] == "sample_count"
    planned = [s.label for s in build_plan(cfg, check_storage=False)]
    assert [label for label in planned if "sample_count" in label] == ["iter 0 sample_count", "iter 1 sample_count"]
    # after the stage whose table it reads; among stages free to run, one whose table another reads goes first (the
    # training line: advantage, update), and this one, whose table nothing reads, after them
    assert planned[1:6] == [
        "iter 0 generate",
        "iter 0 score",
        "iter 0 advantage",
        "iter 0 update",
        "iter 0 sample_count",
    ]

    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    children = _children()
    summary = Runner(cfg).run()
    assert [label for label in summary.ran if "sample_count" in label] == ["iter 0 sample_count", "iter 1 sample_count"]
    # An in-process run leaves this process as it found it: the same signal handlers, no Ray, and no process of its
    # own (update ranks, Ray's, the orphan watchdog, which exits a moment after the run) still running.
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    assert not ray.is_initialized()
    deadline = time.monotonic() + 30
    while _children() - children and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _children() - children, f"left running: {_children() - children}"
    assert SampleCount.closed == 1
    run_dir = Path(summary.run_dir)
    for iteration, metrics in enumerate(read_metrics(run_dir)):
        written = json.loads((run_dir / f"iter_{iteration:04d}" / "sample_count" / "count.json").read_text())
        assert written == {"samples": 4 * 2} and metrics["count/samples"] == 8
        assert metrics["timing_s/count"] >= 0 and "count/seconds_share" in metrics
        assert metrics["timing_s/step"] == pytest.approx(
            sum(metrics[f"timing_s/{t}"] for t in ("gen", "score", "adv", "update")), abs=0.01
        )  # its time is not a training step's

    again = Runner(cfg).run()
    assert again.ran == [] and "iter 1 sample_count" in again.skipped
    check_from_stage(cfg, "sample_count", 1)  # a stage of this run, per iteration
    forced = build_plan(cfg, from_stage="sample_count", from_iteration=0)
    assert [s.label for s in forced if s.status == "forced"] == ["iter 0 sample_count", "iter 1 sample_count"]


def _children() -> set[tuple[int, str]]:
    """(pid, command line) of this process's live children."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
            if int(fields[1]) == os.getpid() and fields[0] != b"Z":
                found.add((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
    return found


def test_an_actor_that_asks_for_more_than_the_embedded_ray_has_is_a_config_error_before_any_stage_runs(
    tmp_path, toy_model_dir, toy_prompts_dir
):
    from batchrl.config import ConfigError

    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir)
    cfg = cfg.model_copy(update={"generate": cfg.generate.model_copy(update={"gpus_per_actor": 1.0})})
    with pytest.raises(
        ConfigError,
        match=r"generate\.gpus_per_actor=1: one generate actor asks for 1 GPU, but the "
        r"Ray cluster has 0 in all",
    ):
        Runner(cfg).run()
    assert not (tmp_path / "contract").exists() or not any((tmp_path / "contract").rglob("_MANIFEST.json"))

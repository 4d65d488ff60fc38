"""The GPU smoke check's CPU-runnable parts (batchrl_toy.smoke, `make gpu-smoke`), as CI runs them: on the tiny model,
with the engine tensor-parallel over two worker processes, so the weight push is checked in the layout where no
Python object can reach the workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchrl.engines import vllm_available
from batchrl.engines.hf_engine import HFEngine
from batchrl_toy import smoke

pytestmark = [pytest.mark.slow]

# The pipeline step runs the CPU profiles of pipelines/quickstart.yaml (engine/vllm_cpu, trainer/cpu_gloo,
# cluster/local) and checks that a rerun skips every stage: test_learns' quickstart test runs that pipeline and
# asserts the same, so CI does not run it twice (~3 minutes).
CPU_STEPS = [step for step in smoke.STEPS if step != "pipeline"]


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="tensor parallelism over 2 CPU workers needs 2 cores")
def test_the_smoke_checks_cpu_parts_pass_on_a_tensor_parallel_engine(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "batchrl_toy.smoke", "--size", "tiny", "--layout", "tp2", "--out", str(tmp_path)]
        + ["--steps", ",".join(CPU_STEPS)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    verdicts = {line.split()[1]: line.split()[0] for line in result.stdout.splitlines() if line[:5] in smoke.VERDICTS}
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert verdicts == {step: "PASS" for step in CPU_STEPS if step != "tests"} | {"tests": "SKIP"}, result.stdout
    assert "[gpu] at the floors: vllm 0.16.0" in result.stdout  # the floor pyproject.toml names resolves


def test_the_push_check_fails_an_engine_that_kept_its_old_weights(tmp_path):
    checks = smoke.Smoke(out=tmp_path, size="tiny", layout="inprocess", cuda=False)
    old, new = checks.model("old", seed=0), checks.model("new", seed=1)
    engine = HFEngine(old)  # never pushed: generates with the old weights
    with pytest.raises(AssertionError, match="the push did not reach the model"):
        smoke._check_new_weights(checks, engine, old=old, new=new)
    engine.load_checkpoint(new)
    assert "from the new weights'" in smoke._check_new_weights(checks, engine, old=old, new=new)


def test_a_failing_step_is_reported_and_the_next_still_runs(tmp_path, monkeypatch):
    checks = smoke.Smoke(out=tmp_path, size="tiny", layout="inprocess", cuda=False)
    lines = []
    monkeypatch.setattr(smoke, "step_generate", lambda _: (_ for _ in ()).throw(RuntimeError("engine died")))
    verdicts = smoke.run_steps(checks, ["generate", "tests"], say=lines.append)
    assert verdicts == {"generate": "FAIL", "tests": "SKIP"}
    assert "RuntimeError: engine died" in lines[0]

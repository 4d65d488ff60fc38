"""batchrl learns: the quickstart pipeline, run for real (toy model built and SFT-warm-started, vLLM on CPU,
FSDP2 on gloo, the evaluate stage on held-out prompts), raises held-out greedy accuracy by at least 25 points.
The PPO quickstart (a critic, GAE) on the same toy model raises it by at least 20 points, and so does the quickstart
training a LoRA adapter (update.lora). Slow: about 5 minutes on 2 idle cores for the first two, toy build included.

The numbers come from the runner's own evaluate stage (the initial policy, then every evaluated iteration), so
this is exactly what `make demo` prints.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from harness import REPO, cli_ok, read_manifest, read_metrics

from batchrl.config import load_pipeline
from batchrl_toy import smoke

pytestmark = pytest.mark.slow

GREEDY = "val-core/arith/reward/mean@1"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The toy model and prompts are built once here (the setup step keeps what exists) for both quickstarts."""
    return tmp_path_factory.mktemp("learns")


def overrides(tmp_path: Path) -> list[str]:
    toy = tmp_path / "toy"
    return [
        f"run.root={tmp_path / 'runs'}",
        f"setup.toy_assets.arguments.model_dir={toy / 'model'}",
        f"setup.toy_assets.arguments.data_dir={toy / 'prompts'}",
        f"setup.toy_assets.arguments.eval_dir={toy / 'eval'}",
        f"model.path={toy / 'model'}",
        f"data.train_files=[{toy / 'prompts'}]",
        f"evaluate.files=[{toy / 'eval'}]",
    ]


def test_the_quickstart_raises_held_out_accuracy_by_25_points(workdir):
    tmp_path = workdir
    started = time.perf_counter()
    done = cli_ok("run", "pipelines/quickstart.yaml", "--run-id", "learns", sets=overrides(tmp_path), timeout=3600)
    wall_s = time.perf_counter() - started
    cfg = load_pipeline(REPO / "pipelines/quickstart.yaml", overrides=overrides(tmp_path))
    run_dir = Path(cfg.run.root) / "learns"
    last = cfg.run.iterations - 1
    before = read_manifest(run_dir / "evaluation")["stats"]
    after = read_manifest(run_dir / f"iter_{last:04d}" / "evaluation")["stats"]
    print(f"quickstart run: {wall_s:.0f} s (toy build included)\n{done.stdout}")
    assert before[GREEDY] <= 0.6, "the warm-started model must start well below ceiling"
    assert after[GREEDY] - before[GREEDY] >= 0.25
    assert f"{GREEDY}: {before[GREEDY]:.3f} -> {after[GREEDY]:.3f}" in done.stdout  # the summary says so

    metrics = read_metrics(run_dir)
    assert [m["iteration"] for m in metrics] == list(range(cfg.run.iterations))
    for m in metrics:  # reward, KL and response length per iteration, as the issue asks
        assert {"critic/score/mean", "actor/ppo_kl", "response_length/mean"} <= set(m)
    assert metrics[-1]["critic/score/mean"] > metrics[0]["critic/score/mean"]  # training reward rose too
    assert metrics[0][f"initial/{GREEDY}"] == before[GREEDY] and metrics[-1][GREEDY] == after[GREEDY]
    assert_quiet(done)
    # the update's resident ranks start before iteration 0 (UpdateStage.prestart) and every update takes them: the
    # guess of their key matched the first update's spec (else a second start, and an 'do not fit' line)
    started = done.stderr.index("started 2 resident update rank(s)")
    assert started < done.stderr.index("iter 0 generate: running") and done.stderr.count("resident update rank") == 1

    # the GPU smoke check's pipeline step, whose CPU profiles are this pipeline's: a rerun skips every stage
    again = cli_ok("run", "pipelines/quickstart.yaml", "--run-id", "learns", sets=overrides(tmp_path), timeout=600)
    ran, rerun = smoke._stage_counts(done.stdout), smoke._stage_counts(again.stdout)
    assert ran[0] > 0 and rerun == (0, sum(ran)), again.stdout[-2000:]


def test_the_ppo_quickstart_with_a_critic_raises_held_out_accuracy_by_20_points(workdir):
    pipeline = "pipelines/ppo_quickstart.yaml"
    done = cli_ok("run", pipeline, "--run-id", "ppo-learns", sets=overrides(workdir), timeout=3600)
    cfg = load_pipeline(REPO / pipeline, overrides=overrides(workdir))
    assert cfg.advantage.estimator == "gae" and cfg.critic is not None
    run_dir = Path(cfg.run.root) / "ppo-learns"
    last = cfg.run.iterations - 1
    before = read_manifest(run_dir / "evaluation")["stats"]
    after = read_manifest(run_dir / f"iter_{last:04d}" / "evaluation")["stats"]
    print(f"PPO quickstart:\n{done.stdout}")
    assert after[GREEDY] - before[GREEDY] >= 0.20
    metrics = read_metrics(run_dir)
    assert metrics[0]["actor/warmup"] == 1.0  # the critic's warm-up iteration
    assert metrics[-1]["critic/vf_explained_var"] > metrics[0]["critic/vf_explained_var"]  # the critic learned too
    assert metrics[-1]["critic/score/mean"] > metrics[0]["critic/score/mean"]
    assert_quiet(done)


def test_the_quickstart_with_a_lora_adapter_raises_held_out_accuracy_by_20_points(workdir):
    """The README's LoRA example: the quickstart training a rank-16 adapter (update.lora) instead of every weight."""
    sets = [*overrides(workdir), "update.lora={rank: 16, alpha: 32}", "update.lr=2e-3"]
    done = cli_ok("run", "pipelines/quickstart.yaml", "--run-id", "lora-learns", sets=sets, timeout=3600)
    run_dir = workdir / "runs" / "lora-learns"
    last_policy = run_dir / "iter_0011" / "policy"
    before = read_manifest(run_dir / "evaluation")["stats"]
    after = read_manifest(run_dir / "iter_0011" / "evaluation")["stats"]
    print(f"LoRA quickstart:\n{done.stdout}")
    assert after[GREEDY] - before[GREEDY] >= 0.20
    assert (last_policy / "adapter" / "adapter_model.safetensors").is_file()  # beside the merged model.safetensors
    assert read_metrics(run_dir)[-1]["actor/optimizer_state_restored"] == 1.0  # the adapter's state carried over
    assert_quiet(done)


def assert_quiet(done: subprocess.CompletedProcess) -> None:
    """Without --verbose, stderr holds batchrl's own log lines only (no engine, Ray, c10 or transformers chatter,
    no progress bar: stderr is not a terminal here), and stdout the summary without any library's warning."""
    foreign = [
        line
        for line in done.stderr.splitlines()
        if line.strip() and not re.match(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) batchrl", line)
    ]
    assert foreign == [], "\n".join(foreign[:20])
    assert "WARNING" not in done.stdout and "Failed to load weights" not in done.stdout, done.stdout[:3000]

"""batchrl learns: the quickstart pipeline, run for real (toy model built and SFT-warm-started, vLLM on CPU,
FSDP2 on gloo), raises held-out greedy accuracy by at least 25 points. Slow: several minutes on 2 cores.

Held-out accuracy is measured by the evaluate stage on the initial model and on the last policy. When the
runner runs the evaluate stage itself (pipelines with an evaluate: section), its numbers for the last policy
must be the ones measured here: same engine, same seeds, same greedy decoding.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchrl.config import load_pipeline
from batchrl.pipeline.stage import StageContext
from batchrl.stages.evaluate import EvaluateStage, compare
from batchrl.storage import RunLayout

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GREEDY = "val-core/arith/reward/mean@1"


def overrides(tmp_path: Path) -> list[str]:
    toy = tmp_path / "toy"
    return [f"run.root={tmp_path / 'runs'}", f"toy_assets.model_dir={toy / 'model'}",
            f"toy_assets.data_dir={toy / 'prompts'}", f"toy_assets.eval_dir={toy / 'eval'}",
            f"model.path={toy / 'model'}", f"data.train_files=[{toy / 'prompts'}]", f"evaluate.files=[{toy / 'eval'}]"]


def evaluate(cfg, policies: dict[str, str]) -> dict[str, dict[str, float]]:
    """The evaluate stage's metrics for each policy, in one Ray session (one engine, new weights pushed in)."""
    import ray

    from batchrl.stages.generate import EnginePool

    layout = RunLayout.for_run(cfg.run.root, "direct-eval")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        return {name: EvaluateStage().run(StageContext(
            cfg=cfg, layout=layout, iteration=None, output_dir=f"{layout.run_dir}/{name}", fingerprint=name,
            inputs={}, input_dirs={}, policy_in=policy)).stats for name, policy in policies.items()}
    finally:
        EnginePool._current = None
        ray.shutdown()


def test_the_quickstart_raises_held_out_accuracy_by_25_points(tmp_path):
    args = [arg for o in overrides(tmp_path) for arg in ("--set", o)]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "batchrl.cli", "run", "pipelines/quickstart.yaml", "--run-id",
                           "learns", *args], cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    wall_s = time.perf_counter() - started
    cfg = load_pipeline(REPO / "pipelines/quickstart.yaml", overrides=overrides(tmp_path))
    run_dir = Path(cfg.run.root) / "learns"
    last = cfg.run.iterations - 1
    results = evaluate(cfg, {"initial": cfg.model.path, "last": str(run_dir / f"iter_{last:04d}" / "policy")})
    before, after = results["initial"], results["last"]
    print(f"quickstart run: {wall_s:.0f} s (toy build included);", *compare(before, after), sep="\n  ")
    assert before[GREEDY] <= 0.6, "the warm-started model must start well below ceiling"
    assert after[GREEDY] - before[GREEDY] >= 0.25
    runner_eval = run_dir / f"iter_{last:04d}" / "evaluation" / "_MANIFEST.json"
    if runner_eval.exists():  # the runner evaluates too: same numbers
        assert json.loads(runner_eval.read_text())["stats"][GREEDY] == pytest.approx(after[GREEDY])

"""PPO with a critic against GRPO: time per iteration of pipelines/ppo_quickstart.yaml over pipelines/quickstart.yaml.

Both run through the CLI in this process's run, one after the other, on the same toy model and prompts (built once
under .cache/toy/quickstart/ by the setup step), with the held-out evaluation off and 6 iterations each. The
number compared is the mean of `timing_s/step` (generate to update, the training step) over iterations 1..5:
iteration 0 builds the engine, and PPO's first iteration is its critic warm-up. PPO adds the values stage (one
critic forward over the rollouts) and the critic's steps in the update (a second model's forward and backward,
without the shared-prompt packing the actor uses), so its target is a ratio, not parity.

Also reported: the per-stage means (values, the update and the critic's part of it). Held-out accuracy is not: the
learning claim is tests/pipeline/test_learns.py's.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness.py
from harness import cli_ok

ITERATIONS = 6


def run(pipeline: str, root: Path) -> list[dict]:
    name = Path(pipeline).stem
    cli_ok(
        "run",
        pipeline,
        "--run-id",
        name,
        "--set",
        f"run.root={root}",
        "--set",
        f"run.iterations={ITERATIONS}",
        "--set",
        "evaluate=null",
        timeout=None,
    )
    return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]


def mean(metrics: list[dict], key: str) -> float:
    values = [m[key] for m in metrics[1:] if key in m]
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-ppo-") as tmp:
        grpo = run("pipelines/quickstart.yaml", Path(tmp))
        ppo = run("pipelines/ppo_quickstart.yaml", Path(tmp))
    grpo_step, ppo_step = mean(grpo, "timing_s/step"), mean(ppo, "timing_s/step")
    print(
        f"RESULT ppo_over_grpo_time_per_iteration={ppo_step / grpo_step:.2f} (target <= 2; quickstart shape, "
        f"iterations 1-{ITERATIONS - 1}: PPO {ppo_step:.2f} s, GRPO {grpo_step:.2f} s per iteration)"
    )
    print(
        f"RESULT ppo_stage_means_s=values {mean(ppo, 'timing_s/values'):.2f}, update {mean(ppo, 'timing_s/update'):.2f}"
        f" of which the critic {mean(ppo, 'perf/critic_time_s'):.2f} (GRPO update {mean(grpo, 'timing_s/update'):.2f};"
        f" generate {mean(ppo, 'timing_s/gen'):.2f} vs {mean(grpo, 'timing_s/gen'):.2f})"
    )


if __name__ == "__main__":
    main()

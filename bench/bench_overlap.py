"""Overlapped iterations: the quickstart's iterations per minute with run.max_staleness 1 against 0, in one run.

Both runs: pipelines/quickstart.yaml (12 iterations, the same 8 samples for each of 128 prompts), generation and the
update given one of the two cores each (generate.cpus_per_actor=1 with vLLM's threads bound to core 0,
update.num_processes=1 with OMP_NUM_THREADS=1), the held-out evaluation before training and after the last
iteration only (an evaluation reads the newest policy, so evaluating every second iteration would wait for each
update and undo the overlap). The span measured runs from iteration 1's generate start to the last update's end,
from the manifests (iteration 0 builds the engine in both); iterations per minute = 11 / span.

Targets (issue 16): >= 1.3x the strict run's iterations per minute, held-out accuracy within 5 points. Each mode runs
with two seeds and the means are compared: one run's greedy accuracy on 60 questions moves by 10 points or more
with the arithmetic alone (the same strict job with other thread counts ends 0.48 or 0.78).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness.py
from harness import cli_ok

ITERATIONS = 12
SEEDS = (0, 1)
GREEDY = "val-core/arith/reward/mean@1"
SAMPLED = "val-core/arith/reward/mean@8"
SHARES = [
    "generate.cpus_per_actor=1",
    "update.num_processes=1",
    f"evaluate.every={ITERATIONS}",
]


def run(root: Path, *, staleness: int, seed: int) -> dict:
    run_id = f"staleness{staleness}-seed{seed}"
    sets = [
        f"run.root={root}",
        f"run.seed={seed}",
        f"run.iterations={ITERATIONS}",
        f"run.max_staleness={staleness}",
        *SHARES,
    ]
    args = [a for s in sets for a in ("--set", s)]
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    cli_ok("run", "pipelines/quickstart.yaml", "--run-id", run_id, *args, timeout=None, env=env)
    run_dir = root / run_id

    def manifest(path: str) -> dict:
        return json.loads((run_dir / path / "_MANIFEST.json").read_text())

    started = manifest("iter_0001/rollouts")["started_at"]
    finished = manifest(f"iter_{ITERATIONS - 1:04d}/policy")["finished_at"]
    after = manifest(f"iter_{ITERATIONS - 1:04d}/evaluation")["stats"]
    return {"per_minute": (ITERATIONS - 1) * 60 / (finished - started), GREEDY: after[GREEDY], SAMPLED: after[SAMPLED]}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as tmp:
        runs = {(k, seed): run(Path(tmp), staleness=k, seed=seed) for seed in SEEDS for k in (0, 1)}

    def mean(k: int, key: str) -> float:
        return sum(runs[(k, seed)][key] for seed in SEEDS) / len(SEEDS)

    ratio = mean(1, "per_minute") / mean(0, "per_minute")
    print(
        f"RESULT overlap_iterations_per_minute_ratio={ratio:.2f} (target >= 1.3; max_staleness 1: "
        f"{mean(1, 'per_minute'):.1f}/min, 0: {mean(0, 'per_minute'):.1f}/min, mean of seeds {list(SEEDS)}; one core "
        "each for generation and the update)"
    )
    for name, key in (("greedy", GREEDY), ("sampled", SAMPLED)):
        per_seed = ", ".join(f"seed {seed}: {runs[(0, seed)][key]:.3f} -> {runs[(1, seed)][key]:.3f}" for seed in SEEDS)
        points = 100 * (mean(1, key) - mean(0, key))
        print(
            f"RESULT overlap_heldout_{name}_points_vs_strict={points:+.1f} (target within 5; {key} after "
            f"{ITERATIONS} iterations, strict -> overlapped, {per_seed})"
        )


if __name__ == "__main__":
    main()

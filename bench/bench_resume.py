"""No-op resume of a finished run: how many stages it redoes (target 0) and what it costs next to the run.

Runs a tiny pipeline to completion with `batchrl run` (the baseline: HF engine on the toy model, 8 prompts,
2 samples, 2 iterations, a 1-process update), then the same command again, and counts the stages the second
run executed (its summary line and `batchrl plan` both say) and times it. Both through the CLI, as a
scheduler's retry would, so process start-up and the embedded Ray are part of both times.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness.py
from harness import DEFAULT, cli_ok, write_pipeline


def pipeline(tmp: Path, *, iterations: int) -> Path:
    """The tests' tiny pipeline on 8 toy prompts, with a reward that needs no test code."""
    from batchrl_toy import ensure_toy_assets

    ensure_toy_assets(tmp / "toy" / "model", tmp / "toy" / "prompts", num_prompts=8, num_shards=2, seed=0)
    return write_pipeline(
        tmp,
        {
            "name": "bench-resume",
            "run": {"seed": 1, "iterations": iterations},
            "data.max_prompts": DEFAULT,
            "score.rewards": [{"reward": "format_hash", "weight": 1.0}],
        },
        model=str(tmp / "toy" / "model"),
        prompts=str(tmp / "toy" / "prompts"),
    )


def timed(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """`batchrl ARGS...` (exit 0 or the bench fails showing its output) and its wall seconds."""
    started = time.perf_counter()
    result = cli_ok(*args, timeout=None)
    return result, time.perf_counter() - started


def stages_ran(stdout: str) -> int:
    match = re.search(r"ran (\d+) stage\(s\)", stdout)
    if match is None:
        raise SystemExit(f"no 'ran N stage(s)' line in the run's output:\n{stdout[-2000:]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_resume_") as tmp:
        path = pipeline(Path(tmp), iterations=args.iterations)
        first, t_first = timed("run", str(path))
        plan, _ = timed("plan", str(path))
        again, t_again = timed("run", str(path))
    total = 1 + 4 * args.iterations
    complete = plan.stdout.count("skip (complete)")
    print(
        f"resume, {total} stages ({args.iterations} iterations): first run {t_first:.1f} s ran "
        f"{stages_ran(first.stdout)}; plan: {complete} of {total} complete; no-op resume {t_again:.1f} s"
    )
    print(f"RESULT resume_stages_redone={stages_ran(again.stdout)} (target 0)")
    print(f"RESULT resume_plan_stages_pending={total - complete} (target 0)")
    print(
        f"RESULT resume_noop_wall_s={t_again:.1f} (baseline: the run itself {t_first:.1f} s, "
        f"ratio {t_again / t_first:.2f})"
    )


if __name__ == "__main__":
    main()

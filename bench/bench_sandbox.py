"""Sandboxed code execution, in one run: what isolation costs, and what hanging programs cost a reward stage.

Part 2's modules (Ray, pyarrow, the score stage) are imported after part 1: forking a large process costs more, and
the bare runs and the sandboxed ones should both start from the small one a reward process or a tool is.

1. Throughput: the same test executions (a program reading two numbers and printing their sum, with a little
   work) through ``run_programs`` (bubblewrap, prlimit, setpriv, the parent's caps) and through a bare
   ``subprocess.run`` of the same interpreter on the same file, both ``--parallel`` at a time. The ratio is
   sandboxed executions per second over bare ones (target >= 0.5).
2. Hanging programs: the score stage's worker (ScoreWorker.process, rewards in their child processes) scoring
   code rows with code_tests, where 5% of the responses sleep forever, against the same rows where they do not
   (those samples then answer right). Every hanging test waits out its wall clock, so the ratio (seconds with
   hangs over seconds without, target <= 1.2) measures how well those waits overlap the other samples' work
   (``score.reward_processes``; with one process per actor they add up in series). What no overlap removes is the
   tail: a hang that starts near the end of the shard ends one wall clock later, so the ratio falls with the
   shard's length over the wall clock (here 240 samples, a 3 s wall clock).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from batchrl.sandbox import Program, isolation_available, run_programs

PROGRAM = "n, k = map(int, input().split())\nprint(sum(range(n)) % 7 + k)\n"
RIGHT = f"```python\n{PROGRAM}```"
HANGING = "```python\nimport time\ntime.sleep(3600)\n```"


def bare_seconds(stdins: list[str], *, parallel: int) -> tuple[float, list[str]]:
    """A bare subprocess.run per input of the same program file, ``parallel`` at a time."""
    with tempfile.TemporaryDirectory() as workdir:
        path = os.path.join(workdir, "main.py")
        with open(path, "w") as f:
            f.write(PROGRAM)

        def one(stdin: str) -> str:
            done = subprocess.run([sys.executable, "-s", "-B", path], input=stdin, capture_output=True, text=True)
            return done.stdout

        started = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            outputs = list(pool.map(one, stdins))
        return time.perf_counter() - started, outputs


def sandboxed_seconds(stdins: list[str], *, parallel: int) -> tuple[float, list[str]]:
    started = time.perf_counter()
    results = run_programs([Program(PROGRAM, stdin=s) for s in stdins], max_parallel=parallel)
    return time.perf_counter() - started, [r.stdout for r in results]


def throughput(num_programs: int, *, parallel: int, repeats: int) -> None:
    stdins = [f"{1000 + i} {i}\n" for i in range(num_programs)]
    sandboxed_seconds(stdins[:parallel], parallel=parallel)  # the one-time isolation probe, outside the timing
    t_bare, t_sandbox = float("inf"), float("inf")
    for _ in range(repeats):  # alternated, best of each: the load of a shared machine drifts
        seconds, bare_out = bare_seconds(stdins, parallel=parallel)
        t_bare = min(t_bare, seconds)
        seconds, sandbox_out = sandboxed_seconds(stdins, parallel=parallel)
        t_sandbox = min(t_sandbox, seconds)
        assert bare_out == sandbox_out, "the sandbox changed a program's output"
    print(
        f"{num_programs} executions, {parallel} at a time (isolated: {isolation_available()}): "
        f"bare subprocess.run {num_programs / t_bare:.1f}/s, sandboxed {num_programs / t_sandbox:.1f}/s"
    )
    print(f"RESULT sandbox_vs_bare_subprocess={t_bare / t_sandbox:.2f} (target >= 0.5)")


def code_rows(num_groups: int, group_size: int, *, hanging_every: int | None) -> Any:
    """Groups of code responses to a 2-test stdin/stdout task; every ``hanging_every``-th response hangs."""
    import pyarrow as pa
    from bench_score import rollout_row  # bench/ is on the path of a script run from it

    from batchrl.storage.schemas import conform

    tests = json.dumps([{"input": f"{n} {k}\n", "output": f"{sum(range(n)) % 7 + k}\n"} for n, k in [(5, 1), (9, 2)]])
    rows = []
    for g in range(num_groups):
        responses = [
            HANGING if hanging_every and (g * group_size + s) % hanging_every == 0 else RIGHT for s in range(group_size)
        ]
        rows.append(rollout_row(g, data_source="code", ground_truth=tests, responses=responses))
    return conform(pa.Table.from_pylist(rows), "rollouts")


def stage_seconds(table: Any, *, timeout_s: float, reward_processes: int) -> tuple[float, float]:
    from batchrl.rewards.combine import TermSpec
    from batchrl.stages.score import ScoreWorker

    params = {"timeout_s": timeout_s, "max_parallel": 2}  # a hanging test waits 3 x timeout_s (the wall clock)
    worker = ScoreWorker(
        terms=[TermSpec("code_tests", 1.0, params=params)],
        by_data_source={},
        failure_reward=0.0,
        timeout_s=30.0,
        reward_processes=reward_processes,
    )
    try:
        worker.process(code_rows(reward_processes, 4, hanging_every=None))  # starts every reward process, untimed
        started = time.perf_counter()
        _, counts = worker.process(table)
        return time.perf_counter() - started, counts["score_sum"]
    finally:
        worker.close()


def hanging(num_groups: int, group_size: int, *, timeout_s: float, reward_processes: int) -> None:
    num_samples = num_groups * group_size
    without = code_rows(num_groups, group_size, hanging_every=None)
    t_none, sum_none = stage_seconds(without, timeout_s=timeout_s, reward_processes=reward_processes)
    with_hangs = code_rows(num_groups, group_size, hanging_every=20)
    t_hang, sum_hang = stage_seconds(with_hangs, timeout_s=timeout_s, reward_processes=reward_processes)
    assert sum_none == num_samples and sum_hang == num_samples - len(range(0, num_samples, 20)), (sum_none, sum_hang)
    print(
        f"score stage, code_tests over {num_samples} samples x 2 tests, per-test CPU limit {timeout_s:g} s "
        f"(wall {3 * timeout_s:g} s), "
        f"{reward_processes} reward processes: no hanging program {t_none:.1f} s, 5% hanging {t_hang:.1f} s"
    )
    print(f"RESULT score_with_5pct_hanging_vs_none={t_hang / t_none:.2f} (target <= 1.2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=max(2, os.cpu_count() or 2))
    parser.add_argument("--groups", type=int, default=60)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=1.0)
    parser.add_argument("--reward-processes", type=int, default=8)
    args = parser.parse_args()
    throughput(args.programs, parallel=args.parallel, repeats=args.repeats)
    hanging(args.groups, args.group_size, timeout_s=args.timeout_s, reward_processes=args.reward_processes)


if __name__ == "__main__":
    main()

"""Scoring throughput: the score stage's worker (ScoreWorker.process on a rollouts table) vs calling the reward
function in a plain Python loop over the same responses, in one run.

The loop is the floor of the work (one reward call per sample, nothing else). The worker additionally reads
the Arrow table, builds each sample's row fields, runs the rewards in its child process with a per-call
deadline (timeout_s, the default) or in-process (timeout_s=None), and writes five list columns plus counters.
gsm8k is a ~microsecond reward, so its ratio shows the worker's overhead at its worst; math (math-verify,
~milliseconds per call) shows the ratio for a reward that does real work.
"""

from __future__ import annotations

import argparse
import random
import time

import pyarrow as pa

from batchrl.rewards import REWARDS
from batchrl.stages.score import ScoreWorker
from batchrl.storage.schemas import conform

FILLER = "Let me think step by step. First we add the numbers, then we check the result again. "


def synthetic_rollouts(num_groups: int, group_size: int, *, data_source: str, seed: int = 0) -> pa.Table:
    """Rows like the generate stage writes: ~300-character responses ending in an answer, half of them right."""
    rng = random.Random(seed)
    rows = []
    for g in range(num_groups):
        truth = rng.randint(1, 999)
        answers = [truth if rng.random() < 0.5 else truth + 1 for _ in range(group_size)]
        if data_source == "math":
            responses = [FILLER * 3 + f"So the answer is $\\boxed{{\\frac{{{2 * a}}}{{2}}}}$." for a in answers]
        else:
            responses = [FILLER * 3 + f"\n#### {a:,}" for a in answers]
        rows.append(rollout_row(g, data_source=data_source, ground_truth=str(truth), responses=responses))
    return conform(pa.Table.from_pylist(rows), "rollouts")


def rollout_row(index: int, *, data_source: str, ground_truth: str, responses: list[str]) -> dict:
    """A rollouts row as generate writes it (token ids and log-probs are placeholders: rewards read the texts)."""
    n = len(responses)
    return {
        "prompt_id": f"p{index}",
        "data_source": data_source,
        "messages_json": "[]",
        "prompt_text": "What is it?",
        "prompt_token_ids": [1, 2, 3],
        "ground_truth": ground_truth,
        "extra_info_json": None,
        "source_file": "f",
        "source_row": index,
        "response_texts": responses,
        "response_token_ids": [[5] * 8] * n,
        "response_logprobs": [[-0.5] * 8] * n,
        "finish_reasons": ["stop"] * n,
        "response_lengths": [80] * n,
        "sample_seeds": list(range(n)),
        "policy_version": 0,
    }


def plain_loop_seconds(table: pa.Table, reward: str, *, repeats: int) -> tuple[float, float]:
    """Best time of `repeats` plain loops (one call per sample), and the reward sum."""
    fn = REWARDS[reward]
    pairs = [
        (r, t)
        for group, t in zip(table.column("response_texts").to_pylist(), table.column("ground_truth").to_pylist())
        for r in group
    ]
    best, total = float("inf"), 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        total = sum(fn(response, truth) for response, truth in pairs)
        best = min(best, time.perf_counter() - started)
    return best, total


def worker_seconds(table: pa.Table, reward: str, *, timeout_s: float | None, repeats: int) -> tuple[float, float]:
    """Best time of `repeats` ScoreWorker.process calls on the whole table, and the reward sum."""
    worker = ScoreWorker(terms=[(reward, 1.0)], by_data_source={}, failure_reward=0.0, timeout_s=timeout_s)
    worker.process(table.slice(0, 1))  # starts the reward child process (and its imports) outside the timing
    best, counts = float("inf"), {}
    for _ in range(repeats):
        started = time.perf_counter()
        _, counts = worker.process(table)
        best = min(best, time.perf_counter() - started)
    if worker.isolated is not None:
        worker.isolated.close()
    assert counts["failed_samples"] == 0, counts
    return best, counts["score_sum"]


def measure(reward: str, num_groups: int, group_size: int, *, repeats: int, target: float) -> None:
    table = synthetic_rollouts(num_groups, group_size, data_source="math" if reward == "math" else "arith")
    num_samples = num_groups * group_size
    t_loop, loop_sum = plain_loop_seconds(table, reward, repeats=repeats)
    t_isolated, isolated_sum = worker_seconds(table, reward, timeout_s=10.0, repeats=repeats)
    t_inline, inline_sum = worker_seconds(table, reward, timeout_s=None, repeats=repeats)
    assert loop_sum == isolated_sum == inline_sum, (loop_sum, isolated_sum, inline_sum)
    print(
        f"score {reward}, {num_samples:,} samples ({num_groups:,} groups x {group_size}), best of {repeats}: "
        f"plain loop {num_samples / t_loop:,.0f} rows/s ({t_loop / num_samples * 1e6:.1f} us/row), "
        f"worker with timeout_s (child process) {num_samples / t_isolated:,.0f} rows/s, "
        f"worker inline (timeout_s=null) {num_samples / t_inline:,.0f} rows/s"
    )
    print(f"RESULT score_{reward}_isolated_vs_loop={t_loop / t_isolated:.2f} (target >= {target})")
    print(f"RESULT score_{reward}_inline_vs_loop={t_loop / t_inline:.2f} (target >= {target})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=20_000)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--math-groups", type=int, default=250)
    args = parser.parse_args()
    # gsm8k costs ~1 us a call: the worker's own per-sample cost (row fields, checks, Arrow columns) dominates.
    measure("gsm8k", args.groups, args.group_size, repeats=3, target=0.1)
    measure("math", args.math_groups, args.group_size, repeats=3, target=0.8)


if __name__ == "__main__":
    main()

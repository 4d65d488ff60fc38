"""Advantage computation: batchrl's vectorised GRPO vs a per-group Python loop (the verl-style
reference) and vs a bare numpy pass (the limit), on the same 1M rewards in one run.

Prints the speed-up over the loop (target >= 50x) and the slowdown against bare numpy (target <= 2x),
and checks that all three give the same advantages.

Robust on a busy machine: times are CPU time of this process (time.process_time: time spent waiting for a
core shared with other jobs is not counted; all three are single-threaded), the three are measured in
interleaved rounds (a slow phase of the machine hits all of them alike), and each keeps its best round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from batchrl.algorithms.advantages import grpo_advantages


def per_group_loop(rewards_PG: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty_like(rewards_PG)
    for p, group in enumerate(rewards_PG.tolist()):
        mean = statistics.fmean(group)
        std = statistics.stdev(group) if len(group) > 1 else 1.0
        out[p] = [(r - mean) / (std + eps) for r in group]
    return out


def bare_numpy(rewards_PG: np.ndarray, eps: float) -> np.ndarray:
    mean = rewards_PG.mean(axis=1, keepdims=True)
    std = rewards_PG.std(axis=1, ddof=1, keepdims=True)
    return (rewards_PG - mean) / (std + eps)


def interleaved_best(fns: dict, *, rounds: int, rounds_of: dict | None = None) -> dict[str, float]:
    """Best CPU time of each function over ``rounds`` interleaved rounds (``rounds_of`` caps some, e.g. the
    slow loop)."""
    best = {name: float("inf") for name in fns}
    for round_index in range(rounds):
        for name, fn in fns.items():
            if round_index >= (rounds_of or {}).get(name, rounds):
                continue
            started = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9, help="Interleaved timing rounds (the loop runs in 2).")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rewards_PG = rng.integers(0, 2, size=(args.samples // args.group_size, args.group_size)).astype(np.float64)
    eps = 1e-6
    ours = grpo_advantages(rewards_PG, eps=eps)
    np.testing.assert_allclose(ours, per_group_loop(rewards_PG, eps), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(ours, bare_numpy(rewards_PG, eps), rtol=1e-9, atol=1e-9)
    best = interleaved_best(
        {
            "ours": lambda: grpo_advantages(rewards_PG, eps=eps),
            "loop": lambda: per_group_loop(rewards_PG, eps),
            "numpy": lambda: bare_numpy(rewards_PG, eps),
        },
        rounds=args.rounds,
        rounds_of={"loop": 2},
    )
    t_ours, t_loop, t_numpy = best["ours"], best["loop"], best["numpy"]
    print(
        f"advantage, {rewards_PG.size:,} samples in groups of {args.group_size}: batchrl {t_ours:.3f} s, "
        f"per-group loop {t_loop:.3f} s, bare numpy {t_numpy:.3f} s (CPU time, best of interleaved rounds)"
    )
    print(f"RESULT advantage_vs_loop_speedup={t_loop / t_ours:.1f} (target >= 50)")
    print(f"RESULT advantage_vs_numpy_ratio={t_ours / t_numpy:.2f} (target <= 2)")


if __name__ == "__main__":
    main()

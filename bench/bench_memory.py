"""Peak memory of score + advantage at 10M samples vs 1M: streaming shard by shard, not loading the table.

Each size runs in its own process (peak RSS is a high-water mark of the process): a synthetic rollouts table
is produced one shard at a time and each shard goes through what the stages do with it: ScoreWorker.process,
conform, an atomic Parquet write, a read back, AdvantageWorker.process, conform, a write. Parts are deleted
once written (disk, not memory, would otherwise grow). Peak RSS is the process's VmHWM (bench/peak_rss.py).

Prints the ratio of the 10M peak to the 1M peak (target <= 1.2) and, for scale, the RSS after imports.
Rule rewards run in-process (score.timeout_s unset): a reward child process would hide its memory from
its peak. The reward is exact_match: the bench measures the stage's bookkeeping, not a reward's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
from peak_rss import peak_rss_mb


def synthetic_rollouts(shard: int, *, num_groups: int, group_size: int, response_tokens: int) -> pa.Table:
    """One shard of a rollouts table (schema data_schemas/rollouts.json), built from numpy arrays."""
    from batchrl.storage.schemas import load_schema

    rng = np.random.default_rng(shard)
    num_samples = num_groups * group_size
    group_offsets = pa.array(np.arange(num_groups + 1, dtype=np.int32) * group_size)
    token_offsets = pa.array(np.arange(num_samples + 1, dtype=np.int32) * response_tokens)

    def per_sample(values: pa.Array) -> pa.Array:
        return pa.ListArray.from_arrays(group_offsets, values)

    def per_token(values: np.ndarray) -> pa.Array:
        return per_sample(pa.ListArray.from_arrays(token_offsets, pa.array(values)))

    answers_S = rng.integers(0, 10, size=num_samples)
    truths_P = rng.integers(0, 10, size=num_groups)
    ids_P = [f"s{shard}-{i}" for i in range(num_groups)]
    columns = {
        "prompt_id": ids_P,
        "data_source": ["synthetic"] * num_groups,
        "messages_json": ['[{"role": "user", "content": "1+1?"}]'] * num_groups,
        "prompt_text": ["What is 1+1?"] * num_groups,
        "prompt_token_ids": pa.ListArray.from_arrays(
            pa.array(np.arange(num_groups + 1, dtype=np.int32) * 4), pa.array(np.ones(num_groups * 4, dtype=np.int32))
        ),
        "ground_truth": truths_P.astype(str).tolist(),
        "extra_info_json": [None] * num_groups,
        "source_file": ["synthetic.parquet"] * num_groups,
        "source_row": np.arange(num_groups, dtype=np.int64),
        "response_texts": per_sample(pa.array(answers_S.astype(str))),
        "response_token_ids": per_token(rng.integers(0, 300, size=num_samples * response_tokens, dtype=np.int32)),
        "response_logprobs": per_token(np.full(num_samples * response_tokens, -1.0, dtype=np.float32)),
        "finish_reasons": per_sample(pa.array(["stop"] * num_samples)),
        "response_lengths": per_sample(pa.array(np.full(num_samples, response_tokens, dtype=np.int32))),
        "sample_seeds": per_sample(pa.array(np.arange(num_samples, dtype=np.int64))),
        "policy_version": np.zeros(num_groups, dtype=np.int32),
    }
    return pa.table(columns).cast(load_schema("rollouts"))


def child(args: argparse.Namespace) -> None:
    """Streams ``args.samples`` samples through score and advantage; prints one JSON line."""
    from batchrl.stages.advantage import AdvantageWorker
    from batchrl.stages.score import ScoreWorker
    from batchrl.storage import read_parquet, write_parquet_atomic
    from batchrl.storage.schemas import conform

    score = ScoreWorker(
        terms=[{"reward": "exact_match", "weight": 1.0}], by_data_source={}, failure_reward=0.0, timeout_s=None
    )
    advantage = AdvantageWorker(config={"estimator": "grpo"}, moments=None)
    rss_after_imports = peak_rss_mb()
    num_groups_total = args.samples // args.group_size
    started, done_samples = time.perf_counter(), 0
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for shard, first in enumerate(range(0, num_groups_total, args.shard_groups)):
            num_groups = min(args.shard_groups, num_groups_total - first)
            rollouts = synthetic_rollouts(
                shard, num_groups=num_groups, group_size=args.group_size, response_tokens=args.response_tokens
            )
            scores, _ = score.process(rollouts)
            scores_uri = os.path.join(tmp, f"scores-{shard:05d}.parquet")
            write_parquet_atomic(conform(scores, "scores"), scores_uri)
            del rollouts, scores
            advantages, _ = advantage.process(read_parquet(scores_uri))
            advantages_uri = os.path.join(tmp, f"advantages-{shard:05d}.parquet")
            write_parquet_atomic(conform(advantages, "advantages"), advantages_uri)
            done_samples += advantages.num_rows
            del advantages
            os.remove(scores_uri)
            os.remove(advantages_uri)
    assert done_samples == num_groups_total * args.group_size, (done_samples, args.samples)
    print(
        json.dumps(
            {
                "samples": done_samples,
                "peak_rss_mb": peak_rss_mb(),
                "rss_after_imports_mb": rss_after_imports,
                "seconds": time.perf_counter() - started,
            }
        )
    )


def measure(samples: int, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        "--samples",
        str(samples),
        "--group-size",
        str(args.group_size),
        "--shard-groups",
        str(args.shard_groups),
        "--response-tokens",
        str(args.response_tokens),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-3000:])
        raise SystemExit(f"bench_memory child for {samples:,} samples failed (exit {result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=None, help="Child mode: samples to stream.")
    parser.add_argument("--small", type=int, default=1_000_000, help="Baseline size (samples).")
    parser.add_argument("--large", type=int, default=10_000_000, help="Measured size (samples).")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--shard-groups", type=int, default=4096, help="Prompt groups per shard (data.shard_size).")
    parser.add_argument("--response-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    small, large = measure(args.small, args), measure(args.large, args)
    for run in (small, large):
        print(
            f"score+advantage, {run['samples']:,} samples in shards of {args.shard_groups * args.group_size:,}: "
            f"peak RSS {run['peak_rss_mb']:.0f} MiB (after imports {run['rss_after_imports_mb']:.0f} MiB), "
            f"{run['seconds']:.1f} s ({run['samples'] / run['seconds']:,.0f} samples/s)"
        )
    print(
        f"RESULT memory_peak_rss_mb_{args.large // 1_000_000}M={large['peak_rss_mb']:.0f} "
        f"(baseline {args.small // 1_000_000}M: {small['peak_rss_mb']:.0f})"
    )
    print(f"RESULT memory_peak_rss_ratio={large['peak_rss_mb'] / small['peak_rss_mb']:.2f} (target <= 1.2)")


if __name__ == "__main__":
    main()

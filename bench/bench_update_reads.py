"""Bytes an update rank decodes from the advantages table per pass, over its share of the table (issue 35, item 2).

A generated advantages table in the grpo_math.yaml shape: 1,024 prompts x 5 samples in 4 parts of 256 prompts (one
per scores shard), prompts in shard order and random prompt ids (the index sorts by them), row groups as the
advantage stage writes them (`advantage.group_aligned_rows`: 60 rows of whole groups). 8 ranks, mini-batches of 256
prompts, 8,192-token micro-batches. Each rank plans with the update's own functions (`logprobs.epoch_mini_batches`,
`logprobs.update_plan`) and reads its rows of every mini-batch with its own `RowReader`, for two passes: the
pre-update log-probs (epoch 0's mini-batches) and one training epoch (epoch 1's draw). A pass reads each sample
once, so a rank's ideal is its share (the table's decoded bytes / 8) per pass.

Prints the busiest rank's decoded bytes per pass over its share: with update.mini_batch_grain row_group (target
<= 1.5) and with the default sample grain (random mini-batches: every rank decodes most of the table for every
mini-batch, ~ranks x mini-batches). Token lists are short (~300 tokens a sample) to keep the default's decoding
quick: the ratios depend on the layout, not on the lengths.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchrl.config.models import UpdateConfig
from batchrl.stages.advantage import group_aligned_rows
from batchrl.trainer import UpdateSpec
from batchrl.trainer.index import read_index
from batchrl.trainer.logprobs import epoch_mini_batches, own_share, update_plan
from batchrl.trainer.rows import RowReader

PROMPTS, SAMPLES, PARTS, MINI_BATCH, WORLD = 1024, 5, 4, 256, 8


def write_table(out: Path, *, seed: int = 0) -> list[str]:
    """The advantages parts: a prompt's samples consecutive, prompts in shard order, aligned row groups."""
    rng = np.random.default_rng(seed)
    prompt_ids = [f"{rng.integers(1 << 62):016x}" for _ in range(PROMPTS)]
    paths = []
    for part, prompts in enumerate(np.array_split(np.arange(PROMPTS), PARTS)):
        rows = len(prompts) * SAMPLES
        prompt_lengths = np.repeat(rng.integers(40, 160, len(prompts)), SAMPLES)
        response_lengths = np.exp(rng.normal(np.log(200), 0.6, rows)).clip(1, 1024).astype(np.int64)
        prompt_tokens = [rng.integers(3, 50_000, n).astype(np.int32) for n in prompt_lengths[::SAMPLES]]
        table = pa.table(
            {
                "prompt_id": [prompt_ids[p] for p in prompts for _ in range(SAMPLES)],
                "sample_idx": pa.array(np.tile(np.arange(SAMPLES), len(prompts)), pa.int32()),
                "prompt_token_ids": pa.array([prompt_tokens[k // SAMPLES] for k in range(rows)], pa.list_(pa.int32())),
                "response_token_ids": pa.array(
                    [rng.integers(3, 50_000, n).astype(np.int32) for n in response_lengths], pa.list_(pa.int32())
                ),
                "response_logprobs": pa.array([None] * rows, pa.list_(pa.float32())),
                "advantage": pa.array(rng.normal(size=rows), pa.float32()),
            }
        )
        for name, lists in (("prompt_length", "prompt_token_ids"), ("response_length", "response_token_ids")):
            table = table.append_column(name, pc.list_value_length(table.column(lists)).cast(pa.int32()))
        path = out / f"part-{part:05d}.parquet"
        pq.write_table(table, path, compression="zstd", row_group_size=group_aligned_rows(table))
        paths.append(str(path))
    return paths


def reads_over_share(files: list[str], *, grain: str, world: int) -> float:
    """The busiest rank's decoded bytes per pass / (the table's decoded bytes / world), over 2 passes."""
    spec = UpdateSpec(
        policy_in="unused",
        policy_out="unused",
        advantages_files=files,
        metrics_path="unused",
        update=UpdateConfig(ppo_mini_batch_size=MINI_BATCH, max_tokens_per_micro_batch=8192, mini_batch_grain=grain),
        seed=42,
    )
    index = read_index(files)
    whole = RowReader(index, with_rollout_logprobs=False)
    whole.read(np.arange(index.num_samples))
    decoded = []
    for rank in range(world):
        reader = RowReader(index, with_rollout_logprobs=False)
        for epoch in (0, 1):  # the pre-update pass reads epoch 0's mini-batches, training here epoch 1's
            for indices in epoch_mini_batches(index, spec, epoch=epoch):
                mine, _ = own_share(update_plan(index, indices, spec=spec, world_size=world)[rank])
                reader.read(mine)
        decoded.append(reader.bytes_decoded)
    return max(decoded) / 2 / (whole.bytes_decoded / world)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=WORLD)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-update-reads-") as tmp:
        files = write_table(Path(tmp))
        row_group = reads_over_share(files, grain="row_group", world=args.world)
        sample = reads_over_share(files, grain="sample", world=args.world)
    shape = f"{args.world} ranks, {PROMPTS} prompts x {SAMPLES}, mini-batches of {MINI_BATCH}, 60-row groups"
    print(
        f"RESULT update_bytes_per_rank_per_pass_over_share={row_group:.2f} (target <= 1.5; mini_batch_grain "
        f"row_group; the default sample grain: {sample:.2f}; {shape})"
    )


if __name__ == "__main__":
    main()

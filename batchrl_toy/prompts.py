"""The toy's prompt tables: synthetic arithmetic prompts as Parquet shards, in batchrl's or verl's layout."""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchrl_toy.task import ARITH_DATA_SOURCE, MAX_OPERAND, ArithSplit, ToyTask, arith_problems

logger = logging.getLogger(__name__)

BATCHRL_PROMPT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("data_source", pa.string()),
        ("prompt", pa.string()),
        ("ground_truth", pa.string()),
    ]
)
VERL_PROMPT_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
    ]
)


def _resolve_filesystem(out_dir: str, filesystem: Any) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it, from a local path, a URI, or a given pyarrow/fsspec fs."""
    if filesystem is None:
        if "://" in out_dir:
            return pafs.FileSystem.from_uri(out_dir)
        return pafs.LocalFileSystem(), os.path.abspath(out_dir)
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem, out_dir
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), out_dir


def _arith_table(problems: list[tuple[str, str]], *, first_index: int, fmt: str, split: ArithSplit) -> pa.Table:
    indices = range(first_index, first_index + len(problems))
    questions = [q for q, _ in problems]
    answers = [a for _, a in problems]
    if fmt == "batchrl":
        columns = {
            "prompt_id": [f"{'arith-eval' if split == 'eval' else 'arith'}-{i:06d}" for i in indices],
            "data_source": [ARITH_DATA_SOURCE] * len(problems),
            "prompt": questions,
            "ground_truth": answers,
        }
        return pa.Table.from_pydict(columns, schema=BATCHRL_PROMPT_SCHEMA)
    columns = {
        "data_source": [ARITH_DATA_SOURCE] * len(problems),
        "prompt": [[{"role": "user", "content": q}] for q in questions],
        "ability": ["math"] * len(problems),
        "reward_model": [{"style": "rule", "ground_truth": a} for a in answers],
        "extra_info": [{"split": "test" if split == "eval" else "train", "index": i} for i in indices],
    }
    return pa.Table.from_pydict(columns, schema=VERL_PROMPT_SCHEMA)


def build_arith_prompts(
    out_dir: str,
    *,
    num_prompts: int,
    num_shards: int,
    seed: int,
    fmt: Literal["batchrl", "verl"] = "batchrl",
    filesystem: Any = None,
    max_operand: int = MAX_OPERAND,
    split: ArithSplit = "all",
    task: ToyTask = "arith",
) -> list[str]:
    """Write synthetic verifiable arithmetic prompts as Parquet shards part-00000.parquet, ...

    The rows do not depend on num_shards (shards are contiguous slices of one seeded list). Operands are
    0..max_operand; split "train" avoids every held-out question and "eval" draws only held-out ones,
    distinct, with prompt ids "arith-eval-NNNNNN" (see `arith_problems`).
    `filesystem` may be a pyarrow or fsspec filesystem (e.g. s3fs); without it out_dir is a local path or
    a URI pyarrow understands. Returns the written paths.
    """
    if fmt not in ("batchrl", "verl"):
        raise ValueError(f"fmt={fmt!r} must be 'batchrl' or 'verl'")
    if not 1 <= num_shards <= max(num_prompts, 1):
        raise ValueError(f"num_shards={num_shards} must be between 1 and num_prompts={num_prompts}")
    fs, root = _resolve_filesystem(out_dir, filesystem)
    fs.create_dir(root, recursive=True)
    problems = arith_problems(num_prompts=num_prompts, seed=seed, max_operand=max_operand, split=split, task=task)
    bounds = np.linspace(0, num_prompts, num_shards + 1).round().astype(int).tolist()
    paths = []
    for shard, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        path = f"{root.rstrip('/')}/part-{shard:05d}.parquet"
        table = _arith_table(problems[start:stop], first_index=start, fmt=fmt, split=split)
        pq.write_table(table, path, filesystem=fs)
        paths.append(path)
    logger.info("wrote %d %s arith prompts in %d shards to %s", num_prompts, fmt, num_shards, out_dir)
    return paths

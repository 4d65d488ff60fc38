"""Iteration 0 of a batched run does not wait on the size of the prompt set (issue 13: target <= 1.5).

Two runs of the same pipeline, 1024 prompts per iteration, one iteration, over an ingested prompts table of 10k
prompts and one of 1M (by default; `--large` and `--small` change them). Both tables are committed ingest output:
a real `batchrl run` ingests 1024 toy prompts once (so the manifest's fingerprint and sources are the ones a run
expects), then the bench rewrites that table as N/1024 parts of 1024 rows, each the ingested part with its
prompt ids made unique, and their manifest (sizes and sha256 included). The run then skips ingest and takes its
batch from the large table exactly as from a real one.

Measured from each run's own records: the driver's time before iteration 0 (command start to generate's start:
process start, Ray, planning over the table's manifest, counting the epoch), and iteration 0 itself (generate's
start to the update's start: generate reading its batch, score, advantage). The ratios 1M / 10k of both are the
results; the toy model and the transformers engine keep the runs to about a minute each on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the harness: tests/harness.py
from harness import DEFAULT, cli_ok, write_pipeline

from batchrl.storage.manifest import PartInfo, read_manifest, write_manifest

BATCH = 1024


def pipeline(tmp: Path, name: str) -> Path:
    """The tests' tiny pipeline over 1024 toy prompts in one part, 1024 prompts per iteration, one iteration."""
    from batchrl_toy import ensure_toy_assets

    ensure_toy_assets(tmp / "toy" / "model", tmp / "toy" / "prompts", num_prompts=BATCH, num_shards=1, seed=0)
    return write_pipeline(
        tmp,
        {
            "name": name,
            "data.max_prompts": DEFAULT,
            "data.shard_size": BATCH,
            "data.prompts_per_iteration": BATCH,
            "generate.max_new_tokens": 4,
            "score.rewards": [{"reward": "format_hash", "weight": 1.0}],
            "update.micro_batch_size": 64,
        },
        model=str(tmp / "toy" / "model"),
        prompts=str(tmp / "toy" / "prompts"),
        file_name=f"{name}.yaml",
    )


def grow_prompts_table(table_dir: Path, num_rows: int) -> None:
    """Rewrites the committed one-part prompts table as num_rows // 1024 parts with unique prompt ids."""
    manifest = read_manifest(str(table_dir))
    (only,) = manifest.parts
    base = pq.read_table(table_dir / only.name)
    ids = base.column("prompt_id").to_pylist()
    column = base.schema.get_field_index("prompt_id")
    parts = []
    for k in range(num_rows // base.num_rows):
        name = f"part-{k:05d}.parquet"
        table = base.set_column(column, "prompt_id", pa.array([f"{k}-{i}" for i in ids], pa.string()))
        pq.write_table(table, table_dir / name)
        data = (table_dir / name).read_bytes()
        parts.append(
            PartInfo(name=name, rows=table.num_rows, sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data))
        )
    write_manifest(str(table_dir), dataclasses.replace(manifest, parts=parts))


def timed_run(path: Path, run_id: str) -> tuple[float, float]:
    """`batchrl run`: (seconds from the command's start to generate's start, generate's start to update's start)."""
    started = time.time()
    cli_ok("run", str(path), "--run-id", run_id, timeout=None)
    run = path.parent / "runs" / run_id / "iter_0000"
    generate = json.loads((run / "rollouts" / "_MANIFEST.json").read_text())
    update = json.loads((run / "policy" / "_MANIFEST.json").read_text())
    return generate["started_at"] - started, update["started_at"] - generate["started_at"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", type=int, default=10_240)
    parser.add_argument("--large", type=int, default=1_048_576)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_batches_") as tmp:
        results = {}
        for label, rows in (("small", args.small), ("large", args.large)):
            path = pipeline(Path(tmp), label)
            cli_ok("run", str(path), timeout=None)  # ingest (and an iteration, dropped below)
            run = path.parent / "runs" / label
            grown = time.perf_counter()
            grow_prompts_table(run / "prompts", rows)
            grown = time.perf_counter() - grown
            for iteration in run.glob("iter_*"):
                shutil.rmtree(iteration)
            results[label] = timed_run(path, label)
            print(
                f"{rows} prompts ({rows // BATCH} parts, written in {grown:.0f} s): driver before iteration 0 "
                f"{results[label][0]:.1f} s, iteration 0 up to the update {results[label][1]:.1f} s",
                flush=True,
            )
    small, large = results["small"], results["large"]
    sizes = f"{args.large} vs {args.small} prompts"
    print(f"RESULT batches_iter0_to_update_large_vs_small={large[1] / small[1]:.2f} (target <= 1.5; {sizes})")
    print(f"RESULT batches_driver_before_iter0_large_vs_small={large[0] / small[0]:.2f} (target <= 1.5; {sizes})")


if __name__ == "__main__":
    main()

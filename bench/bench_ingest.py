"""Ingest at scale (issue 13): throughput against a bare loop (target >= 0.8) and the driver's peak memory at 10x the
prompts (target <= 1.2).

(a) Throughput. The same synthetic prompt files (Parquet, row groups of 1,000 rows, 8 files) are ingested by the
    ingest stage (its pool of Ray actors on a local Ray of all the machine's CPUs, started before the clock, as a
    run's Ray is) and by a bare loop in one process doing the same work with plain pyarrow: stream the row groups,
    render the chat template and batch-encode with the same tokenizer (the toy one the tests use), write Parquet
    parts of 256 rows. The ratio is the loop's time over the stage's (> 1: the stage is faster); each is timed
    ``--rounds`` times, alternating, and the best of each is kept (the machine may be shared).
(b) Driver memory. Two fresh processes each start a local Ray and run the ingest stage over ``--small`` and
    ``--large`` prompts; each reports its own peak RSS (VmHWM of the driver alone: Ray's workers are other
    processes; not ru_maxrss, which a child inherits from the parent that wrote the files: bench/peak_rss.py).
    The ratio large / small is the result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from peak_rss import peak_rss_mb

SHARD_SIZE = 256
ROW_GROUP = 1_000
NUM_FILES = 8


def write_prompts(directory: Path, num_rows: int) -> list[str]:
    """``num_rows`` arithmetic prompts in batchrl's layout, in NUM_FILES files of row groups of ROW_GROUP rows."""
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-num_rows // NUM_FILES)
    paths = []
    for k in range(NUM_FILES):
        ids = range(k * per_file, min((k + 1) * per_file, num_rows))
        table = pa.table(
            {
                "prompt_id": [f"p{i}" for i in ids],
                "data_source": ["arith"] * len(ids),
                "prompt": [f"What is {i % 997} + {i % 89}? Answer after ####." for i in ids],
                "ground_truth": [str(i % 997 + i % 89) for i in ids],
            }
        )
        path = directory / f"prompts-{k:03d}.parquet"
        pq.write_table(table, path, row_group_size=ROW_GROUP)
        paths.append(str(path))
    return paths


def bare_loop(files: list[str], tokenizer_dir: str, out_dir: Path) -> float:
    """Seconds for the same work in one loop: row groups streamed, templated and batch-encoded, parts written."""
    from transformers import AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    part, pending = 0, []
    for path in files:
        parquet = pq.ParquetFile(path)
        for group in range(parquet.num_row_groups):
            rows = parquet.read_row_group(group).to_pylist()
            conversations = [[{"role": "user", "content": row["prompt"]}] for row in rows]
            texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
            encoded = tokenizer(
                texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False
            )
            ids = encoded["input_ids"]
            for row, messages, text, token_ids in zip(rows, conversations, texts, ids):
                pending.append(
                    {
                        "prompt_id": row["prompt_id"],
                        "data_source": row["data_source"],
                        "messages_json": json.dumps(messages),
                        "prompt_text": text,
                        "prompt_token_ids": token_ids,
                        "ground_truth": row["ground_truth"],
                    }
                )
            while len(pending) >= SHARD_SIZE:
                pq.write_table(pa.Table.from_pylist(pending[:SHARD_SIZE]), out_dir / f"part-{part:05d}.parquet")
                pending, part = pending[SHARD_SIZE:], part + 1
    if pending:
        pq.write_table(pa.Table.from_pylist(pending), out_dir / f"part-{part:05d}.parquet")
    return time.perf_counter() - started


def ingest_context(files: list[str], tokenizer_dir: str, root: Path):
    from batchrl.config import validate_dict
    from batchrl.pipeline.stage import StageContext
    from batchrl.storage import RunLayout

    cfg = validate_dict(
        {
            "name": "bench",
            "model": {"path": tokenizer_dir},
            "data": {"train_files": files, "shard_size": SHARD_SIZE},
            "tracking": {"progress_bars": False},
        }
    )
    layout = RunLayout.for_run(str(root), "bench")
    return StageContext(
        cfg=cfg,
        layout=layout,
        iteration=None,
        output_dir=layout.table_dir("prompts", None),
        fingerprint="bench",
        inputs={},
        input_dirs={},
        policy_in=tokenizer_dir,
        embedded_ray=True,
    )


def start_ray() -> None:
    import ray
    from ray.data import DataContext

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False, log_to_driver=False)
    DataContext.get_current().enable_progress_bars = False


def timed_ingest(files: list[str], tokenizer_dir: str, root: Path) -> tuple[float, int]:
    """(seconds, prompts written) of the ingest stage over ``files`` into a fresh directory."""
    from batchrl.stages.ingest import IngestStage

    shutil.rmtree(root, ignore_errors=True)
    ctx = ingest_context(files, tokenizer_dir, root)
    started = time.perf_counter()
    output = IngestStage().run(ctx)
    return time.perf_counter() - started, output.counts["prompts"]


def throughput(tmp: Path, tokenizer_dir: str, num_rows: int, rounds: int) -> None:
    files = write_prompts(tmp / f"in-{num_rows}", num_rows)
    start_ray()
    loop_times, ingest_times = [], []
    for _ in range(rounds):
        shutil.rmtree(tmp / "loop", ignore_errors=True)
        loop_times.append(bare_loop(files, tokenizer_dir, tmp / "loop"))
        seconds, prompts = timed_ingest(files, tokenizer_dir, tmp / "ingest")
        assert prompts == num_rows, prompts
        ingest_times.append(seconds)
        print(f"{num_rows} prompts: bare loop {loop_times[-1]:.1f} s, ingest stage {seconds:.1f} s", flush=True)
    ratio = min(loop_times) / min(ingest_times)
    rate = num_rows / min(ingest_times)
    print(
        f"RESULT ingest_throughput_vs_bare_loop={ratio:.2f} (target >= 0.8; {num_rows} prompts, "
        f"{os.cpu_count()} CPUs, {rate:.0f} prompts/s)"
    )


def driver_peak_rss_mb(tmp: Path, tokenizer_dir: str, num_rows: int) -> tuple[float, float]:
    """(peak RSS in MB, seconds) of a fresh driver process that ingests ``num_rows`` prompts."""
    files = write_prompts(tmp / f"in-{num_rows}", num_rows)
    args = [sys.executable, __file__, "--child", json.dumps([files, tokenizer_dir, str(tmp / f"rss-{num_rows}")])]
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"the ingest child failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["prompts"] == num_rows, report
    shutil.rmtree(tmp / f"in-{num_rows}", ignore_errors=True)
    shutil.rmtree(tmp / f"rss-{num_rows}", ignore_errors=True)
    return report["peak_rss_mb"], report["seconds"]


def child(spec: str) -> None:
    """In a fresh process: start Ray, ingest, print {prompts, seconds, peak_rss_mb} of this process."""
    files, tokenizer_dir, root = json.loads(spec)
    start_ray()
    seconds, prompts = timed_ingest(files, tokenizer_dir, Path(root))
    print(json.dumps({"prompts": prompts, "seconds": seconds, "peak_rss_mb": peak_rss_mb()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a few minutes")
    parser.add_argument("--rows", type=int, default=200_000, help="prompts of the throughput measurement")
    parser.add_argument("--small", type=int, default=200_000, help="prompts of the smaller memory measurement")
    parser.add_argument("--large", type=int, default=2_000_000, help="prompts of the larger memory measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=["throughput", "memory"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.quick:
        args.rows, args.small, args.large, args.rounds = 20_000, 20_000, 200_000, 1
    from batchrl_toy import build_toy_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench_ingest_") as tmp_dir:
        tmp = Path(tmp_dir)
        tokenizer_dir = str(tmp / "tokenizer")
        build_toy_tokenizer(tokenizer_dir)
        if args.only != "throughput":
            small, small_s = driver_peak_rss_mb(tmp, tokenizer_dir, args.small)
            large, large_s = driver_peak_rss_mb(tmp, tokenizer_dir, args.large)
            print(
                f"driver peak RSS: {args.small} prompts {small:.0f} MB ({small_s:.0f} s), "
                f"{args.large} prompts {large:.0f} MB ({large_s:.0f} s)",
                flush=True,
            )
            print(
                f"RESULT ingest_driver_peak_rss_large_vs_small={large / small:.2f} (target <= 1.2; {args.large} vs "
                f"{args.small} prompts: {large:.0f} vs {small:.0f} MB)"
            )
        if args.only != "memory":
            throughput(tmp, tokenizer_dir, args.rows, args.rounds)


if __name__ == "__main__":
    main()

"""Ingest of inputs that cannot be read whole (issue 35): one big gzipped JSON Lines file, one giant Parquet row group.

(a) Driver memory over one ``.jsonl.gz``. Two fresh processes each start a local Ray and ingest one gzipped JSONL
    file, of ``--gz-small-mb`` and ``--gz-large-mb`` MB of compressed text (default 100 vs 1,000, the issue's sizes;
    each prompt carries a random tag, so that gzip keeps ~32 of a record's ~174 bytes: ~30M prompts in 1 GB, so
    the default sizes take hours on 2 cores; --quick: 2 vs 20 MB); each reports its own peak RSS
    (VmHWM of the driver alone, bench/peak_rss.py). The ratio large / small is the result, target <= 1.2: the file
    is streamed in windows by a reader task and tokenized by the pool, the driver holds refs only.
(b) Throughput of one big row group. The same ``--group-rows`` prompts (default 2M) in one Parquet file written as
    one row group, and as row groups of 1,000 rows, each ingested by the stage on a local Ray of all the machine's
    CPUs; the ratio is the small groups' time over the big group's (target >= 0.8: the big group is decoded once,
    in record batches, its windows spread over the pool as chunks of small groups are).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_ingest
import pyarrow as pa
import pyarrow.parquet as pq
from bench_ingest import ROW_GROUP, start_ray, timed_ingest

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def prompt_record(i: int) -> dict:
    """An arithmetic prompt with some words and a tag drawn from ``i`` (so that gzip cannot shrink the file to
    nothing)."""
    words = " ".join(WORDS[(i * k * 2654435761 >> 7) % len(WORDS)] for k in range(1, 6))
    tag = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=12).hexdigest()
    return {
        "prompt_id": f"p{i}",
        "data_source": "arith",
        "prompt": f"{words} [{tag}]: what is {i % 997} + {i % 89}? Answer after ####.",
        "ground_truth": str(i % 997 + i % 89),
    }


def write_gz(path: Path, megabytes: float) -> int:
    """A gzipped JSONL file of about ``megabytes`` MB (compressed); returns its records."""
    path.parent.mkdir(parents=True, exist_ok=True)
    target, count = megabytes * 1e6, 0
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6) as f:
        while raw.tell() < target:
            f.write("".join(json.dumps(prompt_record(i)) + "\n" for i in range(count, count + 10_000)).encode())
            count += 10_000
    return count


def gz_driver_rss(tmp: Path, tokenizer_dir: str, megabytes: float) -> tuple[float, float, int]:
    """(peak RSS in MB, seconds, prompts) of a fresh driver process that ingests one gzipped file."""
    path = tmp / f"gz-{megabytes}" / "prompts.jsonl.gz"
    count = write_gz(path, megabytes)
    root = tmp / f"rss-{megabytes}"
    # bench_ingest's child: a fresh driver that starts Ray, ingests and reports its own peak RSS
    args = [sys.executable, bench_ingest.__file__, "--child", json.dumps([[str(path)], tokenizer_dir, str(root)])]
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"the ingest child failed:\n{result.stderr[-3000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["prompts"] == count, (report, count)
    shutil.rmtree(path.parent, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return report["peak_rss_mb"], report["seconds"], count


def big_group(tmp: Path, tokenizer_dir: str, num_rows: int, rounds: int) -> None:
    records = (prompt_record(i) for i in range(num_rows))
    columns: dict[str, list] = {"prompt_id": [], "data_source": [], "prompt": [], "ground_truth": []}
    for record in records:
        for name, column in columns.items():
            column.append(record[name])
    table = pa.table(columns)
    del columns
    one, small = tmp / "one" / "prompts.parquet", tmp / "small" / "prompts.parquet"
    for path, size in ((one, num_rows), (small, ROW_GROUP)):
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, row_group_size=size)
    del table
    groups = pq.ParquetFile(one).metadata.num_row_groups
    start_ray()
    one_times, small_times = [], []
    for _ in range(rounds):
        seconds, prompts = timed_ingest([str(small)], tokenizer_dir, tmp / "ingest")
        assert prompts == num_rows, prompts
        small_times.append(seconds)
        seconds, prompts = timed_ingest([str(one)], tokenizer_dir, tmp / "ingest")
        assert prompts == num_rows, prompts
        one_times.append(seconds)
        print(f"{num_rows} prompts: {ROW_GROUP}-row groups {small_times[-1]:.1f} s, one group {seconds:.1f} s")
    ratio = min(small_times) / min(one_times)
    print(
        f"RESULT ingest_one_big_row_group_vs_small_groups={ratio:.2f} (target >= 0.8; {num_rows} prompts in "
        f"{groups} row group(s) vs groups of {ROW_GROUP}: {min(one_times):.1f} vs {min(small_times):.1f} s, "
        f"{os.cpu_count()} CPUs)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a few minutes")
    parser.add_argument("--gz-small-mb", type=float, default=100, help="compressed MB of the smaller .jsonl.gz")
    parser.add_argument("--gz-large-mb", type=float, default=1000, help="compressed MB of the larger .jsonl.gz")
    parser.add_argument("--group-rows", type=int, default=2_000_000, help="rows of the one big row group")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", choices=["gz", "group"])
    args = parser.parse_args()
    if args.quick:
        # above ingest.GZ_IN_DRIVER_BYTES: the smaller file, too, goes to the pool
        args.gz_small_mb, args.gz_large_mb, args.group_rows = 2, 20, 200_000
    from batchrl_toy import build_toy_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench_ingest_stream_") as tmp_dir:
        tmp = Path(tmp_dir)
        tokenizer_dir = str(tmp / "tokenizer")
        build_toy_tokenizer(tokenizer_dir)
        if args.only != "group":
            small, small_s, small_n = gz_driver_rss(tmp, tokenizer_dir, args.gz_small_mb)
            large, large_s, large_n = gz_driver_rss(tmp, tokenizer_dir, args.gz_large_mb)
            print(
                f"driver peak RSS: {small_n} prompts {small:.0f} MB ({small_s:.0f} s), "
                f"{large_n} prompts {large:.0f} MB ({large_s:.0f} s)"
            )
            print(
                f"RESULT ingest_gz_driver_peak_rss_large_vs_small={large / small:.2f} (target <= 1.2; one .jsonl.gz of "
                f"{args.gz_large_mb:g} vs {args.gz_small_mb:g} MB, {large_n} vs {small_n} prompts: "
                f"{large:.0f} vs {small:.0f} MB)",
                flush=True,
            )
        if args.only != "gz":
            big_group(tmp, tokenizer_dir, args.group_rows, args.rounds)


if __name__ == "__main__":
    main()

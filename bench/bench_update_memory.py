"""Peak RSS of an update rank at 100k samples vs 10k, the same mini-batch (issue 13: target <= 1.3).

A rank used to read the whole advantages table into Python lists and fill old-log-prob buffers over every response
token of it; now it keeps an index of small columns (~40 bytes a sample), reads a mini-batch's rows when it trains
and spills the pre-update log-probs to a scratch file. Per size, one rank (a fresh process, gloo, world size 1) runs
the worker's own pieces in the worker's order: the index and the streamed checks of the lists, the model and
optimizer, the pre-update pass over EVERY sample (old log-probs recomputed, spilled, the log-probs table written),
then the first MINI_BATCHES (2) optimizer steps of epoch 0, not all of them (20 at 10k samples, 196 at 100k): the
steps after the second read and hold no more than the second does, and all of them would take the large size to an
hour of CPU. Mini-batches of 64 prompts x 8 samples (512 samples), token-budget micro-batches. The model is the
toy tokenizer's Qwen2 at its smallest (1 layer, hidden 16): the bench measures memory, not compute. Sequences are
32-token prompts and 16-64-token responses, in parts of 256 prompts (2048 rows) as the advantage stage writes them
for data.shard_size 256, with the prompt_length and response_length columns.

The peak is VmHWM of the rank's process (bench/peak_rss.py: not ru_maxrss, which it inherits from this parent).
Prints both peaks and their ratio (large / small); `--quick` runs 20k vs 2k samples (a smoke test), `--small` /
`--large` set the sizes (multiples of 2048).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from peak_rss import peak_rss_mb

SAMPLES_PER_PROMPT = 8
PROMPTS_PER_PART = 256
PROMPT_TOKENS = 32
RESPONSE_TOKENS = (16, 64)
MINI_BATCH_PROMPTS = 64
MINI_BATCHES = 2  # optimizer steps taken (of 20 at 10k samples, 196 at 100k): the pass covers every sample
MAX_TOKENS_PER_MICRO_BATCH = 16384


def write_table(out_dir: Path, *, num_samples: int, vocab_size: int) -> list[str]:
    """An advantages table of `num_samples` rows in parts of PROMPTS_PER_PART prompts, built from numpy arrays."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_per_part = PROMPTS_PER_PART * SAMPLES_PER_PROMPT
    paths = []
    for part in range(num_samples // rows_per_part):
        rng = np.random.default_rng(part)
        first_prompt = part * PROMPTS_PER_PART
        prompt_ids = np.repeat([f"p{first_prompt + p:08d}" for p in range(PROMPTS_PER_PART)], SAMPLES_PER_PROMPT)
        prompts_PT = rng.integers(3, vocab_size, (PROMPTS_PER_PART, PROMPT_TOKENS), dtype=np.int32)
        response_lengths = rng.integers(*RESPONSE_TOKENS, rows_per_part, endpoint=True).astype(np.int32)
        response_offsets = np.concatenate([[0], np.cumsum(response_lengths)]).astype(np.int32)
        prompt_offsets = np.arange(rows_per_part + 1, dtype=np.int32) * PROMPT_TOKENS
        num_tokens = int(response_offsets[-1])
        table = pa.table(
            {
                "prompt_id": pa.array(prompt_ids, pa.string()),
                "sample_idx": pa.array(np.tile(np.arange(SAMPLES_PER_PROMPT, dtype=np.int32), PROMPTS_PER_PART)),
                "prompt_token_ids": pa.ListArray.from_arrays(
                    pa.array(prompt_offsets), pa.array(np.repeat(prompts_PT, SAMPLES_PER_PROMPT, axis=0).ravel())
                ),
                "prompt_length": pa.array(np.full(rows_per_part, PROMPT_TOKENS, dtype=np.int32)),
                "response_token_ids": pa.ListArray.from_arrays(
                    pa.array(response_offsets), pa.array(rng.integers(3, vocab_size, num_tokens, dtype=np.int32))
                ),
                "response_length": pa.array(response_lengths),
                "response_logprobs": pa.ListArray.from_arrays(
                    pa.array(response_offsets), pa.array(-5 * rng.random(num_tokens, dtype=np.float32))
                ),
                "advantage": pa.array(rng.normal(size=rows_per_part).astype(np.float32)),
            }
        )
        path = out_dir / f"part-{part:05d}.parquet"
        pq.write_table(table, path, compression="zstd")
        paths.append(str(path))
    return paths


def measure(spec_path: str) -> None:
    """In a process of its own, which is the rank: the update of the spec at `spec_path` up to MINI_BATCHES
    optimizer steps (the worker's own pieces, in the worker's order); prints its peak RSS (MB) as JSON."""
    import os

    from batchrl.trainer import UpdateSpec
    from batchrl.trainer.batching import mini_batches
    from batchrl.trainer.fsdp import init_distributed
    from batchrl.trainer.index import check_token_ids
    from batchrl.trainer.logprobs import UpdateInputs, mini_batch_options, pre_update_pass, uses_rollout_logprobs
    from batchrl.trainer.rows import RowReader
    from batchrl.trainer.training import optimizer_step
    from batchrl.trainer.worker import build_trainer, checked_index

    spec = UpdateSpec.from_json(spec_path)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ctx = init_distributed(spec)
    started = time.perf_counter()
    index, scans = checked_index(spec, ctx=ctx)
    model, optimizer, tokenizer, _ = build_trainer(spec, ctx=ctx)
    check_token_ids(scans, vocab_size=model.get_input_embeddings().num_embeddings)
    reader = RowReader(index, with_rollout_logprobs=uses_rollout_logprobs(spec))
    with tempfile.TemporaryDirectory(prefix="bench_update_memory_rank_") as scratch:
        spilled = pre_update_pass(model, index, reader, spec=spec, ctx=ctx, pad_token_id=0, scratch_dir=scratch)
        pass_s = time.perf_counter() - started
        inputs = UpdateInputs(index=index, reader=reader, spilled=spilled, spec=spec)
        batches = mini_batches(index.group_N, epoch=0, **mini_batch_options(spec))
        for indices in batches[:MINI_BATCHES]:
            optimizer_step(model, optimizer, inputs, indices, spec=spec, ctx=ctx, pad_token_id=0, lr=spec.update.lr)
        spilled.close()
    report = {"peak_rss_mb": peak_rss_mb(), "seconds": time.perf_counter() - started, "pass_seconds": pass_s}
    print(json.dumps(report | {"mini_batches": len(batches), "samples": index.num_samples}))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def update_peak(tmp: Path, *, policy: Path, num_samples: int, vocab_size: int) -> dict:
    """Write the table, then run its update from a fresh process; that process's report."""
    from batchrl.config.models import UpdateConfig
    from batchrl.trainer import UpdateSpec

    out = tmp / f"n{num_samples}"
    spec = UpdateSpec(
        policy_in=str(policy),
        policy_out=str(out / "policy"),
        advantages_files=write_table(out / "advantages", num_samples=num_samples, vocab_size=vocab_size),
        metrics_path=str(out / "metrics.json"),
        logprobs_dir=str(out / "logprobs"),
        update=UpdateConfig(
            num_processes=1,
            backend="gloo",
            lr=1e-5,
            ppo_epochs=1,
            ppo_mini_batch_size=MINI_BATCH_PROMPTS,
            max_tokens_per_micro_batch=MAX_TOKENS_PER_MICRO_BATCH,
            old_logprobs="recompute",
        ),
    )
    spec.to_json(out / "spec.json")
    return measured_in_child(__file__, out / "spec.json", what=f"the update of {num_samples} samples")


def measured_in_child(script: str, spec_path: Path, *, what: str) -> dict:
    """What `script --measure spec_path` printed as its last line (JSON), run in a fresh process so that its peak
    RSS is the update's alone; stops the benchmark, with the child's stderr, if it failed."""
    result = subprocess.run(
        [sys.executable, script, "--measure", str(spec_path)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-4000:])
        raise SystemExit(f"{what} failed")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20k vs 2k samples (a smoke test)")
    parser.add_argument("--small", type=int, default=10_240, help="samples of the small table (multiple of 2048)")
    parser.add_argument("--large", type=int, default=100_352, help="samples of the large table (multiple of 2048)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: run one spec's update and report
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
        return
    small, large = (2_048, 20_480) if args.quick else (args.small, args.large)
    from transformers import AutoConfig

    from batchrl_toy import build_toy_model

    with tempfile.TemporaryDirectory(prefix="bench_update_memory_") as tmp:
        policy = Path(tmp) / "policy_in"
        build_toy_model(  # the toy tokenizer's Qwen2 at its smallest: the bench measures memory, not compute
            policy, hidden_size=16, intermediate_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=1
        )
        vocab_size = AutoConfig.from_pretrained(str(policy)).vocab_size
        peaks = {}
        for num_samples in (small, large):
            peaks[num_samples] = update_peak(Path(tmp), policy=policy, num_samples=num_samples, vocab_size=vocab_size)
            report = peaks[num_samples]
            print(
                f"{num_samples} samples: old log-probs of every sample, then {MINI_BATCHES} of "
                f"{report['mini_batches']} optimizer steps, in {report['seconds']:.0f} s (pass "
                f"{report['pass_seconds']:.0f} s); rank peak RSS {report['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    sizes = f"{large} vs {small} samples, mini-batch {MINI_BATCH_PROMPTS * SAMPLES_PER_PROMPT} samples"
    large_mb, small_mb = peaks[large]["peak_rss_mb"], peaks[small]["peak_rss_mb"]
    print(f"RESULT update_rank_peak_rss_mb_large={large_mb:.0f} (small: {small_mb:.0f})")
    print(f"RESULT update_rank_peak_rss_large_vs_small={large_mb / small_mb:.2f} (target <= 1.3; {sizes})")


if __name__ == "__main__":
    main()

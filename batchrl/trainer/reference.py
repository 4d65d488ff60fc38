"""Per-token log-probs of sampled responses under a frozen model, in one process (no torch.distributed).

Used where a stage outside the update needs a reference model's view of the rollouts: the advantage stage
folding KL into the reward (advantage.kl_in_reward_coef) needs reference log-probs *before* advantages exist,
so they cannot come from the update's own pre-update pass. Same micro-batching (token budget, longest first),
same padding and the same log-prob gather as the trainer, so a token's value equals the trainer's.
"""

from __future__ import annotations

import numpy as np
import torch

from batchrl.trainer.batching import plan_micro_batches
from batchrl.trainer.data import Samples, collate, scatter_response_values


def load_frozen_model(path: str) -> torch.nn.Module:
    """An HF causal LM in float32 eval mode with gradients off (dropout off too)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def response_logprobs(model: torch.nn.Module, samples: Samples, *, pad_token_id: int,
                      max_tokens: int = 8192) -> np.ndarray:
    """Flat float32 array (samples.response_offsets_N1 layout): log p(token) of every response token."""
    from batchrl.trainer.worker import policy_logprobs

    out_flat = torch.zeros(int(samples.response_offsets_N1[-1]), dtype=torch.float32)
    if samples.num_samples == 0:
        return out_flat.numpy()
    budget = max(max_tokens, int(samples.lengths_N.max()))
    for indices in plan_micro_batches(samples.lengths_N, world_size=1, max_tokens=budget)[0]:
        if not indices:
            continue
        mb = collate(samples, indices, pad_token_id=pad_token_id, device=torch.device("cpu"))
        logprobs_BT, _ = policy_logprobs(model, mb, entropy_grad=False)
        scatter_response_values(logprobs_BT, mb, samples, out_flat=out_flat)
    return out_flat.numpy()

"""Policy-loss cost: GSPO, PPO-clip with truncated IS and with a k3 KL loss term, against plain PPO-clip
(the baseline, measured in the same run) on the same [batch, tokens] tensors, forward + backward.

The logits-side work (token_logprobs, entropy) dominates a real step and is shared by all of them; this
checks that the per-token loss arithmetic added by issue 4 stays in the same cost class as PPO-clip.
Prints `RESULT gspo_vs_ppo_time_ratio=... (target <= 1.5)`, the same for PPO + truncated IS, and
`ppo_kl_loss_vs_ppo_time_ratio` (target <= 2.5: a second loss term on top of PPO's).
"""

from __future__ import annotations

import argparse
import time

import torch

from batchrl.algorithms.kl import kl_penalty
from batchrl.algorithms.losses import (
    aggregate_token_losses,
    gspo_token_losses,
    ppo_clip_token_losses,
    truncated_is_weights,
)


def make_batch(batch_size: int, num_tokens: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(batch_size, num_tokens, generator=generator) * 3
    lengths = torch.randint(1, num_tokens + 1, (batch_size,), generator=generator)
    return {
        "logprobs": (old + torch.randn(batch_size, num_tokens, generator=generator) * 0.05).requires_grad_(),
        "old": old,
        "rollout": old + torch.randn(batch_size, num_tokens, generator=generator) * 0.01,
        "ref": old + torch.randn(batch_size, num_tokens, generator=generator) * 0.1,
        "advantages": torch.randn(batch_size, 1, generator=generator).expand(-1, num_tokens),
        "mask": torch.arange(num_tokens)[None, :] < lengths[:, None],
    }


def ppo(b):
    losses, _, _ = ppo_clip_token_losses(
        b["logprobs"], b["old"], b["advantages"], clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    return aggregate_token_losses(losses, b["mask"], mode="token-mean")


def gspo(b):
    losses, _, _ = gspo_token_losses(
        b["logprobs"], b["old"], b["advantages"], b["mask"], clip_ratio_low=3e-4, clip_ratio_high=4e-4
    )
    return aggregate_token_losses(losses, b["mask"], mode="seq-mean-token-mean")


def ppo_tis(b):
    losses, _, _ = ppo_clip_token_losses(
        b["logprobs"], b["old"], b["advantages"], clip_ratio_low=0.2, clip_ratio_high=0.28
    )
    weights = truncated_is_weights(b["old"], b["rollout"], b["mask"], cap=2.0)
    return aggregate_token_losses(losses * weights, b["mask"], mode="token-mean")


def ppo_kl(b):
    kl = kl_penalty(b["logprobs"], b["ref"], estimator="low_var_kl")
    return ppo(b) + 0.001 * aggregate_token_losses(kl, b["mask"], mode="token-mean")


def best_times(loss_fns: dict, batch: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    """Best of `repeats` per function, interleaved round by round so load on a shared machine hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in loss_fns}
    for _ in range(repeats + 1):  # the first round warms up
        for name, loss_fn in loss_fns.items():
            batch["logprobs"].grad = None
            started = time.perf_counter()
            loss_fn(batch).backward()
            times[name].append(time.perf_counter() - started)
    return {name: min(t[1:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    batch = make_batch(args.batch_size, args.tokens)
    times = best_times({"ppo": ppo, "gspo": gspo, "ppo_tis": ppo_tis, "ppo_kl_loss": ppo_kl}, batch, args.repeats)
    print(
        f"losses on [{args.batch_size}, {args.tokens}], fwd+bwd, best of {args.repeats}: "
        + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in times.items())
    )
    # GSPO and TIS replace or scale the PPO token losses; the KL loss term is a second loss on top of PPO.
    for name, target in (("gspo", 1.5), ("ppo_tis", 1.5), ("ppo_kl_loss", 2.5)):
        print(f"RESULT {name}_vs_ppo_time_ratio={times[name] / times['ppo']:.2f} (target <= {target})")


if __name__ == "__main__":
    main()

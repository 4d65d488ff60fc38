"""Writes gae.json: verl's GAE, whitening, value loss and explained variance on seeded random inputs.

Run with verl importable, e.g. `pip install --no-deps --target /tmp/verl_pkg verl tensordict pyvers omegaconf
codetiming orjson` and `PYTHONPATH=/tmp/verl_pkg .venv/bin/python tests/unit/verl_reference/make_gae_reference.py`.
The file records verl's version; tests/unit/test_gae.py compares batchrl's functions with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import verl
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F


def case(seed: int, *, batch: int, tokens: int, gamma: float, lam: float, interior_holes: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, tokens + 1, (batch,), generator=g)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).float()
    if interior_holes:  # multi-turn: tokens inside the response the policy did not write
        mask = mask * (torch.rand(batch, tokens, generator=g) > 0.2).float()
        mask[:, 0] = 1.0
    scores = torch.randn(batch, generator=g, dtype=torch.float64)
    kl = torch.randn(batch, tokens, generator=g, dtype=torch.float64).abs() * 0.1
    kl_coef = 0.05
    rewards = torch.zeros(batch, tokens, dtype=torch.float64)
    rewards[torch.arange(batch), lengths - 1] = scores
    rewards = rewards - kl_coef * kl * (torch.arange(tokens)[None, :] < lengths[:, None])
    values = torch.randn(batch, tokens, generator=g, dtype=torch.float64)
    advantages, returns = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    vpreds = values + 0.3 * torch.randn(batch, tokens, generator=g, dtype=torch.float64)
    out = {"seed": seed, "gamma": gamma, "lam": lam, "kl_coef": kl_coef, "clip_range": 0.2}
    out |= {"lengths": lengths.tolist(), "mask": mask.tolist(), "scores": scores.tolist(), "kl": kl.tolist()}
    out |= {"rewards": rewards.tolist(), "values": values.tolist(), "vpreds": vpreds.tolist()}
    out |= {"advantages": advantages.tolist(), "returns": returns.tolist()}
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss, clipfrac = core_algos.compute_value_loss(vpreds, returns, values, mask, 0.2, loss_agg_mode=mode)
        out[f"vf_loss/{mode}"], out["vf_clipfrac"] = float(loss), float(clipfrac)
    diff_var = torch.var(torch.masked_select(returns - values, mask.bool()))
    out["explained_var"] = float(1.0 - diff_var / (torch.var(torch.masked_select(returns, mask.bool())) + 1e-5))
    out["whitened_check"] = verl_F.masked_whiten(advantages, mask).tolist()  # == advantages (already whitened)
    return out


if __name__ == "__main__":
    cases = [
        case(0, batch=6, tokens=9, gamma=1.0, lam=1.0, interior_holes=False),
        case(1, batch=6, tokens=9, gamma=0.99, lam=0.95, interior_holes=False),
        case(2, batch=5, tokens=12, gamma=0.9, lam=0.8, interior_holes=True),
    ]
    path = Path(__file__).with_name("gae.json")
    path.write_text(json.dumps({"verl_version": verl.__version__, "cases": cases}))
    print(f"wrote {path} (verl {verl.__version__})")

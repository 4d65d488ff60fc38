"""Pure algorithm functions of arrays: no configuration objects, no I/O, no distributed calls.

- advantages (numpy): GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline, pass@k, batch whitening, DAPO dynamic
  sampling and overlong penalty.
- gae (numpy; the value loss torch): token-level rewards, GAE advantages and returns, the clipped value loss.
- estimators: the table of every advantage estimator (group or token kind, whether it needs the batch's moments,
  its options) that the advantage stage dispatches through; `compute_advantages(estimator, rewards_PG, **options)`.
- losses (torch): token log-probs and entropy, PPO-clip (clip-higher, dual-clip), GSPO, truncated
  importance sampling, loss aggregation modes, entropy bonus.
- kl (torch, numpy): per-token KL estimators (k1, k2, k3, low_var_kl, ...) for a loss term, and the KL
  folded into sequence rewards.
- evaluation (numpy): held-out metrics as verl's val-core names them: mean@k, unbiased pass@k, majority
  vote and maj@k, per data_source.

Stages and the trainer are the glue that feeds them. Submodules are imported explicitly (the numpy-only
advantage stage need not import torch).
"""

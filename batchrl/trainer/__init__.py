"""FSDP2 policy update: `run_update(UpdateSpec(...))` trains on an advantages table and writes a checkpoint.

`spec` is the serialisable job description (the validated `UpdateConfig` plus this update's paths and seed);
`launch` starts one process per rank and waits for them (fresh per update, or resident across updates until
`shutdown_trainers()`); `ray_launch` runs the ranks as Ray actors in a placement group instead (on a Ray cluster;
each stages its own inputs and uploads its outputs). What each rank runs:
- `worker`: the rank's lifecycle (`python -m batchrl.trainer.worker`): build or reuse the model and optimizer,
  one update, save; resident ranks serve one update per spec path;
- `fsdp`: the process group, loading and sharding a checkpoint, dropout off;
- `forward`: samples packed into micro-batch rows and the forward to per-token log-probs (also used by
  `reference`, the advantage stage's single-process reference scorer);
- `logprobs`: the old-policy and reference log-probs, once before the first step;
- `training`: losses, optimizer steps, the epoch loop, the update's metrics.
Their pieces: `data` (the advantages table and micro-batch tensors), `batching` (mini-batch and token-budget
micro-batch plans), `schedule` (lr per optimizer step), `checkpoint` (HF policy, optimizer state for exact resume,
the log-probs table), `integrity` (trainer-state checksums), `progress_file` (rank 0's steps done / planned,
read by the launcher for a progress bar).
Importing this package does not import torch.
"""

from batchrl.trainer.launch import prestart_trainers, run_update, shutdown_trainers
from batchrl.trainer.spec import UpdateSpec

__all__ = ["UpdateSpec", "prestart_trainers", "run_update", "shutdown_trainers"]

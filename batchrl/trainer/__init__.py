"""FSDP2 policy update: `run_update(UpdateSpec(...))` trains on an advantages table and writes a checkpoint.

`spec` is the serialisable job description, `launch` starts one process per rank and waits for them (fresh
per update, or resident across updates until `shutdown_trainers()`),
`ray_launch` runs the ranks as Ray actors in a placement group instead (on a Ray cluster; each stages its own
inputs and uploads its outputs), `worker` is what each rank runs. Its pieces: `data` (the advantages table and
micro-batch tensors),
`batching` (mini-batch and token-budget micro-batch plans), `schedule` (lr per optimizer step) and
`checkpoint` (HF policy, optimizer state for exact resume, the log-probs table), `progress_file` (rank 0's
steps done / planned, read by the launcher for a progress bar).
Importing this package does not import torch.
"""

from batchrl.trainer.launch import run_update, shutdown_trainers
from batchrl.trainer.spec import UpdateSpec

__all__ = ["UpdateSpec", "run_update", "shutdown_trainers"]

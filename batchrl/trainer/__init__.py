"""FSDP2 policy update: `run_update(UpdateSpec(...))` trains on an advantages table and writes a checkpoint.

`spec` is the serialisable job description, `launch` starts one process per rank and waits for them,
`worker` is what each rank runs. Importing this package does not import torch.
"""

from batchrl.trainer.launch import run_update
from batchrl.trainer.spec import UpdateSpec

__all__ = ["UpdateSpec", "run_update"]

"""The built-in stages: importing this package registers them.

The runner knows no stage by name (see batchrl/pipeline/stage.py). The run order follows from what each stage
reads: ingest once (and heldout, the held-out prompts, with an evaluate: section); then, every iteration, generate
(prompts), score (rollouts), advantage (scores), update (advantages), evaluate (the held-out prompts and the policy
that update wrote).
"""

from batchrl.stages import (  # noqa: F401  (registers them)
    advantage,
    evaluate,
    generate,
    heldout,
    ingest,
    score,
    update,
    user,
    values,
)

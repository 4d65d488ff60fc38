"""The built-in stages: importing this package registers them (advantage and the user stages through providers in
`STAGE_PROVIDERS`, registered per config by `sync_stages`, as their inputs follow from the config).

The runner knows no stage by name (see batchrl/pipeline/stage.py). The run order follows from what each stage
reads: ingest once (and heldout, the held-out prompts, with an evaluate: section); then, every iteration, generate
(prompts), judge (rollouts, with a judge: section), score (rollouts, or the judgements), advantage (scores), update
(advantages), evaluate (the held-out prompts and the policy that update wrote); prompt_stats (scores, with
data.prompt_stats or data.sources).
"""

from batchrl.stages import (  # noqa: F401  (registers them)
    advantage,
    evaluate,
    generate,
    heldout,
    ingest,
    judge,
    prompt_stats,
    score,
    update,
    user,
    values,
)

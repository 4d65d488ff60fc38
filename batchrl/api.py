"""The Python entry points the command line uses: plan and run a pipeline with the built-in stages.

Importing this module registers the built-in stages (batchrl.stages), then any stage registered afterwards runs
after them. The runner itself (batchrl.pipeline.runner) imports no stage: it runs whatever is registered.
"""

from __future__ import annotations

import batchrl.stages  # noqa: F401  (registers the built-in stages, in run order)
from batchrl.pipeline.runner import PlannedStage, Runner, RunSummary, build_plan, check_from_stage

__all__ = ["PlannedStage", "RunSummary", "Runner", "build_plan", "check_from_stage"]

"""The code a pipeline names (user stages, tools, an environment, reward terms), imported and checked where it loads.

Why one function: `batchrl validate`, `plan` and `run` and the Python API's ``Pipeline(...)`` all load pipelines, and
each of them must refuse a misspelt module, function or param the same way (exit 2, naming the field) before any
work: a reward param checked only at scoring costs the ingest and the generation first (issue 32, item 2). Each
check lives with what it checks; this module only lists them, so a new kind of reference is added once.

What it does not check: files, models and endpoints (a stage's ``check_inputs``, when `run` starts), which
`validate` must not need (a config is validated where its data is not).
"""

from __future__ import annotations

from batchrl.agents.environment import check_environment
from batchrl.agents.tools import check_tools
from batchrl.config import PipelineConfig
from batchrl.stages.score import check_reward_terms
from batchrl.stages.user import check_stage_calls


def check_code_references(cfg: PipelineConfig, *, source: str | None = None) -> None:
    """ConfigError (exit 2) naming the field of the first kind of reference that does not import or fit its
    function; imports the modules named (their top-level code runs, as it would in the run)."""
    check_stage_calls(cfg, source=source)
    check_tools(cfg.generate.tools, source=source)
    check_environment(cfg.generate.environment, source=source)
    check_reward_terms(cfg, source=source)

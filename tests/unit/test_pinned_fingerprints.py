"""Every shipped pipeline, and variants that turn on each planning feature, plans to the fingerprints recorded in
pinned_fingerprints.json: a refactor of the runner, the stages or the config must not re-run a finished table
(a changed fingerprint redoes the stage and everything after it in every user's resumed or nightly run).

A change that means to change a fingerprint (a new semantic field, a fixed bug) re-pins deliberately:
BATCHRL_REPIN=1 pytest tests/unit/test_pinned_fingerprints.py, and the commit says why. The user-stage variant
fingerprints examples/prompt_shaping.py's source: editing that example re-pins too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import batchrl.stages  # noqa: F401  (registers the built-in stages)
from batchrl.config import load_pipeline
from batchrl.pipeline.plan import build_plan

ROOT = Path(__file__).resolve().parents[2]
PINS = Path(__file__).with_name("pinned_fingerprints.json")

SHAPING = (
    "stages=[{name: shaping, after: score, call: 'examples.prompt_shaping:shape_by_prompt_length', "
    "params: {tokens_per_prompt_token: 0.5, min_budget: 4, penalty_per_token: 0.05}, "
    "outputs: [scores, length_penalties]}]"
)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "quickstart": ("quickstart", []),
    "ppo_quickstart": ("ppo_quickstart", []),
    "grpo_math_epochs": ("grpo_math", []),  # ingest alone: the iterations are counted from its table
    "grpo_math": ("grpo_math", ["run.epochs=null", "run.iterations=3"]),
    "ppo_math": ("ppo_math", ["run.epochs=null", "run.iterations=3"]),
    "staleness": ("quickstart", ["run.max_staleness=1"]),
    "ppo_staleness": ("ppo_quickstart", ["run.max_staleness=2"]),
    "kl_in_reward": ("quickstart", ["advantage.kl_in_reward_coef=0.01", "advantage.kl_in_reward_estimator=k3"]),
    "whiten_filter": ("quickstart", ["advantage.whiten=true", "advantage.filter_groups=true"]),
    "rloo": ("quickstart", ["advantage.estimator=rloo"]),
    "reinforce_pp": ("quickstart", ["advantage.estimator=reinforce_pp_baseline"]),
    "passk": ("quickstart", ["advantage.estimator=grpo_passk", "advantage.passk_k=4"]),
    "batches": ("quickstart", ["data.prompts_per_iteration=32", "run.iterations=6"]),
    "logged": ("quickstart", ["generate.logged=all"]),
    "user_stage": ("quickstart", [SHAPING]),
    "reward_model": ("quickstart", ["score.reward_model={path: /models/rm}"]),
    "hf_engine": ("quickstart", ["generate.engine=hf"]),
    "no_evaluate": ("quickstart", ["evaluate=null"]),
}


def plan_fingerprints(pipeline: str, overrides: list[str]) -> dict[str, str]:
    cfg = load_pipeline(ROOT / "pipelines" / f"{pipeline}.yaml", overrides=overrides, run_id="pinned")
    return {step.label: step.fingerprint for step in build_plan(cfg, check_storage=False)}


@pytest.fixture(scope="module")
def pins() -> dict[str, dict[str, str]]:
    if os.environ.get("BATCHRL_REPIN"):
        PINS.write_text(json.dumps({k: plan_fingerprints(*v) for k, v in VARIANTS.items()}, indent=1) + "\n")
    return json.loads(PINS.read_text())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_plan_keeps_its_pinned_fingerprints(pins, variant):
    assert plan_fingerprints(*VARIANTS[variant]) == pins[variant]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_plan_keeps_its_pinned_order(pins, variant):
    """The steps in the order recorded: the pins keep the plan's order (JSON objects keep their keys' order)."""
    assert list(plan_fingerprints(*VARIANTS[variant])) == list(pins[variant])

"""The judge's config (field-named errors, exit 2), its prompt template, and the three verdict parsers."""

from __future__ import annotations

import pytest
from harness import cli, write_yaml

from batchrl.config import ConfigError, load_pipeline
from batchrl.config.judge import JsonVerdict, LetterVerdict, NumberVerdict
from batchrl.rewards import REWARDS
from batchrl.rewards.combine import RewardSet
from batchrl.rewards.judge import parse_verdict, render_judge_prompt

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nReference: {ground_truth}\nGrade 0-10."
JUDGED = {
    "name": "t",
    "model": {"path": "some/model"},
    "data": {"train_files": ["prompts/"]},
    "judge": {"model": "some/judge", "template": TEMPLATE},
    "score": {"rewards": [{"reward": "judge"}]},
}


def load(tmp_path, **sections):
    return load_pipeline(write_yaml(tmp_path / "p.yaml", {**JUDGED, **sections}))


def judge_with(**fields):
    return {**JUDGED["judge"], **fields}


def test_a_judge_section_with_its_term_validates_with_documented_defaults(tmp_path):
    judge = load(tmp_path).judge
    assert (judge.temperature, judge.max_retries, judge.verdict.kind, judge.gpus_per_actor) == (0.0, 2, "number", 0)


@pytest.mark.parametrize(
    ("judge", "score", "message"),
    [
        (judge_with(template="Grade {answer}"), None, r"judge\.template: .*\{answer\} is not a field"),
        (judge_with(template="Grade {prompt}"), None, r"judge\.template: .*must contain \{response\}"),
        (judge_with(template="{response} {"), None, r"judge\.template: .*literal brace"),
        (judge_with(endpoint={"base_url": "http://x/v1", "model": "m"}), None, r"exactly one of judge\.model"),
        ({"template": TEMPLATE}, None, r"exactly one of judge\.model"),
        (judge_with(verdict={"kind": "number", "min": 5, "max": 1}), None, r"judge\.verdict\.number: .*min=5"),
        (judge_with(verdict={"kind": "letter"}), None, r"judge\.verdict\.letter\.grades"),
        (judge_with(verdict={"kind": "stars"}), None, r"judge\.verdict"),
        (judge_with(), {"rewards": [{"reward": "gsm8k"}]}, r"no score\.rewards term reads its verdicts"),
    ],
)
def test_a_bad_judge_config_is_an_error_naming_the_field(tmp_path, judge, score, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, judge=judge, **({"score": score} if score else {}))


def test_a_judge_term_without_a_judge_section_is_refused(tmp_path):
    raw = {k: v for k, v in JUDGED.items() if k != "judge"}
    with pytest.raises(ConfigError, match=r"reward: judge but there is no judge section"):
        load_pipeline(write_yaml(tmp_path / "p.yaml", raw))


def test_a_judge_that_would_share_the_policy_gpus_is_refused_at_validate(tmp_path):
    policy_gpu = {"gpus_per_actor": 1}
    with pytest.raises(ConfigError, match=r"judge\.gpus_per_actor=0\.5 .* a GPU the policy's engines hold"):
        load(tmp_path, judge=judge_with(gpus_per_actor=0.5), generate=policy_gpu)
    staleness = {"max_staleness": 1}
    with pytest.raises(ConfigError, match=r"run\.max_staleness=1: the update's local ranks"):
        load(tmp_path, judge=judge_with(gpus_per_actor=1), generate=policy_gpu, run=staleness)
    assert load(tmp_path, judge=judge_with(gpus_per_actor=1), generate=policy_gpu).judge.gpus_per_actor == 1
    path = write_yaml(tmp_path / "q.yaml", {**JUDGED, "judge": judge_with(gpus_per_actor=0.5), "generate": policy_gpu})
    assert cli("validate", str(path)).returncode == 2


def test_the_template_is_filled_from_the_sample_and_a_missing_field_is_named():
    fields = {"prompt": "2+2?", "response": "4", "ground_truth": "4", "rubric": None}
    assert render_judge_prompt(TEMPLATE, fields) == "Question: 2+2?\nAnswer: 4\nReference: 4\nGrade 0-10."
    assert render_judge_prompt("{{literal}} {response}", fields) == "{literal} 4"
    with pytest.raises(ValueError, match=r"names \{rubric\}, which this sample does not have"):
        render_judge_prompt("{rubric}: {response}", fields)


NUMBER = NumberVerdict(min=0, max=10)


@pytest.mark.parametrize(
    ("text", "verdict", "expected"),
    [
        ("A 3 would be harsh. Score: 7", NUMBER, 0.7),
        ("10", NUMBER, 1.0),
        ("Score: 7.5/10", NumberVerdict(min=0, max=10, pattern=r"Score: *([0-9.]+)", normalize=False), 7.5),
        ("Grade: B. Not an A.", LetterVerdict(grades={"A": 1.0, "B": 0.5}, pattern=r"Grade: (\w+)"), 0.5),
        ("Between A and A+ ... A+", LetterVerdict(grades={"A": 0.8, "A+": 1.0}), 1.0),
        ('thinking {"a": 1}\n```json\n{"score": 4}\n```', JsonVerdict(key="score"), 4.0),
        ('{"score": "0.25", "why": "ok"}', JsonVerdict(min=0, max=1), 0.25),
    ],
)
def test_each_parser_reads_the_last_verdict_in_the_text(text, verdict, expected):
    score, error = parse_verdict(text, verdict)
    assert error is None and score == pytest.approx(expected)


@pytest.mark.parametrize(
    ("text", "verdict", "why"),
    [
        ("no digits here", NUMBER, "no number"),
        ("Score: 11", NUMBER, "11 is outside [0, 10]"),
        ("Grade: Z", LetterVerdict(grades={"A": 1.0}, pattern=r"Grade: (\w)"), "'Z' is not a grade"),
        ("ABBA", LetterVerdict(grades={"A": 1.0, "B": 0.0}), "no grade"),
        ("{score: 3}", JsonVerdict(), "no JSON object"),
        ('{"verdict": 3}', JsonVerdict(), "no key 'score'"),
        ('{"score": true}', JsonVerdict(), "is not a number"),
        ('{"score": 2}', JsonVerdict(min=0, max=1), "outside [0, 1]"),
    ],
)
def test_an_unparsable_verdict_says_why_and_is_never_clamped(text, verdict, why):
    score, error = parse_verdict(text, verdict)
    assert score is None and why in error


def test_the_judge_term_rewards_the_verdict_and_fails_or_falls_back_without_one():
    rewards = RewardSet(terms=[{"reward": "judge", "weight": 2.0}], by_data_source={}, failure_reward=0.0)
    row = {"data_source": "d", "judge_score": 0.75, "judge_error": None}
    assert rewards.evaluate("r", None, row) == ([0.75], [None])
    values, errors = rewards.evaluate("r", None, {**row, "judge_score": None, "judge_error": "unparsable"})
    assert values == [None] and "no judge verdict (unparsable)" in errors[0]
    assert REWARDS["judge"]("r", None, judge_score=None, failure_score=-1.0) == -1.0


def test_the_judge_runs_after_generate_and_its_user_stages_and_score_reads_its_table(tmp_path):
    import batchrl.stages  # noqa: F401  (registers the built-in stages)
    from batchrl.pipeline.stage import STAGES, source_table, stage_order, sync_stages

    probe = {"name": "probe", "after": "generate", "call": "json:dumps", "outputs": ["probed"]}
    cfg = load(tmp_path, stages=[probe])
    try:
        sync_stages(cfg)
        order = stage_order()
        assert order.index("generate") < order.index("probe") < order.index("judge") < order.index("score")
        assert STAGES["judge"].inputs == ("probe",) and source_table("rollouts", "score") == "judgements"
    finally:
        sync_stages(load(tmp_path, judge=None, score={"rewards": [{"reward": "gsm8k"}]}))
    assert "judge" not in STAGES and source_table("rollouts", "score") == "rollouts"


def test_held_out_evaluation_scores_without_the_judge_term(tmp_path):
    from batchrl.stages.score import ScoreStage

    cfg = load(tmp_path, score={"rewards": [{"reward": "judge"}, {"reward": "gsm8k", "weight": 0.5}]})
    assert [t.reward for t in ScoreStage.reward_kwargs(cfg)["terms"]] == ["judge", "gsm8k"]
    assert [t.reward for t in ScoreStage.reward_kwargs(cfg, judged=False)["terms"]] == ["gsm8k"]


def test_the_judge_metrics_hold_its_tokens_per_second_over_its_own_duration():
    from batchrl.stages.judge import JudgeStage
    from batchrl.storage.manifest import Manifest

    manifest = Manifest(
        stage="judge", table="judgements", iteration=0, fingerprint="f", parts=[], schema="judgements",
        started_at=0, finished_at=4, counts={"judge_tokens": 100}, stats={"judge/verdict/mean": 0.5},
    )  # fmt: skip
    metrics = JudgeStage().metrics(manifest, timings={"judge": 4.0, "step": 10.0})
    assert metrics == {"judge/verdict/mean": 0.5, "judge/tokens_per_s": 25.0}


def test_before_a_run_a_missing_judge_model_or_api_key_is_a_config_error_naming_the_field(tmp_path, monkeypatch):
    from batchrl.stages.judge import JudgeStage

    with pytest.raises(ConfigError, match=r"judge\.model: './no/such/dir' is neither a local checkpoint"):
        JudgeStage().check_inputs(load(tmp_path, judge=judge_with(model="./no/such/dir")))
    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    endpoint = {"base_url": "http://judge:8000/v1", "model": "m", "api_key_env": "NO_SUCH_JUDGE_KEY"}
    http = judge_with(model=None, endpoint=endpoint)
    with pytest.raises(ConfigError, match=r"judge\.endpoint\.api_key_env: \$NO_SUCH_JUDGE_KEY is not set"):
        JudgeStage().check_inputs(load(tmp_path, judge=http))


def test_with_max_staleness_the_judge_need_not_wait_for_the_update_before_it(tmp_path):
    from batchrl.pipeline.plan import build_plan

    cfg = load(tmp_path, run={"root": str(tmp_path / "runs"), "iterations": 3, "max_staleness": 1})
    steps = {step.label: step for step in build_plan(cfg, check_storage=False)}
    update_before = steps["iter 1 update"].output_dir
    assert steps["iter 2 judge"].policy_in == steps["iter 2 generate"].policy_in != update_before
    assert steps["iter 2 score"].policy_in == update_before  # score, as before, waits for it

"""User stages (`stages:`): where they go in the dataflow, the contract their output must keep, and the examples."""

from __future__ import annotations

import pyarrow as pa
import pytest
from harness import cli, write_yaml

import batchrl.api  # noqa: F401  (registers the built-in stages and the user-stage provider)
from batchrl.api import Pipeline
from batchrl.config import ConfigError, validate_dict
from batchrl.errors import DataError
from batchrl.pipeline.stage import STAGES, is_sharded, source_table, stage_order, sync_stages
from batchrl.stages.user import (
    INSERTION_POINTS,
    UserStageWorker,
    check_stage_calls,
    checked_output,
    register_function,
)
from examples.prompt_shaping import shape_by_prompt_length
from examples.safety_filter import SafetyFilter

SAFETY = {
    "name": "safety",
    "after": "score",
    "call": "examples.safety_filter:SafetyFilter",
    "params": {"banned_words": ["exploit"]},
    "outputs": ["scores", "safety_scores", "unsafe"],
}
SHAPING = {
    "name": "shaping",
    "after": "score",
    "call": "examples.prompt_shaping:shape_by_prompt_length",
    "params": {"tokens_per_prompt_token": 0.5, "min_budget": 4, "penalty_per_token": 0.05},
    "outputs": ["scores", "length_penalties"],
}


def config(stages: list[dict]):
    return validate_dict({"name": "p", "model": {"path": "m"}, "data": {"train_files": ["d"]}, "stages": stages})


@pytest.fixture(autouse=True)
def built_ins_only_afterwards():
    yield
    sync_stages(config([]))


def test_stages_after_score_run_in_the_order_listed_and_advantage_reads_the_last_one():
    sync_stages(config([SAFETY, SHAPING, SAFETY | {"name": "raw_check", "after": "generate"}]))
    order = stage_order()
    assert order.index("generate") < order.index("raw_check") < order.index("score")
    assert order.index("score") < order.index("safety") < order.index("shaping") < order.index("advantage")
    assert STAGES["safety"].inputs == ("scores",) and STAGES["shaping"].inputs == ("safety",)
    assert source_table("scores", "advantage") == "shaping"
    assert source_table("rollouts", "score") == "raw_check"
    assert source_table("scores", "safety") == "scores"  # the inserted stages read the chain as it is


def test_a_config_without_user_stages_leaves_only_the_built_ins():
    sync_stages(config([SAFETY]))
    sync_stages(config([]))
    assert "safety" not in STAGES and source_table("scores", "advantage") == "scores"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "scores"}, r"stages\[0\]\.name='scores' is a built-in stage or table name"),
        ({"name": "Safety"}, r"stages\.0\.name"),
        ({"after": "update"}, r"stages\.0\.after"),
        ({"call": "not a reference"}, r"is not a 'package\.module:function'"),
        ({"outputs": []}, r"stages\.0\.outputs"),
    ],
)
def test_a_bad_stage_entry_is_a_config_error_naming_the_field(change, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        config([SAFETY | change])


def test_each_insertion_point_is_a_built_in_whose_table_a_stage_after_it_reads_and_takes_over():
    sync_stages(config([SAFETY | {"name": f"after_{point}", "after": point} for point in INSERTION_POINTS]))
    for point in INSERTION_POINTS:
        built_in, inserted = STAGES[point], STAGES[f"after_{point}"]
        assert is_sharded(built_in) and built_in.per_iteration and built_in.config_section is None
        assert inserted.inputs == (built_in.table,) and inserted.schema == built_in.schema
        assert inserted.takes_over == built_in.table


def test_a_wrong_after_is_one_line_naming_the_field_and_the_insertion_points(tmp_path):
    raw = {"name": "p", "model": {"path": "m"}, "data": {"train_files": ["d"]}}
    result = cli("validate", write_yaml(tmp_path / "p.yaml", raw | {"stages": [SAFETY | {"after": "update"}]}))
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("stages.0.after: Input should be 'generate', 'score' or 'advantage' (got 'update')")
    )


def test_two_stages_of_one_name_are_a_config_error():
    with pytest.raises(ValueError, match=r"stages\[1\]\.name='safety' is used twice"):
        config([SAFETY, SAFETY])


BONUS_STAGE = """
def add_bonus(table, *, bonus):
    raise RuntimeError("never called: the params are checked before any work")
"""


def test_a_misspelt_param_stops_validate_plan_and_run_with_exit_2_naming_the_field_before_any_work(tmp_path):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "bonus_stage.py").write_text(BONUS_STAGE)
    stage = {"name": "bonus", "after": "score", "call": "bonus_stage:add_bonus", "params": {"bonnus": 0.1}}
    raw = {
        "name": "p",
        "run": {"root": str(tmp_path / "runs")},
        "model": {"path": "m"},
        "data": {"train_files": [str(tmp_path / "prompts")]},
        "stages": [stage | {"outputs": ["scores"]}],
    }
    path = write_yaml(tmp_path / "p.yaml", raw)
    for command in ("validate", "plan", "run"):
        result = cli(command, path, path_first=[tmp_path / "code"])
        assert result.returncode == 2, (command, result.stderr)
        assert result.stderr == (
            f"config error: {path}: stages[0].params.bonnus: bonus_stage:add_bonus has no parameter 'bonnus'; "
            "did you mean 'bonus'? Remove it or fix its spelling (its parameters: bonus)\n"
        ), command
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"call": "no_such_module_xyz:f"}, r"^stages\[0\]\.call: cannot import module 'no_such_module_xyz'"),
        (
            {"call": "examples.prompt_shaping:shape_by_length"},
            r"^stages\[0\]\.call: .* module 'examples\.prompt_shaping' has no attribute 'shape_by_length'",
        ),
        ({"call": "examples.prompt_shaping:pa"}, r"^stages\[0\]\.call='examples\.prompt_shaping:pa' is a module"),
        (
            {"params": {"tokens_per_prompt_token": 0.5, "penalty_per_token": 0.05}},
            r"^stages\[0\]\.params: examples\.prompt_shaping:shape_by_prompt_length needs 'min_budget': add it "
            r"under params",
        ),
    ],
)
def test_a_call_that_does_not_resolve_or_params_that_miss_one_are_config_errors_naming_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        check_stage_calls(config([SHAPING | change]))


def test_a_class_is_checked_against_its_constructor_and_must_be_callable():
    with pytest.raises(ConfigError) as error:
        check_stage_calls(config([SAFETY, SAFETY | {"name": "typo", "params": {"banned_word": ["x"]}}]))
    assert str(error.value) == (  # one line for the mistake: 'banned_words' is not said to be missing as well
        "stages[1].params.banned_word: examples.safety_filter:SafetyFilter has no parameter 'banned_word'; did you "
        "mean 'banned_words'? Remove it or fix its spelling (its parameters: banned_words, min_safety)"
    )
    with pytest.raises(ConfigError, match=r"stages\[0\]\.call='batchrl\.config:PipelineConfig' is a class without"):
        check_stage_calls(config([SAFETY | {"call": "batchrl.config:PipelineConfig", "params": {}}]))


def add_bonus(table, *, bonus):
    return table


def takes_any_params(table, **params):
    return table


def takes_no_table(*, bonus):
    return None


def test_a_function_taking_kwargs_takes_any_params_and_one_without_a_positional_parameter_none():
    check_stage_calls(config([SHAPING | {"call": register_function(takes_any_params), "params": {"x": 1}}]))
    with pytest.raises(ConfigError, match=r"takes no positional parameter for the shard's table"):
        check_stage_calls(config([SHAPING | {"call": register_function(takes_no_table), "params": {"bonus": 1}}]))


def test_the_python_api_checks_an_inserted_functions_params_when_it_is_inserted():
    pipeline = Pipeline.from_dict({"name": "p", "model": {"path": "m"}, "data": {"train_files": ["d"]}})
    with pytest.raises(ConfigError, match=r"stages\[0\]\.params\.bonnus: .* did you mean 'bonus'\?"):
        pipeline.insert_after("score", add_bonus, name="b", outputs=["scores"], params={"bonnus": 1})


def shard() -> pa.Table:
    return pa.table(
        {
            "prompt_id": ["a", "b"],
            "prompt_token_ids": pa.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2]], pa.list_(pa.int32())),
            "response_texts": [["fine answer", "an exploit here"], ["ok", "exploit"]],
            "response_lengths": pa.array([[2, 12], [3, 9]], pa.list_(pa.int32())),
            "scores": pa.array([[1.0, 1.0], [0.5, 1.0]], pa.list_(pa.float32())),
        }
    )


SCHEMA = shard().schema


def test_the_safety_example_zeroes_unsafe_rewards_and_flags_them():
    out = SafetyFilter(banned_words=["exploit"], min_safety=0.9)(shard())
    assert out.column("unsafe").to_pylist() == [[False, True], [False, True]]
    assert out.column("safety_scores").to_pylist()[0][1] == pytest.approx(1 - 1 / 3)
    assert out.column("scores").to_pylist() == [[1.0, 0.0], [0.5, 0.0]]
    checked_output(shard(), out, stage="safety", outputs=SAFETY["outputs"], schema=SCHEMA)


def test_the_shaping_example_charges_tokens_beyond_the_prompts_budget():
    out = shape_by_prompt_length(shard(), tokens_per_prompt_token=0.5, min_budget=4, penalty_per_token=0.05)
    # budgets: max(4, 0.5 x 10) = 5 and max(4, 0.5 x 2) = 4
    flat = [value for group in out.column("length_penalties").to_pylist() for value in group]
    assert flat == pytest.approx([0.0, 0.35, 0.0, 0.25])
    flat = [value for group in out.column("scores").to_pylist() for value in group]
    assert flat == pytest.approx([1.0, 0.65, 0.5, 0.75])


def test_output_columns_of_the_input_are_cast_back_and_added_ones_kept():
    out = shard().set_column(4, "scores", pa.array([[0.0, 1.0], [1.0, 1.0]], pa.list_(pa.float64())))
    out = out.append_column("note", pa.array(["x", "y"]))
    checked = checked_output(shard(), out, stage="s", outputs=["scores", "note"], schema=SCHEMA)
    assert checked.schema.field("scores").type == pa.list_(pa.float32())
    assert checked.column_names == [*SCHEMA.names, "note"]


@pytest.mark.parametrize(
    ("edit", "outputs", "message"),
    [
        (lambda t: t.slice(0, 1), ["scores"], r"stage s returned 1 rows for a shard of 2"),
        (lambda t: t.drop_columns(["response_texts"]), ["scores"], r"dropped the column 'response_texts'"),
        (lambda t: t.set_column(0, "prompt_id", pa.array(["b", "a"])), ["scores"], r"changed the column 'prompt_id'"),
        (lambda t: t.append_column("extra", pa.array([1, 2])), ["scores"], r"added the column\(s\) \['extra'\]"),
        (lambda t: t, ["scores", "flag"], r"did not return the column\(s\) \['flag'\]"),
        (lambda t: t.set_column(4, "scores", pa.array(["x", "y"])), ["scores"], r"'scores' as string"),
        (lambda t: t.to_pylist(), ["scores"], r"returned a list; it must return a pyarrow\.Table"),
        (lambda t: None, ["scores"], r"returned None; it must return a pyarrow\.Table"),
    ],
)
def test_an_output_that_breaks_the_contract_is_a_data_error_naming_stage_and_column(edit, outputs, message):
    with pytest.raises(DataError, match=message):
        checked_output(shard(), edit(shard()), stage="s", outputs=outputs, schema=SCHEMA)


def reads_a_column_it_lacks(table: pa.Table) -> pa.Table:
    return table.append_column("flag", table.column("no_such_column"))  # pyarrow raises inside table.pxi


class CastsTextToNumbers:
    def __init__(self):
        self.fill = pa.array(["x"]).cast(pa.int32())  # pyarrow raises inside compute.py and error.pxi

    def __call__(self, table: pa.Table) -> pa.Table:
        return table


def test_a_stage_that_raises_inside_a_library_is_located_at_the_users_line_not_the_librarys():
    worker = UserStageWorker(
        stage="s", call="m:f", params={}, outputs=["flag"], schema="scores", function=reads_a_column_it_lacks
    )
    with pytest.raises(DataError) as error:
        worker.process(shard())
    line = reads_a_column_it_lacks.__code__.co_firstlineno + 1
    assert str(error.value).startswith("stage s: m:f raised KeyError: ")
    assert str(error.value).endswith(f" at {__file__}:{line}")
    with pytest.raises(DataError, match=rf"stage s: building m:C\(\*\*params\) raised .* at {__file__}:\d+$") as error:
        UserStageWorker(stage="s", call="m:C", params={}, outputs=["x"], schema="scores", function=CastsTextToNumbers)
    assert str(error.value).endswith(f":{CastsTextToNumbers.__init__.__code__.co_firstlineno + 1}")

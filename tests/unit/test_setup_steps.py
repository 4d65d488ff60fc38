"""The pipeline's setup: steps. Loading a pipeline imports nothing they name; `batchrl run` resolves every step
before the first runs, calls them in order, and a mistake is a config error naming the field (exit 2)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
import yaml
from harness import cli

from batchrl.config import ConfigError, load_pipeline
from batchrl.setup_steps import run_setup_steps

MINIMAL = {"name": "t", "model": {"path": "some/model"}, "data": {"train_files": ["prompts/"]}}

HOOKS = """
from pathlib import Path

LOG = Path({log!r})
with LOG.open("a") as f:
    f.write("imported\\n")

NOT_A_FUNCTION = 3


def record(*, word, times=1):
    with LOG.open("a") as f:
        f.write(word * times + "\\n")
"""


@pytest.fixture
def hooks(tmp_path, monkeypatch) -> tuple[str, Path]:
    """(name of an importable module whose import and calls append to a log, the log)."""
    name = f"setup_hooks_{uuid.uuid4().hex[:8]}"
    log = tmp_path / "log.txt"
    (tmp_path / f"{name}.py").write_text(HOOKS.format(log=str(log)))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, log


def write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_loading_a_pipeline_imports_nothing_its_setup_steps_name(tmp_path, hooks):
    module, log = hooks
    cfg = load_pipeline(
        write(tmp_path, dict(MINIMAL, setup={"greet": {"call": f"{module}:record", "arguments": {"word": "hi"}}}))
    )
    assert cfg.setup["greet"].arguments == {"word": "hi"}
    assert not log.exists() and module not in sys.modules


def test_a_call_without_a_colon_is_a_config_error_naming_the_field_when_loaded(tmp_path):
    raw = dict(MINIMAL, setup={"toy": {"call": "batchrl_toy.setup_toy_assets"}})
    with pytest.raises(ConfigError, match=r"setup\.toy\.call: must look like 'package\.module:function'"):
        load_pipeline(write(tmp_path, raw))


def test_a_misspelt_step_field_is_named_with_a_suggestion(tmp_path):
    raw = dict(MINIMAL, setup={"toy": {"call": "a:b", "argumnts": {}}})
    with pytest.raises(ConfigError, match=r"unknown field 'setup\.toy\.argumnts'.*did you mean 'arguments'"):
        load_pipeline(write(tmp_path, raw))


def test_steps_run_in_the_order_written_with_their_arguments_and_can_be_overridden_with_set(tmp_path, hooks):
    module, log = hooks
    raw = dict(
        MINIMAL,
        setup={
            "first": {"call": f"{module}:record", "arguments": {"word": "a", "times": 2}},
            "second": {"call": f"{module}:record", "arguments": {"word": "b"}},
        },
    )
    cfg = load_pipeline(write(tmp_path, raw), overrides=["setup.second.arguments.word=c"])
    run_setup_steps(cfg.setup)
    assert log.read_text().splitlines() == ["imported", "aa", "c"]


@pytest.mark.parametrize(
    "call, arguments, error",
    [
        ("no_such_module_xyz:fn", {}, r"^setup\.bad\.call: cannot import module 'no_such_module_xyz'"),
        ("{module}:nothing_here", {}, r"^setup\.bad\.call: .*has no attribute 'nothing_here'"),
        ("{module}:NOT_A_FUNCTION", {}, r"^setup\.bad\.call: .* names an integer, not a function"),
        ("{module}:record", {"wrd": "x"}, r"^setup\.bad\.arguments: .*cannot be called with them.*parameters: word"),
    ],
)
def test_a_step_that_cannot_be_called_is_a_config_error_before_any_step_runs(tmp_path, hooks, call, arguments, error):
    module, log = hooks
    raw = dict(
        MINIMAL,
        setup={
            "good": {"call": f"{module}:record", "arguments": {"word": "ran"}},
            "bad": {"call": call.format(module=module), "arguments": arguments},
        },
    )
    with pytest.raises(ConfigError, match=error):
        run_setup_steps(load_pipeline(write(tmp_path, raw)).setup)
    assert "ran" not in (log.read_text() if log.exists() else "")


def test_the_toy_step_rejects_bad_arguments_naming_them_before_building_anything(tmp_path):
    raw = dict(
        MINIMAL,
        setup={
            "toy_assets": {
                "call": "batchrl_toy:setup_toy_assets",
                "arguments": {
                    "model_dir": str(tmp_path / "m"),
                    "data_dir": str(tmp_path / "d"),
                    "sft_steps": -1,
                    "num_promps": 8,
                },
            }
        },
    )
    with pytest.raises(ConfigError) as caught:
        run_setup_steps(load_pipeline(write(tmp_path, raw)).setup)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("setup.toy_assets: arguments.sft_steps: Input should be greater than or equal to 0")
    assert lines[1].startswith("setup.toy_assets: arguments.num_promps: unknown argument")
    assert not (tmp_path / "m").exists() and not (tmp_path / "d").exists()


def test_batchrl_run_with_an_unimportable_setup_step_exits_2_with_one_line_and_writes_nothing(tmp_path):
    raw = dict(
        MINIMAL,
        run={"root": str(tmp_path / "runs")},
        setup={"fetch": {"call": "no_such_module_xyz:fetch", "arguments": {"day": 1}}},
    )
    result = cli("run", write(tmp_path, raw))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("config error: setup.fetch.call: cannot import module")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()

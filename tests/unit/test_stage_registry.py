"""The run order follows from what stages read, not from the order they were registered (imported) in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchrl.pipeline import stage as contract
from batchrl.pipeline.stage import POLICY, Stage, register, stage_order


def make(name: str, table: str, inputs: tuple[str, ...] = (), *, once: bool = False, new_policy: bool = False):
    return type(
        name,
        (Stage,),
        {
            "name": name,
            "table": table,
            "schema": None,
            "inputs": inputs,
            "per_iteration": not once,
            "reads_policy": "new" if new_policy else "previous",
        },
    )


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(contract, "STAGES", {})
    return contract


def test_stages_run_after_the_stages_whose_tables_they_read_whatever_their_registration_order(registry):
    for cls in [
        make("judge", "verdicts", (POLICY,), new_policy=True),
        make("train", POLICY, ("labels",)),
        make("label", "labels", ("items", POLICY)),
        make("load", "items", once=True),
    ]:
        register(cls)
    assert stage_order() == ["load", "label", "train", "judge"]


def test_among_stages_free_to_run_one_whose_table_is_read_goes_first_then_the_names_decide(registry):
    stages = [
        make("load", "items", once=True),
        make("b", "bs", ("items",)),
        make("report", "reports", ("items",)),
        make("a", "as", ("items",)),
        make("total", "totals", ("bs",)),
    ]
    for cls in reversed(stages):
        register(cls)
    assert stage_order() == ["load", "b", "a", "report", "total"]  # b: total reads its table
    for name in list(contract.STAGES):
        contract.unregister(name)
    for cls in stages:
        register(cls)
    assert stage_order() == ["load", "b", "a", "report", "total"]


def test_a_stage_reading_a_table_nobody_writes_or_a_cycle_is_refused(registry):
    register(make("x", "xs", ("ys",)))
    with pytest.raises(AssertionError, match=r"'x' reads \['ys'\], which no registered stage writes"):
        stage_order()
    register(make("y", "ys", ("xs",)))
    with pytest.raises(AssertionError, match=r"\['x', 'y'\] read each other's tables in a cycle"):
        stage_order()


def test_two_writers_of_one_table_and_one_name_twice_are_refused(registry):
    register(make("x", "xs"))
    with pytest.raises(AssertionError, match="registered twice"):
        register(make("x", "other"))
    with pytest.raises(AssertionError, match="both write the table 'xs'"):
        register(make("z", "xs"))


def test_the_built_in_run_order_is_the_pipeline_diagrams():
    import batchrl.stages  # noqa: F401  (registers them)
    from batchrl.config import validate_dict
    from batchrl.pipeline.stage import sync_stages

    # advantage's input depends on the config (the values table with a critic): planning syncs the stages first
    sync_stages(validate_dict({"name": "t", "model": {"path": "m"}, "data": {"train_files": ["d"]}}))
    assert stage_order() == [
        "heldout",
        "ingest",
        "generate",
        "score",
        "advantage",
        "update",
        "evaluate",
        "prompt_stats",
    ]


# In a fresh process: the stage modules imported one by one in the order given (the package itself imports them
# sorted), then a config with a user stage after score and a critic (the values stage after it) planned.
IMPORT_IN_ORDER = """
import importlib, json, sys, types
from pathlib import Path

import batchrl

package = types.ModuleType("batchrl.stages")
package.__path__ = [str(Path(batchrl.__file__).parent / "stages")]
sys.modules["batchrl.stages"] = package
for name in sys.argv[1:]:
    importlib.import_module(f"batchrl.stages.{name}")

from batchrl.config import validate_dict
from batchrl.pipeline.stage import STAGES, source_table, stage_order, sync_stages

shaping = {"name": "shaping", "after": "score", "call": "examples.prompt_shaping:shape_by_prompt_length",
           "outputs": ["scores", "length_penalties"]}
sync_stages(validate_dict({"name": "p", "model": {"path": "m"}, "data": {"train_files": ["d"]},
                           "advantage": {"estimator": "gae"}, "critic": {}, "stages": [shaping]}))
reads = [source_table(table, "advantage") for table in STAGES["advantage"].inputs]
print(json.dumps({"registered": list(STAGES), "order": stage_order(), "advantage_reads": reads}))
"""


def test_the_run_order_and_what_advantage_reads_do_not_depend_on_the_order_the_stages_are_imported_in():
    modules = ["advantage", "evaluate", "generate", "heldout", "ingest", "score", "update", "user", "values"]
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", IMPORT_IN_ORDER, *order],
                cwd=Path(__file__).resolve().parents[2],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for order in (modules, modules[::-1])
    ]
    assert runs[0]["registered"] != runs[1]["registered"]  # the two processes did register in other orders
    for run in runs:
        order = ["heldout", "ingest", "generate", "score", "shaping", "values", "advantage", "update", "evaluate"]
        assert run["order"] == order
        assert run["advantage_reads"] == ["values"]

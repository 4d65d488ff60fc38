"""The run order follows from what stages read, not from the order they were registered (imported) in."""

from __future__ import annotations

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
            "reads_new_policy": new_policy,
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


def test_among_stages_free_to_run_registration_order_decides(registry):
    for cls in [make("load", "items", once=True), make("b", "bs", ("items",)), make("a", "as", ("items",))]:
        register(cls)
    assert stage_order() == ["load", "b", "a"]


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
    assert stage_order() == ["ingest", "generate", "score", "advantage", "update", "evaluate"]

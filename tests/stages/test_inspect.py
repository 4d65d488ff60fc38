"""`batchrl inspect` on what ingest commits: the rejects side table that the ingest warning points to, with its rows
or empty (an ingest that rejects nothing writes no rejects part), the held-out prompts' rejects likewise (the heldout
stage's own manifest lists them), and a directory that is no table (one line,
exit 3). The ingest runs in this process and is committed as the runner commits it; the command line runs as a
user runs it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from harness import cli

from batchrl.config import validate_dict
from batchrl.pipeline.stage import StageContext
from batchrl.stages.heldout import HeldOutStage
from batchrl.stages.ingest import IngestStage
from batchrl.storage import RunLayout
from batchrl.storage.manifest import Manifest, write_manifest
from batchrl_toy import build_toy_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_toy_tokenizer(path)
    return str(path)


def committed_ingest(tmp_path: Path, tokenizer_dir: str, prompts: list[str], *, held_out: bool = False) -> Path:
    """The run directory of a run whose ingest of ``prompts`` (an empty one is rejected) is committed; its run.yaml
    written as the runner writes it. ``held_out``: ``prompts`` are the evaluation's, ingested by the heldout stage."""
    rows = [
        {"prompt_id": f"p{i}", "data_source": "arith", "prompt": text, "ground_truth": "1"}
        for i, text in enumerate(prompts)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    raw = {
        "name": "t",
        "run": {"root": str(tmp_path / "runs")},
        "model": {"path": tokenizer_dir},
        "data": {"train_files": [str(tmp_path / "in.parquet")]},
    }
    if held_out:
        raw["evaluate"] = {"files": raw["data"]["train_files"]}
    stage = HeldOutStage() if held_out else IngestStage()
    cfg = validate_dict(raw)
    layout = RunLayout.for_run(cfg.run.root, cfg.run_id)
    output_dir = layout.table_dir(stage.table, None)
    ctx = StageContext(
        cfg=cfg,
        layout=layout,
        iteration=None,
        output_dir=output_dir,
        fingerprint="x",
        inputs={},
        input_dirs={},
        policy_in=tokenizer_dir,
        embedded_ray=True,  # as under the runner: a small input is ingested in this process
    )
    started = time.time()
    out = stage.run(ctx)
    manifest = Manifest(
        stage=stage.name,
        table=stage.table,
        iteration=None,
        fingerprint="x",
        parts=out.parts,
        schema="prompts",
        started_at=started,
        finished_at=time.time(),
        counts=out.counts,
        extra_parts=out.extra_parts,
    )
    write_manifest(output_dir, manifest)
    (Path(layout.run_dir) / "run.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return Path(layout.run_dir)


def test_inspect_shows_the_rows_of_the_rejects_table_that_the_ingest_warning_points_to(tmp_path, tokenizer_dir):
    run_dir = committed_ingest(tmp_path, tokenizer_dir, ["What is 1 + 0?", "", "What is 0 + 1?"])
    result = cli("inspect", run_dir / "prompts" / "_rejects")
    assert result.returncode == 0, result.stderr
    header, *_, last = result.stdout.splitlines()
    assert header.startswith("prompts rejects, side table of ") and header.endswith("1 part(s), 1 rows"), header
    assert "reason: string" in result.stdout
    assert (json.loads(last)["prompt_id"], json.loads(last)["reason"]) == ("p1", "empty_prompt")
    listing = cli("inspect", run_dir).stdout
    assert any(line.startswith("prompts rejects") and " 1 rows" in line for line in listing.splitlines()), listing


def test_inspect_shows_the_held_out_prompts_rejects_which_the_heldout_stage_lists(tmp_path, tokenizer_dir):
    run_dir = committed_ingest(tmp_path, tokenizer_dir, ["What is 1 + 0?", "", "What is 0 + 1?"], held_out=True)
    result = cli("inspect", run_dir / "evaluation_prompts" / "_rejects")
    assert result.returncode == 0, result.stderr
    header, *_, last = result.stdout.splitlines()
    assert header.startswith("evaluation_prompts rejects, side table of ") and header.endswith("1 rows"), header
    assert (json.loads(last)["prompt_id"], json.loads(last)["reason"]) == ("p1", "empty_prompt")
    table = cli("inspect", run_dir / "evaluation_prompts").stdout
    assert table.startswith("heldout stage table") and "2 rows" in table.splitlines()[0], table


def test_an_ingest_that_rejects_nothing_writes_no_rejects_part_and_inspect_says_its_rejects_are_empty(
    tmp_path, tokenizer_dir
):
    run_dir = committed_ingest(tmp_path, tokenizer_dir, ["What is 1 + 0?", "What is 0 + 1?"])
    assert not (run_dir / "prompts" / "_rejects").exists()
    result = cli("inspect", run_dir / "prompts" / "_rejects")
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0]
    assert header.startswith("prompts rejects") and "0 part(s), 0 rows: empty" in header, header
    assert "reason: string not null" in result.stdout  # the declared schema of the rejects table
    listing = cli("inspect", run_dir)
    assert listing.returncode == 0 and "prompts rejects" not in listing.stdout  # nothing to read there
    assert "prompts " in listing.stdout


def test_a_directory_that_is_no_table_is_a_one_line_data_error_and_so_is_a_missing_path(tmp_path, tokenizer_dir):
    run_dir = committed_ingest(tmp_path, tokenizer_dir, ["What is 1 + 0?"])
    journal = run_dir / "prompts" / "_journal"
    assert journal.is_dir()
    result = cli("inspect", journal)
    assert result.returncode == 3
    assert result.stderr == (
        f"data error: {journal} has no _MANIFEST.json: it is no committed stage table (its stage has not "
        "finished, or it is not a table's directory); `batchrl inspect RUN_DIR` lists a run's tables\n"
    )
    missing = cli("inspect", run_dir / "iter_0000" / "scores")
    assert (missing.returncode, missing.stderr) == (
        3,
        f"data error: {run_dir / 'iter_0000' / 'scores'} does not exist\n",
    )

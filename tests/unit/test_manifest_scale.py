"""Manifests and plans of many-part tables: the manifest's JSON reads as before (one part per line), the local
listing gives what fsspec's does, and planning a run with run.epochs reads each table's manifest and listing once
per command."""

from __future__ import annotations

import dataclasses
import json

from batchrl.api import Runner, build_plan
from batchrl.config import validate_dict
from batchrl.pipeline import plan as plan_module
from batchrl.storage import resolve, write_bytes_atomic
from batchrl.storage.journal import Journal, record
from batchrl.storage.manifest import Manifest, PartInfo, file_sizes, read_manifest, write_manifest


def manifest(num_parts: int, **fields) -> Manifest:
    parts = [PartInfo(f"part-{k:05d}.parquet", k, f"{k:064x}", 100 + k) for k in range(num_parts)]
    return Manifest(
        **{
            "stage": "score",
            "table": "scores",
            "iteration": 0,
            "fingerprint": "f",
            "parts": parts,
            "schema": "scores",
            "started_at": 0.5,
            "finished_at": 1.5,
            "counts": {"num_samples": 3},
            "stats": {"critic/score/mean": 0.25},
            **fields,
        }
    )


def test_the_manifest_json_is_what_json_dumps_wrote_with_one_line_per_part():
    parts = [PartInfo('a "quoted" é.parquet', 1, "x", 2)]
    full = manifest(3, extra_parts={"rejects": parts, "none": []}, trainer_state=parts, inputs={"rollouts": "d"})
    for m in (full, manifest(0), manifest(2, trainer_state=None)):
        text = m.to_json()
        assert json.loads(text) == json.loads(json.dumps(dataclasses.asdict(m), indent=2, sort_keys=True))
        assert Manifest.from_json(text) == m
    lines = manifest(3).to_json().splitlines()
    assert '    {"name": "part-00001.parquet", "num_bytes": 101, "rows": 1, "sha256": "' + f"{1:064x}" + '"},' in lines


def test_a_manifest_in_the_older_indented_layout_still_reads(tmp_path):
    m = manifest(2)
    (tmp_path / "_MANIFEST.json").write_text(json.dumps(dataclasses.asdict(m), indent=2, sort_keys=True))
    assert read_manifest(str(tmp_path)) == m


def test_the_local_listing_gives_every_file_below_with_its_size_like_fsspecs(tmp_path):
    table = str(tmp_path / "t")
    write_manifest(table, manifest(2))
    (tmp_path / "t" / "part-00000.parquet").write_bytes(b"12345")
    Journal(table).append([record("part-00000.parquet", [PartInfo("part-00000.parquet", 1, "s", 5)])])
    fs, path = resolve(table)
    expected = {name[len(path) + 1 :]: info["size"] for name, info in fs.find(path, detail=True).items()}
    assert file_sizes(table) == expected and "part-00000.parquet" in expected and len(expected) == 3
    assert file_sizes(str(tmp_path / "nothing")) == {}


def test_planning_a_run_with_epochs_reads_each_manifest_once(tmp_path, monkeypatch):
    cfg = validate_dict(
        {
            "name": "r",
            "run": {"root": str(tmp_path / "runs"), "epochs": 1},
            "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"},
            "data": {"train_files": [str(tmp_path / "in")], "prompts_per_iteration": 2},
        }
    )
    (ingest,) = [s for s in build_plan(cfg, check_storage=False) if s.name == "ingest"]
    prompts = manifest(4, stage="ingest", table="prompts", fingerprint=ingest.fingerprint)
    for part in prompts.parts:  # present with their recorded sizes (not their sha256)
        write_bytes_atomic(f"{ingest.output_dir}/{part.name}", b"x" * part.num_bytes)
    write_manifest(ingest.output_dir, prompts)
    reads: list[str] = []

    def counting(table_dir: str):
        reads.append(table_dir)
        return read_manifest(table_dir)

    monkeypatch.setattr(plan_module, "read_manifest", counting)
    plan = build_plan(cfg)
    assert [s.label for s in plan][:3] == ["ingest", "iter 0 generate", "iter 0 score"] and len(plan) == 1 + 4 * 3
    assert plan[0].status == "done" and reads.count(ingest.output_dir) == 1
    reads.clear()
    runner = Runner(cfg)
    assert runner.cfg.run.iterations == 3 and reads.count(ingest.output_dir) == 1
    reads.clear()
    assert build_plan(cfg, verify_checksums=True)[0].status == "damaged"  # the parts' sha256 differ from the record
    assert reads.count(ingest.output_dir) == 1  # read once, with the checksums: counting takes it from the plan

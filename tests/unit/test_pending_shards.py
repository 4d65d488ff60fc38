"""A resumed sharded stage takes its finished shards from the output's journal, one listing and one hash of each
recorded part: it opens no output part as Parquet, keeps each recorded shard with its recorded counts, and redoes
exactly the shards no intact record claims (a part changed since it was recorded, even to the same size, included)."""

from __future__ import annotations

import hashlib
import shutil

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrl.config.models import ActorResources
from batchrl.pipeline.shards import ShardRun, ShardWorker, pending_shards, run_sharded, shard_jobs
from batchrl.storage import write_parquet_atomic
from batchrl.storage.journal import Journal
from batchrl.storage.manifest import Manifest, PartInfo
from batchrl.storage.schemas import load_schema


def prompts_part(prompt_ids: list[str]) -> pa.Table:
    schema = load_schema("prompts")
    columns = {}
    for f in schema:
        if f.name == "prompt_id":
            columns[f.name] = prompt_ids
        elif f.name.startswith("logged_"):  # training on logged data only
            columns[f.name] = pa.nulls(len(prompt_ids), f.type)
        elif pa.types.is_list(f.type):
            columns[f.name] = [[1, 2]] * len(prompt_ids)
        elif pa.types.is_string(f.type):
            columns[f.name] = ["x"] * len(prompt_ids)
        else:
            columns[f.name] = [0] * len(prompt_ids)
    return pa.table(columns).cast(schema)


class Tagger(ShardWorker):
    """An identity stage on prompts (prompts -> prompts) that counts the rows it saw."""

    schema = "prompts"

    def process(self, table: pa.Table) -> tuple[pa.Table, dict[str, float]]:
        return table, {"rows": float(table.num_rows), "shards": 1.0}


def input_table(tmp_path, num_parts: int) -> Manifest:
    """An input table of ``num_parts`` shards under tmp_path/in (part k holds prompts pk-0, pk-1)."""
    parts = []
    for k in range(num_parts):
        name = f"part-{k:05d}.parquet"
        size, digest = write_parquet_atomic(prompts_part([f"p{k}-0", f"p{k}-1"]), str(tmp_path / "in" / name))
        parts.append(PartInfo(name=name, rows=2, sha256=digest, num_bytes=size))
    return Manifest(
        stage="x",
        table="in",
        iteration=None,
        fingerprint="f",
        parts=parts,
        schema="prompts",
        started_at=0,
        finished_at=0,
    )


def run(tmp_path, manifest: Manifest):
    """The stage in this process (a lone CPU shard on an 'embedded' Ray runs in the driver: no Ray needed)."""
    shards = ShardRun(str(tmp_path / "in"), manifest, str(tmp_path / "out"), progress_bars=False, embedded_ray=True)
    return run_sharded(shards, worker_cls=Tagger, worker_kwargs={}, actors=ActorResources())


def pending(tmp_path, manifest: Manifest):
    jobs = shard_jobs(input_dir=str(tmp_path / "in"), input_manifest=manifest, output_dir=str(tmp_path / "out"))
    return pending_shards(jobs, output_dir=str(tmp_path / "out"))


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Every path opened for reading through fsspec (all of batchrl's reads go through it) from now on."""
    opened: list[str] = []
    original = fsspec.AbstractFileSystem.open

    def spying_open(self, path, mode="rb", *args, **kwargs):
        if "r" in mode:
            opened.append(str(path))
        return original(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(fsspec.AbstractFileSystem, "open", spying_open)
    return opened


def test_a_resumed_stage_reads_each_recorded_part_once_to_hash_it_and_redoes_exactly_the_unrecorded_shard(
    tmp_path, reads
):
    one = input_table(tmp_path, 1)
    run(tmp_path, one)  # shard 0 done and recorded; the crash came before shard 1
    both = input_table(tmp_path, 2)
    done = tmp_path / "out" / "part-00000.parquet"
    written_at = done.stat().st_mtime_ns
    reads.clear()
    parts, counts = run(tmp_path, both)
    assert [p.name for p in parts] == ["part-00000.parquet", "part-00001.parquet"]
    assert counts == {"rows": 4.0, "shards": 2.0}  # shard 0's counts come from its record
    assert done.stat().st_mtime_ns == written_at  # not redone
    assert [path for path in reads if "/out/part-" in path] == [str(done)]  # read once, for its sha256
    assert [path.rsplit("/", 1)[-1] for path in reads if "/in/" in path] == ["part-00001.parquet"]
    assert sorted(pending(tmp_path, both)[0]) == ["part-00000.parquet", "part-00001.parquet"]


def test_a_recorded_shard_is_kept_with_its_part_and_counts(tmp_path):
    manifest = input_table(tmp_path, 1)
    (part,), _ = run(tmp_path, manifest)
    parts, counts, jobs = pending(tmp_path, manifest)
    assert parts == {"part-00000.parquet": part} and counts == {"rows": 2.0, "shards": 1.0} and jobs == []
    assert part.sha256 == hashlib.sha256((tmp_path / "out" / part.name).read_bytes()).hexdigest()


def test_a_file_under_a_part_name_that_no_record_claims_is_redone(tmp_path, caplog):
    manifest = input_table(tmp_path, 2)
    (tmp_path / "out").mkdir()
    pq.write_table(pa.table({"question": ["what?"], "answer": [19.0]}), tmp_path / "out" / "part-00000.parquet")
    parts, _, jobs = pending(tmp_path, manifest)
    assert parts == {} and [job["name"] for job in jobs] == ["part-00000.parquet", "part-00001.parquet"]
    assert "part-00000.parquet is not this stage's output" in caplog.text
    run(tmp_path, input_table(tmp_path, 1))  # the redo replaces it with the stage's own output
    assert pq.read_table(tmp_path / "out" / "part-00000.parquet").column("prompt_id").to_pylist() == ["p0-0", "p0-1"]


def test_a_recorded_part_truncated_or_deleted_since_is_redone(tmp_path):
    manifest = input_table(tmp_path, 1)
    run(tmp_path, manifest)
    done = tmp_path / "out" / "part-00000.parquet"
    done.write_bytes(done.read_bytes()[:10])
    assert [job["name"] for job in pending(tmp_path, manifest)[2]] == ["part-00000.parquet"]
    done.unlink()
    assert [job["name"] for job in pending(tmp_path, manifest)[2]] == ["part-00000.parquet"]


def test_a_recorded_part_replaced_by_other_rows_of_the_same_size_is_redone_with_a_warning_naming_it(tmp_path, caplog):
    manifest = input_table(tmp_path, 1)
    (recorded,), _ = run(tmp_path, manifest)
    done = tmp_path / "out" / "part-00000.parquet"
    foreign = tmp_path / "foreign.parquet"
    write_parquet_atomic(prompts_part(["p0-1", "p0-0"]), str(foreign))  # the same rows in another order
    assert foreign.stat().st_size == done.stat().st_size
    shutil.copyfile(foreign, done)
    parts, _, jobs = pending(tmp_path, manifest)
    assert parts == {} and [job["name"] for job in jobs] == ["part-00000.parquet"]
    assert f"{done} does not hash to the sha256 its journal record holds" in caplog.text
    (redone,), _ = run(tmp_path, manifest)
    assert redone == recorded  # the shard's own output again, not the file found under its name
    assert pq.read_table(done).column("prompt_id").to_pylist() == ["p0-0", "p0-1"]


def test_a_record_made_from_another_input_is_redone(tmp_path, caplog):
    manifest = input_table(tmp_path, 1)
    run(tmp_path, manifest)
    (other,) = input_table(tmp_path / "other", 1).parts
    replaced = Manifest(
        **{**manifest.__dict__, "parts": [PartInfo("part-00000.parquet", 2, "0" * 64, other.num_bytes)]}
    )
    parts, _, jobs = pending(tmp_path, replaced)
    assert parts == {} and [job["name"] for job in jobs] == ["part-00000.parquet"]
    assert "not this stage's output" in caplog.text


def test_a_slice_job_is_kept_only_for_the_same_rows(tmp_path):
    manifest = input_table(tmp_path, 1)
    run(tmp_path, manifest)
    (job,) = shard_jobs(input_dir=str(tmp_path / "in"), input_manifest=manifest, output_dir=str(tmp_path / "out"))
    sliced = job | {"row_ids": [1]}
    assert pending_shards([sliced], output_dir=str(tmp_path / "out"))[2] == [sliced]


def test_records_survive_a_run_copied_to_another_directory(tmp_path):
    manifest = input_table(tmp_path / "a", 1)
    run(tmp_path / "a", manifest)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    parts, _, jobs = pending(tmp_path / "b", manifest)
    assert list(parts) == ["part-00000.parquet"] and jobs == []
    assert len(Journal(str(tmp_path / "b" / "out")).load()) == 1

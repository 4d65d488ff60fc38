"""generate's batch with data.curriculum, on tables written to disk: the prompt ids are read from the prompts
table and the solved streaks from the committed prompt_stats table generate declares, single-source and mixed; the
parts the runner keeps on resume are the batch's."""

from __future__ import annotations

import pyarrow as pa
import pytest

from batchrl.algorithms.curriculum import CurriculumRule, curriculum_batch
from batchrl.config import validate_dict
from batchrl.errors import DataError
from batchrl.stages.generate import GenerateStage
from batchrl.stages.generate_batches import prompt_batch
from batchrl.stages.prompt_stats import PART
from batchrl.storage import join, write_parquet_atomic
from batchrl.storage.manifest import Manifest, PartInfo, write_manifest

PARTS = {"easy/part-00000.parquet": 6, "easy/part-00001.parquet": 4, "hard/part-00002.parquet": 8}
IDS = {name: [f"{name.split('/')[0]}-{name[-9:-8]}-{row}" for row in range(rows)] for name, rows in PARTS.items()}


def committed(directory: str, tables: dict[str, pa.Table], table: str) -> Manifest:
    infos = []
    for name, data in tables.items():
        num_bytes, digest = write_parquet_atomic(data, join(directory, name))
        infos.append(PartInfo(name, data.num_rows, digest, num_bytes))
    manifest = Manifest("s", table, None, "f", infos, table, 0, 0)
    write_manifest(directory, manifest)
    return manifest


@pytest.fixture
def tables(tmp_path):
    prompts = committed(
        str(tmp_path / "prompts"), {name: pa.table({"prompt_id": ids}) for name, ids in IDS.items()}, "prompts"
    )
    solved = [*IDS["easy/part-00000.parquet"], *IDS["easy/part-00001.parquet"][:2]]  # 8 of the 10 easy prompts
    stats = pa.table({"prompt_id": solved, "solved_streak": [3] * len(solved)})
    committed(str(tmp_path / "prompt_stats"), {PART: stats}, "prompt_stats")
    dirs = {"prompts": str(tmp_path / "prompts"), "prompt_stats": str(tmp_path / "prompt_stats")}
    return prompts, dirs, set(solved)


def config(**data):
    raw = {"name": "t", "model": {"path": "m"}, "data": {"train_files": ["x"], **data}}
    return validate_dict(raw)


def ids_of(batch) -> list[str]:
    return sorted(IDS[s.part][row] for s in batch.slices for row in s.row_indices())


def test_a_single_source_batch_skips_the_solved_prompts_of_the_committed_table(tables):
    prompts, dirs, solved = tables
    cfg = config(prompts_per_iteration=6, curriculum={"skip_solved_streak": 2})
    batch = prompt_batch(cfg, 1, prompts, dirs)
    assert len(ids_of(batch)) == 6 and not set(ids_of(batch)) & solved
    streaks = dict.fromkeys(solved, 3)
    parts = list(PARTS.items())
    expected = curriculum_batch(
        parts, IDS, streaks, rule=CurriculumRule(2), seed=cfg.run.seed, iteration=1, batch_size=6
    )
    assert batch == expected
    # what the runner keeps on resume is this batch's parts
    assert GenerateStage().planned_parts(cfg, 1, {"prompts": prompts}, dirs) == [
        f"part-{k:05d}.parquet" for k in range(len(batch.slices))
    ]


def test_a_mixed_batch_skips_per_source_and_counts_what_it_skipped(tables):
    prompts, dirs, solved = tables
    sources = [{"name": "easy", "files": ["a"], "count": 3}, {"name": "hard", "files": ["b"], "count": 3}]
    cfg = validate_dict(
        {"name": "t", "model": {"path": "m"}, "data": {"sources": sources, "curriculum": {"skip_solved_streak": 1}}}
    )
    batch = prompt_batch(cfg, 0, prompts, dirs)
    taken = ids_of(batch)
    assert sum(pid.startswith("easy") for pid in taken) == 3 and sum(pid.startswith("hard") for pid in taken) == 3
    # easy has 2 prompts left to learn: a pass over its 10 takes them and fills the third place with a solved one,
    # the other 7 solved ones skipped; hard has no stats, nothing skipped
    assert len(set(taken) & solved) == 1
    assert set(IDS["easy/part-00001.parquet"][2:]) <= set(taken)
    assert batch.skipped == 7
    without_stats = prompt_batch(cfg, 0, prompts, {"prompts": dirs["prompts"]})  # a run's first iteration
    assert without_stats.skipped == 0


def test_a_prompt_stats_table_not_committed_is_a_data_error(tables, tmp_path):
    prompts, dirs, _ = tables
    cfg = config(prompts_per_iteration=6, curriculum={"skip_solved_streak": 2})
    with pytest.raises(DataError, match=r"data\.curriculum reads the prompt_stats table at .* not committed"):
        prompt_batch(cfg, 1, prompts, {**dirs, "prompt_stats": str(tmp_path / "nowhere")})

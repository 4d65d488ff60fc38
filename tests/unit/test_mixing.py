"""Batches mixing several prompt sources (batchrl.algorithms.mixing, data.sources): weights to exact counts, each
source its own deterministic stream with its own epochs, and the config's field-named errors."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from harness import write_yaml

from batchrl.algorithms.batches import iteration_batch
from batchrl.algorithms.mixing import largest_remainder, mixed_batch, source_counts, source_of_part
from batchrl.config import ConfigError, load_pipeline

# source "math": 3 parts, 20 rows; source "code": 2 parts, 8 rows
PARTS = [("math/part-00000.parquet", 8), ("math/part-00001.parquet", 8), ("math/part-00002.parquet", 4)]
PARTS += [("code/part-00003.parquet", 5), ("code/part-00004.parquet", 3)]


def rows_by_source(batch) -> Counter:
    return Counter(source_of_part(s.part) for s in batch.slices for _ in s.row_indices())


def rows_of(batch, source: str) -> list[tuple[str, int]]:
    return sorted((s.part, r) for s in batch.slices if source_of_part(s.part) == source for r in s.row_indices())


def test_weights_become_integer_counts_by_the_largest_remainder_summing_to_the_batch():
    assert largest_remainder({"a": 3, "b": 1}, 32) == {"a": 24, "b": 8}
    # exact shares 10.67, 10.67, 10.67: one left over goes to the first listed
    assert largest_remainder({"a": 1, "b": 1, "c": 1}, 32) == {"a": 11, "b": 11, "c": 10}
    # exact 6.4, 25.6: floors 6 and 25, the one left to the larger remainder (b's 0.6)
    assert largest_remainder({"a": 1, "b": 4}, 32) == {"a": 6, "b": 26}
    for weights in ({"a": 0.2, "b": 0.3, "c": 0.5}, {"a": 7, "b": 1, "c": 1, "d": 1}):
        counts = largest_remainder(weights, 37)
        assert sum(counts.values()) == 37
        for name, weight in weights.items():
            assert abs(counts[name] - 37 * weight / sum(weights.values())) < 1


def test_exact_counts_come_first_and_the_weights_share_what_is_left():
    counts = source_counts(counts={"a": 4, "b": None, "c": None}, weights={"a": None, "b": 1, "c": 3}, total=20)
    assert counts == {"a": 4, "b": 4, "c": 12}
    assert source_counts(counts={"a": 4, "b": 2}, weights={"a": None, "b": None}, total=None) == {"a": 4, "b": 2}


def test_a_part_belongs_to_the_source_its_name_starts_with():
    assert source_of_part("math/part-00000.parquet") == "math"
    assert source_of_part("part-00000.parquet") is None
    assert source_of_part("_rejects/part-00000.parquet") is None


def test_every_mixed_batch_holds_each_source_in_its_count_with_no_prompt_twice():
    for iteration in range(12):
        batch = mixed_batch(PARTS, counts={"math": 6, "code": 2}, seed=5, iteration=iteration)
        assert rows_by_source(batch) == Counter({"math": 6, "code": 2})
        rows = [(s.part, r) for s in batch.slices for r in s.row_indices()]
        assert len(rows) == len(set(rows)) == batch.rows == 8


def test_a_mixed_batch_is_a_pure_function_of_seed_and_iteration():
    first = mixed_batch(PARTS, counts={"math": 6, "code": 2}, seed=5, iteration=3)
    assert first == mixed_batch(PARTS, counts={"math": 6, "code": 2}, seed=5, iteration=3)
    other_seed = mixed_batch(PARTS, counts={"math": 6, "code": 2}, seed=6, iteration=3)
    assert rows_of(first, "math") != rows_of(other_seed, "math")


def test_each_source_is_its_own_stream_with_its_own_epochs():
    """math (20 rows, 6 a batch) has 3 batches an epoch, code (8 rows, 2 a batch) 4: each source's rows in a batch
    are what iteration_batch takes from its parts alone, and each starts over on its own schedule."""
    code = PARTS[3:]
    for iteration in range(13):
        batch = mixed_batch(PARTS, counts={"math": 6, "code": 2}, seed=5, iteration=iteration)
        alone = iteration_batch(code, seed=5, iteration=iteration, batch_size=2, stream="code")
        assert rows_of(batch, "code") == sorted((s.part, r) for s in alone.slices for r in s.row_indices())
        shares = {share.name: share for share in batch.sources}
        assert (shares["math"].epoch, shares["code"].epoch) == (iteration // 3, iteration // 4)
        assert batch.epoch == max(iteration // 3, iteration // 4)
    # within one epoch of code, its 4 batches cover 8 distinct rows: every row once
    epoch = [rows_of(mixed_batch(PARTS, counts={"math": 6, "code": 2}, seed=5, iteration=i), "code") for i in range(4)]
    assert len({row for rows in epoch for row in rows}) == 8


def test_a_source_with_fewer_prompts_than_its_count_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"source 'code' has 8 prompt\(s\), fewer than its 9"):
        mixed_batch(PARTS, counts={"math": 6, "code": 9}, seed=5, iteration=0)


SOURCES = {
    "name": "t",
    "model": {"path": "some/model"},
    "data": {
        "sources": [
            {"name": "math", "files": ["a.jsonl"], "weight": 3},
            {"name": "code", "files": ["b/"], "weight": 1},
        ],
        "prompts_per_iteration": 32,
    },
}


def load(tmp_path: Path, data: dict | None = None, **top):
    raw = {**SOURCES, **top, "data": {**SOURCES["data"], **(data or {})}}
    return load_pipeline(write_yaml(tmp_path / "p.yaml", raw))


def test_sources_give_the_train_files_and_counts_and_read_back_from_their_dump(tmp_path):
    cfg = load(tmp_path)
    assert cfg.data.train_files == ["a.jsonl", "b/"]
    assert cfg.data.source_counts() == {"math": 24, "code": 8}
    again = load(tmp_path, data=cfg.data.model_dump(mode="json"))  # run.yaml holds both: the same list
    assert again.data == cfg.data


@pytest.mark.parametrize(
    ("data", "top", "message"),
    [
        ({"train_files": ["c.jsonl"]}, {}, r"give data\.train_files or data\.sources, not both"),
        ({"prompts_per_iteration": None}, {}, r"with a weight need data\.prompts_per_iteration"),
        ({"sources": [{"name": "a b", "files": ["x"], "count": 2}]}, {}, r"source name 'a b' must be"),
        ({"sources": [{"name": "a", "files": ["x"], "count": 2, "weight": 1}]}, {}, r"exactly one of weight and count"),
        ({"sources": [{"name": "a", "files": ["x"], "count": 2}] * 2}, {}, r"sources\[1\]\.name='a' is used twice"),
        ({"sources": [{"name": "a", "files": ["x"], "count": 30}]}, {}, r"counts sum to 30: they must equal"),
        (
            {"sources": [{"name": "a", "files": ["x"], "weight": 1000}, {"name": "b", "files": ["y"], "weight": 1}]},
            {},
            r"sources\[1\]\.weight=1\.0 gives 'b' 0 of the 32 prompts",
        ),
        ({}, {"run": {"epochs": 2}}, r"set run\.iterations instead"),
    ],
)
def test_a_bad_sources_config_is_an_error_naming_the_field(tmp_path, data, top, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, data=data, **top)

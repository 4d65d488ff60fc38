"""Difficulty-aware batches (batchrl.algorithms.curriculum, data.curriculum): on a hand-made stats table, the prompts
solved k times in a row are passed over and their places go to the next ones in the stream, unseen prompts always
come, a floor of revisits, a batch that is always full, and the same batch every time."""

from __future__ import annotations

from batchrl.algorithms.batches import iteration_batch
from batchrl.algorithms.curriculum import CurriculumRule, curriculum_batch, revisited

PARTS = [("part-00000.parquet", 6), ("part-00001.parquet", 6)]
IDS = {name: [f"{name[5:10]}-{row}" for row in range(rows)] for name, rows in PARTS}
SKIP_2 = CurriculumRule(skip_solved_streak=2)


def ids_of(batch) -> list[str]:
    return sorted(IDS[s.part][row] for s in batch.slices for row in s.row_indices())


def uniform(iteration: int, batch_size: int = 4) -> list[str]:
    return ids_of(iteration_batch(PARTS, seed=7, iteration=iteration, batch_size=batch_size))


def batch(streaks: dict[str, int], iteration: int = 0, rule: CurriculumRule = SKIP_2, batch_size: int = 4):
    return curriculum_batch(PARTS, IDS, streaks, rule=rule, seed=7, iteration=iteration, batch_size=batch_size)


def test_without_a_solved_prompt_the_batch_is_the_uniform_one():
    for iteration in range(5):
        made = batch({pid: 1 for pid in uniform(iteration)}, iteration=iteration)  # streak 1 < k = 2
        assert ids_of(made) == uniform(iteration)
        assert made.skipped == 0


def test_prompts_solved_k_times_in_a_row_are_skipped_and_the_next_in_the_stream_take_their_places():
    first = uniform(0)
    solved = {first[0]: 2, first[1]: 5}
    made = batch(solved)
    taken = ids_of(made)
    assert made.skipped == 2
    assert len(taken) == 4 and len(set(taken)) == 4
    assert first[0] not in taken and first[1] not in taken
    assert set(first[2:]) <= set(taken)
    # the two places go to the first prompts of the uniform batch after it
    assert set(taken) - set(first) <= set(uniform(1))


def test_unseen_prompts_are_never_skipped_and_new_ids_join_as_unseen():
    every_id = [pid for ids in IDS.values() for pid in ids]
    streaks = {pid: 3 for pid in every_id[:8]}  # the last 4 prompts were never sampled
    for iteration in range(4):
        taken = ids_of(batch(streaks, iteration=iteration))
        assert set(every_id[8:]) <= set(taken)


def test_a_pass_over_the_whole_source_that_finds_too_few_fills_the_batch_with_skipped_prompts():
    every_id = [pid for ids in IDS.values() for pid in ids]
    streaks = {pid: 9 for pid in every_id[2:]}  # 2 of 12 left to learn from, batch of 4
    made = batch(streaks)
    taken = ids_of(made)
    assert len(taken) == 4 and len(set(taken)) == 4
    assert set(every_id[:2]) <= set(taken)
    assert made.skipped == 10 - 2  # the two used to fill are not counted as skipped


def test_the_revisit_floor_takes_a_share_of_the_solved_prompts_anyway():
    keys = [f"p{i}" for i in range(4000)]
    share = sum(revisited(pid, seed=7, iteration=3, revisit=0.1) for pid in keys) / len(keys)
    assert abs(share - 0.1) / 0.1 < 0.15
    assert not any(revisited(pid, seed=7, iteration=3, revisit=0.0) for pid in keys)
    every_id = [pid for ids in IDS.values() for pid in ids]
    solved = {pid: 5 for pid in every_id}
    always = batch(solved, rule=CurriculumRule(skip_solved_streak=1, revisit=0.999999))
    assert ids_of(always) == uniform(0) and always.skipped == 0


def test_the_batch_is_a_pure_function_of_its_inputs():
    streaks = {pid: 2 for pid in uniform(0)[:3]}
    rule = CurriculumRule(skip_solved_streak=2, revisit=0.3)
    made = [batch(streaks, iteration=2, rule=rule) for _ in range(3)]
    assert made[0] == made[1] == made[2]
    assert ids_of(batch(streaks, iteration=3, rule=rule)) != ids_of(made[0])

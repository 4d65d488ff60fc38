"""The prompts an iteration of generate rolls out: uniform (`batches`), mixed (`mixing`, data.sources), and with
data.curriculum difficulty-aware (`curriculum`), which reads the prompt ids of the prompts table and the prompt_stats
table of the iteration before (generate declares it: `GenerateStage.previous_tables`)."""

from __future__ import annotations

from batchrl.algorithms.batches import Batch, iteration_batch
from batchrl.algorithms.curriculum import CurriculumRule, curriculum_batch
from batchrl.algorithms.mixing import Choose, mixed_batch
from batchrl.config import PipelineConfig
from batchrl.errors import DataError
from batchrl.storage import join, read_parquet
from batchrl.storage.manifest import Manifest, read_manifest

STATS_TABLE = "prompt_stats"


def prompt_batch(
    cfg: PipelineConfig, iteration: int | None, prompts: Manifest, input_dirs: dict[str, str] | None = None
) -> Batch:
    """The prompts ``iteration`` rolls out (see batchrl.algorithms.batches): all of them when
    data.prompts_per_iteration is unset; with data.sources, each source's count from its own stream (`mixing`); with
    data.curriculum, each stream passing over the solved prompts (``input_dirs``: generate's, where the prompts and
    the previous prompt_stats are)."""
    parts = [(part.name, part.rows) for part in prompts.parts]
    choose = curriculum_choice(cfg, iteration or 0, input_dirs) if cfg.data.curriculum else None
    if cfg.data.sources:
        try:
            counts = cfg.data.source_counts()
            return mixed_batch(parts, counts=counts, seed=cfg.run.seed, iteration=iteration or 0, choose=choose)
        except ValueError as err:
            raise DataError(f"data.sources: {err} (lower its weight or count, or add prompts)") from None
    if choose is not None:
        return choose(parts, cfg.data.prompts_per_iteration, "")
    return iteration_batch(
        parts,
        seed=cfg.run.seed,
        iteration=iteration or 0,
        batch_size=cfg.data.prompts_per_iteration,
    )


def curriculum_choice(cfg: PipelineConfig, iteration: int, input_dirs: dict[str, str] | None) -> Choose:
    """A source's slice by `curriculum_batch`, with the solved streaks of the prompt_stats table generate reads (none
    at a run's first iteration: every prompt is unseen) and the prompt ids of the parts it walks, read once each."""
    if input_dirs is None or "prompts" not in input_dirs:
        raise AssertionError("a curriculum batch needs generate's input directories")
    rule = CurriculumRule(cfg.data.curriculum.skip_solved_streak, cfg.data.curriculum.revisit)
    streaks = solved_streaks(input_dirs.get(STATS_TABLE))
    prompts_dir = input_dirs["prompts"]

    def choose(parts: list[tuple[str, int]], count: int, key: str) -> Batch:
        ids = {name: read_parquet(join(prompts_dir, name), columns=["prompt_id"]) for name, _ in parts}
        ids = {name: table.column("prompt_id").to_pylist() for name, table in ids.items()}
        return curriculum_batch(
            parts, ids, streaks, rule=rule, seed=cfg.run.seed, iteration=iteration, batch_size=count, key=key
        )

    return choose


def stats_committed(input_dirs: dict[str, str] | None) -> bool:
    """Whether generate's curriculum batch can be made now (`batchrl plan`'s listing): its prompt_stats committed, or
    none to read (a run's first iteration)."""
    if input_dirs is None:
        return False
    return STATS_TABLE not in input_dirs or read_manifest(input_dirs[STATS_TABLE]) is not None


def solved_streaks(stats_dir: str | None) -> dict[str, int]:
    """prompt_id -> solved_streak of a committed prompt_stats table ({} without one)."""
    if stats_dir is None:
        return {}
    manifest = read_manifest(stats_dir)
    if manifest is None:
        raise DataError(f"data.curriculum reads the prompt_stats table at {stats_dir}, which is not committed")
    tables = [
        read_parquet(join(stats_dir, part.name), columns=["prompt_id", "solved_streak"]) for part in manifest.parts
    ]
    return {
        prompt_id: streak
        for table in tables
        for prompt_id, streak in zip(table.column("prompt_id").to_pylist(), table.column("solved_streak").to_pylist())
    }

"""The run directory layout (see docs/ARCHITECTURE.md): one place that names every path of a run."""

from __future__ import annotations

from dataclasses import dataclass

from batchrl.storage.fs import join


@dataclass(frozen=True)
class RunLayout:
    run_dir: str  # <run_root>/<run_id>, local path or URI

    @classmethod
    def for_run(cls, root: str, run_id: str) -> RunLayout:
        return cls(join(root, run_id))

    @property
    def run_yaml(self) -> str:
        return join(self.run_dir, "run.yaml")

    @property
    def lock(self) -> str:
        return join(self.run_dir, "run.lock")

    @property
    def lineage(self) -> str:
        """init_from resolution and the input files inherited from earlier runs (nightly chains)."""
        return join(self.run_dir, "_LINEAGE.json")

    @property
    def metrics_jsonl(self) -> str:
        return join(self.run_dir, "metrics.jsonl")

    def iteration_dir(self, iteration: int) -> str:
        return join(self.run_dir, f"iter_{iteration:04d}")

    def table_dir(self, table: str, iteration: int | None) -> str:
        """Run-level tables (prompts) live in the run dir; per-iteration tables under iter_NNNN/."""
        base = self.run_dir if iteration is None else self.iteration_dir(iteration)
        return join(base, table)

    def iteration_metrics(self, iteration: int) -> str:
        return join(self.iteration_dir(iteration), "metrics.json")

    def crash_log(self, stage_label: str, process: str) -> str:
        """What a process that died of a signal left on stderr, for a stage ("iter 9 update") and a process
        ("update rank 0"): _logs/iter_9_update-update_rank_0.log."""
        return join(self.run_dir, "_logs", f"{_slug(stage_label)}-{_slug(process)}.log")


def part_name(shard_index: int) -> str:
    return f"part-{shard_index:05d}.parquet"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text.strip())

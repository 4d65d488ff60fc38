"""generate builds its engines once per run (issue 35, item 3): all generate.num_actors of them on its first call,
even when that stage has fewer jobs (a resume), so a later iteration with more jobs reuses them instead of shutting
them down and building new engines (on a GPU: new CUDA graphs)."""

from __future__ import annotations

from pathlib import Path

from test_generate import config, generate, ingest

from batchrl.storage import RunLayout


def test_a_resume_with_one_job_left_builds_every_engine_and_the_next_iteration_reuses_them(
    engine_pool, tmp_path, toy_model_dir, toy_prompts_dir
):
    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, "hf")
    cfg.generate.num_actors, cfg.generate.cpus_per_actor = 2, 0.5
    prompts = ingest(cfg)
    output, rows = generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="iter0")
    assert len(output.parts) == 2

    engine_pool.close()  # a new session resumes iteration 0 with one of its two shards left to do
    run_dir = Path(RunLayout.for_run(cfg.run.root, cfg.run_id).run_dir)
    (run_dir / "iter0" / output.parts[1].name).unlink()
    _, resumed = generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="iter0")
    assert len(engine_pool.actors) == 2 and resumed == rows
    built = list(engine_pool.actors)

    generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="iter1", iteration=1)  # two jobs
    assert engine_pool.actors == built

"""generate builds its engines once per run (issue 35, item 3): all generate.num_actors of them on its first call,
even when that stage has fewer jobs (a resume), so a later iteration with more jobs reuses them instead of shutting
them down and building new engines (on a GPU: new CUDA graphs)."""

from __future__ import annotations

from pathlib import Path

from test_generate import config, generate, ingest

from batchrl.storage import RunLayout, read_parquet


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


def test_an_evaluation_of_one_held_out_part_keeps_both_engines_busy_and_keeps_its_rows_in_order(
    engine_pool, tmp_path, toy_model_dir
):
    from test_evaluate import config as evaluate_config
    from test_evaluate import run_evaluate

    from batchrl_toy import build_arith_prompts

    build_arith_prompts(str(tmp_path / "held_out"), num_prompts=5, num_shards=1, seed=11)
    cfg = evaluate_config(
        tmp_path, toy_model_dir, [str(tmp_path / "held_out")], {"num_samples": 2, "max_new_tokens": 3}
    )
    cfg.generate.num_actors, cfg.generate.cpus_per_actor = 2, 0.5
    output, table = run_evaluate(cfg, "evaluated", engine_pool)
    greedy = [p.name for p in output.extra_parts["rollouts"] if "greedy-" in p.name]
    assert len(greedy) == 3 and len(engine_pool.actors) == 2  # 5 prompts for 2 engines: pieces of at most 2
    prompts = read_parquet(str(Path(cfg.run.root) / cfg.run_id / "evaluation_prompts" / output.parts[0].name))
    assert table.column("prompt_id").to_pylist() == prompts.column("prompt_id").to_pylist()
    assert all(len(scores) == 2 for scores in table.column("sample_scores").to_pylist())

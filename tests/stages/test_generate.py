"""generate stage on embedded Ray with real engines: one row per group, reproducible shards, and new
policies pushed into the live engine in place (equal to an engine built from the new checkpoint)."""

from __future__ import annotations

import pytest

from batchrl.config import validate_dict
from batchrl.engines import vllm_available
from batchrl.pipeline.stage import StageContext
from batchrl.stages.generate import GenerateStage, engine_actors
from batchrl.stages.ingest import IngestStage
from batchrl.storage import RunLayout, read_parquet
from batchrl.storage.manifest import Manifest, write_manifest

ENGINES = [
    "hf",
    pytest.param(
        "vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM not installed")]
    ),
]


@pytest.fixture(scope="module")
def second_policy(tmp_path_factory, toy_model_dir):
    """Same architecture and tokenizer as the toy model, different weights."""
    from batchrl_toy import build_toy_model

    path = tmp_path_factory.mktemp("policy2") / "model"
    build_toy_model(path, seed=123)
    return str(path)


def config(tmp_path, toy_model_dir, toy_prompts_dir, engine):
    return validate_dict(
        {
            "name": "gen",
            "run": {"root": str(tmp_path / "runs"), "seed": 5},
            "model": {"path": toy_model_dir},
            "data": {"train_files": [toy_prompts_dir], "shard_size": 3, "max_prompts": 6, "max_prompt_tokens": 96},
            "generate": {"engine": engine, "num_samples_per_prompt": 3, "max_new_tokens": 10, "temperature": 1.0},
        }
    )


def ingest(cfg) -> tuple[str, Manifest]:
    layout = RunLayout.for_run(cfg.run.root, cfg.run_id)
    out_dir = layout.table_dir("prompts", None)
    output = IngestStage().run(
        StageContext(
            cfg=cfg,
            layout=layout,
            iteration=None,
            output_dir=out_dir,
            fingerprint="p",
            inputs={},
            input_dirs={},
            policy_in=cfg.model.path,
        )
    )
    manifest = Manifest(
        stage="ingest",
        table="prompts",
        iteration=None,
        fingerprint="p",
        parts=output.parts,
        schema="prompts",
        started_at=0,
        finished_at=0,
    )
    write_manifest(out_dir, manifest)
    return out_dir, manifest


def generate(cfg, prompts, engines, *, policy: str, out_name: str, iteration: int = 0):
    prompts_dir, manifest = prompts
    layout = RunLayout.for_run(cfg.run.root, cfg.run_id)
    out_dir = f"{layout.run_dir}/{out_name}"
    ctx = StageContext(
        cfg=cfg,
        layout=layout,
        iteration=iteration,
        output_dir=out_dir,
        fingerprint="g",
        inputs={"prompts": manifest},
        input_dirs={"prompts": prompts_dir},
        policy_in=policy,
        engines=engines,
    )
    output = GenerateStage().run(ctx)
    rows = [r for p in output.parts for r in read_parquet(f"{out_dir}/{p.name}").to_pylist()]
    return output, rows


@pytest.mark.parametrize("engine", ENGINES)
def test_one_row_per_group_and_a_regenerated_shard_equals_the_lost_one(
    engine_pool, tmp_path, toy_model_dir, toy_prompts_dir, engine
):
    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, engine)
    prompts = ingest(cfg)
    output, rows = generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="a")
    assert [p.rows for p in output.parts] == [3, 3]
    assert len(rows) == 6 and all(len(r["response_token_ids"]) == 3 for r in rows)
    assert all(
        len(t) == len(lp) == n
        for r in rows
        for t, lp, n in zip(r["response_token_ids"], r["response_logprobs"], r["response_lengths"])
    )
    assert all(reason in ("stop", "length") for r in rows for reason in r["finish_reasons"])
    assert len({tuple(t) for r in rows for t in r["response_token_ids"]}) > 1  # sampled, not constant
    assert output.counts["num_samples"] == 18

    _, again = generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="b")
    assert again == rows  # ids, tokens, logprobs, texts, seeds: identical
    assert output.stats["perf/weight_push_s"] == 0.0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_new_policy_is_pushed_into_the_live_engine_and_generates_like_a_fresh_engine(
    engine_pool, tmp_path, toy_model_dir, toy_prompts_dir, second_policy, engine
):
    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, engine)
    prompts = ingest(cfg)
    generate(cfg, prompts, engine_pool, policy=toy_model_dir, out_name="first")  # builds the engines
    actors = list(engine_pool.actors)
    pushed, pushed_rows = generate(cfg, prompts, engine_pool, policy=second_policy, out_name="pushed", iteration=1)
    assert engine_pool.actors == actors  # same actors: no rebuild
    assert pushed.stats["perf/engine_build_s"] == 0.0 and pushed.stats["perf/weight_push_s"] > 0.0

    engine_pool.close()
    fresh_cfg = validate_dict(cfg.model_dump() | {"model": cfg.model.model_dump() | {"path": second_policy}})
    fresh, fresh_rows = generate(fresh_cfg, prompts, engine_pool, policy=second_policy, out_name="fresh", iteration=1)
    assert fresh.stats["perf/engine_build_s"] > 0.0
    for a, b in zip(pushed_rows, fresh_rows, strict=True):
        assert a["response_token_ids"] == b["response_token_ids"]
        for lp_a, lp_b in zip(a["response_logprobs"], b["response_logprobs"], strict=True):
            assert lp_a == pytest.approx(lp_b, abs=1e-4)


def test_a_killed_generation_actor_is_restarted_and_reloads_the_shards_policy(
    engine_pool, tmp_path, toy_model_dir, toy_prompts_dir, second_policy
):
    import ray

    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, "hf")
    prompts = ingest(cfg)
    _, expected = generate(cfg, prompts, engine_pool, policy=second_policy, out_name="expected", iteration=1)
    actors = list(engine_pool.actors)
    ray.kill(actors[0], no_restart=False)  # Ray restarts it (max_restarts): it comes back holding model.path
    _, after_restart = generate(cfg, prompts, engine_pool, policy=second_policy, out_name="after", iteration=1)
    assert engine_pool.actors == actors
    assert after_restart == expected  # the restarted actor pushed the shard's policy before generating


def test_live_engines_at_least_as_many_as_asked_for_are_reused_and_fewer_are_rebuilt(
    engine_pool, tmp_path, toy_model_dir, toy_prompts_dir
):
    import ray

    cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, "hf")
    cfg.generate.cpus_per_actor = 0.5
    ctx = StageContext(cfg, RunLayout.for_run(cfg.run.root, cfg.run_id), 0, "", "", {}, {}, "", engines=engine_pool)
    two = engine_actors(ctx, num_actors=1, build_actors=2)  # evaluate: any live engines, else a full set
    assert len(two) == 2
    assert engine_actors(ctx, num_actors=1) == two  # a resume with one shard left: the same engines
    assert engine_actors(ctx, num_actors=2) == two
    three = engine_actors(ctx, num_actors=3)
    assert len(three) == 3 and not set(three) & set(two)
    with pytest.raises(ray.exceptions.RayActorError):  # the two were shut down first, freeing their CPUs
        ray.get(two[0].sleep.remote())


def test_sleeping_engines_wake_with_the_shards_policy_and_generate_as_awake_ones(
    engine_pool, tmp_path, toy_model_dir, toy_prompts_dir, second_policy
):
    awake_cfg = config(tmp_path, toy_model_dir, toy_prompts_dir, "hf")
    sleep_cfg = validate_dict(
        awake_cfg.model_dump() | {"generate": awake_cfg.generate.model_dump() | {"engine_lifetime": "sleep"}}
    )
    prompts = ingest(awake_cfg)
    _, awake_rows = generate(awake_cfg, prompts, engine_pool, policy=second_policy, out_name="awake", iteration=1)

    first, first_rows = generate(sleep_cfg, prompts, engine_pool, policy=toy_model_dir, out_name="first")
    actors = list(engine_pool.actors)  # asleep now: their engines hold no weights
    again, again_rows = generate(sleep_cfg, prompts, engine_pool, policy=toy_model_dir, out_name="again")
    assert engine_pool.actors == actors and again.stats["perf/engine_build_s"] == 0.0
    assert again.stats["perf/weight_push_s"] > 0.0  # the same policy, reloaded: sleep dropped the weights
    assert again_rows == first_rows
    _, pushed_rows = generate(sleep_cfg, prompts, engine_pool, policy=second_policy, out_name="pushed", iteration=1)
    assert pushed_rows == awake_rows

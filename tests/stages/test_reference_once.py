"""KL in the reward with batch moments (issue 35, item 4): the reference model runs once per scores shard. The
moments pass keeps each shard's per-token KL (its tape) and the second pass replays it: the same advantages as two
reference passes gave, bit for bit."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_score_advantage import advantage_context, scores_table

from batchrl.algorithms.advantages import BatchMoments
from batchrl.config.models import AdvantageConfig
from batchrl.stages.advantage import AdvantageStage, AdvantageWorker, MomentsWorker
from batchrl.storage import read_parquet

SHARDS = [
    [("a0", "7", ["#### 7", "#### 8", "x"]), ("a1", "1", ["#### 1", "no", "#### 1"])],
    [("b0", "3", ["#### 3", "#### 3", "#### 4"]), ("b1", "2", ["#### 2", "q"])],  # two group sizes: two pieces
]
KL = {"estimator": "reinforce_pp_baseline", "kl_in_reward_coef": 0.1}


@pytest.fixture
def reference_calls(monkeypatch) -> list[int]:
    """The samples of each reference forward (`response_logprobs`, the real one), as they are made."""
    from batchrl.trainer import reference

    calls, original = [], reference.response_logprobs

    def counting(model, samples, **kwargs):
        calls.append(len(samples.response_offsets_N1) - 1)
        return original(model, samples, **kwargs)

    monkeypatch.setattr(reference, "response_logprobs", counting)
    return calls


def first_pass(tmp_path, toy_model_dir, parts, *, kl_dir) -> dict[str, float]:
    """The batch's moments from the stage's moments worker, called as its actor pool calls it."""
    worker = MomentsWorker(config=AdvantageConfig(**KL).model_dump(), reference_path=toy_model_dir, kl_dir=kl_dir)
    rows = worker({"input_uri": [str(tmp_path / "scores" / p.name) for p in parts], "name": [p.name for p in parts]})
    return dataclasses.asdict(sum((BatchMoments(**json.loads(m)) for m in rows["moments_json"]), BatchMoments(0, 0, 0)))


def second_pass(tmp_path, toy_model_dir, parts, moments, *, kl_dir):
    """Each part's advantages from the stage's advantage worker, called as its actor pool calls it."""
    config = AdvantageConfig(**KL).model_dump()
    worker = AdvantageWorker(config=config, moments=moments, reference_path=toy_model_dir, kl_dir=kl_dir)
    out_dir = tmp_path / ("with_tapes" if kl_dir else "without")
    worker(
        {
            "input_uri": [str(tmp_path / "scores" / p.name) for p in parts],
            "output_uri": [str(out_dir / p.name) for p in parts],
            "name": [p.name for p in parts],
        }
    )
    return [read_parquet(str(out_dir / p.name)) for p in parts]


def two_pass_advantages(tmp_path, toy_model_dir, parts, *, kl_dir):
    moments = first_pass(tmp_path, toy_model_dir, parts, kl_dir=kl_dir)
    return second_pass(tmp_path, toy_model_dir, parts, moments, kl_dir=kl_dir)


def test_the_second_pass_replays_the_first_passs_kl_and_gets_the_same_advantages(
    tmp_path, toy_model_dir, reference_calls
):
    manifest, _ = scores_table(tmp_path, SHARDS)
    before = two_pass_advantages(tmp_path, toy_model_dir, manifest.parts, kl_dir=None)
    assert len(reference_calls) == 6  # 3 pieces, each forwarded by both passes
    reference_calls.clear()
    after = two_pass_advantages(tmp_path, toy_model_dir, manifest.parts, kl_dir=str(tmp_path / "tapes"))
    assert reference_calls == [6, 2, 3]  # each piece once: a0 and a1; then b's pieces (by_group_size's order)
    for old, new in zip(before, after):
        for column in ("advantage", "reward_kl"):
            assert new.column(column).to_pylist() == old.column(column).to_pylist()
        assert np.isfinite(new.column("reward_kl").to_numpy()).all()


def test_a_tape_that_does_not_fit_the_shard_is_not_replayed(tmp_path, toy_model_dir, reference_calls):
    """A tape written for other rows (here: the other part's) is checked piece by piece and the shard computed."""
    manifest, _ = scores_table(tmp_path, SHARDS)
    tapes = tmp_path / "tapes"
    moments = first_pass(tmp_path, toy_model_dir, manifest.parts, kl_dir=str(tapes))
    before = second_pass(tmp_path, toy_model_dir, manifest.parts, moments, kl_dir=None)
    (tapes / manifest.parts[0].name).write_bytes((tapes / manifest.parts[1].name).read_bytes())
    reference_calls.clear()
    after = second_pass(tmp_path, toy_model_dir, manifest.parts, moments, kl_dir=str(tapes))
    assert reference_calls == [6]  # part 0 computed again; part 1 replayed its own tape
    for old, new in zip(before, after):
        assert new.column("advantage").to_pylist() == old.column("advantage").to_pylist()


def test_the_stage_runs_the_reference_once_per_shard_and_drops_its_tapes(tmp_path, toy_model_dir, reference_calls):
    manifest, _ = scores_table(tmp_path, SHARDS[:1])  # one shard: both passes run in this process
    ctx = advantage_context(tmp_path, manifest, **KL)
    model = ctx.cfg.model.model_copy(update={"path": toy_model_dir})
    ctx = dataclasses.replace(ctx, cfg=ctx.cfg.model_copy(update={"model": model}), embedded_ray=True)
    output = AdvantageStage().run(ctx)
    assert reference_calls == [6]
    assert not (tmp_path / "advantages" / "_journal" / "reference_kl").exists()  # read, then dropped
    before = two_pass_advantages(tmp_path, toy_model_dir, manifest.parts, kl_dir=None)
    got = read_parquet(str(tmp_path / "advantages" / output.parts[0].name))
    assert got.column("advantage").to_pylist() == before[0].column("advantage").to_pylist()

    (tmp_path / "advantages" / output.parts[0].name).unlink()  # a redo: the moments record's tape is gone,
    reference_calls.clear()  # so the moments are computed again, and the reference still runs once
    again = AdvantageStage().run(ctx)
    assert reference_calls == [6] and again.parts[0].sha256 == output.parts[0].sha256

"""score and advantage workers on hand-made rollout groups: rewards within rows, failures recorded,
GRPO advantages, and the explode to one row per sample."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrl.algorithms.advantages import batch_moments
from batchrl.config.models import AdvantageConfig
from batchrl.stages.advantage import AdvantageWorker
from batchrl.stages.advantage_group import raw_advantages
from batchrl.stages.advantage_table import shard_groups
from batchrl.stages.score import RewardSet, ScoreWorker
from batchrl.storage.schemas import conform


def rollouts(groups: list[tuple[str, str, list[str]]], data_source: str = "arith") -> pa.Table:
    rows = []
    for prompt_id, truth, responses in groups:
        n = len(responses)
        rows.append(
            {
                "prompt_id": prompt_id,
                "data_source": data_source,
                "messages_json": "[]",
                "prompt_text": "q",
                "prompt_token_ids": [1, 2],
                "ground_truth": truth,
                "extra_info_json": None,
                "source_file": "f",
                "source_row": 0,
                "response_texts": responses,
                "response_token_ids": [[3] * (i + 1) for i in range(n)],
                "response_logprobs": [[-0.5] * (i + 1) for i in range(n)],
                "finish_reasons": ["stop"] * n,
                "response_lengths": [i + 1 for i in range(n)],
                "sample_seeds": list(range(n)),
                "policy_version": 0,
            }
        )
    return conform(pa.Table.from_pylist(rows), "rollouts")


def advantage_worker(moments=None, **config) -> AdvantageWorker:
    return AdvantageWorker(config=AdvantageConfig(**config).model_dump(), moments=moments)


def worker(**overrides) -> ScoreWorker:
    kwargs = {"terms": [], "by_data_source": {}, "failure_reward": 0.0} | overrides
    return ScoreWorker(**kwargs)


def test_default_reward_of_the_data_source_scores_each_sample_in_its_group_row():
    table = rollouts([("p0", "7", ["#### 7", "#### 8", "no answer", "so #### 7"])])
    out, counts = worker().process(table)
    assert out.column("scores").to_pylist() == [[1.0, 0.0, 0.0, 1.0]]
    assert out.column("score_errors").to_pylist() == [[None] * 4]
    assert counts["score_sum"] == 2.0 and counts["num_samples"] == 4 and counts["failed_samples"] == 0


def test_weighted_terms_add_up():
    table = rollouts([("p0", "7", ["#### 7", "#### 8"])])
    out, _ = worker(terms=[("gsm8k", 1.0), ("format_hash", 0.5)]).process(table)
    assert out.column("scores").to_pylist() == [[1.5, 0.5]]


@pytest.mark.parametrize(
    "reward,error",
    [
        ("custom_rewards:explodes", "raised RuntimeError: boom"),
        ("custom_rewards:not_a_number", "not a finite number"),
        ("custom_rewards:gives_up", "returned None"),
    ],
)
def test_a_failing_reward_scores_the_failure_reward_and_records_why(reward, error):
    table = rollouts([("p0", "7", ["a", "b"])])
    out, counts = worker(terms=[(reward, 1.0)], failure_reward=-1.0).process(table)
    assert out.column("scores").to_pylist() == [[-1.0, -1.0]]
    assert all(error in e for e in out.column("score_errors").to_pylist()[0])
    assert counts["failed_samples"] == 2


def test_an_unknown_data_source_without_a_reward_fails_before_scoring():
    with pytest.raises(ValueError, match="reward_by_data_source"):
        RewardSet(terms=[], by_data_source={}, failure_reward=0.0).terms_for("mystery")


def test_advantages_are_group_relative_and_exploded_to_one_row_per_sample():
    table = rollouts([("p0", "7", ["#### 7", "#### 8", "#### 8", "#### 7"]), ("p1", "1", ["#### 1", "#### 1"] * 2)])
    scored, _ = worker().process(table)
    out, counts = advantage_worker(estimator="grpo").process(scored)
    out = conform(out, "advantages")
    assert out.num_rows == 8
    assert out.column("prompt_id").to_pylist() == ["p0"] * 4 + ["p1"] * 4
    assert out.column("sample_idx").to_pylist() == [0, 1, 2, 3] * 2
    # rewards [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / (0.57735 + 1e-6)
    expected = 0.5 / (np.sqrt(1 / 3) + 1e-6)
    np.testing.assert_allclose(
        out.column("advantage").to_numpy()[:4], [expected, -expected, -expected, expected], rtol=1e-6
    )
    np.testing.assert_array_equal(out.column("advantage").to_numpy()[4:], 0.0)  # all-equal group
    assert out.column("response_token_ids").to_pylist()[2] == [3, 3, 3]
    assert out.column("response_logprobs").to_pylist()[1] == [-0.5, -0.5]
    # the update plans from these two small columns without reading the lists
    assert out.column("prompt_length").to_pylist() == [2] * 8
    assert out.column("response_length").to_pylist() == [1, 2, 3, 4] * 2
    assert counts["groups"] == 2 and counts["groups_all_equal"] == 1


def test_the_advantage_parts_are_written_in_row_groups_small_enough_for_the_updates_row_reads(tmp_path):
    import pyarrow.parquet as pq

    from batchrl.storage import write_parquet_atomic

    groups = [(f"p{i}", "1", ["#### 1", "#### 2"] * 50) for i in range(3)]  # 300 samples
    scored, _ = worker().process(rollouts(groups))
    write_parquet_atomic(scored, str(tmp_path / "scores.parquet"))
    job = {"input_uri": [str(tmp_path / "scores.parquet")], "output_uri": [str(tmp_path / "adv.parquet")]}
    result = advantage_worker(estimator="grpo")(job | {"name": ["adv.parquet"]})
    footer = pq.ParquetFile(tmp_path / "adv.parquet").metadata
    assert result["rows"] == [300] and footer.num_rows == 300
    # groups of 100 samples, above the 64-row cap: row groups of 64 (5-sample groups would get 60, whole groups)
    assert [footer.row_group(g).num_rows for g in range(footer.num_row_groups)] == [64, 64, 64, 64, 44]
    expected, _ = advantage_worker(estimator="grpo").process(scored)
    assert pq.read_table(tmp_path / "adv.parquet").column("advantage").to_pylist() == (
        expected.column("advantage").to_pylist()
    )


def test_drgrpo_subtracts_the_mean_without_std_scaling():
    scored, _ = worker().process(rollouts([("p0", "7", ["#### 7", "#### 8", "#### 8", "#### 8"])]))
    out, _ = advantage_worker(estimator="drgrpo").process(scored)
    np.testing.assert_allclose(out.column("advantage").to_numpy(), [0.75, -0.25, -0.25, -0.25], rtol=1e-6)


def test_rloo_uses_the_leave_one_out_baseline():
    scored, _ = worker().process(rollouts([("p0", "7", ["#### 7", "#### 8", "#### 8", "#### 8"])]))
    out, _ = advantage_worker(estimator="rloo").process(scored)
    # rewards [1, 0, 0, 0]: 1 - 0 = 1 for the first; 0 - 1/3 for the others
    np.testing.assert_allclose(out.column("advantage").to_numpy(), [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)


def test_dynamic_sampling_drops_all_equal_groups_and_counts_them():
    table = rollouts(
        [("p0", "7", ["#### 7", "#### 8"]), ("p1", "1", ["#### 1", "#### 1"]), ("p2", "2", ["#### 5", "#### 5"])]
    )
    scored, _ = worker().process(table)
    out, counts = advantage_worker(estimator="grpo", filter_groups=True).process(scored)
    assert out.column("prompt_id").to_pylist() == ["p0", "p0"]
    assert counts["groups_filtered"] == 2 and counts["groups"] == 1


def test_whitening_shards_with_global_moments_equals_whitening_the_whole_batch():
    shard_a = rollouts([("a0", "7", ["#### 7", "#### 8", "x"]), ("a1", "1", ["#### 1", "no", "#### 1"])])
    shard_b = rollouts([("b0", "3", ["#### 3", "#### 3", "#### 4"])])
    scored_a, _ = worker().process(shard_a)
    scored_b, _ = worker().process(shard_b)
    cfg = AdvantageConfig(estimator="reinforce_pp_baseline")
    total = None
    for scored in (scored_a, scored_b):
        groups = shard_groups(scored, filter_groups=False)
        m = batch_moments(raw_advantages(groups, cfg), weights=groups.lengths_PG)
        total = m if total is None else total + m
    moments = {"weight": total.weight, "mean": total.mean, "m2": total.m2}
    out_a, _ = advantage_worker(moments=moments, estimator="reinforce_pp_baseline").process(scored_a)
    out_b, _ = advantage_worker(moments=moments, estimator="reinforce_pp_baseline").process(scored_b)
    sharded = np.concatenate([out_a.column("advantage").to_numpy(), out_b.column("advantage").to_numpy()])
    # Whole batch by hand: r - group mean, then token-weighted (lengths 1, 2, 3 per group) z-score.
    rewards = np.array([[1, 0, 0], [1, 0, 1], [1, 1, 0]], dtype=np.float64)
    centered = rewards - rewards.mean(axis=1, keepdims=True)
    weights = np.tile([1.0, 2.0, 3.0], (3, 1))
    mean = (weights * centered).sum() / weights.sum()
    var = (weights * (centered - mean) ** 2).sum() / (weights.sum() - 1)
    np.testing.assert_allclose(sharded, ((centered - mean) / np.sqrt(var + 1e-8)).reshape(-1), rtol=1e-5)


def test_passk_needs_its_k_and_reinforce_pp_cannot_be_whitened_twice():
    with pytest.raises(ValueError, match="passk_k"):
        AdvantageConfig(estimator="grpo_passk")
    with pytest.raises(ValueError, match="already whitens"):
        AdvantageConfig(estimator="reinforce_pp_baseline", whiten=True)


def reference_logprobs_by_hand(model_dir: str, prompt: list[int], response: list[int]) -> np.ndarray:
    """log p_ref(response token) from one unbatched forward (independent of the stage's micro-batching)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    targets = torch.tensor(prompt + response)[1:]
    return logprobs[torch.arange(len(targets)), targets][len(prompt) - 1 :].numpy()


def test_kl_folded_into_the_reward_subtracts_coef_times_the_summed_kl_before_grpo(toy_model_dir):
    scored, _ = worker().process(rollouts([("p0", "7", ["#### 7", "#### 8", "#### 8", "#### 7"])]))
    worker_kl = AdvantageWorker(
        config=AdvantageConfig(estimator="grpo", kl_in_reward_coef=0.1).model_dump(),
        moments=None,
        reference_path=toy_model_dir,
    )
    out, counts = worker_kl.process(scored)
    out = conform(out, "advantages")
    # by hand: k1 = behaviour (-0.5 per token) - reference, summed over each response [3] * (i + 1)
    summed = np.array(
        [(-0.5 - reference_logprobs_by_hand(toy_model_dir, [1, 2], [3] * (i + 1))).sum() for i in range(4)]
    )
    np.testing.assert_allclose(out.column("reward_kl").to_numpy(), summed, rtol=1e-5)
    rewards = np.array([1.0, 0.0, 0.0, 1.0]) - 0.1 * summed
    expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(out.column("advantage").to_numpy(), expected, rtol=1e-4)
    assert out.column("score").to_pylist() == [1.0, 0.0, 0.0, 1.0]  # the score column stays the reward's
    per_token_mean = summed / np.arange(1, 5)
    assert counts["reward_kl_token_mean_sum"] == pytest.approx(per_token_mean.sum(), rel=1e-5)


def test_kl_in_reward_is_zero_when_the_rollout_logprobs_are_the_references_own(toy_model_dir):
    table = rollouts([("p0", "7", ["#### 7", "#### 8", "#### 8"])])
    scored, _ = worker().process(table)
    own = [reference_logprobs_by_hand(toy_model_dir, [1, 2], [3] * (i + 1)).tolist() for i in range(3)]
    scored = scored.set_column(
        scored.column_names.index("response_logprobs"),
        "response_logprobs",
        pa.array([own], scored.schema.field("response_logprobs").type),
    )
    config = AdvantageConfig(estimator="grpo", kl_in_reward_coef=5.0, kl_in_reward_estimator="k3").model_dump()
    out, _ = AdvantageWorker(config=config, moments=None, reference_path=toy_model_dir).process(scored)
    plain, _ = advantage_worker(estimator="grpo").process(scored)
    np.testing.assert_allclose(out.column("reward_kl").to_numpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(out.column("advantage").to_numpy(), plain.column("advantage").to_numpy(), atol=1e-4)
    assert plain.column("reward_kl").null_count == 3  # off: null, not 0


@pytest.mark.parametrize("share_prompt, max_tokens", [(False, 8192), (True, 8192), (True, 14)])
def test_reference_logprobs_equal_one_unbatched_forward_per_sample_with_or_without_shared_prompts(
    toy_model_dir, share_prompt, max_tokens, monkeypatch
):
    """Two prompts of different lengths, 3 samples each; with share_prompt a row holds a prompt once and then its
    samples' responses (all of them, or, with a 14-token budget, packs cut by it: 4 + 2 + 5 + 3, then 7 + 2 + 5 and
    7 + 3)."""
    from batchrl.stages.advantage_table import explode_groups
    from batchrl.trainer import reference
    from batchrl.trainer.data import samples_from_table

    rng = np.random.default_rng(0)
    prompts = [[5, 9, 11, 4], [7, 8, 12, 13, 6, 10, 3]]
    prompt_ids, responses = [], []
    for prompt in prompts:
        for length in (2, 5, 3):
            prompt_ids.append(prompt)
            responses.append(rng.integers(3, 40, length).tolist())
    rows = []
    for g, prompt in enumerate(prompts):
        group = responses[3 * g : 3 * g + 3]
        rows.append(
            {
                "prompt_id": f"p{g}",
                "data_source": "arith",
                "messages_json": "[]",
                "prompt_text": "q",
                "prompt_token_ids": prompt,
                "ground_truth": "1",
                "extra_info_json": None,
                "source_file": "f",
                "source_row": g,
                "response_texts": ["x"] * 3,
                "response_token_ids": group,
                "response_logprobs": [[-0.5] * len(r) for r in group],
                "finish_reasons": ["stop"] * 3,
                "response_lengths": [len(r) for r in group],
                "sample_seeds": [0, 1, 2],
                "policy_version": 0,
                "scores": [1.0, 0.0, 1.0],
                "score_errors": [None] * 3,
                "reward_values": [[1.0], [0.0], [1.0]],
                "reward_names": ["r"],
                "reward_weights": [1.0],
            }
        )
    groups = shard_groups(conform(pa.Table.from_pylist(rows), "scores"), filter_groups=False)
    samples = samples_from_table(explode_groups(groups.table, np.zeros_like(groups.rewards_PG)))
    rows_per_micro_batch = []
    from batchrl.trainer import forward

    collate_packs = forward.collate_packs
    monkeypatch.setattr(
        forward,
        "collate_packs",
        lambda s, packs, **kw: rows_per_micro_batch.append([len(p) for p in packs]) or collate_packs(s, packs, **kw),
    )

    model = reference.load_frozen_model(toy_model_dir)
    flat = reference.response_logprobs(model, samples, pad_token_id=0, max_tokens=max_tokens, share_prompt=share_prompt)

    expected = np.concatenate([reference_logprobs_by_hand(toy_model_dir, p, r) for p, r in zip(prompt_ids, responses)])
    np.testing.assert_allclose(flat, expected, atol=1e-5)
    pack_sizes = sorted(size for sizes in rows_per_micro_batch for size in sizes)
    assert (
        pack_sizes == {(False, 8192): [1] * 6, (True, 8192): [3, 3], (True, 14): [1, 2, 3]}[(share_prompt, max_tokens)]
    )


def test_sharing_prompts_in_the_reference_pass_is_not_in_the_advantage_fingerprint_but_the_kl_settings_are():
    from batchrl.config.models import PipelineConfig
    from batchrl.stages.advantage import AdvantageStage

    def fingerprint(**advantage):
        cfg = PipelineConfig(name="t", model={"path": "m"}, data={"train_files": ["x.parquet"]}, advantage=advantage)
        return AdvantageStage().fingerprint_config(cfg)

    kl = {"kl_in_reward_coef": 0.1}
    assert fingerprint(**kl, kl_in_reward_share_prompt=True) == fingerprint(**kl)
    assert fingerprint(**kl, kl_in_reward_max_tokens=64) != fingerprint(**kl) != fingerprint()


def scores_table(tmp_path, shards: list[list[tuple[str, str, list[str]]]]):
    """A committed scores table of one part per shard (hand-made groups, scored by the default reward)."""
    from batchrl.storage import write_parquet_atomic
    from batchrl.storage.manifest import Manifest, PartInfo

    parts, tables = [], []
    for k, groups in enumerate(shards):
        scored, _ = worker().process(rollouts(groups))
        scored = conform(scored, "scores")
        num_bytes, digest = write_parquet_atomic(scored, str(tmp_path / "scores" / f"part-{k:05d}.parquet"))
        parts.append(PartInfo(f"part-{k:05d}.parquet", scored.num_rows, digest, num_bytes))
        tables.append(scored)
    manifest = Manifest("score", "scores", 0, "s", parts, "scores", 0.0, 1.0)
    return manifest, tables


def advantage_context(tmp_path, manifest, **advantage):
    from batchrl.config import validate_dict
    from batchrl.pipeline.stage import StageContext
    from batchrl.storage import RunLayout

    cfg = validate_dict(
        {
            "name": "adv",
            "run": {"root": str(tmp_path / "runs")},
            "model": {"path": "unused"},
            "data": {"train_files": ["unused"]},
            "advantage": advantage,
            "ray": {"num_cpus": 2},
            "tracking": {"progress_bars": False},
        }
    )
    return StageContext(
        cfg=cfg,
        layout=RunLayout.for_run(cfg.run.root, cfg.run_id),
        iteration=0,
        output_dir=str(tmp_path / "advantages"),
        fingerprint="a",
        inputs={"scores": manifest},
        input_dirs={"scores": str(tmp_path / "scores")},
        policy_in="unused",
    )


def test_the_stage_merges_each_shards_moments_from_its_workers_and_its_driver_reads_no_scores_part(
    ray_session, tmp_path, monkeypatch
):
    import fsspec

    from batchrl.stages import advantage as advantage_module
    from batchrl.stages import advantage_moments
    from batchrl.storage import read_parquet

    shards = [
        [("a0", "7", ["#### 7", "#### 8", "x"]), ("a1", "1", ["#### 1", "no", "#### 1"])],
        [("b0", "3", ["#### 3", "#### 3", "#### 4"])],
        [("c0", "5", ["#### 5", "#### 5", "#### 5"]), ("c1", "2", ["no", "#### 2", "#### 9"])],
    ]
    manifest, tables = scores_table(tmp_path, shards)
    cfg = AdvantageConfig(estimator="reinforce_pp_baseline")
    total = None  # what the driver computed before: each part's moments, summed in the table's order
    for table in tables:
        groups = shard_groups(table, filter_groups=False)
        m = batch_moments(raw_advantages(groups, cfg), weights=groups.lengths_PG)
        total = m if total is None else total + m
    moments = {"weight": total.weight, "mean": total.mean, "m2": total.m2}
    expected = [advantage_worker(moments=moments, estimator="reinforce_pp_baseline").process(t)[0] for t in tables]

    opened: list[str] = []  # every file the driver opens from here on
    moment_jobs: list[int] = []  # the shards each first pass computed moments for
    original_open, original_map = fsspec.AbstractFileSystem.open, advantage_moments.map_shards

    def spying_open(fs, path, *args, **kwargs):
        opened.append(str(path))
        return original_open(fs, path, *args, **kwargs)

    def counting_map(worker_cls, worker_kwargs, jobs, **kwargs):
        moment_jobs.append(len(jobs))
        return original_map(worker_cls, worker_kwargs, jobs, **kwargs)

    monkeypatch.setattr(fsspec.AbstractFileSystem, "open", spying_open)
    monkeypatch.setattr(advantage_moments, "map_shards", counting_map)
    ctx = advantage_context(tmp_path, manifest, estimator="reinforce_pp_baseline")
    output = advantage_module.AdvantageStage().run(ctx)
    assert moment_jobs == [3]  # the first pass ran on the actor pool, one job per scores part
    assert not [path for path in opened if "/scores/" in path]  # the driver itself read none of them
    for part, table in zip(output.parts, expected):
        got = read_parquet(f"{ctx.output_dir}/{part.name}").column("advantage").to_pylist()
        assert got == table.column("advantage").to_pylist()  # the same sums in the same order: the same floats

    (tmp_path / "advantages" / "part-00001.parquet").unlink()  # a resumed stage: moments come from its journal
    again = advantage_module.AdvantageStage().run(ctx)
    assert moment_jobs == [3, 0] and [p.sha256 for p in again.parts] == [p.sha256 for p in output.parts]


def test_groups_of_several_sizes_in_one_shard_get_each_groups_own_advantages_in_shard_order():
    """Logged data may hold groups of unequal size: each group is normalised by its own statistics (a group of
    one as verl does: GRPO r / (1 + eps), RLOO r), and the samples stay in the shard's order."""
    groups = [
        ("g3", "7", ["#### 7", "#### 8", "#### 7"]),
        ("g1", "7", ["#### 7"]),
        ("g2", "1", ["#### 1", "no"]),
        ("g3b", "2", ["#### 2", "x", "y"]),
    ]
    scored, _ = worker().process(rollouts(groups))
    rewards = [[1.0, 0.0, 1.0], [1.0], [1.0, 0.0], [1.0, 0.0, 0.0]]
    assert scored.column("scores").to_pylist() == rewards
    eps = 1e-6
    by_hand_grpo = [
        (np.array(r) - np.mean(r)) / (np.std(r, ddof=1) + eps) if len(r) > 1 else np.array(r) / (1 + eps)
        for r in rewards
    ]
    by_hand_rloo = [
        np.array([x - (sum(r) - x) / (len(r) - 1) for x in r]) if len(r) > 1 else np.array(r) for r in rewards
    ]
    for estimator, by_hand in (("grpo", by_hand_grpo), ("rloo", by_hand_rloo)):
        out, counts = advantage_worker(estimator=estimator).process(scored)
        out = conform(out, "advantages")
        assert out.column("prompt_id").to_pylist() == ["g3"] * 3 + ["g1"] + ["g2"] * 2 + ["g3b"] * 3
        assert out.column("sample_idx").to_pylist() == [0, 1, 2, 0, 0, 1, 0, 1, 2]
        assert out.column("response_text").to_pylist() == [t for _, _, texts in groups for t in texts]
        np.testing.assert_allclose(out.column("advantage").to_numpy(), np.concatenate(by_hand), rtol=1e-6, atol=1e-7)
        assert counts["groups"] == 4 and counts["num_samples"] == 9
    # dynamic sampling drops the all-equal groups of any size but keeps a lone sample (verl's DAPO recipe)
    equal = rollouts([("e2", "1", ["#### 1", "#### 1"]), ("s1", "1", ["no"]), ("m3", "1", ["#### 1", "a", "b"])])
    scored_equal, _ = worker().process(equal)
    out, counts = advantage_worker(estimator="grpo", filter_groups=True).process(scored_equal)
    assert out.column("prompt_id").to_pylist() == ["s1"] + ["m3"] * 3 and counts["groups_filtered"] == 1


def test_whitening_over_ragged_shards_equals_whitening_the_whole_batch_by_hand(tmp_path):
    from batchrl.algorithms.advantages import BatchMoments
    from batchrl.stages.advantage import MomentsWorker

    shard_a = rollouts([("a0", "7", ["#### 7", "#### 8", "x"]), ("a1", "1", ["#### 1", "no"])])
    shard_b = rollouts([("b0", "3", ["#### 3"]), ("b1", "3", ["#### 3", "#### 4", "#### 3", "q"])])
    scored = [worker().process(shard)[0] for shard in (shard_a, shard_b)]
    first_pass = MomentsWorker(config=AdvantageConfig(estimator="reinforce_pp_baseline").model_dump())
    total = None
    for k, table in enumerate(scored):  # the stage's first pass, shard by shard, as on the workers
        pq.write_table(table, tmp_path / f"part-{k}.parquet")
        row = first_pass({"input_uri": [str(tmp_path / f"part-{k}.parquet")], "name": [f"part-{k}.parquet"]})
        m = BatchMoments(**json.loads(row["moments_json"][0]))
        total = m if total is None else total + m
    moments = {"weight": total.weight, "mean": total.mean, "m2": total.m2}
    outs = [advantage_worker(moments=moments, estimator="reinforce_pp_baseline").process(t)[0] for t in scored]
    sharded = np.concatenate([o.column("advantage").to_numpy() for o in outs])
    rewards = [[1, 0, 0], [1, 0], [1], [1, 0, 1, 0]]
    centered = np.concatenate([np.array(r) - (np.mean(r) if len(r) > 1 else 0.0) for r in rewards])
    weights = np.concatenate([np.arange(1, len(r) + 1, dtype=np.float64) for r in rewards])  # response lengths
    mean = (weights * centered).sum() / weights.sum()
    var = (weights * (centered - mean) ** 2).sum() / (weights.sum() - 1)
    np.testing.assert_allclose(sharded, (centered - mean) / np.sqrt(var + 1e-8), rtol=1e-5)


def test_a_group_without_samples_or_passk_over_a_smaller_group_is_a_data_error_not_an_assertion():
    from batchrl.errors import DataError

    scored, _ = worker().process(rollouts([("a", "1", ["#### 1", "no", "#### 1"]), ("b", "1", ["#### 1"])]))
    with pytest.raises(
        DataError, match=r"estimator grpo_passk: pass@k needs an integer k in \[1, samples_per_group=1\]"
    ):
        advantage_worker(estimator="grpo_passk", passk_k=2).process(scored)
    empty = scored.set_column(
        scored.column_names.index("scores"), "scores", pa.array([[1.0, 0.0, 1.0], []], pa.list_(pa.float64()))
    )
    with pytest.raises(DataError, match="prompt 'b' has no samples"):
        advantage_worker(estimator="grpo").process(empty)


def metrics_of(stats_by_stage: dict[str, dict[str, float]]) -> dict:
    """iteration_metrics over committed score and advantage manifests holding these stats."""
    from batchrl.pipeline.plan import PlannedStage
    from batchrl.pipeline.summary import iteration_metrics
    from batchrl.stages.advantage import AdvantageStage
    from batchrl.stages.score import ScoreStage
    from batchrl.storage.manifest import Manifest

    stages = {"score": ScoreStage(), "advantage": AdvantageStage()}
    plan = {}
    for name, stats in stats_by_stage.items():
        fields = {"stage": name, "table": name, "iteration": 0, "fingerprint": "f", "parts": [], "schema": name}
        manifest = Manifest(**fields, started_at=0.0, finished_at=1.0, counts={}, stats=stats)
        plan[(name, 0)] = PlannedStage(name, 0, f"/r/{name}", "f", {}, "", status="done", manifest=manifest)
    return iteration_metrics(plan, stages, 0)


def test_critic_score_is_what_advantage_read_and_the_score_stages_own_is_score_raw():
    metrics = metrics_of(
        {
            "score": {"critic/score/mean": 0.172, "critic/score/max": 1.0, "critic/score/min": 0.0},
            "advantage": {"critic/score/mean": 0.272, "critic/score/max": 1.1, "critic/score/min": 0.1},
        }
    )
    assert (metrics["critic/score/mean"], metrics["critic/score/max"], metrics["critic/score/min"]) == (0.272, 1.1, 0.1)
    assert (metrics["score/raw/mean"], metrics["score/raw/max"], metrics["score/raw/min"]) == (0.172, 1.0, 0.0)
    # an advantage manifest from before advantage counted the scores: the score stage's numbers, as they were
    older = metrics_of({"score": {"critic/score/mean": 0.172}, "advantage": {"critic/advantages/mean": 0.0}})
    assert older["critic/score/mean"] == older["score/raw/mean"] == 0.172


def test_advantage_counts_every_score_it_read_the_groups_that_filtering_drops_included():
    from batchrl.stages.advantage_metrics import score_counts

    counts = score_counts(pa.table({"scores": [[1.0, 1.0], [0.0, 0.5]]}))  # the first group is all equal
    assert counts == {"score_samples": 4.0, "score_sum": 2.5, "score_max": 1.0, "score_min": 0.0}


def test_a_user_stage_reports_its_effect_on_each_numeric_column_it_changes():
    from batchrl.stages.user import column_effects, effect_stats

    before = pa.table({"scores": [[0.0, 1.0], [0.5, 2.0]], "note": ["x", "y"]})
    after = before.set_column(0, "scores", pa.array([[0.0, 1.0], [0.5, 1.0]]))  # a clip at 1.0
    counts = column_effects(before, after, columns=["scores", "note"])  # "note" holds no numbers
    assert effect_stats(counts) == {"scores/mean_before": 0.875, "scores/mean_after": 0.625, "scores/changed": 1}

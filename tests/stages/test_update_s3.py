"""The update stage reads an advantages table on object storage in place: the ranks read the rows they train on from
S3 (moto's server), nothing downloads the table, and the update equals the one that reads the same table from a
local directory. One gloo rank on the tiny Qwen2 of test_trainer, run by the stage itself (`UpdateStage.run`)."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from trainer_helpers import advantages_manifest, load_weights, synthetic_rows, write_advantages

TIMEOUT_S = 180


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory) -> Path:
    from batchrl_toy import build_toy_model

    out = tmp_path_factory.mktemp("update_s3") / "policy_in"
    build_toy_model(out, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, seed=0)
    return out


def run_update_stage(root: Path, *, advantages_dir: str, manifest, policy: Path, monkeypatch) -> tuple[dict, list]:
    """UpdateStage.run at iteration 0 of a run under `root`, reading the advantages from `advantages_dir`; returns
    (its stats, the advantages files of the spec its ranks were given)."""
    import batchrl.trainer
    from batchrl.config.models import PipelineConfig
    from batchrl.pipeline.stage import StageContext
    from batchrl.stages.update import UpdateStage
    from batchrl.storage import RunLayout

    cfg = PipelineConfig(
        name="t",
        run={"root": str(root), "iterations": 1},
        model={"path": str(policy)},
        data={"train_files": ["x.parquet"]},
        update={
            "backend": "gloo",
            "launcher": "local",
            "trainer_lifetime": "stage",
            "lr": 1e-4,
            "ppo_mini_batch_size": 2,
            "ppo_epochs": 2,
            "max_tokens_per_micro_batch": 40,
            "kl_loss_coef": 0.1,
        },
        tracking={"progress_bars": False},
    )
    layout = RunLayout.for_run(str(root), "t")
    ctx = StageContext(
        cfg=cfg,
        layout=layout,
        iteration=0,
        output_dir=layout.table_dir("policy", 0),
        fingerprint="f",
        inputs={"advantages": manifest},
        input_dirs={"advantages": advantages_dir},
        policy_in=str(policy),
    )
    specs, real_run_update = [], batchrl.trainer.run_update

    def recording_run_update(spec, **kwargs):
        specs.append(spec)
        return real_run_update(spec, **kwargs)

    monkeypatch.setattr(batchrl.trainer, "run_update", recording_run_update)
    output = UpdateStage().run(ctx)
    return output, specs[0].advantages_files


def test_an_update_reads_its_advantages_from_s3_in_place_and_trains_what_a_local_table_trains(
    tmp_path, tiny_policy, s3_bucket, monkeypatch
):
    from transformers import AutoConfig

    from batchrl.storage import resolve

    vocab_size = AutoConfig.from_pretrained(str(tiny_policy)).vocab_size
    files = write_advantages(synthetic_rows(vocab_size=vocab_size, seed=6), tmp_path / "advantages", row_group_size=6)
    manifest = advantages_manifest(files)
    fs, _ = resolve(f"s3://{s3_bucket}")
    for f in files:
        fs.put_file(f, f"{s3_bucket}/advantages/{Path(f).name}")

    local, local_files = run_update_stage(
        tmp_path / "local",
        advantages_dir=str(tmp_path / "advantages"),
        manifest=manifest,
        policy=tiny_policy,
        monkeypatch=monkeypatch,
    )
    remote, remote_files = run_update_stage(
        tmp_path / "remote",
        advantages_dir=f"s3://{s3_bucket}/advantages",
        manifest=manifest,
        policy=tiny_policy,
        monkeypatch=monkeypatch,
    )

    # the ranks were handed the S3 objects themselves: no local copy of the table was made to train from
    assert remote_files == [f"s3://{s3_bucket}/advantages/{Path(f).name}" for f in files]
    assert local_files == files
    for name in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
        assert math.isfinite(local.stats[name])
        assert remote.stats[name] == pytest.approx(local.stats[name], rel=1e-6, abs=1e-9), name
    assert remote.stats["actor/num_optimizer_steps"] == local.stats["actor/num_optimizer_steps"] == 4
    policy_dir = "t/iter_0000/policy"
    weights_local = load_weights(tmp_path / "local" / policy_dir)
    weights_remote = load_weights(tmp_path / "remote" / policy_dir)
    assert max((weights_local[k] - weights_remote[k]).abs().max().item() for k in weights_local) <= 1e-7
    assert [p.name for p in remote.extra_parts["logprobs"]] == ["_logprobs/part-00000.parquet"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_advantages_part_changed_after_its_manifest_was_written_is_refused_before_any_rank_starts(
    tmp_path, tiny_policy, s3_bucket, monkeypatch, where
):
    """The ranks read the parts in place, never whole, so they cannot hash them: the stage does, as shard workers
    check their inputs. Here the same rows with every advantage negated, padded to the byte to the part's size."""
    import pyarrow.compute as pc
    from harness import rewrite_at_the_same_size
    from transformers import AutoConfig

    import batchrl.trainer
    from batchrl.errors import DataError
    from batchrl.storage import resolve

    vocab_size = AutoConfig.from_pretrained(str(tiny_policy)).vocab_size
    files = write_advantages(synthetic_rows(vocab_size=vocab_size, seed=6), tmp_path / "advantages", row_group_size=6)
    manifest = advantages_manifest(files)
    table = pq.read_table(files[1])
    rewrite_at_the_same_size(
        Path(files[1]),
        table.set_column(table.schema.get_field_index("advantage"), "advantage", pc.negate(table["advantage"])),
    )
    advantages_dir = str(tmp_path / "advantages")
    if where == "s3":
        advantages_dir = f"s3://{s3_bucket}/advantages"
        fs, _ = resolve(advantages_dir)
        for f in files:
            fs.put_file(f, f"{s3_bucket}/advantages/{Path(f).name}")
    started = []
    monkeypatch.setattr(batchrl.trainer, "run_update", lambda spec, **kwargs: started.append(spec))
    with pytest.raises(DataError, match=f"{Path(files[1]).name} does not match the sha256 in its manifest"):
        run_update_stage(
            tmp_path / "run",
            advantages_dir=advantages_dir,
            manifest=manifest,
            policy=tiny_policy,
            monkeypatch=monkeypatch,
        )
    assert started == []
